"""The spawned-rank harness (rlkernels/testing/spawn.py) tells a hang from slow progress: a real deadlock fails
within the idle limit, a rank that computes (or compiles) for longer than that limit does not."""

import time

import pytest
import torch
import torch.distributed as dist

from rlkernels.testing.spawn import spawn


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
