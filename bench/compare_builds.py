"""Runs one `djinn bench` with two builds of djinn in alternating rounds, in one run on one
machine, and prints each row's p50 under both and their ratio (after / before): how a change
is shown to be no slower.

Usage: compare_builds.py BEFORE AFTER ROUNDS -- BENCH ARGS...
  e.g. compare_builds.py /tmp/djinn-before target/release/djinn 3 -- tcp --sizes 64,4KiB
A BENCH that is a Python script (bench/python_client.py) runs under this Python with the
build as its DJINN_BIN (the node it starts), the client the same for both.

Each round runs BEFORE, then AFTER (the first round's order is swapped in every other round,
so neither always runs on a warmer machine). A row is a markdown table row of the bench's
output whose first columns name it and whose first `p50` column is a number; the figure per
build is the median of its rounds."""
import os
import statistics
import subprocess
import sys


def rows(output: str) -> dict:
    """The p50 of each table row of a bench's output, by the row's name."""
    found, p50_at = {}, None
    for line in output.splitlines():
        cells = [c.strip().strip("*") for c in line.strip().strip("|").split("|")]
        if not line.startswith("|") or len(cells) < 2:
            p50_at = None
            continue
        if any(c.startswith("p50") for c in cells):
            p50_at = next(i for i, c in enumerate(cells) if c.startswith("p50"))
            continue
        if p50_at is None or set(cells[0]) <= {"-"}:
            continue
        try:
            found[" · ".join(cells[:p50_at])] = float(cells[p50_at])
        except ValueError:
            pass
    return found


def main() -> None:
    args = sys.argv[1:]
    if "--" not in args or args.index("--") != 3:
        sys.exit(__doc__)
    before, after, rounds, bench = args[0], args[1], int(args[2]), args[4:]
    seen = {before: [], after: []}
    for r in range(rounds):
        for binary in ((before, after) if r % 2 == 0 else (after, before)):
            print(f"round {r + 1}/{rounds}: {binary} bench {' '.join(bench)}", file=sys.stderr, flush=True)
            if bench[0].endswith(".py"):
                command, env = [sys.executable, *bench], {**os.environ, "DJINN_BIN": binary}
            else:
                command, env = [binary, "--log", "warn", "bench", *bench], None
            out = subprocess.run(command, check=True, capture_output=True, text=True, env=env)
            seen[binary].append(rows(out.stdout))
    print(f"| row | before p50 µs | after p50 µs | after / before |\n|---|---|---|---|")
    for name in seen[before][0]:
        b = statistics.median(run[name] for run in seen[before] if name in run)
        a = statistics.median(run[name] for run in seen[after] if name in run)
        print(f"| {name} | {b:.1f} | {a:.1f} | **{a / b:.2f}** |")


if __name__ == "__main__":
    main()
