#!/usr/bin/env python3
"""Fails when the modules of a crate import each other in a cycle.

For every crate of the workspace (each `src/` with a lib.rs or main.rs), a module is a file or
directory directly under src/ (`a.rs` or `a/`), and `a` imports `b` when any of a's files names
`crate::b` (in a `use` or a path). A cycle among them is reported with the lines that make it.
Usage: scripts/import-cycles.py [ROOT]"""
import re
import sys
from pathlib import Path

ROOT = Path(sys.argv[1] if len(sys.argv) > 1 else Path(__file__).resolve().parent.parent)
CRATE_PATH = re.compile(r"\bcrate::(\w+)")
USE_GROUP = re.compile(r"\buse\s+crate::\{([^;]*)\}", re.S)


def modules(src: Path) -> dict[str, list[Path]]:
    out = {}
    for entry in src.iterdir():
        if entry.name in ("lib.rs", "main.rs"):
            continue
        if entry.suffix == ".rs":
            out.setdefault(entry.stem, []).append(entry)
        elif entry.is_dir():
            out.setdefault(entry.name, []).extend(sorted(entry.rglob("*.rs")))
    return out


def imports(files: list[Path], names: set[str]) -> dict[str, str]:
    """What the files import of `names`: module → the first line naming it."""
    found = {}
    for f in files:
        # Comments (a doc link is no import) blanked, lines kept where they were.
        text = re.sub(r"//[^\n]*", "", f.read_text())
        # Test modules may reach anywhere: only the code a build compiles counts.
        text = text.split("#[cfg(test)]\nmod tests")[0]
        for group in USE_GROUP.finditer(text):
            for name in re.findall(r"(?:^|[,{\s])(\w+)", group.group(1)):
                if name in names:
                    line = text[: group.start()].count("\n") + 1
                    found.setdefault(name, f"{f.relative_to(ROOT)}:{line}")
        for m in CRATE_PATH.finditer(text):
            if m.group(1) in names:
                line = text[: m.start()].count("\n") + 1
                found.setdefault(m.group(1), f"{f.relative_to(ROOT)}:{line}")
    return found


def cycles(graph: dict[str, dict[str, str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


failed = False
for src in sorted(p for p in ROOT.glob("**/src") if "target" not in p.parts and "vendor" not in p.parts):
    if not ((src / "lib.rs").exists() or (src / "main.rs").exists()):
        continue
    mods = modules(src)
    graph = {m: {k: v for k, v in imports(files, set(mods)).items() if k != m} for m, files in mods.items()}
    for component in cycles(graph):
        failed = True
        print(f"{src.parent.relative_to(ROOT)}: modules {', '.join(component)} import each other:")
        for m in component:
            for n, where in sorted(graph[m].items()):
                if n in component:
                    print(f"  {m} -> {n}  ({where})")
sys.exit(1 if failed else 0)
