"""The trainers' own loss tests, unmodified, against the adapters (rlkernels/testing/trainer_tests.py routes them).

OpenRLHF 0.11.2 ships its tests in its wheel: its loss aggregation and correction tests (`test_loss_aggregation.py`,
16 cases with the actor's) exercise `PolicyLoss` and its actor's temperature-scaled entropy
(`test_actor_entropy_temperature.py`) `Actor.forward`. They run here in a fresh pytest process against the
installed files, every one of them, with the class under test rebound to the adapter's. BY_DESIGN lists the tests
that cannot pass by design, with the reason: none today.

SkyRL 0.4.0, AReaL 1.0.4 and TorchTitan 0.3.0 ship no tests of their losses in their wheels; their losses are held
to the trainers' own functions by the parity tests beside this file.
"""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from .trainer_imports import trainer_or_skip

ROOT = Path(__file__).resolve().parents[2]
OPENRLHF_TESTS = ("test_loss_aggregation.py", "test_actor_entropy_temperature.py")
BY_DESIGN = {}  # test id -> why it cannot pass against the adapter


def _openrlhf_tests_dir() -> Path:
    trainer_or_skip("openrlhf_loss", "OpenRLHF 0.11.2")
    import importlib.metadata

    files = importlib.metadata.files("openrlhf") or []
    found = [f for f in files if str(f).replace("\\", "/") in {f"tests/{name}" for name in OPENRLHF_TESTS}]
    if len(found) != len(OPENRLHF_TESTS):
        pytest.skip("this openrlhf install does not ship its tests")
    return Path(found[0].locate()).parent


def test_openrlhfs_own_tests_pass_against_the_adapter(tmp_path):
    tests = _openrlhf_tests_dir()
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rA", "-p", "no:cacheprovider", "-p", "rlkernels.testing.trainer_tests",
         *(str(tests / name) for name in OPENRLHF_TESTS)],
        capture_output=True, text=True, timeout=600, cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(ROOT)})
    out = done.stdout
    routed = re.search(r"rlkernels routed: (.*)", out)
    assert routed, out[-3000:]
    assert "test_loss_aggregation.PolicyLoss" in routed.group(1) and "Actor.forward" in routed.group(1), out[-3000:]
    failed = set(re.findall(r"^FAILED (\S+)", out, re.M))
    passed = set(re.findall(r"^PASSED (\S+)", out, re.M))
    assert failed == set(BY_DESIGN), out[-5000:]
    assert len(passed) == 16 and done.returncode == (1 if BY_DESIGN else 0), out[-3000:]
