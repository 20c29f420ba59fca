"""`TrainState`: what a training step carries from one step to the next, in a module of its own
below the step (fnmoe.train), the loop and the checkpoint (fnmoe.checkpoint), so that saving and
loading a state imports neither the step nor the data loader."""
from __future__ import annotations

from dataclasses import dataclass

from fnmoe.tree import Tree


@dataclass(frozen=True)
class TrainState:
    params: Tree
    opt_state: Tree
    step: int  # optimizer steps taken
