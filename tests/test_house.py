"""House rules: private torch APIs only through fnmoe/_torch.py (docs/design.md §1, rule 9), a version
guard that names the supported range, fnmoe.clear_caches, imports that run one way, short modules,
every module in docs/architecture.md's table, and checkpoints of an earlier leaf name still loading."""
import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import fnmoe
from fnmoe import _torch, caches
from fnmoe.models import transforms
from fnmoe.kernels import attention as cpu_attention
from fnmoe.data import loader as data
from fnmoe.data import mixture
from fnmoe.memory import policies as memory
from fnmoe.parallel import reshard
from fnmoe.parallel import sharding
from fnmoe.parallel import gather as fgather
from fnmoe import compile as fcompile
from fnmoe.parallel import dist as fdist

ROOT = Path(__file__).resolve().parents[1]

# private attributes of torch objects, whatever name the object goes by
TORCH_PRIVATE_ATTRS = {
    "_version", "_base", "_local_tensors", "_flatten", "_timeout", "_Options", "_grouped_mm", "_check",
    "_StridedShard", "_get_default_store", "_c10d_functional", "_c10d_functional_autograd", "_dynamo",
    "_inductor", "_functorch", "_pytree", "_python_dispatch", "_functional_collectives", "_local_tensor",
    "_internal", "_spec", "_C", "_prims", "_refs", "_subclasses", "_higher_order_ops",
}


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _torch_module(name: str) -> bool:
    return name == "torch" or name.startswith("torch.")


def private_torch_uses(source: str) -> list[tuple[int, str]]:
    """(line, what) for each private torch API a module's source reaches: an import of a private
    torch module or name, an attribute with a private component on a name bound to torch, a known
    private attribute of a torch object, or such a name given to getattr/hasattr/import_module."""
    tree = ast.parse(source)
    torch_names: set[str] = set()
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if _torch_module(a.name):
                    torch_names.add(a.asname or a.name.split(".")[0])
                    if any(_private(p) for p in a.name.split(".")):
                        found.append((node.lineno, f"import {a.name}"))
        elif isinstance(node, ast.ImportFrom) and node.module and _torch_module(node.module):
            for a in node.names:
                torch_names.add(a.asname or a.name)
            if any(_private(p) for p in node.module.split(".")) or any(_private(a.name) for a in node.names):
                found.append((node.lineno, f"from {node.module} import {', '.join(a.name for a in node.names)}"))
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            chain, root = [node.attr], node.value
            while isinstance(root, ast.Attribute):
                chain.append(root.attr)
                root = root.value
            rooted = isinstance(root, ast.Name) and root.id in torch_names
            if node.attr in TORCH_PRIVATE_ATTRS or (rooted and _private(node.attr)):
                found.append((node.lineno, ast.unparse(node)))
        elif isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", None)) in (
                "getattr", "hasattr", "setattr", "delattr", "import_module", "__import__"):
            for arg in node.args:
                if isinstance(arg, ast.Constant) and isinstance(arg.value, str) and (
                        arg.value in TORCH_PRIVATE_ATTRS
                        or (_torch_module(arg.value) and any(_private(p) for p in arg.value.split(".")))):
                    found.append((node.lineno, ast.unparse(node)))
    return sorted(set(found))


def test_private_torch_apis_only_through_fnmoe_torch():
    bad = []
    for path in sorted((ROOT / "fnmoe").rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if rel == "fnmoe/_torch.py":
            continue
        bad += [f"{rel}:{line}: {what}" for line, what in private_torch_uses(path.read_text())]
    assert not bad, "private torch APIs outside fnmoe/_torch.py (add a wrapper there):\n" + "\n".join(bad)


def test_the_scan_sees_each_kind_of_private_access():
    src = """
import torch
import torch.distributed as dist
import torch.utils._pytree as pytree
from torch.distributed.tensor.placement_types import _StridedShard
a = torch._check(True)
b = dist.ProcessGroupGloo._Options()
c = torch.ops._c10d_functional.all_to_all_single
d = t._version + t._base
e = getattr(torch, "_grouped_mm", None)
f = torch.__version__ + self._mine + cpu_gemm._build_error()
"""
    lines = {line for line, _ in private_torch_uses(src)}
    assert lines == {4, 5, 6, 7, 8, 9, 10}


def test_supported_range_is_pyprojects():
    """_torch.SUPPORTED says what pyproject.toml requires."""
    req = re.search(r'"torch>=([\d.]+),<([\d.]+)"', (ROOT / "pyproject.toml").read_text())
    assert req, "pyproject.toml's torch requirement"
    assert _torch.SUPPORTED == f"{req[1]} <= torch < {req[2]}"


# ---------------------------------------------------------------- the version guard

def test_a_missing_private_attribute_names_the_installed_torch_and_the_supported_range(monkeypatch):
    from torch.distributed.device_mesh import DeviceMesh

    monkeypatch.delattr(DeviceMesh, "_flatten")
    with pytest.raises(RuntimeError) as e:
        _torch.flatten_mesh(object.__new__(DeviceMesh), "dp")
    assert isinstance(e.value, ImportError)  # one error for both: a missing module or attribute
    msg = str(e.value)
    assert "DeviceMesh._flatten" in msg and torch.__version__ in msg and _torch.SUPPORTED in msg


@pytest.mark.launch
@pytest.mark.parametrize("use", ["from fnmoe import forward", "import fnmoe.training.step",
                                 "import fnmoe.training.loop"])
def test_a_missing_private_module_fails_the_import_naming_the_range(use):
    """Whichever way a program reaches fnmoe's torch code: a public name of the lazy package, or a
    module imported directly (fnmoe/_torch.py is the only one that reaches a private torch module)."""
    code = ("import sys; sys.modules['torch.distributed._local_tensor'] = None\n"
            f"try:\n    {use}\nexcept ImportError as e:\n    print(e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert "torch.distributed._local_tensor" in out.stdout, out.stdout + out.stderr
    assert _torch.SUPPORTED in out.stdout and torch.__version__ in out.stdout


@pytest.mark.launch
def test_the_package_and_the_commands_help_load_no_torch():
    """`import fnmoe`, `fnmoe --help` and `fnmoe train --help` answer without torch (~3 s of CPU);
    the public names load it on first use, all of them there."""
    code = ("import contextlib, io, sys\n"
            "import fnmoe, fnmoe.cli\n"
            "for argv in ([], ['--help'], ['train', '--help']):\n"
            "    with contextlib.redirect_stdout(io.StringIO()), contextlib.suppress(SystemExit):\n"
            "        fnmoe.cli.main(argv)\n"
            "print('torch' in sys.modules)\n"
            "missing = [n for n in fnmoe.__all__ if getattr(fnmoe, n, None) is None]\n"
            "listed = set(fnmoe.__all__) <= set(dir(fnmoe))\n"
            "print('torch' in sys.modules, missing, listed)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert out.stdout.splitlines() == ["False", "True [] True"], out.stdout + out.stderr


# ---------------------------------------------------------------- clear_caches

def _sizes() -> dict[str, int]:
    return {"compiled": len(fcompile._compiled), "said": len(fcompile._said),
            "with_policy": memory.with_policy.cache_info().currsize,
            "with_impl": cpu_attention._with_impl.cache_info().currsize,
            "ranks": sharding._ranks.cache_info().currsize, "submesh": len(sharding._submeshes),
            "epochs": data._epoch_permutation.cache_info().currsize,
            "source epochs": mixture._source_permutation.cache_info().currsize,
            "under transforms": transforms._under.cache_info().currsize, "tracked": len(reshard._tracked),
            "last block": reshard._last is not None, "in flight": len(fgather._in_flight) + len(fgather._scattering)}


def test_clear_caches_empties_them_and_a_forward_still_runs(monkeypatch):
    monkeypatch.setattr(fcompile, "_said", set())  # this test's own: other tests expect their warnings said
    run = fnmoe.load_config(str(ROOT / "configs" / "tiny.toml"))
    params = fnmoe.init_params(run.model, seed=0)
    tokens_BL = torch.randint(0, run.model.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    before, _ = fnmoe.forward(params, tokens_BL, run.model)

    fcompile.say_once("house: said once")
    memory.with_policy(torch.sin, "full")
    fcompile.compiled(torch.cos)  # registered, never called: nothing compiles
    data._epoch_permutation(0, 0, 10)
    mixture._source_permutation(0, "a", 0, 10)
    transforms._under(run.model, True)
    assert all(_sizes()[k] for k in ("said", "with_policy", "compiled", "epochs", "source epochs", "under transforms"))

    fnmoe.clear_caches()
    assert not any(_sizes().values()), _sizes()
    after, _ = fnmoe.forward(params, tokens_BL, run.model)
    assert torch.equal(after, before)


# memos of pure functions of frozen values, which hold nothing else: not caches in clear_caches'
# sense (fnmoe/caches.py), so not registered
NOT_CACHES = ("fnmoe/plan/", "fnmoe/config/", "fnmoe/models/params.py", "fnmoe/kernels/gemm.py")


def _memoized(tree: ast.AST) -> list[tuple[ast.FunctionDef, bool]]:
    """(function, registered) for each function decorated by functools.cache or lru_cache."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            names = [ast.unparse(d.func if isinstance(d, ast.Call) else d) for d in node.decorator_list]
            if any(n.split(".")[-1] in ("cache", "lru_cache") for n in names):
                out.append((node, "caches.register" in names))
    return out


def test_every_cache_registers_its_clear_where_it_is_defined():
    """A functools cache in fnmoe is decorated by fnmoe.caches.register (so clear_caches empties it)
    unless its module is one of NOT_CACHES; the registered ones are emptied by clear_caches."""
    missing = []
    for path in sorted((ROOT / "fnmoe").rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if not rel.startswith(NOT_CACHES):
            missing += [f"{rel}:{f.lineno}: {f.name}" for f, ok in _memoized(ast.parse(path.read_text())) if not ok]
    assert not missing, "caches not registered with fnmoe.caches.register:\n" + "\n".join(missing)
    assert [ok for _, ok in _memoized(ast.parse("@functools.lru_cache(maxsize=2)\ndef f(): pass\n"
                                                "@caches.register\n@functools.cache\ndef g(): pass"))] == [False, True]
    for cached in (data._epoch_permutation, mixture._source_permutation, memory.with_policy, transforms._under,
                   cpu_attention._with_impl, sharding._ranks):
        assert cached.cache_clear in caches.registered(), cached
    assert {fcompile.clear, reshard.clear, fgather.clear, sharding._submeshes.clear} <= set(caches.registered())

    with pytest.raises(TypeError, match="caches.register"):
        caches.register({})
    calls = []

    def forget() -> None:
        calls.append(1)

    n = len(caches.registered())
    try:
        assert caches.register(forget) is forget and caches.register(forget) is forget  # once
        assert len(caches.registered()) == n + 1
        fnmoe.clear_caches()
        assert calls == [1]
    finally:
        caches._clears.remove(forget)


def test_clear_caches_between_steps_on_a_simulated_mesh():
    """Meshes made before clearing keep working: the train loss of a 2x2 mesh is unchanged."""
    from test_sharding import CFG, B, _rank_part, _tokens

    from fnmoe import optim
    from fnmoe.config import MeshConfig, OptimConfig, RunConfig, TrainConfig
    from fnmoe.parallel.sharding import init_params
    from fnmoe.training.step import init_state, make_train_step
    from fnmoe.memory.policies import train_runner

    def losses(clear: bool) -> list[float]:
        run = RunConfig(model=CFG, mesh=MeshConfig(fsdp=2, ep=2), train=TrainConfig(batch_size=B, steps=2),
                        optim=OptimConfig(warmup_steps=2))
        tx = optim.from_config(run.optim, 2)
        out = []
        with fdist.simulate(4):
            mesh = sharding.make_mesh(run.mesh, run.dist)
            state, step = init_state(init_params(CFG, 0, mesh=mesh), tx), make_train_step(run, tx, train_runner(run))
            for s in range(2):
                x_BL = _rank_part(_tokens(s), 4)
                state, metrics = step(state, [(x_BL[:, :-1], x_BL[:, 1:])])
                out.append(metrics["loss"])
                if clear:
                    fnmoe.clear_caches()
                    assert not sharding._submeshes
        return out

    assert losses(clear=True) == losses(clear=False)


def _import_graph():
    sys.path.insert(0, str(ROOT / "tools"))
    try:
        import import_graph
    finally:
        sys.path.pop(0)
    return import_graph


def test_imports_run_one_way_and_modules_stay_short():
    """tools/import_graph.py reads every import, lazy ones included: no circle, no module over 450 lines."""
    ig = _import_graph()
    edges = ig.graph()
    assert {"fnmoe.models.moe", "fnmoe.models.seams"} <= edges["fnmoe.models.transformer"]
    # the model runs through its seams (fnmoe/models/seams.py): it imports neither FSDP nor the memory policies
    assert not [m for m in edges["fnmoe.models.transformer"] if m.startswith(("fnmoe.parallel", "fnmoe.memory"))]
    assert ig.circles(edges) == []
    assert ig.circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert ig.long_modules(450) == []


MODEL_MAY_NOT = ("fnmoe.parallel", "fnmoe.memory", "fnmoe.training")


def test_the_model_imports_no_parallel_memory_or_training(tmp_path):
    """fnmoe/models/ imports nothing from parallel/, memory/ or training/, lazy imports included, and
    tools/import_graph.py's KNOWN lists no exception for it: what the model needs of them comes in
    through its seams (fnmoe/models/seams.py: the runner, the params source, the expert-parallel
    exchange in the params), and a mesh's shards of init_params are fnmoe.parallel.sharding's."""
    ig = _import_graph()
    edges = ig.graph()
    assert "fnmoe.models.moe" in edges and "fnmoe.models.transformer" in edges
    found = sorted((m, d) for m, deps in edges.items() if m.startswith("fnmoe.models") for d in deps
                   if d.startswith(MODEL_MAY_NOT))
    assert not found, f"the model imports {found}"
    assert not [e for e in ig.KNOWN if e[0].startswith("fnmoe.models")], ig.KNOWN
    # the scan sees a lazy import too: one inside a function counts
    (tmp_path / "toy.py").write_text("def f():\n    from fnmoe.parallel import dispatch\n")
    assert ig.imports(tmp_path / "toy.py", {"fnmoe.parallel.dispatch"}) == {"fnmoe.parallel.dispatch"}


def test_at_most_12_modules_at_the_top_and_each_package_says_what_lives_there():
    """fnmoe/'s top holds at most 12 modules (its __init__ and __main__ included); the rest live in
    packages, each of whose __init__ starts with a one-line docstring saying what lives there."""
    flat = sorted(p.name for p in (ROOT / "fnmoe").glob("*.py"))
    assert len(flat) <= 12, f"{len(flat)} modules at the top of fnmoe/ (at most 12): {flat}"
    packages = sorted(p.parent for p in (ROOT / "fnmoe").glob("*/__init__.py"))
    assert {"models", "training", "sampling", "parallel", "memory"} <= {p.name for p in packages}
    for pkg in packages:
        doc = ast.get_docstring(ast.parse((pkg / "__init__.py").read_text()))
        where = f"fnmoe/{pkg.name}/__init__.py"
        assert doc and doc.splitlines()[0].strip(), f"{where}: no docstring saying what lives there"
        assert len(doc.splitlines()[0]) <= 110, f"{where}: its docstring's first line is one line"
    # the model package draws its data flow, naming the file of each step
    doc = ast.get_docstring(ast.parse((ROOT / "fnmoe" / "models" / "__init__.py").read_text()))
    for step, file in [("embedding", "transformer.py"), ("attention", "attention.py"), ("route", "routing.py"),
                       ("permute", "moe.py"), ("experts", "moe.py"), ("unpermute", "moe.py"),
                       ("head", "transformer.py")]:
        assert any(step in line and file in line for line in doc.splitlines()), (step, file)
        assert (ROOT / "fnmoe" / "models" / file).exists()


def test_no_package_imports_one_above_it():
    """tools/import_graph.py's package rule: each package or top-level module sits on a layer of its
    LAYERS and imports nothing above its own; the imports against it today are its KNOWN list, each
    with the work that removes it. A new one fails here, and so does a KNOWN one that is gone."""
    ig = _import_graph()
    up, unplaced = ig.against_order(ig.graph())
    assert not unplaced, f"place these in tools/import_graph.py's LAYERS: {unplaced}"
    new = [f"{m} -> {d}" for m, d in up if (m, d) not in ig.KNOWN]
    assert not new, "imports of a package above the importer's (tools/import_graph.py LAYERS):\n" + "\n".join(new)
    gone = [f"{m} -> {d}" for m, d in ig.KNOWN if (m, d) not in up]
    assert not gone, "no longer against the order: delete from tools/import_graph.py's KNOWN:\n" + "\n".join(gone)
    # the scan: a package's modules are one unit, fnmoe/__init__.py is ""; up is only across layers
    toy = {"fnmoe.a.x": {"fnmoe.b"}, "fnmoe.b": {"fnmoe.a.y", "fnmoe.c"}, "fnmoe.a.y": set(), "fnmoe.c": set(),
           "fnmoe": {"fnmoe.b"}, "fnmoe.d": set()}
    assert ig.against_order(toy, [("a", "c"), ("b",), ("",)]) == ([("fnmoe.a.x", "fnmoe.b")], ["d"])


def test_no_module_takes_another_modules_private_names(tmp_path):
    """tools/import_graph.py's private-name rule: a name another fnmoe module imports (or reads off an
    imported module) is public; a private module's name (fnmoe/_torch.py) is allowed."""
    ig = _import_graph()
    assert ig.private_names() == []
    src = tmp_path / "fnmoe" / "user.py"
    src.parent.mkdir()
    src.write_text("from fnmoe import _torch, model as m\nfrom fnmoe.model import _hidden, public\n"
                   "import fnmoe.train as t\nx = _torch.pytree, m._block, t._step, m.__doc__\n")
    modules = {"fnmoe", "fnmoe._torch", "fnmoe.model", "fnmoe.train", "fnmoe.user"}
    orig = ig.ROOT
    ig.ROOT = tmp_path / "fnmoe"
    try:
        found = ig.private_uses(src, modules)
    finally:
        ig.ROOT = orig
    assert found == [(2, "fnmoe.model._hidden"), (4, "fnmoe.model._block"), (4, "fnmoe.train._step")]


def test_every_module_is_in_the_architecture_table():
    table = [line for line in (ROOT / "docs" / "architecture.md").read_text().splitlines() if line.startswith("| `")]
    named = " ".join(table)
    missing = []
    for path in sorted((ROOT / "fnmoe").rglob("*.py")):
        rel = path.relative_to(ROOT / "fnmoe")
        if path.name == "__init__.py":
            continue
        # a package's modules are named in its row as `file.py`, top-level modules as `file.py` too
        if f"`{rel.name}`" not in named and f"`{rel.as_posix()}`" not in named:
            missing.append(rel.as_posix())
    assert not missing, f"modules missing from docs/architecture.md's table: {missing}"


def test_an_earlier_leaf_name_loads_as_todays(tmp_path):
    """router_DE became w_router_DE: a native tree written under the earlier name loads, with the
    values of the same seed (a renamed leaf draws its init under its earlier name)."""
    from safetensors.torch import save_file

    from fnmoe.models.params import current_path, init_params
    from fnmoe.tree import flatten_dict
    from fnmoe.tree_io import load_tree, save_tree

    run = fnmoe.load_config(ROOT / "configs" / "tiny.toml")
    params = init_params(run.model, seed=0)
    save_tree(tmp_path / "tree", params, run.model)
    old = {k.replace("w_router_DE", "router_DE"): v for k, v in flatten_dict(params).items()}
    assert any(k.endswith(".router_DE") for k in old)
    index = (tmp_path / "tree" / "index.json")
    index.write_text(index.read_text().replace("w_router_DE", "router_DE"))
    save_file({k: v.contiguous() for k, v in old.items()}, str(tmp_path / "tree" / "params.safetensors"))
    _, loaded = load_tree(tmp_path / "tree")
    got, want = flatten_dict(loaded), flatten_dict(params)
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    assert current_path("opt_state.0.mu.layers.1.moe.router_DE") == "opt_state.0.mu.layers.1.moe.w_router_DE"
    # the seed's values did not move with the name: the same draw as under the earlier name
    from fnmoe.models.params import LeafInit, draw_leaf
    init = LeafInit((run.model.dim, run.model.moe.n_experts), run.model.init_std)
    assert torch.equal(draw_leaf(init, 0, "layers.1.moe.w_router_DE"), draw_leaf(init, 0, "layers.1.moe.router_DE"))


@pytest.mark.launch
def test_the_tree_is_clean_under_ruff():
    """pyproject.toml's [tool.ruff] rules hold for fnmoe, tests and tools (ruff comes with the test extra)."""
    ruff = subprocess.run([sys.executable, "-m", "ruff", "check", "fnmoe", "tests", "tools"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert ruff.returncode == 0, ruff.stdout[-3000:] + ruff.stderr[-1000:]
