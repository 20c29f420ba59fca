"""fnmoe: functional Mixture-of-Experts training in PyTorch.

Parameters are a plain tree of tensors; the model, the optimizer and the training step are
pure functions over it. The names below are the public API (docs/design.md §3).
"""
# before anything loads torch, hence OpenMP: the fnmoe command's threads wait passively (fnmoe/threads.py)
from fnmoe import threads as _threads

_threads.before_torch()

from fnmoe import _torch  # noqa: F401, E402  first: a missing private torch API fails there, naming the range
from fnmoe import checkpoint, func, hf, optim  # noqa: E402
from fnmoe.caches import clear_caches  # noqa: E402
from fnmoe.config import (  # noqa: E402
    CheckpointConfig,
    DataConfig,
    DistConfig,
    MemoryConfig,
    MeshConfig,
    ModelConfig,
    MoEConfig,
    OptimConfig,
    PlanConfig,
    ProfileConfig,
    RunConfig,
    TrainConfig,
    load_config,
)
from fnmoe.model import forward  # noqa: E402
from fnmoe.params import init_params  # noqa: E402
from fnmoe.train import init_state, loss_fn, make_train_step  # noqa: E402
from fnmoe.train_state import TrainState  # noqa: E402
from fnmoe.tree import value_and_grad  # noqa: E402

__all__ = [
    "CheckpointConfig", "DataConfig", "DistConfig", "MemoryConfig", "MeshConfig", "ModelConfig",
    "MoEConfig", "OptimConfig", "PlanConfig", "ProfileConfig", "RunConfig", "TrainConfig",
    "TrainState", "forward", "init_params", "init_state", "load_config", "loss_fn",
    "checkpoint", "clear_caches", "func", "hf", "make_train_step", "optim", "value_and_grad",
]
