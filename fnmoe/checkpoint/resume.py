"""Resuming a run: which checkpoint (`resume_point`, `find_latest`), whether the run may continue
it (`check_resume_config`), and its TrainState and RNG states on the current mesh (`load_state`)."""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Callable

import torch
from torch.distributed.tensor import DTensor

from fnmoe import optim
from fnmoe.parallel import sharding
from fnmoe.checkpoint.format import CONFIG, CheckpointError, whole_slices, list_checkpoints
from fnmoe.checkpoint.load import opened_files, read_region, verify_together, saved_config
from fnmoe.checkpoint.procs import rank_in_job
from fnmoe.checkpoint.shards import rng_states
from fnmoe.config import RunConfig, to_dict
from fnmoe.models.params import current_path, init_params
from fnmoe.training.state import TrainState
from fnmoe.tree import Tree, tree_flatten_with_paths

log = logging.getLogger("fnmoe")

# model fields that pick kernels, not the params: they may change on resume like optimizer settings
RUNTIME_MODEL_FIELDS = ("model.compute_dtype", "model.compile", "model.moe.impl", "model.attention_impl")


def _flat_diff(old: dict, new: dict, prefix: str = "") -> list[tuple[str, Any, Any]]:
    out = []
    for key in old.keys() | new.keys():
        a, b = old.get(key), new.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            out += _flat_diff(a, b, f"{prefix}{key}.")
        elif a != b:
            out.append((prefix + key, a, b))
    return sorted(out)


def check_resume_config(saved: RunConfig, run: RunConfig, ckpt: Path, step: int) -> None:
    """Refuse a resume that changes the model's shape (listing the fields) or the data order (the batch
    size, the sequence length); warn about other changes (optimizer, schedule, step count, mesh, ...),
    which apply from the resume point on."""
    diffs = [d for d in _flat_diff(to_dict(saved), to_dict(run)) if d[0] != "resume"]
    shown = lambda ds: ", ".join(f"{k} {a!r} -> {b!r}" for k, a, b in ds)  # noqa: E731
    model = [d for d in diffs if d[0].startswith("model.") and d[0] not in RUNTIME_MODEL_FIELDS]
    if model:
        raise CheckpointError(f"cannot resume from {ckpt}: model fields differ from the checkpoint's: "
                              f"{shown(model)}; use the checkpoint's values (its {CONFIG}) or start a new run")
    if saved.train.batch_size != run.train.batch_size:
        # the data order is a function of the step (Loader.batch_at): step N of another size is another sample
        raise CheckpointError(
            f"cannot resume from {ckpt} with --train.batch-size {run.train.batch_size}: it was saved at step {step} "
            f"with batch size {saved.train.batch_size}, and the samples of a step follow from the step and the "
            f"batch size, so the rest of the epoch would be skipped or repeated; resume with --train.batch-size "
            f"{saved.train.batch_size} (--train.grad-accum and the mesh may change) or start a new run")
    if saved.data.seq_len != run.data.seq_len:
        # the stream is cut into windows of seq_len + 1 tokens: another length is another set of windows
        raise CheckpointError(
            f"cannot resume from {ckpt} with --data.seq-len {run.data.seq_len}: it was saved at step {step} with "
            f"sequence length {saved.data.seq_len}, and the data order (which windows of the token stream each step "
            f"reads, and how many make an epoch) follows from the sequence length, so the rest of the epoch would be "
            f"skipped or repeated; resume with --data.seq-len {saved.data.seq_len} or start a new run")
    if diffs and rank_in_job()[0] == 0:  # every rank finds the same: rank 0 says it
        log.warning("resuming from %s with %d setting%s changed from its %s (they apply after step %d):\n%s",
                    ckpt, len(diffs), "s"[:len(diffs) != 1], CONFIG, step, changed_flags(diffs))
        jump = lr_jump(saved, run, step)
        if jump:
            log.warning(jump)


def changed_flags(diffs: list[tuple[str, Any, Any]]) -> str:
    """One line a changed setting, as its flag: `  --data.corpus: 'data/mine' -> 'bundled'`."""
    return "\n".join(f"  --{k.replace('_', '-')}: {a!r} -> {b!r}" for k, a, b in diffs)


def lr_jump(saved: RunConfig, run: RunConfig, step: int) -> str | None:
    """What the changed settings do to the learning rate of step `step` + 1 (0-based index step),
    when they change it by more than 1%: the saved run's schedule against this run's (a finished
    run extended with more steps goes back up its cosine). None for another optimizer, whose fresh
    state restarts the schedule (said where the state is restored)."""
    if saved.optim.name != run.optim.name:
        return None

    def lr(cfg: RunConfig) -> float:
        return optim.schedule_from_config(cfg.optim, cfg.optim.lr, cfg.train.steps)(torch.tensor(step)).item()
    old, new = lr(saved), lr(run)
    if abs(new - old) <= 0.01 * max(abs(old), abs(new)):
        return None
    done = " (the saved run had ended there, at the end of its decay)" if step >= saved.train.steps else ""
    return (f"the learning rate jumps {'up' if new > old else 'down'} at step {step + 1}: {old:.3g} by the "
            f"checkpoint's schedule ({saved.optim.schedule} over {saved.train.steps} steps, peak {saved.optim.lr:g})"
            f"{done}, {new:.3g} by this run's ({run.optim.schedule} over {run.train.steps} steps, peak "
            f"{run.optim.lr:g})")


Reader = Callable[[str, tuple[slice, ...]], torch.Tensor]
"""(path, slice) -> that slice of a saved tensor of one section"""


def _restore_params(template: Tree, entries: dict[str, dict], read: Reader, mesh, ckpt: Path) -> Tree:
    """The saved params in the structure of `template` (meta tensors): whole, or on a mesh each
    rank's slices placed by the rules."""
    paths, leaves, rebuild = tree_flatten_with_paths(template)
    if set(paths) != entries.keys():
        missing, extra = sorted(set(paths) - entries.keys()), sorted(entries.keys() - set(paths))
        raise CheckpointError(f"{ckpt}: params differ from the model's: missing {missing[:5]}, unexpected {extra[:5]}")
    bad = [p for p, x in zip(paths, leaves) if entries[p]["shape"] != list(x.shape)]
    if bad:
        raise CheckpointError(f"{ckpt}: params of the wrong shape for the model: {bad[:5]}")
    dtypes = dict(zip(paths, (x.dtype for x in leaves)))
    if mesh is None:
        return rebuild([read(p, whole_slices(x.shape)).to(x.dtype) for p, x in zip(paths, leaves)])
    return sharding.distribute(template, mesh, lambda path, idx: read(path, idx).to(dtypes[path]))


def _restore_opt_state(template: Tree, entries: dict[str, dict], read: Reader, ckpt: Path) -> Tree:
    """The saved optimizer state in the structure of `template` (tx.init of the run's optimizer on
    the restored params): a leaf that is a DTensor there is read rank by rank as it is placed.

    0-D float64 leaves are hyperparameters (optim.py keeps lr, betas, eps, weight decay, momentum and
    clip norm so), taken from the template: a changed optim setting applies on resume. A state of
    another structure (another optimizer) is replaced by the fresh template, with a warning.
    """
    paths, leaves, rebuild = tree_flatten_with_paths(template)
    same = set(paths) == entries.keys() and all(
        entries[p]["shape"] == list(x.shape) and entries[p]["dtype"] == str(x.dtype).removeprefix("torch.")
        for p, x in zip(paths, leaves))
    if not same:
        log.warning("the optimizer state in %s does not fit the configured optimizer; starting it fresh "
                    "(moments and step counts from zero, so the lr schedule starts over)", ckpt)
        return template

    def leaf(path: str, x: torch.Tensor) -> torch.Tensor:
        if x.ndim == 0 and x.dtype == torch.float64:
            return x
        if isinstance(x, DTensor):
            return sharding.distribute_like(x, lambda idx: read(path, idx))
        return read(path, whole_slices(x.shape)).to(x.device)
    return rebuild([leaf(p, x) for p, x in zip(paths, leaves)])


def _restore_rng(entries: dict[str, dict], read: Reader) -> None:
    """Set this rank's RNG states to the saved ones; ranks the saving mesh did not have keep their
    seeded state, and rank 0 says so once."""
    rank, world = rank_in_job()
    saved_world = len({k.split(".")[0] for k in entries})  # every saving rank wrote its own states
    if rank == 0 and world > saved_world:
        log.warning("the checkpoint has the RNG states of %d ranks: ranks %d..%d keep their seeded state",
                    saved_world, saved_world, world - 1)
    prefix = f"rank{rank}."
    saved = {k.removeprefix(prefix) for k in entries if k.startswith(prefix)}
    here = {k.removeprefix(prefix) for k in rng_states(rank)}
    if saved and saved != here:
        log.warning("the checkpoint has RNG states %s, this process %s; the others keep their seeded state",
                    sorted(saved), sorted(here))
    for name in saved & here:
        state = read(prefix + name, whole_slices(entries[prefix + name]["shape"]))
        if name == "torch_cpu":
            torch.set_rng_state(state)
        else:
            torch.cuda.set_rng_state(state, int(name.removeprefix("cuda")))


def load_state(ckpt: Path, index: dict, run: RunConfig, tx: optim.GradientTransformation,
               fingerprint: str, mesh=None) -> TrainState:
    """The TrainState saved in ckpt (index: from verify(ckpt)) for `run` on `mesh` (None: one
    process), whatever mesh saved it, and this rank's RNG states restored. fingerprint: the corpus
    fingerprint of the data the run reads now (its loader's `data.fingerprint`).

    Raises CheckpointError if the model's shape changed; warns when other settings or the data did.
    """
    ckpt = Path(ckpt)
    check_resume_config(saved_config(ckpt), run, ckpt, index["step"])
    data = index["train"]["data"]
    if data["corpus_fingerprint"] != fingerprint and rank_in_job()[0] == 0:
        log.warning("the data differ from the checkpoint's (corpus fingerprint %s, now %s): samples after step "
                    "%d are not those the saved run would have seen", data["corpus_fingerprint"],
                    fingerprint, index["step"])
    # an earlier release's leaf names (params.RENAMED) read as today's
    entries = {**index, **{s: {current_path(p): e for p, e in index[s].items()} for s in ("tensors", "opt_state")}}
    with opened_files(ckpt) as get:
        def reader(section: str) -> Reader:
            return lambda path, idx: read_region(get, entries[section][path], idx, f"{ckpt}: {section} '{path}'")
        params = _restore_params(init_params(run.model, device="meta"), entries["tensors"], reader("tensors"), mesh,
                                 ckpt)
        opt_state = _restore_opt_state(tx.init(params), entries["opt_state"], reader("opt_state"), ckpt)
        _restore_rng(index["rng"], reader("rng"))
    return TrainState(params, opt_state, index["step"])


def _newest_verified(root: Path) -> tuple[tuple[Path, dict] | None, list[tuple[Path, str]]]:
    """(the newest checkpoint under root that verifies and its index, or None; the newer ones that
    did not, each with why)."""
    failed = []
    for _, path in list_checkpoints(root):
        try:
            return (path, verify_together(path)), failed
        except CheckpointError as e:
            failed.append((path, str(e)))
    return None, failed


def find_latest(root: Path) -> tuple[Path, dict] | None:
    """The newest complete checkpoint under root and its verified index; None if there is none.
    Corrupt or partial ones are passed over with a warning naming the bad file."""
    found, failed = _newest_verified(root)
    if rank_in_job()[0] == 0:  # every rank has the same verdict
        for path, why in failed:
            log.warning("skipping checkpoint %s: %s; falling back to an older one", path.name, why)
    return found


def _auto(root: Path) -> tuple[Path, dict] | None:
    """--resume auto: the newest checkpoint that verifies; None when root holds none at all. A run
    whose checkpoints all fail to verify is refused, never started over: they may be one transient
    fault (a file server's hiccup) or one release's difference away from readable."""
    found, failed = _newest_verified(root)
    if found is None and failed:
        why = "; ".join(f"{path.name}: {e}" for path, e in failed)
        raise CheckpointError(f"--resume auto: none of the {len(failed)} checkpoints in {root} verifies, so the run "
                              f"is not resumed and nothing was removed ({why}); fix or restore one, resume from one "
                              "by path with --resume PATH, or start a new run on purpose with another "
                              "--train.run-dir")
    if failed and rank_in_job()[0] == 0:
        log.warning("--resume auto: resuming from %s, the newest checkpoint that verifies; newer ones that do not "
                    "are set aside, not removed: %s", found[0].name,
                    "; ".join(f"{path.name}: {e}" for path, e in failed))
    return found


def resume_point(resume: str, root: Path) -> tuple[Path, dict] | None:
    """The checkpoint `--resume` names, with its verified index: none -> None, auto -> the newest
    one under root that verifies (None if root holds none; refused if none verifies), else the
    directory PATH. On several ranks every rank calls this, and all get the same answer."""
    if resume == "none":
        return None
    if resume == "auto":
        return _auto(root)
    return Path(resume), verify_together(Path(resume))
