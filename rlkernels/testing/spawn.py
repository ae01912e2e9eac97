"""Real process groups for the distributed tests: gloo ranks spawned with torch.multiprocessing.

`spawn(world, check, *args)` runs `check(rank, world, *args)` on every rank of a fresh gloo group
(file rendezvous; `backend="nccl"` for the one-GPU check) and fails with every rank's traceback.
`check` must be a module-level function (spawned processes import it by name).

A hung rank fails the test instead of hanging the suite, and a slow one does not: the parent watches
the CPU time of the ranks and of their children (Inductor's compile workers), and the deadline
restarts whenever they make progress. Ranks blocked in a collective that will never complete use no
CPU (measured: ~3 ms per second in a gloo wait), so `idle_s` (60 s) without progress means a hang; a
rank compiling on a machine that is busy with other work is slow, not hung, and keeps the test alive
up to `CAP_S`. The group's own timeout is that cap too, so a rank waiting at a collective for a peer
that is still compiling does not time out. tests/test_spawn.py shows a real deadlock (a rank
that skips a collective) failing within the idle limit.

`Collectives` wraps torch.distributed functions (the library calls them through the module) to
count calls and the bytes each rank sends, per group.
"""

import datetime
import os
import tempfile
import time
import traceback
from collections import defaultdict
from typing import Iterable, Optional

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

IDLE_S = 60.0  # no progress for this long: a hang
CAP_S = 900.0  # a spawn that is still running after this long fails, progress or not (a runaway loop)
# progress: the ranks' processes together used at least this much CPU time per second of wall time (an idle
# gloo wait uses ~0.003 s/s per rank; a rank that computes or compiles, even on a loaded machine, ~0.3-1)
PROGRESS_CPU_PER_S = 0.1
POLL_S = 1.0


def _tree_cpu_seconds(roots: Iterable[int]) -> Optional[float]:
    """User + system CPU seconds of the processes `roots` and all their descendants (their reaped children
    included), read from /proc; None where there is no /proc."""
    tick = os.sysconf("SC_CLK_TCK")
    parent, cpu = {}, {}
    try:
        pids = [int(name) for name in os.listdir("/proc") if name.isdigit()]
    except OSError:
        return None
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:  # it exited meanwhile
            continue
        parent[pid] = int(fields[1])
        cpu[pid] = sum(int(x) for x in fields[11:15]) / tick  # utime, stime, cutime, cstime
    wanted, total = set(roots), 0.0
    for pid in cpu:
        p, seen = pid, 0
        while p in parent and p not in wanted and seen < 64:
            p, seen = parent[p], seen + 1
        if p in wanted:
            total += cpu[pid]
    return total


def _worker(rank, world, init_file, check, args, errors, backend):
    code = 0
    try:
        dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=CAP_S))
        torch.set_num_threads(1)
        check(rank, world, *args)
        dist.barrier()
    except BaseException:  # noqa: BLE001 -- reported to the parent, which fails the test
        errors.put((rank, traceback.format_exc()))
        code = 1
    # Leave without tearing the group down: after the barrier nothing is in flight, and gloo's
    # destructor racing a peer that already left can abort a rank that passed (seen once in CI runs)
    os._exit(code)


def spawn(world, check, *args, backend="gloo", idle_s: float = IDLE_S):
    with tempfile.TemporaryDirectory() as tmp:
        ctx = mp.get_context("spawn")
        errors = ctx.SimpleQueue()
        init_file = os.path.join(tmp, "rendezvous")
        procs = [ctx.Process(target=_worker, args=(r, world, init_file, check, args, errors, backend))
                 for r in range(world)]
        for p in procs:
            p.start()
        verdict = _watch(procs, idle_s)
        hung = [p for p in procs if p.is_alive()]
        for p in hung:
            p.kill()
        for p in hung:
            p.join(10)
        failures = []
        while not errors.empty():
            failures.append(errors.get())
        assert not failures, "\n".join(f"rank {r}:\n{tb}" for r, tb in failures)
        assert not hung, f"{len(hung)} rank(s) {verdict}"
        assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]


def _watch(procs, idle_s: float) -> str:
    """Wait for the ranks while they make progress; return why the wait stopped, if any rank is still alive."""
    pids = [p.pid for p in procs]
    start = last_progress = time.monotonic()
    last_cpu = _tree_cpu_seconds(pids)
    while any(p.is_alive() for p in procs):
        procs[0].join(POLL_S) if procs[0].is_alive() else time.sleep(POLL_S)
        now = time.monotonic()
        cpu = _tree_cpu_seconds(pids)
        if cpu is None or last_cpu is None or cpu - last_cpu >= PROGRESS_CPU_PER_S * (now - last_progress):
            if cpu is not None:  # without /proc, only the cap applies to a busy run, idle_s to all runs
                last_progress, last_cpu = now, cpu
        if now - last_progress > idle_s:
            return (f"made no progress for {idle_s:.0f} s (a hang: used {cpu - last_cpu:.2f} s of CPU meanwhile)"
                    if cpu is not None else f"did not finish within {idle_s:.0f} s")
        if now - start > CAP_S:
            return f"still running after {CAP_S:.0f} s (progressing, but past the cap)"
    return ""


class Collectives:
    """Counts calls of torch.distributed.<name> and the bytes this rank sends (all_gather's input,
    all_reduce's buffer), per group: `calls[(name, group_label)]`, `sent[(name, group_label)]`.
    `labels` maps a group to its label; the default group is "world"."""

    def __init__(self, *names, labels=None):
        self.labels = {id(g): label for g, label in (labels or {}).items()}
        self.real = {name: getattr(dist, name) for name in names}
        self.calls = defaultdict(int)
        self.sent = defaultdict(int)
        for name in names:
            setattr(dist, name, self._counting(name))

    def _counting(self, name):
        def call(*args, **kwargs):
            group = kwargs.get("group")
            key = (name, self.labels.get(id(group), "world"))
            self.calls[key] += 1
            tensor = args[1] if name == "all_gather" else args[0]
            self.sent[key] += tensor.numel() * tensor.element_size()
            return self.real[name](*args, **kwargs)
        return call

    def reset(self):
        self.calls.clear()
        self.sent.clear()

    def restore(self):
        for name, fn in self.real.items():
            setattr(dist, name, fn)
