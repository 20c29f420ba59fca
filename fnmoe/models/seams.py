"""The seams the model runs through, each chosen by its caller and passed in, so the model knows
neither the memory policies nor FSDP nor the expert-parallel exchange:

  BlockRunner   how each block, and each of its regions, runs: what it keeps for backward
                (fnmoe.memory.policies.Runner: recompute, offload, resharding). PLAIN runs
                everything as it is, which is what a plain forward does.
  ParamsSource  how params reach compute. CAST (one process): every leaf cast to the compute dtype.
                For sharded (DTensor) params, FSDP's gathers with one block of lookahead
                (fnmoe.parallel.fsdp.GATHER; fnmoe.parallel.fsdp.params_source picks by the leaves).
  Exchange      how a MoE layer's rows reach the ep ranks owning their experts and come back: the
                params source puts one in a MoE layer's params as "ep" when its expert stacks hold
                one ep rank's experts (fnmoe.parallel.fsdp; fnmoe.parallel.dispatch.Exchange).

and one the step reports through: `mark(phase, tree)`, the step's phase for whatever listens
(fnmoe.plan.meters' meters, while they run; nothing otherwise).

hidden_states takes layer i's params from the source's feed (`feed.outside(i)`), then calls
`runner(i, fn, p, x_BLD, *rest)` for block i, where fn(p, x_BLD, *rest) is the block (p its params
as the feed gave them, x_BLD its input); inside, the block takes its compute params from the feed
(`feed.inside(p, i)`: again when backward recomputes it) and runs each of its regions (attention,
MoE, dense MLP) through `runner.region(i, name, fn, compile, *args)`.

Legend: B batch, L sequence, D model; in Exchange R routed rows sorted by global expert, E experts, N
token chunks, S ep ranks, X local experts (E/S), XDF / XFD a rank's expert stacks.
"""
from __future__ import annotations

from typing import Any, Callable, Iterator, NamedTuple, Protocol

import torch
from torch.distributed.tensor import DTensor

from fnmoe import compile as fcompile
from fnmoe.tree import Tree, tree_map


class BlockRunner(Protocol):
    offloads: bool
    """blocks take their params already cast to the compute dtype: offload tells a block's params
    from its activations by their storages, and casts inside a compiled region would be saved
    (and copied to the host) as activations"""

    def begin(self) -> None:
        """A micro-batch's forward begins (the step calls it): what the previous one kept is over."""

    def __call__(self, i: int, fn: Callable, p: dict, x_BLD, *rest) -> Any:
        """Block i: fn(p, x_BLD, *rest) under this runner's policy for blocks."""

    def region(self, i: int, name: str, fn: Callable, compile: bool, *args) -> Any:
        """Region `name` of block i: fn(*args), compiled when compile, under its region policy."""

    def chunk_recompute(self, i: int) -> str | None:
        """How backward recomputes block i's MoE token chunks (fnmoe.models.moe_chunks): None when it keeps
        what they save; "keep" when it recomputes them, keeping the expert-parallel exchange's outputs
        (the recompute around the region replays them); "replay" when the chunks send their rows again."""

    def block_chunks(self, i: int) -> Chunking | None:
        """Whether block i runs in chunks of its sequences (fnmoe.models.block_chunks), recomputed one at a
        time in backward; None runs it whole (under the runner's policy)."""


class Chunking(NamedTuple):
    """How a block runs in chunks of its sequences (BlockRunner.block_chunks)."""
    n: int
    """chunks: they divide the block's sequences"""
    modes: Callable[[], tuple[Any, Any]]
    """a new chunk's (forward mode, recompute mode): context managers under which the chunk's
    forward keeps the outputs a recompute must not change (its routing, its exchange) and the
    recompute takes them back, in the forward's order (fnmoe.memory.policies)"""


class Plain:
    """Every block and region as it is (regions compiled when asked)."""
    offloads = False

    def begin(self) -> None:
        pass

    def __call__(self, i: int, fn: Callable, p: dict, x_BLD, *rest):
        return fn(p, x_BLD, *rest)

    def region(self, i: int, name: str, fn: Callable, compile: bool, *args):
        return (fcompile.compiled(fn) if compile else fn)(*args)

    def chunk_recompute(self, i: int) -> str | None:
        return None

    def block_chunks(self, i: int) -> Chunking | None:
        return None


PLAIN: BlockRunner = Plain()


class LayerFeed(Protocol):
    """One forward's layers from a ParamsSource, taken in order."""

    def outside(self, i: int) -> dict:
        """Layer i's params as block i's runner takes them (once, before block i runs)."""

    def inside(self, p: dict, i: int) -> dict:
        """Block i's params in the compute dtype from what `outside` gave, inside the runner (so a
        recompute in backward takes them again)."""


class ParamsSource(Protocol):
    def __call__(self, tree: Tree, dtype: torch.dtype) -> Tree:
        """A subtree's leaves in dtype, now, as plain tensors (the embedding, the final norm, the
        head, a layer's copy outside its block)."""

    def layers(self, layers: list[dict], dtype: torch.dtype, cast_inside: bool) -> LayerFeed:
        """The feed of one forward over layers (the stored params of each, in order). cast_inside:
        compiled regions cast their own params (one process, nothing offloaded)."""


def _unsharded(t: torch.Tensor) -> torch.Tensor:
    if isinstance(t, DTensor):
        raise ValueError("sharded (DTensor) params reach compute through FSDP's gathers: pass "
                         "source=fnmoe.parallel.fsdp.params_source(params) (the train step and eval_loss choose it)")
    return t


def cast(tree: Tree, dtype: torch.dtype) -> Tree:
    """The gather of one process: every leaf in dtype."""
    return tree_map(lambda t: _unsharded(t).to(dtype), tree)


class _CastLayers:
    def __init__(self, layers: list[dict], dtype: torch.dtype, cast_inside: bool):
        self.layers, self.dtype, self.cast_inside = layers, dtype, cast_inside

    def outside(self, i: int) -> dict:
        # compiled regions cast their params inside (model.in_compute_dtype); else cast here, before
        # the runner: offload tells params from activations by their storages
        return self.layers[i] if self.cast_inside else cast(self.layers[i], self.dtype)

    def inside(self, p: dict, i: int) -> dict:
        return p


class Cast:
    """The params source of one process: leaves cast to the compute dtype."""

    def __call__(self, tree: Tree, dtype: torch.dtype) -> Tree:
        return cast(tree, dtype)

    def layers(self, layers: list[dict], dtype: torch.dtype, cast_inside: bool) -> LayerFeed:
        return _CastLayers(layers, dtype, cast_inside)


CAST: ParamsSource = Cast()


class Sent(Protocol):
    """One chunk's rows on their way to the ep ranks owning their experts (Exchange.send)."""
    rows: torch.Tensor
    """what arrives here, the all-to-all in flight until Exchange.received"""
    recv_SX: torch.Tensor
    """rows for each local expert from each source rank"""


class Exchange(Protocol):
    """The expert-parallel token exchange over one group of ep ranks. A chunk's rows are sent
    (`send`, issued), received (waited for), run by the local experts and sent back (`send_back`,
    issued; `returned`, waited for), so that a caller computes while an exchange travels."""

    def experts(self, expert_mlp: Callable, x_RD, counts_E, w_gate_XDF, w_up_XDF, w_down_XFD, gemm: str):
        """expert_mlp for rows sorted by global expert (counts_E rows each), run by the ep ranks owning
        the experts: the rows' results in x_RD's order, on this rank (the whole exchange, waited for)."""

    def dispatched(self, x_RD, counts_E, n_local: int) -> Sent:
        """The dispatch of rows sorted by global expert (counts_E each; n_local experts a rank),
        issued after the count exchange that sets its splits."""

    def chunk_counts(self, counts_NE) -> torch.Tensor:
        """[N, S, X]: the rows this rank receives from each rank for each local expert, for each of N
        chunks whose rows for each expert are counts_NE: every chunk's in one count exchange."""

    def chunk_splits(self, counts_NE, recv_NSX, rows_N: list[int]) -> list[tuple[list, list]]:
        """Each chunk's (send, recv): its rows to and from each ep rank (one host read for all)."""

    def send(self, x_RD, recv_SX, splits: tuple[list, list]) -> Sent:
        """Issue the dispatch of x_RD (rows sorted by global expert) by splits = (send, recv)."""

    def received(self, sent: Sent) -> torch.Tensor:
        """The dispatched rows that arrived here, waited for, by (source rank, local expert)."""

    def local_experts(self, expert_mlp: Callable, x_recv, recv_SX, w_gate_XDF, w_up_XDF, w_down_XFD,
                      gemm: str) -> torch.Tensor:
        """expert_mlp of the received rows, in their arrival order."""

    def send_back(self, y_recv, sent: Sent) -> torch.Tensor:
        """Issue the return of the experts' rows to where sent's rows came from."""

    def returned(self, back, sent: Sent) -> torch.Tensor:
        """What send_back returned, waited for: in the order sent's rows had, on this rank."""

    def combine(self, y_recv, sent: Sent) -> torch.Tensor:
        """send_back, then returned."""

    def arrived(self, x, out, send_S: list, recv_S: list, what: str) -> torch.Tensor:
        """out, kept from the forward's exchange of x by (send_S, recv_S), as if x were sent again: a
        recompute sends nothing forward, and its backward sends the gradient back (`what` names it)."""

    def grad_to_experts(self, g_RD, sent: Sent) -> torch.Tensor:
        """Issue the combine's backward by hand: the gradient of the rows returned, to the experts'
        ranks (fnmoe.models.moe_steps.Split); `waited` waits."""

    def grad_to_tokens(self, g_recv, sent: Sent) -> torch.Tensor:
        """Issue the dispatch's backward by hand: the gradient of the rows received, to their senders."""

    def waited(self, t: torch.Tensor) -> torch.Tensor:
        """A gradient grad_to_experts or grad_to_tokens issued, waited for."""

    def in_flight(self, t: torch.Tensor) -> Iterator[None]:
        """Yields once where a caller may compute while t's exchange travels (waited for first on a
        group that takes one collective at a time)."""


_listeners: list = []
"""what the step's phase marks reach: fnmoe.plan.meters' meters while they run, innermost last"""


def listen(listener) -> None:
    """listener.marked(phase, tree) is called at each mark until unlisten(listener)."""
    _listeners.append(listener)


def unlisten(listener) -> None:
    _listeners.remove(listener)


def mark(phase: str, tree: Tree = None) -> None:
    """The step enters phase ("forward", "grads", "update"; backward is seen from autograd's
    engine); tree is what the phase made (the micro-batch's gradients). A no-op without a listener."""
    for listener in _listeners:
        listener.marked(phase, tree)
