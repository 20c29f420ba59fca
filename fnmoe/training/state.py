"""`TrainState`: what a training step carries from one step to the next, in a module of its own
below the step (fnmoe.training.step), the loop and the checkpoint (fnmoe.checkpoint), so that saving and
loading a state imports neither the step nor the data loader.

A step built with donate=True (fnmoe.training.step.make_train_step) updates the params and optimizer state
of the TrainState it is given in place and returns a new TrainState over the same tensors; the
given one is marked donated (`donate`), and a step or a save given it again raises DonatedError
(`check_live`): its tensors hold the new values, or, if the step was cut short, part of them."""
from __future__ import annotations

from dataclasses import dataclass

from fnmoe.tree import Tree


@dataclass(frozen=True)
class TrainState:
    params: Tree
    opt_state: Tree
    step: int  # optimizer steps taken


class DonatedError(RuntimeError):
    """A TrainState (or its params or opt_state) given to a donating step was used again."""


def donate(state: TrainState) -> None:
    """Mark state as given to a step that updates it in place (before the first write)."""
    object.__setattr__(state, "_donated", True)  # not a field: equality and the checkpoint ignore it


def donated(state: TrainState) -> bool:
    return getattr(state, "_donated", False)


def check_live(state: TrainState, who: str) -> None:
    """DonatedError if state was donated: its params and optimizer state were updated in place."""
    if donated(state):
        raise DonatedError(f"{who}: this TrainState (step {state.step}) was donated to a train step, which updated "
                           "its params and optimizer state in place; use the TrainState that step returned "
                           "(or build the step with donate=False / run with --train.no-donate)")
