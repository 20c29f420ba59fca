"""Rank-wide agreements and guards, one rank's view of the others scripted:

- one config (fnmoe.parallel.same_config): a field that only one rank's config has (another fnmoe
  release on that host) is a difference, named, whichever rank has it;
- a restart's store handshake (fnmoe.parallel.dist.attempt_store): a follower takes only the answer
  to its own hello of this attempt. Rank 0 of a restart may start before its followers and find the
  attempt before's hellos still in the store: it answers them too (no one reads those), and still
  answers each follower's new hello once it comes;
- preflight (fnmoe.run.guards.preflight): rank 0's verdict on the run directory reaches every rank
  (each raises it, naming rank 0, and the others test nothing after it), and a verdict of rank 1
  reaches rank 0. The gathers are scripted: each rank's view is what all_gather_object gives it.
"""
import datetime
import threading
import time
from pathlib import Path

import pytest
import torch.distributed as dist

from fnmoe.config import RunConfig
from fnmoe.parallel import dist as fdist
from fnmoe.parallel.same_config import flat_config, mismatch
from fnmoe.run import guards
from fnmoe.run.rundir import RunDirError

RUN = RunConfig(name="tiny")
UNSET = "<not a field of this rank's fnmoe>"


@pytest.mark.parametrize("who", [0, 1])
def test_a_field_on_one_ranks_config_only_is_a_difference(who):
    flat = flat_config(RUN)
    more = dict(flat, **{"train.newer_field": 3})
    flats = [more, flat] if who == 0 else [flat, more]
    shown = ["3", UNSET] if who == 0 else [UNSET, "3"]
    assert mismatch(flats) == (
        f"the ranks were given different configs: train.newer_field is {shown[0]} on rank 0 and {shown[1]} on rank 1; "
        "every rank must run the same config (the same --config file and flags); stopped before step 1")
    # and among several ranks, the one that has it is named
    assert mismatch([flat, flat, flat, more]).startswith("the ranks were given different configs: train.newer_field "
                                                         f"is {UNSET} on rank 0 and 3 on rank 3;")


def _store():
    return dist.TCPStore("localhost", 0, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=5))


def _attempt(port: int, n: int, leader_first_s: float) -> list:
    """Each rank's store from attempt_store (threads, a client each), rank 0 started leader_first_s
    before its followers."""
    out: list = [None] * n

    def rank(r: int) -> None:
        client = dist.TCPStore("localhost", port, is_master=False, timeout=datetime.timedelta(seconds=5))
        try:
            out[r] = fdist.attempt_store(client, r, n, datetime.timedelta(seconds=3), poll_s=0.005)
        except Exception as e:  # noqa: BLE001 (reported by the caller's assert)
            out[r] = e
    threads = [threading.Thread(target=rank, args=(r,)) for r in range(n)]
    threads[0].start()
    time.sleep(leader_first_s)
    for t in threads[1:]:
        t.start()
    for t in threads:
        t.join(20)
    return out


def test_a_restarts_followers_get_this_attempts_answer_though_rank_0_came_first_and_saw_stale_hellos():
    """3 ranks, three attempts over one store; from the second on, rank 0 starts 0.3 s before the
    followers and reads the hellos the attempt before left. Each attempt's ranks share one fresh
    namespace: a key one of them writes is read by all, and the attempt before's is not there."""
    server = _store()
    for attempt in range(3):
        stores = _attempt(server.port, 3, leader_first_s=0.3 if attempt else 0.0)
        assert all(isinstance(s, dist.PrefixStore) for s in stores), (attempt, stores)
        assert not any(s.check(["mark"]) for s in stores), attempt
        stores[attempt % 3].set("mark", str(attempt))
        assert [s.get("mark").decode() for s in stores] == [str(attempt)] * 3


def _rank_view(monkeypatch, rank: int, others: dict) -> list:
    """rank's side of a 2-rank job: all_gather_object puts others[i] (the i-th gather's value of the
    other rank) beside what this rank sends; returns what this rank sent, gather by gather."""
    sent = []

    def gather(out, obj, group=None):
        out[:] = [obj, others[len(sent)]] if rank == 0 else [others[len(sent)], obj]
        sent.append(obj)
    monkeypatch.setattr(guards.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(guards.dist, "all_gather_object", gather)
    monkeypatch.setattr(guards.fdist, "world", lambda: 2)
    return sent


def test_rank_0s_verdict_on_the_run_directory_stops_rank_1_which_tests_nothing_more(tmp_path, monkeypatch):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "checkpoints").write_text("")  # what rank 0 finds
    verdict = f"cannot write checkpoints: {run_dir / 'checkpoints'} is a file, not a directory"
    assert guards.check_outputs(RUN, run_dir, 0) == verdict
    (run_dir / "checkpoints").unlink()  # rank 1's host sees a writable directory
    sent = _rank_view(monkeypatch, 1, {0: verdict, 1: verdict})
    with pytest.raises(RunDirError, match=rf"^rank 0: {verdict}; stopped before step 1$"):
        guards.preflight(RUN, run_dir, 1)
    assert sent == [None, None] and list(run_dir.iterdir()) == []  # rank 1 made nothing after rank 0 failed


def test_rank_1s_verdict_on_the_run_directory_stops_rank_0(tmp_path, monkeypatch):
    rank1 = "cannot write checkpoints: creating a file in /elsewhere/checkpoints failed: Permission denied"
    sent = _rank_view(monkeypatch, 0, {0: None, 1: rank1})
    with pytest.raises(RunDirError, match=rf"^rank 1: {rank1}; stopped before step 1$"):
        guards.preflight(RUN, tmp_path, 0)
    assert sent == [None, None] and list(Path(tmp_path).iterdir()) == []  # rank 0's test, tidied


def test_rank_0_sends_its_verdict_before_the_others_test(tmp_path, monkeypatch):
    (tmp_path / "checkpoints").write_text("")
    verdict = f"cannot write checkpoints: {tmp_path / 'checkpoints'} is a file, not a directory"
    sent = _rank_view(monkeypatch, 0, {0: None, 1: None})
    with pytest.raises(RunDirError, match=rf"^rank 0: {verdict}; stopped before step 1$"):
        guards.preflight(RUN, tmp_path, 0)
    assert sent == [verdict, verdict]
