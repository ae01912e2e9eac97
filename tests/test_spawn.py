"""The spawned-rank harness (rlkernels/testing/spawn.py) tells a hang from slow progress: a real deadlock fails
within the idle limit, a rank that computes (or compiles) for longer than that limit does not. A RankPool runs
case after case on the same ranks, and a failed case takes its group down so the next starts fresh."""

import os
import time

import pytest
import torch
import torch.distributed as dist

from rlkernels.testing.spawn import RankPool, spawn


def _deadlock(rank, world):
    """Rank 1 skips the all_reduce and waits for a message rank 0 never sends: both block for good."""
    t = torch.zeros(3)
    if rank == 0:
        dist.all_reduce(t)
    else:
        dist.recv(t, src=0)


def _busy(rank, world, seconds):
    """Rank 0 computes (as a compiling rank does) while rank 1 waits for it at a collective."""
    if rank == 0:
        end = time.monotonic() + seconds
        x = torch.randn(64, 64)
        while time.monotonic() < end:
            x = torch.tanh(x @ x.T / 64)
    dist.barrier()


def test_a_deadlock_fails_within_the_idle_limit():
    start = time.monotonic()
    with pytest.raises(AssertionError, match="made no progress for 4 s"):
        spawn(2, _deadlock, idle_s=4)
    assert time.monotonic() - start < 60  # the idle limit plus process start-up, not the group's timeout


def test_a_rank_that_works_past_the_idle_limit_is_not_a_hang():
    start = time.monotonic()
    spawn(2, _busy, 8.0, idle_s=3)
    assert time.monotonic() - start >= 8.0


FIRST_PID = {}  # in a rank: the pid that ran the pool's first case


def _same_process(rank, world, first):
    """Records this rank's pid on the first case; later cases assert they run in that process (or, after
    `first` is passed again, record anew)."""
    if first:
        FIRST_PID["pid"] = os.getpid()
    assert FIRST_PID.get("pid") == os.getpid(), "a pool case ran in another process than the first"
    dist.all_reduce(torch.ones(1))


def _fails_on_rank_1(rank, world):
    assert rank != 1, "rank 1 fails on purpose"
    dist.all_reduce(torch.ones(1))  # rank 0 waits here for a peer that has left


def test_a_pool_runs_its_cases_on_the_same_ranks_and_starts_afresh_after_a_failure():
    pool = RankPool(2, idle_s=10)
    try:
        pool.run(_same_process, True)
        pool.run(_same_process, False)
        with pytest.raises(AssertionError, match="(?s)rank 1:.*rank 1 fails on purpose"):
            pool.run(_fails_on_rank_1)
        with pytest.raises(AssertionError, match="ran in another process"):  # fresh ranks: nothing recorded
            pool.run(_same_process, False)
        pool.run(_same_process, True)
        pool.run(_same_process, False)
    finally:
        pool.close()


def test_a_deadlock_in_a_pool_fails_within_the_idle_limit():
    pool = RankPool(2, idle_s=4)
    start = time.monotonic()
    try:
        with pytest.raises(AssertionError, match="made no progress for 4 s"):
            pool.run(_deadlock)
    finally:
        pool.close()
    assert time.monotonic() - start < 60
