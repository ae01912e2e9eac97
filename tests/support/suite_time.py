"""Where the suite's time goes, by category (docs/development.md, "The suite's budget").

During a run (tests/conftest.py loads the hooks below) each test is given one category, from what it did:
the first that applies in this order, since a test that starts a fresh interpreter or spawns ranks pays
that start whatever runs inside it:

- AOT / nvcc:      it compiles Triton kernels ahead of time or CUDA sources (markers aot, cuda_compile)
- fresh process:   it started a Python interpreter (first contact, examples, benchmarks' command lines)
- spawned ranks:   it ran gloo ranks (rlkernels.testing.spawn)
- Inductor:        Dynamo handed Inductor at least one graph in this process
- Dynamo:          Dynamo traced at least one graph (aot_eager and counting backends)
- interpreter:     it ran Triton kernels through TRITON_INTERPRET (marker interpret)
- hypothesis:      a @given test
- peers:           it runs a peer's code in process (tests/peers, tests/integrations)
- plain:           everything else
- skipped:         skipped before its call (the GPU tests on a machine without one)

The category is written as a junit property, so one report covers every xdist worker:

    python -m pytest --junitxml=suite.xml ...
    python -m tests.support.suite_time suite.xml        # the table, slowest category first
"""

import subprocess
import sys
import xml.etree.ElementTree as ET
from collections import defaultdict

ORDER = ("AOT / nvcc", "fresh process", "spawned ranks", "Inductor", "Dynamo", "interpreter", "hypothesis",
         "peers", "plain")


class _Seen:
    """What the test running in this process has done so far (reset per test)."""

    def __init__(self):
        self.interpreters = 0
        self.spawns = 0


SEEN = _Seen()


def _watch_process_starts():
    """Counts interpreters started through subprocess (every fresh-process test uses sys.executable)."""
    real_init = subprocess.Popen.__init__

    def init(self, args, *a, **k):
        first = args[0] if isinstance(args, (list, tuple)) and args else args
        if isinstance(first, str) and ("python" in first.rsplit("/", 1)[-1] or first == sys.executable):
            SEEN.interpreters += 1
        return real_init(self, args, *a, **k)

    subprocess.Popen.__init__ = init


def _watch_spawns():
    from rlkernels.testing import spawn

    real_spawn, real_run = spawn.spawn, spawn.RankPool.run

    def counted_spawn(*a, **k):
        SEEN.spawns += 1
        return real_spawn(*a, **k)

    def counted_run(self, *a, **k):
        SEEN.spawns += 1
        return real_run(self, *a, **k)

    spawn.spawn = counted_spawn
    spawn.RankPool.run = counted_run


def _dynamo_counts():
    from torch._dynamo.utils import counters

    inductor = counters["inductor"]
    return (counters["stats"]["unique_graphs"],
            inductor["fxgraph_cache_miss"] + inductor["fxgraph_cache_hit"] + inductor["fxgraph_cache_bypass"])


def install():
    """Called once per process (tests/conftest.py): the counters the categories read."""
    _watch_process_starts()
    _watch_spawns()


def start():
    """Before a test's call phase: reset the counters; returns the Dynamo counts to compare with."""
    SEEN.interpreters = SEEN.spawns = 0
    return _dynamo_counts()


def finish(item, before):
    """After the call phase: the test's category, as a junit property."""
    graphs, inductor = (after - then for after, then in zip(_dynamo_counts(), before))
    path = str(item.path)
    found = {
        "fresh process": SEEN.interpreters > 0,
        "spawned ranks": SEEN.spawns > 0,
        "AOT / nvcc": any(item.get_closest_marker(m) for m in ("aot", "cuda_compile")),
        "Inductor": inductor > 0,
        "Dynamo": graphs > 0,
        "interpreter": item.get_closest_marker("interpret") is not None,
        "hypothesis": getattr(getattr(item, "obj", None), "is_hypothesis_test", False),
        "peers": "/tests/peers/" in path or "/tests/integrations/" in path,
    }
    item.user_properties.append(("category", next((c for c in ORDER if found.get(c)), "plain")))


def table(junit_path):
    """(category, tests, seconds) rows from a junit report, slowest first, and the total."""
    seconds, counts = defaultdict(float), defaultdict(int)
    for case in ET.parse(junit_path).getroot().iter("testcase"):
        props = {p.get("name"): p.get("value") for p in case.iter("property")}
        category = props.get("category", "skipped" if case.find("skipped") is not None else "plain")
        seconds[category] += float(case.get("time", 0.0))
        counts[category] += 1
    rows = sorted(((c, counts[c], seconds[c]) for c in seconds), key=lambda r: -r[2])
    return rows, sum(seconds.values())


if __name__ == "__main__":
    rows, total = table(sys.argv[1])
    print("| category | tests | seconds | share |\n| --- | ---: | ---: | ---: |")
    for category, n, s in rows:
        print(f"| {category} | {n} | {s:.0f} | {100 * s / max(total, 1e-9):.0f}% |")
    print(f"| all | {sum(r[1] for r in rows)} | {total:.0f} | 100% |")
