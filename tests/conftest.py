"""Test-wide switches, markers and tolerances.

Triton kernels run on the CPU through the interpreter: TRITON_INTERPRET must be set before any
kernel module is imported, so it is set here, at collection, whenever no GPU is present.
"""

import os
import sys

import torch

# pytest-xdist (execnet) starts its workers with PYTHONDONTWRITEBYTECODE=1, which every interpreter they start
# inherits (multiprocessing's ranks as -B): nothing they import would ever be cached as bytecode. In a fresh
# clone that is rlkernels and the tests, compiled again in every worker, rank and interpreter. The workers
# and the interpreters the tests start write it; the ranks read it.
sys.dont_write_bytecode = False
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
from hypothesis import HealthCheck, settings  # noqa: E402

from .support import suite_time  # noqa: E402

# CI runs on 2 cores: example budgets are explicit per test (tests/cases.py::scaled); no deadline, since first
# calls compile. Two profiles:
# - "ci" (the default): derandomized, so a run replays the same examples every time (a clean clone either
#   passes or fails, never flakes), at each test's stated budget;
# - "thorough" (HYPOTHESIS_PROFILE=thorough, for a nightly or manual run): fresh examples every run and ten times
#   each budget (HYPOTHESIS_SCALE overrides the factor).
_health = [HealthCheck.too_slow, HealthCheck.data_too_large]
settings.register_profile("ci", deadline=None, derandomize=True, suppress_health_check=_health)
settings.register_profile("thorough", deadline=None, suppress_health_check=_health)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

# Under pytest-xdist each worker takes its share of the cores: two workers on 2 cores would otherwise each run
# 2 intra-op threads, every parallel region waiting for a thread the other worker has descheduled. Results do
# not depend on it (every backend splits work over rows, each row computed by one thread).
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _WORKERS > 1:
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // _WORKERS))
    # and Inductor compiles in the worker itself: a pool of compile processes per worker (and per compiling rank)
    # costs its start-up for cores another worker is using (first-contact interpreters keep the default)
    os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")

HAS_CUDA = torch.cuda.is_available()
NO_GPU = "needs a CUDA GPU; none on this machine"
requires_gpu = pytest.mark.skipif(not HAS_CUDA, reason=NO_GPU)


def pytest_collection_modifyitems(config, items):
    for item in items:
        if "gpu" in item.keywords and not HAS_CUDA:
            item.add_marker(pytest.mark.skip(reason=f"{NO_GPU} (run benchmarks/gpu_check.sh on one)"))
        elif "interpret" in item.keywords and HAS_CUDA:
            # its Triton kernels run on CPU tensors, and the interpreter is off where a GPU is: the compiled
            # kernels' checks are the `gpu` cases (tests/kernels/test_gpu_kernels.py, cases.triton_here)
            item.add_marker(pytest.mark.skip(reason="runs Triton on CPU tensors through the interpreter, which is "
                                                    "off on a GPU machine"))


@pytest.fixture(scope="module")
def rank_pools():
    """`rank_pools(world)`: one RankPool per world size for this module's family of spawned cases (one start of
    the ranks per family, not per case; rlkernels/testing/spawn.py), closed when the module is done."""
    from rlkernels.testing.spawn import RankPool

    pools = {}

    def pool(world):
        if world not in pools:
            pools[world] = RankPool(world)
        return pools[world]

    yield pool
    for p in pools.values():
        p.close()


# -- the suite's time by category (tests/support/suite_time.py) ----------------------------------------------
def pytest_configure(config):
    suite_time.install()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    before = suite_time.start()
    yield
    suite_time.finish(item, before)
