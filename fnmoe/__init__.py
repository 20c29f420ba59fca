"""fnmoe: functional Mixture-of-Experts training in PyTorch.

Parameters are a plain tree of tensors; the model, the optimizer and the training step are
pure functions over it. The names below are the public API (docs/design.md §3).
"""
from fnmoe import checkpoint, func, hf, optim
from fnmoe.caches import clear_caches
from fnmoe.config import (
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
from fnmoe.model import forward
from fnmoe.params import init_params
from fnmoe.train import init_state, loss_fn, make_train_step
from fnmoe.train_state import TrainState
from fnmoe.tree import value_and_grad

__all__ = [
    "CheckpointConfig", "DataConfig", "DistConfig", "MemoryConfig", "MeshConfig", "ModelConfig",
    "MoEConfig", "OptimConfig", "PlanConfig", "ProfileConfig", "RunConfig", "TrainConfig",
    "TrainState", "forward", "init_params", "init_state", "load_config", "loss_fn",
    "checkpoint", "clear_caches", "func", "hf", "make_train_step", "optim", "value_and_grad",
]
