#!/usr/bin/env python3
"""Fails when the modules of a crate import each other in a cycle.

For every crate of the workspace (each `src/` with a lib.rs or main.rs), a module is a file or
directory directly under src/ (`a.rs` or `a/`), and `a` imports `b` when any of a's files names
`crate::b` (in a `use` or a path). Then the same inside each directory module `d/`: its
submodules import each other by `super::b` (from their own file) or `crate::d::b`. A cycle
among them is reported with the lines that make it.
Usage: scripts/import-cycles.py [ROOT]"""
import re
import sys
from pathlib import Path

ROOT = Path(sys.argv[1] if len(sys.argv) > 1 else Path(__file__).resolve().parent.parent)


def modules(src: Path) -> dict[str, list[Path]]:
    """The modules directly in `src` (a crate's src/ or a directory module), with their files."""
    out = {}
    for entry in src.iterdir():
        if entry.name in ("lib.rs", "main.rs", "mod.rs"):
            continue
        if entry.suffix == ".rs":
            out.setdefault(entry.stem, []).append(entry)
        elif entry.is_dir():
            out.setdefault(entry.name, []).extend(sorted(entry.rglob("*.rs")))
    return out


def imports(files: list[Path], names: set[str], prefix: str, own: set[Path]) -> dict[str, str]:
    """What the files import of `names` through `prefix` (`crate::`, `crate::d::`), or `super::`
    from the files in `own`: module → the first line naming it."""
    by_path = re.compile(rf"\b{re.escape(prefix)}(\w+)")
    by_group = re.compile(rf"\buse\s+{re.escape(prefix)}\{{([^;]*)\}}", re.S)
    found = {}
    for f in files:
        patterns = [(by_path, by_group)]
        if f in own and prefix != "crate::":
            patterns.append((re.compile(r"\bsuper::(\w+)"), re.compile(r"\buse\s+super::\{([^;]*)\}", re.S)))
        # Comments (a doc link is no import) blanked, lines kept where they were.
        text = re.sub(r"//[^\n]*", "", f.read_text())
        # Test modules may reach anywhere: only the code a build compiles counts.
        text = text.split("#[cfg(test)]\nmod tests")[0]
        for path, group_of in patterns:
            for group in group_of.finditer(text):
                for name in re.findall(r"(?:^|[,{\s])(\w+)", group.group(1)):
                    if name in names:
                        line = text[: group.start()].count("\n") + 1
                        found.setdefault(name, f"{f.relative_to(ROOT)}:{line}")
            for m in path.finditer(text):
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


def check(crate: Path, directory: Path, prefix: str) -> bool:
    """Reports the cycles among the modules in `directory` (reached as `prefix`), then those
    inside each of its directory modules; true when there was one."""
    mods = modules(directory)
    # A module's own file: `super::` there names its siblings (deeper files name its children).
    own = {f for m, files in mods.items() for f in files if f.parent == directory or f.name == "mod.rs" and f.parent.parent == directory}
    graph = {m: {k: v for k, v in imports(files, set(mods), prefix, own).items() if k != m} for m, files in mods.items()}
    found = False
    for component in cycles(graph):
        found = True
        where = prefix.removeprefix("crate::").removesuffix("::") or "the crate root"
        print(f"{crate.relative_to(ROOT)} ({where}): modules {', '.join(component)} import each other:")
        for m in component:
            for n, line in sorted(graph[m].items()):
                if n in component:
                    print(f"  {m} -> {n}  ({line})")
    for sub in sorted(p for p in directory.iterdir() if p.is_dir()):
        found |= check(crate, sub, f"{prefix}{sub.name}::")
    return found


failed = False
for src in sorted(p for p in ROOT.glob("**/src") if "target" not in p.parts and "vendor" not in p.parts):
    if (src / "lib.rs").exists() or (src / "main.rs").exists():
        failed |= check(src.parent, src, "crate::")
sys.exit(1 if failed else 0)
