"""Process groups: start one from torchrun's environment, warm it, diagnose a failed collective,
and simulate ranks in one process.

torchrun sets RANK, WORLD_SIZE, LOCAL_RANK and the rendezvous address; `init_from_env` starts the
default group from them (gloo on CPU, NCCL on GPU) with --dist.timeout-s and warms it with a
barrier, because a lazily created communicator can deadlock at the first collective that only
some ranks reach. Under torchrun's agent-hosted store the ranks first agree on a key prefix of
their own (`attempt_store`), so a restart (`--max-restarts`) never reads its dead predecessors'
keys. `simulate(world)` runs `world` ranks in this process (LocalTensorMode over the fake process
group): every tensor holds one value per rank and collectives are computed exactly, which is how
the tests check the mesh matrix without starting processes.

A collective that waits longer than --dist.timeout-s, or loses a peer, raises on gloo;
`failure_report` turns that into a message naming the collective (the last one `entering` named on
this rank) and the ranks that do not answer (asked through the rendezvous store, which torchrun's
agent holds, so a stopped rank cannot block the question). On NCCL the watchdog ends the process
itself, with its own message. `exit_worker` ends a worker that finished without the interpreter's
finalization, which a gloo thread still freeing a collective's tensors can abort.

The private torch APIs used for that (LocalTensor, the fake process group,
the default group's store) come from fnmoe._torch.
"""
from __future__ import annotations

import contextlib
import datetime
import logging
import os
import sys
import time
import uuid
import warnings
from typing import Callable, Iterator, NoReturn

import torch
import torch.distributed as dist

from fnmoe import _torch
from fnmoe._torch import FakeStore, LocalTensor, LocalTensorMode, enabled_local_tensor_mode
from fnmoe._torch import maybe_disable_local_tensor_mode
from fnmoe.config import DistConfig

# how long ranks whose collective failed wait for the others to say they are alive
PROBE_S = 10.0
_PROBE_KEY = "fnmoe/probe/"
# where the ranks of a torchrun attempt agree on their store's key prefix (attempt_store)
_ATTEMPT_KEY = "fnmoe/attempt/"
# The collective this rank entered last. A plain global, not a ContextVar: backward's collectives
# are named by autograd hooks, which run on autograd's threads on GPUs.
_entered = ["none named yet"]


def launched() -> bool:
    """True under torchrun (or any launcher that sets WORLD_SIZE) with more than one process."""
    return int(os.environ.get("WORLD_SIZE", "1")) > 1


def exit_worker(code: int) -> NoReturn:
    """End a torchrun worker now, without interpreter finalization. Gloo's worker threads can still
    hold the last reference to a finished collective's tensors; freeing them takes the GIL, and a
    thread that takes it while the interpreter finalizes is ended by a forced unwind that aborts
    the process ('terminate called without an active exception', SIGABRT) after a run that
    succeeded: 2 launches in ~30 of a compiled 2x2 run here. The caller closes its files first
    (fnmoe.training.step joins the checkpoint writer and closes the metrics); logs and stdio are flushed here."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def backend_for(dcfg: DistConfig) -> str:
    if dcfg.backend != "auto":
        return dcfg.backend
    return "nccl" if torch.cuda.is_available() else "gloo"


def compute_device(dcfg: DistConfig | None, world: int) -> torch.device:
    """Where a process of a job of `world` ranks trains, one rule for params, batches and the host
    pool's copies: its GPU (torchrun's LOCAL_RANK) when there is one and the ranks talk over NCCL
    (or there is one rank), else the CPU. --dist.backend gloo on a GPU host trains on the CPU, as
    gloo's mesh places the params (batches on the GPU beside CPU params failed at the first step)."""
    if not torch.cuda.is_available():
        return torch.device("cpu")
    if world > 1 and backend_for(dcfg or DistConfig()) == "gloo":
        warnings.warn("--dist.backend gloo on a host with GPUs: training runs on the CPU (gloo's mesh is a "
                      "CPU mesh); use --dist.backend nccl (the default there) to train on the GPUs", stacklevel=2)
        return torch.device("cpu")
    return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))


def init_from_env(dcfg: DistConfig) -> None:
    """Start the default process group from torchrun's environment and warm it with a barrier; a
    failure to start is one CollectiveError naming this rank (no gloo traceback)."""
    if dist.is_initialized():
        return
    backend = backend_for(dcfg)
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    timeout = datetime.timedelta(seconds=dcfg.timeout_s)
    me, n = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    try:
        if agent_store_shared():
            dist.init_process_group(backend, timeout=timeout, rank=me, world_size=n,
                                    store=attempt_store(agent_store(timeout), me, n, timeout))
        else:
            dist.init_process_group(backend, timeout=timeout)
        dist.barrier()
    except (RuntimeError, dist.DistStoreError) as e:  # DistError is a RuntimeError
        if dist.is_initialized():
            dist.destroy_process_group()
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CollectiveError(f"rank {me} of {n}: starting the process group ({backend}) failed: {first}") from e


def agent_store_shared() -> bool:
    """True when torchrun's agent hosts the store its workers meet at (its default with the c10d
    rendezvous): the store outlives the workers, so it holds every earlier attempt's keys."""
    return os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == str(True)


def agent_store(timeout: datetime.timedelta) -> dist.Store:
    """A client of the store torchrun's agent hosts at MASTER_ADDR:MASTER_PORT."""
    return dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                         timeout=timeout)


def attempt_store(store: dist.Store, me: int, n: int, timeout: datetime.timedelta,
                  poll_s: float = 0.02) -> dist.Store:
    """store under a key prefix that no earlier attempt of this torchrun job used, the same on
    every rank. torchrun's agent keeps one store for all its restarts, so a restarted worker would
    read the keys of the attempt before (a dead peer's address: gloo's "Connect timeout", NCCL's
    stale unique id; pytorch/pytorch#135712), and TORCHELASTIC_RESTART_COUNT is no namespace: each
    node's agent counts its own restarts. So the ranks agree on a fresh one: each rank > 0 says
    hello with a new random nonce and waits for the key named by it (which no earlier attempt can
    have written); rank 0 draws the attempt's id, answers every nonce it reads (an earlier
    attempt's left-over nonce gets an answer no one reads) until all ranks have counted themselves
    under that id. Every process of an earlier attempt is gone before a restart's begin, so no
    stale writer races this."""
    deadline = time.monotonic() + timeout.total_seconds()
    late = lambda: CollectiveError(  # noqa: E731
        f"rank {me} of {n}: the ranks did not all arrive within {timeout.total_seconds():g} s (--dist.timeout-s) "
        f"to start the process group (torchrun attempt {os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')})")
    if me != 0:
        nonce = uuid.uuid4().hex
        store.set(f"{_ATTEMPT_KEY}hello/{me}", nonce)
        try:
            store.wait([f"{_ATTEMPT_KEY}answer/{nonce}"], timeout)
        except dist.DistStoreError:
            raise late() from None
        attempt = store.get(f"{_ATTEMPT_KEY}answer/{nonce}").decode()
        store.add(f"{_ATTEMPT_KEY}{attempt}/arrived", 1)
    else:
        attempt, answered = uuid.uuid4().hex, {}
        hellos = [f"{_ATTEMPT_KEY}hello/{r}" for r in range(1, n)]
        while store.add(f"{_ATTEMPT_KEY}{attempt}/arrived", 0) < n - 1:
            if time.monotonic() > deadline:
                raise late()
            if store.check(hellos):  # every rank has said hello at least once (in some attempt)
                for r, nonce in enumerate(store.multi_get(hellos), 1):
                    if answered.get(r) != nonce:
                        store.set(f"{_ATTEMPT_KEY}answer/{nonce.decode()}", attempt)
                        answered[r] = nonce
            time.sleep(poll_s)
    return dist.PrefixStore(f"{_ATTEMPT_KEY}{attempt}/", store)


def group_options(dcfg: DistConfig):
    """(backend, options) that give a new process group --dist.timeout-s: subgroups otherwise take
    torch's default timeout (30 min on gloo), not the default group's."""
    backend = backend_for(dcfg)
    opts = _torch.gloo_options() if backend == "gloo" else dist.ProcessGroupNCCL.Options()
    _torch.set_pg_timeout(opts, datetime.timedelta(seconds=dcfg.timeout_s))
    return backend, opts


def entering(what: str) -> None:
    """Name the collective this rank is about to enter, for a failure's message (a list write: cheap
    enough for every call site). Inside compiled regions nothing is named: a graph has no place
    for a host-side write, and the region's name is on the last one made outside it."""
    if not torch.compiler.is_compiling():
        _entered[0] = what


def last_entered() -> str:
    """The collective this rank named last (`entering`)."""
    return _entered[0]


def entering_in_backward(t: torch.Tensor, what: str) -> torch.Tensor:
    """t, naming `what` when backward reaches the op that made t: the backward of the collective
    behind it runs next. A hook on the node, which costs less than a tensor hook."""
    if not torch.compiler.is_compiling() and t.grad_fn is not None:
        t.grad_fn.register_prehook(lambda _: entering(what))
    return t


class CollectiveError(ValueError):
    """A collective failed: it waited longer than --dist.timeout-s, or a peer went away; the message
    names it and the ranks that do not answer. A ValueError so that the CLI reports it as one line."""


_GLOO_FAILURES = {"Timed out waiting": "timed out after {timeout_s:g} s (--dist.timeout-s)",
                  # a peer that exited, crashed, or timed out first (gloo then closes its connections)
                  "Connection closed by peer": "lost a peer's connection",
                  "Connection reset by peer": "lost a peer's connection"}


def collective_failed(e: BaseException) -> bool:
    """gloo's error for a collective that waited past its group's timeout or lost a peer."""
    return isinstance(e, RuntimeError) and any(text in str(e) for text in _GLOO_FAILURES)


def unresponsive_ranks(wait_s: float) -> list[int]:
    """The ranks not yet marked alive in the rendezvous store wait_s after the first failing rank
    asked: one deadline for all, so every failing rank names the same ranks at about the same time
    (before torchrun stops the job)."""
    store = _torch.default_store()
    store.set_timeout(datetime.timedelta(seconds=wait_s))  # bounds every call, should the store's host be lost
    store.set(f"{_PROBE_KEY}alive/{rank()}", b"")
    deadline = float(store.compare_set(f"{_PROBE_KEY}deadline", "", str(time.time() + wait_s)))
    keys = [f"{_PROBE_KEY}alive/{r}" for r in range(world())]
    try:
        store.wait(keys, datetime.timedelta(seconds=max(deadline - time.time(), 0.1)))
        return []
    except dist.DistStoreError:
        return [r for r, key in enumerate(keys) if not store.check([key])]


def failure_report(e: RuntimeError, timeout_s: float) -> str:
    """What failed on this rank, the collective it entered last and which ranks do not answer."""
    wait_s = min(timeout_s, PROBE_S)
    try:
        missing = unresponsive_ranks(wait_s)
    except RuntimeError as probe_error:  # e.g. the store's host is the lost one
        who = f"which ranks are unresponsive is unknown: the rendezvous store did not answer ({probe_error})"
    else:
        who = (f"unresponsive: rank{'s' if len(missing) > 1 else ''} {', '.join(map(str, missing))} (no answer "
               f"within {wait_s:g} s more: stopped, hung, dead or on a lost host)" if missing else
               f"every rank answered within {wait_s:g} s, so none is lost: one is slower than the timeout, or "
               "the ranks wait in different collectives")
    first = str(e).strip().splitlines()[0]
    what = next(v for k, v in _GLOO_FAILURES.items() if k in str(e)).format(timeout_s=timeout_s)
    return (f"rank {rank()} of {world()}: a collective {what}; the last one this rank entered: {_entered[0]}; "
            f"{who}\n  gloo: {first}")


def rank() -> int:
    """This process's global rank (0 without a process group, and in a simulation)."""
    return dist.get_rank() if dist.is_initialized() and not simulated() else 0


def world() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def simulated() -> bool:
    return enabled_local_tensor_mode() is not None


def fake_group() -> bool:
    """True over torch's fake process group (a simulation, or `fnmoe rehearse` playing one rank)."""
    return dist.is_initialized() and dist.get_backend() == "fake"


def rank_map(fn: Callable[[int], torch.Tensor]) -> torch.Tensor:
    """fn(rank) as this rank's tensor; in a simulation, one value per simulated rank."""
    mode = enabled_local_tensor_mode()  # its methods, not torch's module-level rank_map: torch 2.11 lacks that
    return mode.rank_map(fn) if mode is not None else fn(rank())


def tensor_map(t: torch.Tensor, fn: Callable[[int, torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """fn(rank, this rank's t): local work that differs by rank (in a simulation, run once per rank)."""
    mode = enabled_local_tensor_mode()
    return mode.tensor_map(t, fn) if mode is not None else fn(rank(), t)


def rank_ints(fn: Callable[[int], list[int]]) -> list:
    """fn(rank): ints that differ by rank, such as a collective's split sizes; in a simulation each
    is a SymInt holding every simulated rank's value. Computed on the host: no device sync."""
    if enabled_local_tensor_mode() is None:
        return fn(rank())
    return rank_map(lambda r: torch.tensor(fn(r), dtype=torch.int64, device="cpu")).tolist()


def ranks_here() -> list[int]:
    """The ranks this process runs: its own, or every simulated one."""
    mode = enabled_local_tensor_mode()
    return sorted(mode.ranks) if mode is not None else [rank()]


def rank_values(t: torch.Tensor) -> dict[int, torch.Tensor]:
    """{rank: t's value there} for each of ranks_here(), as plain tensors."""
    if isinstance(t, LocalTensor):
        return dict(_torch.local_tensors(t))
    return dict.fromkeys(ranks_here(), t)


def unsimulated() -> contextlib.AbstractContextManager:
    """Ops on plain tensors in the body stay plain (a simulation's mode is off there): for host work
    such as file IO on values taken out of a simulation with rank_values."""
    return maybe_disable_local_tensor_mode()


@contextlib.contextmanager
def simulate(n_ranks: int) -> Iterator[None]:
    """Run the body as n_ranks ranks in this process (fake process group + LocalTensorMode)."""
    if dist.is_initialized():
        raise RuntimeError("fnmoe.parallel.dist.simulate: a process group is already running in this process")
    dist.init_process_group("fake", world_size=n_ranks, rank=0, store=FakeStore())
    try:
        with LocalTensorMode(n_ranks):
            yield
    finally:
        dist.destroy_process_group()
