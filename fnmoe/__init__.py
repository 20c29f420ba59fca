"""fnmoe: functional Mixture-of-Experts training in PyTorch.

Parameters are a plain tree of tensors; the model, the optimizer and the training step are
pure functions over it. The names below are the public API (docs/design.md §3).

Each is loaded on first use (PEP 562), so `import fnmoe` and the `fnmoe` command's help load
no torch (~3 s of CPU: torch, dynamo, DTensor). A missing private torch API still fails on
first use naming the supported range: fnmoe/_torch.py, the one module that reaches them, is
loaded before any name below.
"""
# before anything loads torch, hence OpenMP: threads spin briefly, then sleep (fnmoe/threads.py), for
# the command and a library import alike; where torch loaded first, one line says how instead
from fnmoe import threads as _threads

if (_late := _threads.before_torch()) is not None:
    import logging as _logging

    _logging.getLogger("fnmoe").warning(_late)

import importlib as _importlib  # noqa: E402

# public name -> the module that defines it (the module itself when its last name is the public one)
_EXPORTS = {
    **{name: "fnmoe.config" for name in (
        "CheckpointConfig", "DataConfig", "DistConfig", "MemoryConfig", "MeshConfig", "ModelConfig",
        "MoEConfig", "OptimConfig", "PlanConfig", "ProfileConfig", "RunConfig", "TrainConfig", "load_config")},
    **{name: f"fnmoe.{name}" for name in ("checkpoint", "func", "hf", "optim")},
    "routing": "fnmoe.models.routing",
    "seams": "fnmoe.models.seams",
    "clear_caches": "fnmoe.caches",
    "forward": "fnmoe.models.transformer",
    "init_params": "fnmoe.parallel.sharding",
    "init_state": "fnmoe.training.step",
    "loss_fn": "fnmoe.training.step",
    "make_train_step": "fnmoe.training.step",
    "TrainState": "fnmoe.training.state",
    "value_and_grad": "fnmoe.tree",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'fnmoe' has no attribute {name!r}")
    _importlib.import_module("fnmoe._torch")  # first: a missing private torch API fails there, naming the range
    module = _importlib.import_module(_EXPORTS[name])
    value = module if module.__name__.rsplit(".", 1)[-1] == name else getattr(module, name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
