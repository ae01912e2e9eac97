"""Real process groups for the distributed tests: gloo ranks spawned with torch.multiprocessing.

`spawn(world, check, *args)` runs `check(rank, world, *args)` on every rank of a fresh gloo group
(file rendezvous; `backend="nccl"` for the one-GPU check) and fails with every rank's traceback.
Every wait has a timeout -- the group's, the joins' -- so a failing or hung rank fails the test
instead of hanging the suite. `check` must be a module-level function (spawned processes import it
by name).

`Collectives` wraps torch.distributed functions (the library calls them through the module) to
count calls and the bytes each rank sends, per group.
"""

import datetime
import os
import tempfile
import time
import traceback
from collections import defaultdict

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

TIMEOUT_S = 120


def _worker(rank, world, init_file, check, args, errors, backend):
    code = 0
    try:
        dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=TIMEOUT_S))
        torch.set_num_threads(1)
        check(rank, world, *args)
        dist.barrier()
    except BaseException:  # noqa: BLE001 -- reported to the parent, which fails the test
        errors.put((rank, traceback.format_exc()))
        code = 1
    # Leave without tearing the group down: after the barrier nothing is in flight, and gloo's
    # destructor racing a peer that already left can abort a rank that passed (seen once in CI runs)
    os._exit(code)


def spawn(world, check, *args, backend="gloo"):
    with tempfile.TemporaryDirectory() as tmp:
        ctx = mp.get_context("spawn")
        errors = ctx.SimpleQueue()
        init_file = os.path.join(tmp, "rendezvous")
        procs = [ctx.Process(target=_worker, args=(r, world, init_file, check, args, errors, backend))
                 for r in range(world)]
        for p in procs:
            p.start()
        deadline = time.monotonic() + TIMEOUT_S
        for p in procs:
            p.join(max(1.0, deadline - time.monotonic()))
        hung = [p for p in procs if p.is_alive()]
        for p in hung:
            p.kill()
        failures = []
        while not errors.empty():
            failures.append(errors.get())
        assert not failures, "\n".join(f"rank {r}:\n{tb}" for r, tb in failures)
        assert not hung, f"{len(hung)} rank(s) did not finish within {TIMEOUT_S} s"
        assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]


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
