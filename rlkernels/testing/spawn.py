"""Real process groups for the distributed tests: gloo ranks spawned with torch.multiprocessing.

`spawn(world, check, *args)` runs `check(rank, world, *args)` on every rank of a fresh gloo group
(file rendezvous; `backend="nccl"` for the one-GPU check) and fails with every rank's traceback.
`check` must be a module-level function (spawned processes import it by name).

`RankPool(world)` keeps one such group up for a family of cases: `pool.run(check, *args)` fails as `spawn`
does, but the ranks' start (~3-5 s on 2 cores: the interpreter, torch, the library, the rendezvous) and
their first-call warm-ups are paid once per family instead of once per case. A case that fails or hangs
takes the group down with it (its ranks may be stuck in a collective), and the next case starts a fresh
one. Use it where the cases are independent of what a process ran before; a check about a process's
first call keeps `spawn`.

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
import queue
import tempfile
import time
import traceback
from collections import defaultdict
from multiprocessing.connection import wait as wait_for
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


def _init_rank(rank, world, init_file, backend):
    dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=CAP_S))
    torch.set_num_threads(1)


def _worker(rank, world, init_file, check, args, errors, backend):
    code = 0
    try:
        _init_rank(rank, world, init_file, backend)
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
        verdict = _watch(procs, idle_s, lambda: not any(p.is_alive() for p in procs),
                         lambda timeout: wait_for([p.sentinel for p in procs], timeout))
        hung = _kill_alive(procs)
        failures = []
        while not errors.empty():
            failures.append(errors.get())
        assert not failures, _report(failures)
        assert not hung, f"{len(hung)} rank(s) {verdict}"
        assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]


def _pool_worker(rank, world, init_file, jobs, results, backend):
    try:
        _init_rank(rank, world, init_file, backend)
    except BaseException:  # noqa: BLE001
        _leave(results, (rank, traceback.format_exc()))
    while True:
        job = jobs.get()
        if job is None:  # the pool closes: nothing is in flight after the last case's barrier
            os._exit(0)
        check, args = job
        try:
            check(rank, world, *args)
            dist.barrier()
        except BaseException:  # noqa: BLE001 -- the case fails, and this group goes with it
            _leave(results, (rank, traceback.format_exc()))
        results.put((rank, None))


def _leave(results, outcome):
    """Report a failure and exit: the queue's feeder thread must hand the report over before os._exit."""
    results.put(outcome)
    results.close()
    results.join_thread()
    os._exit(1)


class RankPool:
    """`world` ranks of one gloo group that run case after case (see the module's docstring). Close it when
    the family is done (a module-scoped fixture); a failed case closes it, and the next `run` starts anew."""

    def __init__(self, world: int, backend: str = "gloo", idle_s: float = IDLE_S):
        self.world, self.backend, self.idle_s = world, backend, idle_s
        self._procs, self._jobs, self._tmp = [], [], None

    def _start(self):
        ctx = mp.get_context("spawn")
        self._tmp = tempfile.TemporaryDirectory()
        init_file = os.path.join(self._tmp.name, "rendezvous")
        self._jobs = [ctx.SimpleQueue() for _ in range(self.world)]
        self._results = ctx.Queue()
        self._procs = [ctx.Process(target=_pool_worker,
                                   args=(r, self.world, init_file, self._jobs[r], self._results, self.backend))
                       for r in range(self.world)]
        for p in self._procs:
            p.start()

    def run(self, check, *args):
        if not self._procs:
            self._start()
        for jobs in self._jobs:
            jobs.put((check, args))
        outcomes = {}

        def take(timeout=None):
            try:
                rank, error = self._results.get(timeout=timeout) if timeout else self._results.get_nowait()
            except queue.Empty:
                return False
            outcomes[rank] = error
            return True

        def finished():
            while take():
                pass
            if len(outcomes) == self.world:
                return True
            # a failed rank has left: its peers finish, raise at their next collective, or hang (the watch's
            # idle limit); once every rank has reported or exited there is nothing more to wait for
            failed = any(error is not None for error in outcomes.values())
            return failed and not any(p.is_alive() for r, p in enumerate(self._procs) if r not in outcomes)

        verdict = _watch(self._procs, self.idle_s, finished, take)
        failures = sorted((rank, error) for rank, error in outcomes.items() if error is not None)
        if failures or verdict:  # its ranks may be stuck in a collective: no goodbye, just kill them
            self.close(graceful=False)
        assert not failures, _report(failures)
        assert not verdict, f"{self.world - len(outcomes)} rank(s) {verdict}"

    def close(self, graceful: bool = True):
        if graceful:  # between cases every rank waits for its next job
            for jobs in self._jobs:
                jobs.put(None)
            for p in self._procs:
                p.join(10)
        _kill_alive(self._procs)
        self._procs = []
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None


def _kill_alive(procs):
    alive = [p for p in procs if p.is_alive()]
    for p in alive:
        p.kill()
    for p in alive:
        p.join(10)
    return alive


def _report(failures):
    return "\n".join(f"rank {r}:\n{tb}" for r, tb in failures)


def _watch(procs, idle_s: float, finished, wait) -> str:
    """Wait while the ranks make progress, until `finished()`; return why the wait stopped ('' when finished).
    `wait(timeout)` returns early when there is news (a rank exited, a result came)."""
    pids = [p.pid for p in procs]
    start = last_progress = time.monotonic()
    last_cpu = _tree_cpu_seconds(pids)
    while not finished():
        if not any(p.is_alive() for p in procs):  # a last report may have come in as they left
            return "" if finished() else "exited before finishing"
        wait(POLL_S)
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
