"""Test-wide switches, markers and tolerances.

Triton kernels run on the CPU through the interpreter: TRITON_INTERPRET must be set before any
kernel module is imported, so it is set here, at collection, whenever no GPU is present.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
from hypothesis import HealthCheck, settings  # noqa: E402

# CI runs on 2 cores: example budgets are explicit per test (scale them with HYPOTHESIS_SCALE, see
# tests/cases.py); no deadline, since first calls compile.
# The default profile is derandomized, so a CI run replays the same examples every time (a clean
# clone either passes or fails, never flakes); HYPOTHESIS_PROFILE=explore draws fresh ones.
_health = [HealthCheck.too_slow, HealthCheck.data_too_large]
settings.register_profile("ci", deadline=None, derandomize=True, suppress_health_check=_health)
settings.register_profile("explore", deadline=None, suppress_health_check=_health)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

HAS_CUDA = torch.cuda.is_available()
NO_GPU = "needs a CUDA GPU; none on this machine"
requires_gpu = pytest.mark.skipif(not HAS_CUDA, reason=NO_GPU)


def pytest_collection_modifyitems(config, items):
    for item in items:
        if "gpu" in item.keywords and not HAS_CUDA:
            item.add_marker(pytest.mark.skip(reason=f"{NO_GPU} (run benchmarks/gpu_check.sh on one)"))
