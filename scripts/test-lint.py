#!/usr/bin/env python3
"""Finds tests that cannot be trusted, in the Rust tests (tests/*.rs and every `#[cfg(test)]`
part of a crate) and the Python tests (client-lib/python/tests):

- a test that returns before it asserts anything: it passes by doing nothing (a test that needs
  hardware is `#[ignore = "needs …"]` or `pytest.skip`ped instead, so the skip is counted);
- a wall-clock comparison in an assertion (how long something took, whether it happened
  within some time) that tests/WALLCLOCK.md does not list, with its reason, for its function.
  Such limits fail under load on a 2-core CI machine: wait on a counter or an event instead, or
  derive the bound from the configured timeout with a margin and list it. A hang guard (a poll
  for an event that fails only once a deadline of at least HANG_GUARD_SECONDS has passed) is
  not a limit and needs no listing.

Usage: scripts/test-lint.py [ROOT]; exits non-zero, naming each finding, when there is one."""
import ast
import re
import sys
from pathlib import Path

ROOT = Path(sys.argv[1] if len(sys.argv) > 1 else Path(__file__).resolve().parent.parent).resolve()
HANG_GUARD_SECONDS = 10
RUST_DIRS = ["tests", "auth", "memory", "proto", "supervisor", "dataplane", "gpudirect", "graph", "executor", "control",
             "client-lib", "node", "tools", "bench", "sync", "shm"]

# --- Rust ---------------------------------------------------------------------------------------

RUST_ASSERT = re.compile(r"\b(assert(_eq|_ne|_matches)?!|debug_assert\w*!|prop_assert\w*!|panic!|unreachable!)")
RUST_CLOCK = re.compile(r"\.elapsed\(\)|Instant::now\(\)|SystemTime::now\(\)|\bclosed_within\(|\.recv_timeout\(")
RUST_MEASURED = re.compile(r"\.elapsed\(\)|\bclosed_within\(|\.recv_timeout\(|\.duration_since\(|\bcpu_time\(")
# An ordering comparison against a span of time: whatever is on the other side was measured
# (a name bound from a helper that timed something, a thread's result).
RUST_DURATION_ORDER = re.compile(r"(<=?|>=?)\s*[^,;]*(Duration::from_\w+|as_(secs|millis|micros|nanos)\b)|"
                                 r"(Duration::from_\w+\([^)]*\)|\.as_(secs|millis|micros|nanos)\(\)[^,;<>]*)\s*(<=?|>=?)[^=]")
RUST_TEST_ATTR = re.compile(r"#\[(tokio::)?test\b")
RUST_FN = re.compile(r"\bfn\s+(\w+)")


def strip_rust(text):
    """The source with comments and string contents blanked (lengths and newlines kept)."""
    out, i, n = [], 0, len(text)
    while i < n:
        c = text[i]
        if text.startswith("//", i):
            j = text.find("\n", i)
            j = n if j < 0 else j
            out.append(" " * (j - i))
            i = j
        elif text.startswith("/*", i):
            j = text.find("*/", i + 2)
            j = n if j < 0 else j + 2
            out.append(re.sub(r"[^\n]", " ", text[i:j]))
            i = j
        elif c == "r" and re.match(r'r#*"', text[i:i + 10]) and (i == 0 or not (text[i - 1].isalnum() or text[i - 1] == "_")):
            hashes = re.match(r'r(#*)"', text[i:]).group(1)
            end = text.find('"' + hashes, i + 2 + len(hashes))
            end = n if end < 0 else end + 1 + len(hashes)
            out.append(re.sub(r"[^\n]", " ", text[i:end]))
            i = end
        elif c == '"':
            j = i + 1
            while j < n and text[j] != '"':
                j += 2 if text[j] == "\\" else 1
            out.append('"' + re.sub(r"[^\n]", " ", text[i + 1:j]) + '"')
            i = j + 1
        elif c == "'" and re.match(r"'(\\.|[^\\'])'", text[i:i + 4]) or text.startswith("'\\u{", i):
            j = text.find("'", i + 1 if text[i + 1] != "\\" else i + 3)
            out.append("' '" + " " * (j - i - 2))
            i = j + 1
        else:
            out.append(c)
            i += 1
    return "".join(out)


def matching_brace(code, open_at):
    depth = 0
    for j in range(open_at, len(code)):
        if code[j] == "{":
            depth += 1
        elif code[j] == "}":
            depth -= 1
            if depth == 0:
                return j
    return len(code) - 1


def rust_functions(code):
    """(name, body start, body end, is a test) for every fn with a body, nested ones too."""
    for m in RUST_FN.finditer(code):
        open_at = code.find("{", m.end())
        semi = code.find(";", m.end())
        if open_at < 0 or (0 <= semi < open_at):
            continue
        head = code[max(0, m.start() - 300):m.start()]
        # The attributes right above the fn (stop at the previous item's end).
        attrs = head[max(head.rfind("}"), head.rfind(";")) + 1:]
        yield m.group(1), open_at, matching_brace(code, open_at), bool(RUST_TEST_ATTR.search(attrs))


def nested_spans(code, start, end):
    """Spans inside (start, end) that belong to a nested fn or closure body."""
    spans = []
    for m in re.finditer(r"\bfn\s+\w+[^{;]*\{|\|[^|\n]*\|\s*(->\s*[^{]+)?\{|\basync\s+(move\s+)?\{", code[start + 1:end]):
        open_at = start + 1 + m.end() - 1
        spans.append((open_at, matching_brace(code, open_at)))
    return spans


def rust_test_regions(path, code):
    """The parts of a file that are test code: all of it under tests/, else what follows a
    `#[cfg(test)]` (a test module, or a file included as one)."""
    rel = path.relative_to(ROOT).as_posix()
    if rel.startswith("tests/") or path.name in ("tests.rs",) or path.stem.endswith("_tests"):
        return [(0, len(code))]
    regions = []
    for m in re.finditer(r"#\[cfg\(test\)\]", code):
        open_at = code.find("{", m.end())
        semi = code.find(";", m.end())
        if open_at >= 0 and not (0 <= semi < open_at):
            regions.append((m.start(), matching_brace(code, open_at)))
    return regions


def hang_guard_deadlines(body):
    """Names of deadlines set at least HANG_GUARD_SECONDS ahead in this body."""
    names = set()
    for m in re.finditer(r"let\s+(mut\s+)?(\w+)\s*=\s*[\w:]*Instant::now\(\)\s*\+\s*Duration::from_(secs|millis)\((\d+)\)", body):
        seconds = int(m.group(4)) / (1000 if m.group(3) == "millis" else 1)
        if seconds >= HANG_GUARD_SECONDS:
            names.add(m.group(2))
    return names


def statement_at(code, at):
    """The assertion macro call starting at `at`, up to its closing parenthesis."""
    open_at = code.find("(", at)
    depth = 0
    for j in range(open_at, len(code)):
        if code[j] in "([{":
            depth += 1
        elif code[j] in ")]}":
            depth -= 1
            if depth == 0:
                return code[at:j + 1]
    return code[at:]


def lint_rust(path, findings):
    text = path.read_text()
    code = strip_rust(text)
    rel = path.relative_to(ROOT).as_posix()
    line_of = lambda at: code.count("\n", 0, at) + 1
    for lo, hi in rust_test_regions(path, code):
        for name, start, end, is_test in rust_functions(code):
            if not (lo <= start <= hi):
                continue
            body = code[start:end + 1]
            nested = nested_spans(code, start, end)
            inside_nested = lambda at: any(a < at < b for a, b in nested)
            if is_test:
                first_assert = next((start + m.start() for m in RUST_ASSERT.finditer(body)
                                     if not inside_nested(start + m.start())), None)
                for m in re.finditer(r"\breturn\b", body):
                    at = start + m.start()
                    if inside_nested(at) or (first_assert is not None and first_assert < at):
                        continue
                    findings.append((rel, line_of(at), name, "returns before asserting anything"))
                    break
            # Wall-clock readings: direct, or through a name bound to a measured time in this
            # function (an instant alone, as a fake clock's start, is not a measurement).
            clocked = set()
            for m in re.finditer(r"let\s+(mut\s+)?(\w+|\([^)]*\))[^=;]*=\s*([^;]*);", body):
                if RUST_MEASURED.search(m.group(3)):
                    clocked.update(re.findall(r"\w+", m.group(2)))
            guards = hang_guard_deadlines(body)
            for m in RUST_ASSERT.finditer(body):
                at = start + m.start()
                stmt = statement_at(code, at)
                uses_clock = RUST_CLOCK.search(stmt) or RUST_MEASURED.search(stmt) or RUST_DURATION_ORDER.search(stmt) or \
                    any(re.search(rf"\b{v}\b", stmt) for v in clocked - {"mut", "_"})
                if not uses_clock:
                    continue
                if re.fullmatch(r"assert!\(\s*[\w:]*Instant::now\(\)\s*<\s*(\w+)\s*(,.*)?\)", stmt, re.S):
                    deadline = re.match(r"assert!\(\s*[\w:]*Instant::now\(\)\s*<\s*(\w+)", stmt).group(1)
                    if deadline in guards:
                        continue
                findings.append((rel, line_of(at), name, "wall-clock comparison"))


# --- Python -------------------------------------------------------------------------------------

PY_CLOCK_CALLS = {"monotonic", "monotonic_ns", "time", "time_ns", "perf_counter", "perf_counter_ns"}


def py_uses_clock(node, clocked):
    for sub in ast.walk(node):
        if isinstance(sub, ast.Call) and isinstance(sub.func, ast.Attribute) and sub.func.attr in PY_CLOCK_CALLS \
                and isinstance(sub.func.value, ast.Name) and sub.func.value.id == "time":
            return True
        if isinstance(sub, ast.Name) and sub.id in clocked:
            return True
    return False


def own_nodes(fn):
    """The nodes of a function, leaving out nested functions, lambdas and classes."""
    stack = list(ast.iter_child_nodes(fn))
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)):
            continue
        yield node
        stack.extend(ast.iter_child_nodes(node))


def is_py_assertion(node):
    if isinstance(node, ast.Assert):
        return True
    if isinstance(node, ast.Call):
        f = node.func
        name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""
        return name in ("fail", "raises", "warns") or name.startswith("assert")
    return False


def lint_python(path, findings):
    rel = path.relative_to(ROOT).as_posix()
    tree = ast.parse(path.read_text(), filename=str(path))
    for fn in ast.walk(tree):
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        nodes = list(own_nodes(fn))
        if fn.name.startswith("test"):
            asserts = [n.lineno for n in nodes if is_py_assertion(n)]
            returns = sorted(n.lineno for n in nodes if isinstance(n, ast.Return))
            if returns and (not asserts or returns[0] < min(asserts)):
                findings.append((rel, returns[0], fn.name, "returns before asserting anything"))
        clocked, guards = set(), set()
        for n in sorted((n for n in nodes if isinstance(n, (ast.Assign, ast.AugAssign, ast.Expr))), key=lambda n: n.lineno):
            value = n.value
            targets = n.targets if isinstance(n, ast.Assign) else [n.target] if isinstance(n, ast.AugAssign) else []
            # `took.append(time.monotonic() - t0)` makes `took` a clock reading too.
            if isinstance(n, ast.Expr) and isinstance(value, ast.Call) and isinstance(value.func, ast.Attribute) \
                    and value.func.attr == "append" and isinstance(value.func.value, ast.Name):
                targets = [value.func.value]
            if not targets or not py_uses_clock(value, clocked):
                continue
            for t in targets:
                if isinstance(t, ast.Name):
                    clocked.add(t.id)
                    # deadline = time.monotonic() + N, N >= HANG_GUARD_SECONDS
                    if isinstance(value, ast.BinOp) and isinstance(value.op, ast.Add) \
                            and isinstance(value.right, ast.Constant) and isinstance(value.right.value, (int, float)) \
                            and value.right.value >= HANG_GUARD_SECONDS:
                        guards.add(t.id)
        for n in nodes:
            if not isinstance(n, ast.Assert) or not py_uses_clock(n.test, clocked):
                continue
            t = n.test
            if isinstance(t, ast.Compare) and len(t.ops) == 1 and isinstance(t.ops[0], ast.Lt) \
                    and isinstance(t.comparators[0], ast.Name) and t.comparators[0].id in guards:
                continue
            findings.append((rel, n.lineno, fn.name, "wall-clock comparison"))


# --- the listed exceptions ----------------------------------------------------------------------

def listed():
    """(path, function) pairs from tests/WALLCLOCK.md: lines `- `path` `function`: reason`."""
    doc = ROOT / "tests" / "WALLCLOCK.md"
    entries = {}
    if doc.exists():
        for m in re.finditer(r"^- `([^`]+)` `([^`]+)`: *(.*)$", doc.read_text(), re.M):
            entries[(m.group(1), m.group(2))] = m.group(3).strip()
    return entries


def main():
    findings = []
    for d in RUST_DIRS:
        for path in sorted((ROOT / d).rglob("*.rs")):
            if "target" in path.relative_to(ROOT).parts:
                continue
            lint_rust(path, findings)
    for path in sorted((ROOT / "client-lib" / "python" / "tests").glob("*.py")):
        lint_python(path, findings)
    entries = listed()
    bad, used = [], set()
    for rel, line, fn, what in sorted(set(findings)):
        if what == "wall-clock comparison" and (rel, fn) in entries:
            used.add((rel, fn))
            if not entries[(rel, fn)]:
                bad.append(f"{rel}:{line}: {fn}: listed in tests/WALLCLOCK.md without a reason")
            continue
        bad.append(f"{rel}:{line}: {fn}: {what}" + (" not listed in tests/WALLCLOCK.md" if what.startswith("wall") else ""))
    for rel, fn in sorted(set(entries) - used):
        bad.append(f"tests/WALLCLOCK.md: `{rel}` `{fn}` is listed but has no wall-clock comparison (remove it)")
    for b in bad:
        print(b, flush=True)
    if bad:
        sys.exit(f"test-lint: {len(bad)} finding(s)")
    print(f"test-lint: no test returns before asserting; {len(used)} listed wall-clock comparisons")


if __name__ == "__main__":
    main()
