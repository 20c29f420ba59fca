"""fnmoe's import graph: which module imports which, every circle in it, imports against the
package order, private names used across modules, and the longest modules.

    python tools/import_graph.py            # circles, imports against LAYERS, private names, long modules
    python tools/import_graph.py --edges    # also every edge, importer -> imported

Reads the source with ast (nothing is imported), so lazy imports inside functions count like
top-level ones: a circle hidden behind a function-level import is still a circle. Exit status 1
when there is a circle, an import against the package order that KNOWN does not list, a package or
top-level module LAYERS does not place, a private name used across modules, or a module over
--max-lines.

A name another module imports (`from fnmoe.x import name`, or `x.name` on an imported module) is
public: it does not start with "_". A private *module* may keep its name (fnmoe/_torch.py); the
names it exports are public.

The package order: each unit (a package under fnmoe/, or a top-level module; a package's module
where LAYERS names it on its own, such as "training.step") sits on a layer of LAYERS, and imports
only units on its own layer or below: nothing imports "up". The layers are today's import graph,
read bottom up; a new package or top-level module gets a place in them.
"""
from __future__ import annotations

import argparse
import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "fnmoe"

# Units low to high: a unit imports its own layer and those below. "" is fnmoe/__init__.py (the
# public API, which re-exports from anywhere).
LAYERS: list[tuple[str, ...]] = [
    ("_torch", "caches", "dtypes", "threads"),  # private torch behind names; the cache registry; dtype
                                                # names; how the command's threads wait
    ("tree", "config"),                         # trees of tensors; the run configuration
    ("compile",),                               # the one torch.compile site
    ("kernels",),                               # the CPU kernels the model runs
    ("models",),                                # the model, its seams (runner, params source), its params
    ("parallel",),                              # process groups, the mesh, gathers, the EP exchange
    ("optim", "data", "training.state", "run"),
    ("tree_io", "checkpoint"),                  # checkpoint/ imports neither the step nor the data
    ("hf",),
    ("memory",),                                # what a block keeps for backward: runs the model's blocks
    ("training.step", "sampling"),              # the step; text in and out of a model
    ("plan",),                                  # plans the step and rehearses it
    ("func", "training"),                       # the loop (which plans a run) and evaluation
    ("cli",),                                   # the command: its subcommands import what they run
    ("", "__main__"),
]

# Imports against LAYERS that exist today, each with the work that removes it: none today.
# tests/test_house.py fails on any other, on an entry here that no longer exists (delete it), and on
# any from fnmoe/models/ to parallel/, memory/ or training/, listed here or not.
KNOWN: dict[tuple[str, str], str] = {}


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


def unit(module: str, order: list[tuple[str, ...]] = LAYERS) -> str:
    """The unit of LAYERS a module belongs to: its package under fnmoe/ ("" for fnmoe), or the
    package's module itself where LAYERS places that module on its own ("training.step")."""
    parts = module.split(".")
    own = ".".join(parts[1:3])
    if len(parts) > 2 and any(own in layer for layer in order):
        return own
    return parts[1] if len(parts) > 1 else ""


def layers(order: list[tuple[str, ...]] = LAYERS) -> dict[str, int]:
    """unit -> its layer's index (0 lowest)."""
    return {u: i for i, layer in enumerate(order) for u in layer}


def against_order(edges: dict[str, set[str]], order: list[tuple[str, ...]] = LAYERS
                  ) -> tuple[list[tuple[str, str]], list[str]]:
    """(the imports of a unit on a higher layer, sorted; the units order does not place)."""
    where = layers(order)
    units = {m: unit(m, order) for m in set(edges) | {d for deps in edges.values() for d in deps}}
    unplaced = sorted({units[m] for m in edges} - set(where))
    up = sorted((m, d) for m, deps in edges.items() for d in deps
                if units[m] in where and units[d] in where and where[units[d]] > where[units[m]])
    return up, unplaced


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


def private_uses(path: Path, modules: set[str]) -> list[tuple[int, str]]:
    """(line, "module.name") for each private name path's module takes from another fnmoe module:
    imported by name, or read as an attribute of a module it imported."""
    me, out, aliases = module_name(path), [], {}
    tree = ast.parse(path.read_text(), str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0 and node.module in modules:
            for a in node.names:
                if f"{node.module}.{a.name}" in modules:  # a module: its name may be private (_torch)
                    aliases[a.asname or a.name] = f"{node.module}.{a.name}"
                elif _private(a.name) and node.module != me:
                    out.append((node.lineno, f"{node.module}.{a.name}"))
        elif isinstance(node, ast.Import):
            aliases.update({a.asname: a.name for a in node.names if a.name in modules and a.asname})
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases
                and _private(node.attr) and aliases[node.value.id] != me):
            out.append((node.lineno, f"{aliases[node.value.id]}.{node.attr}"))
    return sorted(set(out))


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def private_names() -> list[str]:
    """"module:line: module.name" for every private name used across fnmoe's modules."""
    files = {module_name(p): p for p in ROOT.rglob("*.py")}
    return [f"{m}:{line}: {what}" for m, p in sorted(files.items()) for line, what in private_uses(p, set(files))]


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
    up, unplaced = against_order(edges)
    for m, d in up:
        why = f"known: {KNOWN[m, d]}" if (m, d) in KNOWN else "new"
        print(f"up: {m} -> {d} ({unit(d)} is above {unit(m) or 'fnmoe'}; {why})")
    for u in unplaced:
        print(f"unplaced: fnmoe.{u} is on no layer of LAYERS")
    for m, d in sorted(set(KNOWN) - set(up)):
        print(f"gone: {m} -> {d} no longer imports up; delete it from KNOWN")
    new = [e for e in up if e not in KNOWN]
    private = private_names()
    for line in private:
        print(f"private: {line} (another module's private name: rename it public)")
    longs = long_modules(args.max_lines)
    for m, n in longs:
        print(f"long: {m} has {n} lines (> {args.max_lines})")
    print(f"{len(edges)} modules, {sum(map(len, edges.values()))} imports, {len(found)} circles, "
          f"{len(up)} imports against the package order ({len(new)} new), {len(private)} private names across "
          f"modules, {len(longs)} modules over {args.max_lines} lines")
    return 1 if found or new or unplaced or private or longs else 0


if __name__ == "__main__":
    sys.exit(main())
