#!/usr/bin/env python3
"""Runs every block the docs mark as runnable in README.md and docs/*.md, each in a fresh
directory with the build's `djinn` first on PATH, and fails on the first block that fails,
printing it and its output. Processes a block leaves running are stopped with it.

- A shell block (a fence opened with ```sh runnable) runs with bash -euo pipefail.
- A Python block (```python runnable) runs with PYTHON against a `djinn up` of its own, which
  this script starts in the block's directory and gives the block as DJINN_CONTROL (its
  control plane's http://HOST:PORT), with client-lib/python/examples on PYTHONPATH.
  A Python block that is a fragment on purpose is fenced ```python excerpt; any other
  ```python fence (a plain one included) fails the run, so every block is one or the other.

Usage: scripts/doc-blocks.py [DJINN_BIN_DIR, default target/debug] [PYTHON, default .venv/bin/python]"""
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.argv[1] if len(sys.argv) > 1 else ROOT / "target" / "debug").resolve()
PYTHON = Path(sys.argv[2] if len(sys.argv) > 2 else ROOT / ".venv" / "bin" / "python").absolute()
EXAMPLES = ROOT / "client-lib" / "python" / "examples"
# Every fence that opens a block, with its info string (```sh runnable: "sh runnable").
FENCE = re.compile(r"^```(\S[^\n]*)?\n(.*?)^```$", re.S | re.M)
LIMIT_S = 120


def stop(proc):
    """Ends `proc` and everything it started (its process group)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def start_up(cwd, env, log):
    """`djinn up` on free ports in `cwd` (its store under the block's DJINN_STATE_DIR), once its
    node has joined; returns the process and the control plane's URL."""
    out = Path(cwd) / ".up.out"
    with open(out, "w") as stdout:
        up = subprocess.Popen([str(BIN / "djinn"), "up", "--listen", "127.0.0.1:0", "--control-listen", "127.0.0.1:0",
                               "--log", "warn"], cwd=cwd, env=env, stdout=stdout, stderr=log, start_new_session=True)
    deadline = time.monotonic() + 30
    control = None
    while control is None or not joined(control, env):
        if up.poll() is not None or time.monotonic() > deadline:
            stop(up)
            raise RuntimeError(f"djinn up did not start (exit {up.returncode}): {out.read_text()!r}")
        m = re.search(r"^djinn control listening on (\S+)$", out.read_text(), re.M)
        control = m and f"http://{m.group(1)}"
        time.sleep(0.1)
    return up, control


def joined(control, env) -> bool:
    status = subprocess.run([str(BIN / "djinn"), "status", "--control", control, "--json"], env=env,
                            capture_output=True, text=True)
    return status.returncode == 0 and '"nodes":[{' in status.stdout.replace(" ", "")


def run(kind, code, cwd, log):
    """Runs one block in `cwd`, its output to `log`; returns its exit status."""
    env = {**os.environ, "PATH": f"{BIN}:{os.environ['PATH']}", "DJINN_STATE_DIR": f"{cwd}/state"}
    up = None
    if kind == "python":
        up, env["DJINN_CONTROL"] = start_up(cwd, env, log)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(EXAMPLES), os.environ.get("PYTHONPATH")]))
        argv = [str(PYTHON), "-c", code]
    else:
        argv = ["bash", "-euo", "pipefail", "-c", code]
    # Output to a file, not a pipe: what the block leaves in the background keeps the pipe
    # open, and the block's end is its own process's exit.
    proc = subprocess.Popen(argv, cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        status = proc.wait(timeout=LIMIT_S)
    except subprocess.TimeoutExpired:
        status = -1
        log.write(f"(timed out after {LIMIT_S} s)\n")
    finally:
        # What the block started in the background goes with it; then its `djinn up`.
        stop(proc)
        if up is not None:
            stop(up)
    return status


docs = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# (where, kind, code) of every runnable block; a Python fence that is neither fails at once.
blocks = []
for doc in docs:
    text = doc.read_text()
    for m in FENCE.finditer(text):
        info = (m.group(1) or "").split()
        where = f"{doc.relative_to(ROOT)}:{text[: m.start()].count(chr(10)) + 1}"
        if info[:1] in (["python"], ["py"]) and info[1:] not in (["runnable"], ["excerpt"]):
            sys.exit(f"{where}: a Python block is fenced ```{m.group(1)}: mark it ```python runnable "
                     f"(CI runs it) or ```python excerpt (a fragment on purpose)")
        if info in (["sh", "runnable"], ["python", "runnable"]):
            blocks.append((where, info[0], m.group(2)))
if not blocks:
    sys.exit("no runnable block found: the docs lost theirs")
if any(kind == "python" for _, kind, _ in blocks) and not PYTHON.exists():
    sys.exit(f"no Python interpreter at {PYTHON}: give its path as the second argument")
for where, kind, code in blocks:
    with tempfile.TemporaryDirectory() as cwd, open(f"{cwd}/.output", "w+") as log:
        try:
            status = run(kind, code, cwd, log)
        except RuntimeError as e:
            status = -1
            log.write(f"{e}\n")
        log.seek(0)
        out = log.read()
    if status != 0:
        print(f"{where}: the block failed ({status}):\n{code}\n{out}")
        sys.exit(1)
    print(f"{where}: ok")
