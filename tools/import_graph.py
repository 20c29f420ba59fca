"""fnmoe's import graph: which module imports which, every circle in it, and the longest modules.

    python tools/import_graph.py            # circles (none expected) and modules over --max-lines
    python tools/import_graph.py --edges    # also every edge, importer -> imported

Reads the source with ast (nothing is imported), so lazy imports inside functions count like
top-level ones: a circle hidden behind a function-level import is still a circle. Exit status 1
when there is a circle or a module over --max-lines.
"""
from __future__ import annotations

import argparse
import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "fnmoe"


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path, modules: set[str]) -> set[str]:
    """The fnmoe modules path imports (`from fnmoe import x` names module fnmoe.x when it is one)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name in modules}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            subs = {f"{node.module}.{a.name}" for a in node.names} & modules
            out |= subs or ({node.module} & modules)
    return out


def graph() -> dict[str, set[str]]:
    files = {module_name(p): p for p in ROOT.rglob("*.py")}
    return {m: imports(p, set(files)) - {m} for m, p in files.items()}


def circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Each strongly connected component of more than one module (Tarjan), sorted."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    sys.setrecursionlimit(10_000)
    for v in sorted(edges):
        if v not in index:
            visit(v)
    return sorted(out)


def long_modules(max_lines: int) -> list[tuple[str, int]]:
    sizes = [(module_name(p), len(p.read_text().splitlines())) for p in ROOT.rglob("*.py")]
    return sorted(((m, n) for m, n in sizes if n > max_lines), key=lambda x: -x[1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--edges", action="store_true", help="print every edge")
    ap.add_argument("--max-lines", type=int, default=450)
    args = ap.parse_args()
    edges = graph()
    if args.edges:
        for m in sorted(edges):
            print(f"{m} -> {', '.join(sorted(edges[m])) or '-'}")
    found = circles(edges)
    for c in found:
        print("circle: " + " <-> ".join(c))
    longs = long_modules(args.max_lines)
    for m, n in longs:
        print(f"long: {m} has {n} lines (> {args.max_lines})")
    print(f"{len(edges)} modules, {sum(map(len, edges.values()))} imports, {len(found)} circles, "
          f"{len(longs)} modules over {args.max_lines} lines")
    return 1 if found or longs else 0


if __name__ == "__main__":
    sys.exit(main())
