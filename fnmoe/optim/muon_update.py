"""Muon: momentum, then Newton-Schulz orthogonalisation of every weight matrix (docs/design.md §5).

torch.optim.Muon is the reference: for a weight W_IO (y = x @ W) we give the update that
torch.optim.Muon gives its [out, in] parameter W_IO.T, transposed back. Momentum buffers and
Newton-Schulz outputs are bitwise equal to torch's. The step itself is optax's chain
(s*O, + wd*W, * -lr, then W + update) where torch folds lr*s into one scalar and updates W
in place (W*(1 - lr*wd), then a fused multiply-add); the roundings differ, so params agree
to ~1 ulp per step (checked at 1e-6 relative), not bitwise.

On a mesh (params and grads DTensors, sharding.py) Newton-Schulz still sees only whole matrices,
each on exactly one rank. A leaf whose mesh dims split only leading (batch) dims, an expert stack
split on E, is orthogonalised on the shards each rank holds: no communication. A leaf whose matrix
dims are split has every matrix assigned to one owner of the splitting group (heaviest first to the
least-loaded rank); one all-to-all sends each rank's pieces of all the group's matrices to their
owners in bf16 (what Newton-Schulz rounds them to anyway), owners run it batched, and one reverse
all-to-all returns the pieces: two collectives per group and step, moving each matrix twice in
bf16. Momentum and the scaling stay elementwise on the shards, so the update equals the
single-process one, bitwise where a batched GEMM's result does not depend on the batch (CPU).

Legend: B matrices batched into one Newton-Schulz call (leading dims of all leaves of one
matrix shape, flattened together), I in, O out (weights are [*, I, O]), R <= C the rows
and columns of the wide view that Newton-Schulz iterates on, Z a flat all-to-all buffer.
"""
from __future__ import annotations

import heapq
import itertools
import math
from collections import defaultdict
from typing import Literal, NamedTuple

import torch
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from fnmoe.models import transforms
from fnmoe.parallel import dist as fdist
from fnmoe.parallel import sharding
from fnmoe.parallel.dispatch import all_to_all
from fnmoe.optim.adam import Fused, adamw
from fnmoe.optim.base import (GradientTransformation, PerLeaf, ScalarOrSchedule, Tree, add_decayed_weights, chain,
                              checked, decay_mask, default_labels, device_of, hyper, hyper_tensor, leaves_of,
                              partition, scale_by_learning_rate, set_to_zero)
from fnmoe.tree import tree_flatten_with_paths, tree_map

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
"""Keller Jordan's quintic: maximal slope at zero, converges to singular values in about [0.7, 1.2]"""
AdjustLR = Literal["original", "match_rms_adamw", "spectral"]


def newton_schulz(G_BIO: Tensor, steps: int = 5, eps: float = 1e-7, dtype: torch.dtype = torch.bfloat16) -> Tensor:
    """Approximately orthogonalise each matrix [I, O] of G (any leading dims) in dtype (bf16, as
    torch; float32 makes the update insensitive to last-bit changes of the gradient, which bf16
    rounding turns into ulp-sized jumps of single entries).

    Works on torch's [out, in] view G.mT, made wide (transposed when out > in) as
    torch.optim.Muon does, with the same addmm-form updates in baddbmm, so each matrix
    comes out bitwise equal to torch's `_zeropower_via_newtonschulz(G.mT).mT`. The
    iteration runs in four buffers allocated once (fresh large tensors are costly on CPU). Under
    vmap (an ensemble of optimizers) the members join the leading dims (_newton_schulz_op), so each
    comes out bitwise as it would alone.
    """
    if _under_vmap():
        return _newton_schulz_op(G_BIO, steps, eps, dtype)
    a, b, c = NS_COEFFICIENTS
    I, O = G_BIO.shape[-2:]
    tall = O > I  # torch's view [O, I] has more rows than columns
    G_BRC = G_BIO.reshape(-1, I, O)
    X_BRC = (G_BRC if tall else G_BRC.mT).to(dtype, memory_format=torch.contiguous_format, copy=True)
    # Frobenius norm >= spectral norm, so this puts every singular value in [0, 1]
    X_BRC.div_(X_BRC.norm(dim=(-2, -1), keepdim=True).clamp(min=eps))
    Y_BRC = torch.empty_like(X_BRC)
    A_BRR = X_BRC.new_empty(X_BRC.shape[0], X_BRC.shape[1], X_BRC.shape[1])
    B_BRR = torch.empty_like(A_BRR)
    for _ in range(steps):
        torch.bmm(X_BRC, X_BRC.mT, out=A_BRR)
        torch.baddbmm(A_BRR, A_BRR, A_BRR, beta=b, alpha=c, out=B_BRR)
        torch.baddbmm(X_BRC, B_BRR, X_BRC, beta=a, out=Y_BRC)
        X_BRC, Y_BRC = Y_BRC, X_BRC
    return (X_BRC if tall else X_BRC.mT).reshape(G_BIO.shape)


def _under_vmap() -> bool:
    # torch.compile traces the plain path: dynamo cannot call functorch's interpreter stack
    return not torch.compiler.is_compiling() and "vmap" in transforms.active()


@torch.library.custom_op("fnmoe::newton_schulz", mutates_args=())
def _newton_schulz_op(G_BIO: Tensor, steps: int, eps: float, dtype: torch.dtype) -> Tensor:
    """newton_schulz as an op with a batching rule of its own: vmap's rule for baddbmm computes
    beta*input + alpha*product with two roundings where baddbmm has one (in bf16, entries many ulps
    off after five steps), and out= buffers take no batched tensors."""
    return newton_schulz(G_BIO, steps, eps, dtype)


@_newton_schulz_op.register_vmap
def _newton_schulz_vmap(info, in_dims: tuple, G_BIO: Tensor, steps: int, eps: float,
                        dtype: torch.dtype) -> tuple[Tensor, int | None]:
    d = in_dims[0]  # the members are one more leading (batch) dim of the matrices
    return newton_schulz(G_BIO if d is None else G_BIO.movedim(d, 0), steps, eps, dtype), None if d is None else 0


def lr_scale(I: int, O: int, adjust_lr: AdjustLR) -> float:
    """The per-matrix lr factor s, from torch's [rows=out, cols=in] view."""
    if adjust_lr == "original":
        return math.sqrt(max(1.0, O / I))
    if adjust_lr == "match_rms_adamw":
        return 0.2 * math.sqrt(max(O, I))
    if adjust_lr == "spectral":
        return math.sqrt(O / I)
    raise ValueError(f"adjust_lr must be 'original', 'match_rms_adamw' or 'spectral', got {adjust_lr!r}")


def _orthogonalize(U_leaves: list[Tensor], steps: int, eps: float, dtype: torch.dtype) -> list[Tensor]:
    """newton_schulz on every leaf, with one batched call per (matrix shape, device)."""
    if _under_vmap():  # vmap batches the members already, and its batched leaves copy into no plain buffer
        return [newton_schulz(U, steps, eps, dtype) for U in U_leaves]
    groups: dict[tuple, list[int]] = defaultdict(list)
    for i, U in enumerate(U_leaves):
        groups[(*U.shape[-2:], U.device)].append(i)
    out: list[Tensor | None] = [None] * len(U_leaves)
    for (I, O, device), idx in groups.items():
        sizes = [U_leaves[i].numel() // (I * O) for i in idx]
        U_BIO = torch.empty(sum(sizes), I, O, dtype=dtype, device=device)
        for i, U_part in zip(idx, U_BIO.split(sizes)):
            U_part.copy_(U_leaves[i].reshape(-1, I, O))
        for i, O_part in zip(idx, newton_schulz(U_BIO, steps, eps, dtype).split(sizes)):
            out[i] = O_part.reshape(U_leaves[i].shape)
    return out


def _matrix_split(U: Tensor) -> tuple[DeviceMesh, int] | None:
    """(mesh, mesh dim) of the one mesh dim that splits U's matrices; None when U is plain or its
    mesh dims split only batch dims (Newton-Schulz then runs on the shards as they are)."""
    if not isinstance(U, DTensor):
        return None
    splits = [m for m, d in sharding.split_dims(U).items() if d >= U.ndim - 2]
    if len(splits) > 1 or any(not isinstance(U.placements[m], Shard) for m in splits):
        raise ValueError(f"muon: matrices split as {U.placements} over {U.device_mesh}; it supports one "
                         "mesh dim splitting a matrix dim, as Shard")
    return (U.device_mesh, splits[0]) if splits else None


def _on_shards(U_leaves: list[Tensor], steps: int, eps: float, dtype: torch.dtype) -> list[Tensor]:
    """_orthogonalize on what this rank holds of each leaf, DTensors rewrapped as they were."""
    locals_ = [U.to_local() if isinstance(U, DTensor) else U for U in U_leaves]
    return [DTensor.from_local(O, U.device_mesh, U.placements, shape=U.shape, stride=U.stride())
            if isinstance(U, DTensor) else O for U, O in zip(U_leaves, _orthogonalize(locals_, steps, eps, dtype))]


def _owners(costs: list[int], n_ranks: int) -> list[int]:
    """Each matrix's owner: the heaviest first, each to the least-loaded rank (ties to the lower
    rank), so every rank computes the same answer and the Newton-Schulz work is balanced."""
    load = [(0, k) for k in range(n_ranks)]
    owner = [0] * len(costs)
    for u in sorted(range(len(costs)), key=lambda u: -costs[u]):  # stable: equal costs in leaf order
        total, k = heapq.heappop(load)
        owner[u] = k
        heapq.heappush(load, (total + costs[u], k))
    return owner


def _pieces(shape: tuple[int, int], d: int, n_ranks: int) -> tuple[tuple[int, int], ...]:
    """The [I, O] shapes that the ranks of a group hold of a matrix whose dim d they split."""
    return tuple((n, shape[1]) if d == 0 else (shape[0], n) for n in sharding.chunk_lengths(shape[d], n_ranks))


def _segments(lengths: list[list[int]]) -> list[tuple[int, int, tuple[int, ...]]]:
    """(first rank, end rank, piece length of each run) of the maximal ranges of ranks that hold
    pieces of one length of every run, from each run's lengths by rank: torch.chunk gives full
    pieces, one shorter, then empty ones, so a few ranges cover a group of any size."""
    segs: list[list] = []
    for s in range(len(lengths[0])):
        ns = tuple(ls[s] for ls in lengths)
        if segs and segs[-1][2] == ns:
            segs[-1][1] = s + 1
        else:
            segs.append([s, s + 1, ns])
    return [(a, b, ns) for a, b, ns in segs]


def _owner_step(recv_Z: Tensor, mine: list[tuple[tuple[int, int], int]], n_ranks: int, steps: int,
                eps: float, dtype: torch.dtype) -> Tensor:
    """On one owner: every rank's pieces of its matrices (by source rank, then matrix) made whole,
    orthogonalised, and cut into the pieces to send back (by destination rank, then matrix).

    Matrices come in runs of one shape and split dim, and ranks in segments that hold pieces of one
    length (_segments): each (segment, run) is one block moved by one permuted copy, so the op count
    does not grow with the group (a piece a matrix and rank was 1.6 ms of fake-tensor dispatch each
    in a rehearsal: 40 s of K2's update at fsdp 96)."""
    if not mine:
        return recv_Z
    runs = [(shape, d, len(list(g))) for (shape, d), g in itertools.groupby(mine)]
    lengths = [sharding.chunk_lengths(shape[d], n_ranks) for shape, d, _ in runs]
    segs = _segments(lengths)
    other = [shape[1 - d] for shape, d, _ in runs]  # a piece's extent across its split dim

    def widths(ns: tuple[int, ...]) -> list[int]:  # one rank's elements of each run
        return [J * n * w for (_, _, J), n, w in zip(runs, ns, other)]
    blocks = recv_Z.split([(b - a) * sum(widths(ns)) for a, b, ns in segs])
    parts: list[list[Tensor]] = [[] for _ in runs]
    for (a, b, ns), z in zip(segs, blocks):
        if z.numel() == 0:
            continue
        g = b - a
        for r, (((I, O), d, J), n, x) in enumerate(zip(runs, ns, z.view(g, -1).split(widths(ns), dim=1))):
            if n:
                parts[r].append(x.reshape(g, J, n, O).transpose(0, 1).reshape(J, g * n, O) if d == 0 else
                                x.reshape(g, J, I, n).permute(1, 2, 0, 3).reshape(J, I, g * n))
    whole = [p[0] if len(p) == 1 else torch.cat(p, dim=d + 1) for p, (_, d, _) in zip(parts, runs)]
    done = _orthogonalize(whole, steps, eps, dtype)
    out = []
    for a, b, ns in segs:
        g, cols = b - a, []
        for ((I, O), d, J), n, O_JIO, ls in zip(runs, ns, done, lengths):
            if n:
                x = O_JIO.narrow(d + 1, sum(ls[:a]), g * n)
                cols.append(x.reshape(J, g, n, O).transpose(0, 1).reshape(g, -1) if d == 0 else
                            x.reshape(J, I, g, n).permute(2, 0, 1, 3).reshape(g, -1))
        if cols:
            out.append(torch.cat(cols, dim=1).reshape(-1))
    return torch.cat(out)


def _on_owners(U_leaves: list[DTensor], mesh: DeviceMesh, mesh_dim: int, steps: int, eps: float,
               dtype: torch.dtype) -> list[Tensor]:
    """_orthogonalize of leaves whose matrices mesh_dim splits: each matrix gathered whole to one
    owner of that group, orthogonalised there, and its pieces sent back (two all-to-alls)."""
    S, group = mesh.size(mesh_dim), mesh.get_group(mesh_dim)
    shards = [U.to_local() for U in U_leaves]
    # a matrix is (leaf, index in the rank's batch); batch splits are even (E % ep == 0), so every
    # rank of every group lists the same matrices
    counts = [math.prod(x.shape[:-2]) for x in shards]
    held = [m for x, n in zip(shards, counts) for m in x.reshape(n, *x.shape[-2:]).unbind()]  # this rank's pieces
    split = [sharding.split_dims(U)[mesh_dim] - (U.ndim - 2) for U in U_leaves]  # 0: I, 1: O
    mats = [(tuple(U.shape[-2:]), d) for U, d, n in zip(U_leaves, split, counts) for _ in range(n)]
    owner = _owners([min(I, O) ** 2 * max(I, O) for (I, O), _ in mats], S)
    order = sorted(range(len(mats)), key=owner.__getitem__)
    mine = [[mats[u] for u in order if owner[u] == k] for k in range(S)]

    def from_each(r: int) -> list[int]:  # what rank r, as an owner, receives from each rank of its group
        pieces = [_pieces(shape, d, S) for shape, d in mine[sharding.coordinate(mesh, r)[mesh_dim]]]
        return [sum(math.prod(p[s]) for p in pieces) for s in range(S)]
    from_all = fdist.rank_ints(from_each)
    to_owner = [sum(held[u].numel() for u in order if owner[u] == k) for k in range(S)]
    send_Z = torch.cat([held[u].flatten() for u in order]).to(dtype)  # Newton-Schulz's own rounding
    recv_Z = all_to_all(send_Z, from_all, to_owner, group)
    done_Z = fdist.tensor_map(recv_Z, lambda r, x: _owner_step(x, mine[sharding.coordinate(mesh, r)[mesh_dim]], S,
                                                               steps, eps, dtype))
    back_Z = all_to_all(done_Z, to_owner, from_all, group)
    back = dict(zip(order, back_Z.split([held[u].numel() for u in order])))
    starts = itertools.accumulate(counts, initial=0)
    return [DTensor.from_local(torch.stack([back[u].view(held[u].shape) for u in range(a, a + n)]).view(x.shape),
                               U.device_mesh, U.placements, shape=U.shape, stride=U.stride())
            for U, x, a, n in zip(U_leaves, shards, starts, counts)]


def _orthogonalize_leaves(U_leaves: list[Tensor], steps: int, eps: float, dtype: torch.dtype) -> list[Tensor]:
    """Newton-Schulz of every matrix of every leaf, plain or DTensor, always on whole matrices:
    on the shards where no matrix dim is split, else by owners, one exchange per splitting group."""
    groups: dict[tuple | None, list[int]] = defaultdict(list)
    for i, U in enumerate(U_leaves):
        groups[_matrix_split(U)].append(i)
    out: list[Tensor | None] = [None] * len(U_leaves)
    for key, idx in groups.items():
        leaves = [U_leaves[i] for i in idx]
        done = _on_shards(leaves, steps, eps, dtype) if key is None else _on_owners(leaves, *key, steps, eps, dtype)
        for i, O in zip(idx, done):
            out[i] = O
    return out


class ScaleByMuonState(NamedTuple):
    momentum: Tensor
    mu: Tree
    """momentum buffers M, one per leaf, in momentum_dtype"""


def scale_by_muon(momentum: float = 0.95, nesterov: bool = True, ns_steps: int = 5,
                  adjust_lr: AdjustLR = "match_rms_adamw", eps: float = 1e-7,
                  momentum_dtype: torch.dtype = torch.float32, ns_dtype: torch.dtype = torch.bfloat16
                  ) -> GradientTransformation:
    """s * NS(U) per matrix: M = lerp(M, G, 1-mu); U = lerp(G, M, mu) (Nesterov) or M.

    Leaves need >= 2 dims: the last two are [in, out], leading dims are a batch (experts). Leaves
    are plain tensors or DTensors laid out by sharding.py (module docstring: whole matrices only).
    Follow with add_decayed_weights and scale_by_learning_rate for the full Muon step.
    """
    lr_scale(1, 1, adjust_lr)  # fail at construction on an unknown name
    hyper("scale_by_muon: momentum", momentum, hi=1.0, hi_open=True)
    hyper("scale_by_muon: eps", eps)

    def update(updates: Tree, state: ScaleByMuonState, params: Tree = None) -> tuple[Tree, ScaleByMuonState]:
        paths, G_leaves, rebuild = tree_flatten_with_paths(updates)
        for path, G in zip(paths, G_leaves):
            if G.ndim < 2:
                raise ValueError(f"muon: leaf '{path}' has shape {tuple(G.shape)}; Muon needs >= 2 dims "
                                 "(label it 'adamw')")
        mu = state.momentum
        # the same lerps as torch.optim.Muon, so the buffers are bitwise equal; weights in the lerp's dtype
        # as in adam._adam_moments (vmap)
        M_leaves = [M.lerp(G.to(M.dtype), (1 - mu).to(M.dtype))
                    for G, M in zip(G_leaves, leaves_of(state.mu, updates), strict=True)]
        U_leaves = [G.lerp(M.to(G.dtype), mu.to(G.dtype)) for G, M in zip(G_leaves, M_leaves)] if nesterov else M_leaves
        O_leaves = _orthogonalize_leaves(U_leaves, ns_steps, eps, ns_dtype)
        # back to the update dtype before scaling: scaling bf16 O would round it again (~1e-4 off torch)
        out = [O.to(G.dtype, copy=True).mul_(lr_scale(*G.shape[-2:], adjust_lr)) for G, O in zip(G_leaves, O_leaves)]
        return rebuild(out), ScaleByMuonState(mu, rebuild(M_leaves))

    def init(params: Tree) -> ScaleByMuonState:
        return ScaleByMuonState(hyper_tensor(momentum, device_of(params)),
                                tree_map(lambda p: torch.zeros_like(p, dtype=momentum_dtype), params))
    return GradientTransformation(init, update)


def muon(lr: ScalarOrSchedule, weight_decay: float = 0.1, momentum: float = 0.95, nesterov: bool = True,
         ns_steps: int = 5, adjust_lr: AdjustLR = "match_rms_adamw", adamw_lr: ScalarOrSchedule | None = None,
         adamw_betas: tuple[float, float] = (0.9, 0.95), adamw_eps: float = 1e-8,
         adamw_weight_decay: float | None = None, labels: PerLeaf | None = None,
         momentum_dtype: torch.dtype = torch.float32, ns_dtype: torch.dtype = torch.bfloat16,
         fused: Fused = "off") -> GradientTransformation:
    """Muon on matrices, AdamW on the rest, buffers frozen (labels: `default_labels`, or `labels=`).

    Muon leaves: W <- W(1 - lr*wd) - lr*s*NS(U), the decay with the unadjusted lr. AdamW
    leaves: lr adamw_lr (None: lr), decay adamw_weight_decay (None: weight_decay) on
    matrices only. Set hyperparameters between steps with optim.set_hyperparams.

    The default scale s differs from torch.optim.Muon's: adjust_lr="match_rms_adamw" (s =
    0.2*sqrt(max(in, out)): updates of AdamW's RMS, so AdamW's lr and weight decay carry over, as in
    Moonlight and Kimi K2), where torch.optim.Muon's default (adjust_lr_fn=None) is "original" (s =
    sqrt(max(1, out/in))). adjust_lr="original" takes torch's steps (lr_scale lists the three).
    fused: the AdamW leaves' (adam.adamw's).
    """
    hyper("muon: learning rate", lr)
    if adamw_lr is not None:
        hyper("muon: adamw_lr", adamw_lr)
    return checked(partition({
        "muon": chain(scale_by_muon(momentum, nesterov, ns_steps, adjust_lr, momentum_dtype=momentum_dtype,
                                    ns_dtype=ns_dtype),
                      add_decayed_weights(weight_decay),
                      scale_by_learning_rate(lr)),
        "adamw": adamw(lr if adamw_lr is None else adamw_lr, *adamw_betas, adamw_eps,
                       weight_decay if adamw_weight_decay is None else adamw_weight_decay, mask=decay_mask,
                       fused=fused),
        "frozen": set_to_zero(),
    }, default_labels if labels is None else labels), "muon update")
