"""What the checks of tools/gpu_check.sh share: the Recorder of a step's rows, its deadline, the
train step as the loop builds it, and small helpers. Imported first by each check: where safetensors is
missing it is stubbed before fnmoe loads (no check reads or writes checkpoints)."""
from __future__ import annotations

import dataclasses
import json
import sys
import time
import traceback
import types
import typing
from pathlib import Path

TOOLS = Path(__file__).resolve().parents[1]
ROOT = TOOLS.parent
if str(TOOLS) not in sys.path:  # the checks import tools/ scripts (bench_moe, bench_adamw)
    sys.path[:0] = [str(ROOT), str(TOOLS)]

from gpu_checks.summary import SECTIONS  # noqa: E402 (torch-free)

PEAK_TFLOPS = 989.0  # H100/H200/GH200 bf16 dense (docs/design.md §7)
NOTES: list[str] = []
GPU_SHAPES = ["4096,512,256,32,4", "16384,2048,1408,64,6"]  # the MoE bench's: the CPU anchor; a DeepSeek-V3-16B layer
DRY_SHAPES = ["256,64,32,8,2"]
DEADLINE = [float("inf")]  # time.monotonic() by which this step must end (--timeout)
RESULTS_DIR: list[Path] = [Path(".")]  # --results (the step's traces go there)


def _stub_safetensors() -> None:
    """fnmoe imports safetensors at module level (checkpoints, HF); no step here uses it."""
    try:
        import safetensors  # noqa: F401
        import safetensors.torch  # noqa: F401 (fnmoe imports it)
    except ImportError:
        st, stt = types.ModuleType("safetensors"), types.ModuleType("safetensors.torch")

        class SafetensorError(Exception):
            pass

        def missing(*args, **kwargs):
            raise ImportError("safetensors is not installed (stubbed by tools/gpu_checks/common.py)")

        st.SafetensorError, st.safe_open, st.torch = SafetensorError, missing, stt
        stt.save_file = stt.load_file = missing
        sys.modules["safetensors"], sys.modules["safetensors.torch"] = st, stt
        NOTES.append("safetensors not installed: stubbed (no step reads or writes checkpoints)")


_stub_safetensors()


import torch  # noqa: E402

from fnmoe.config import MemoryConfig, ModelConfig, RunConfig  # noqa: E402
from fnmoe.models.params import leaf_inits  # noqa: E402
from fnmoe.memory.policies import train_runner  # noqa: E402
from fnmoe.plan.activations import pool_bytes  # noqa: E402
from fnmoe.training.step import make_train_step  # noqa: E402
from fnmoe.tree import map_with_path  # noqa: E402


def build_step(run: RunConfig, tx, donate: bool = False):
    """(run's train step, its runner): the host pool sized where the step is built, as fnmoe.training.loop does;
    donate: the update in place (fnmoe.training.loop's default, run.train.donate), else the pure one."""
    runner = train_runner(run, pool_bytes(run))
    return make_train_step(run, tx, runner, donate=donate), runner


class Recorder:
    """Rows of one step, rewritten to DIR/<step>.json after every row."""

    def __init__(self, results: Path, step: str):
        self.path = results / f"{step}.json"
        self.section = SECTIONS[step]
        self.rows: list[list[str]] = []
        self.env = f"torch {torch.__version__}, python {sys.version.split()[0]}"
        if torch.cuda.is_available():
            self.env += f", {torch.cuda.get_device_name(0)}"
        self.flush()

    def row(self, check: str, result: str, status: str = "ok") -> None:
        print(f"  [{self.section}] {check}: {result}  -> {status}", flush=True)
        self.rows.append([check, result, status])
        self.flush()

    def guarded(self, check: str, fn, *args, **kwargs):
        """Run one sub-check; an exception becomes a FAIL row and the step goes on."""
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        except Exception as e:
            traceback.print_exc()
            self.row(check, f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}", "FAIL")
        finally:
            print(f"  ({check}: {time.perf_counter() - t0:.1f} s)", flush=True)
        return None

    def flush(self) -> None:
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"section": self.section, "rows": self.rows, "notes": NOTES, "env": self.env}))
        tmp.replace(self.path)


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().float().cpu(), b.detach().float().cpu()
    return ((a - b).norm() / b.norm().clamp_min(1e-12)).item()


def status(ok: bool) -> str:
    return "ok" if ok else "FAIL"



def time_left() -> float:
    return DEADLINE[0] - time.monotonic()


def device_params(cfg: ModelConfig, device: str, seed: int = 0):
    """fnmoe's init distribution drawn on the device (fast; not init_params' exact values)."""
    g = torch.Generator(device=device).manual_seed(seed)

    def draw(path, init):
        if init.std == 0.0:
            return torch.full(init.shape, init.value, device=device)
        return torch.randn(init.shape, device=device, generator=g).mul_(init.std)
    return map_with_path(draw, leaf_inits(cfg))


def leaves(tree) -> list:
    if isinstance(tree, dict):
        return [x for v in tree.values() for x in leaves(v)]
    return [tree]


def _memory_kwargs() -> dict:
    return {f.name: f.default for f in dataclasses.fields(MemoryConfig) if f.default is not dataclasses.MISSING}


def memory_policies() -> list[tuple[str, dict]]:
    """(label, MemoryConfig overrides) of the policies MemoryConfig offers, 'none' first: each value of
    `recompute`, a bool `offload` switch (alone and with full recompute), and each per-region value
    applied to every region field (attention / moe / mlp) at once."""
    hints = typing.get_type_hints(MemoryConfig)
    fields = {f.name: typing.get_args(hints[f.name]) for f in dataclasses.fields(MemoryConfig)}
    out = [("none", {})]
    for v in fields.get("recompute", ()):
        if v != "none":
            out.append((f"recompute={v}", {"recompute": v}))
    for name in fields:
        if "offload" in name and hints[name] is bool:
            out.append((f"{name}=True", {name: True}))
            if "full" in fields.get("recompute", ()):
                out.append((f"recompute=full+{name}", {"recompute": "full", name: True}))
    regions = [n for n, args in fields.items() if n != "recompute" and "none" in args]
    values = [v for v in dict.fromkeys(v for n in regions for v in fields[n]) if v != "none"]
    for v in values:
        out.append((f"{'/'.join(regions)}={v}", {n: v for n in regions if v in fields[n]}))
    return out


def recompute_policies() -> list[str]:
    """The values MemoryConfig.recompute accepts (a Literal), 'none' first."""
    hints = typing.get_type_hints(MemoryConfig)
    vals = list(typing.get_args(hints.get("recompute", str))) or ["none"]
    return sorted(vals, key=lambda v: v != "none")


def offload_variant() -> tuple[dict, str] | None:
    """MemoryConfig kwargs that turn offload on, if MemoryConfig offers it: a bool field named *offload*,
    or a Literal field with an 'offload' value."""
    for label, kw in memory_policies():
        if "offload" in label:
            return kw, label
    return None


class NotOffered(Exception):
    """A memory policy this build refuses (invalid combination, planned but not run, not built on this device)."""


def with_policy(run: RunConfig, overrides: dict) -> RunConfig:
    """run with MemoryConfig overrides, validated (fnmoe.config.validate); NotOffered when refused."""
    from fnmoe.config import validate

    run = dataclasses.replace(run, memory=MemoryConfig(**{**_memory_kwargs(), **overrides}))
    try:
        return validate(run)
    except ValueError as e:
        raise NotOffered(str(e).replace("invalid config:", "").strip().splitlines()[0]) from None


def refused(e: Exception) -> str | None:
    """The reason when e says a policy is not offered (not a bug): validation, 'not run yet', not built."""
    if isinstance(e, NotOffered):
        return str(e)
    if isinstance(e, (NotImplementedError, ValueError)):
        return f"{type(e).__name__}: {str(e).splitlines()[0][:140]}"
    return None
