"""The trainer adapters on first contact, each in a fresh interpreter: importing an adapter changes nothing in its
trainer until the user selects it (SkyRL's registry, OpenRLHF's PolicyLoss, AReaL's loss function); the one line
does; and CI installs every trainer the parity tests run, so none of them is skipped there."""

import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from rlkernels.testing import trainers

ROOT = Path(__file__).resolve().parents[2]


def _run(code: str) -> str:
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=180,
                          cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def test_the_ci_command_installs_every_trainer_the_tests_run():
    command = next(line for line in (ROOT / "README.md").read_text().splitlines() if "pytest" in line)
    for name, version in trainers.PINS.items():
        assert f"{name}=={version}" in command, name
    for deps in trainers.EXTRA_DEPS.values():
        for dep in deps:
            assert dep in command, dep
    assert re.search(r"--no-deps --ignore-requires-python", command)


def test_skyrl_registry_is_untouched_until_register():
    try:
        trainers.skyrl_ppo_utils()
    except ImportError as exc:  # pragma: no cover - reported by the skip
        pytest.skip(f"SkyRL 0.4.0 is not importable here ({exc})")
    out = _run("""
        from rlkernels.testing.trainers import skyrl_ppo_utils
        registry = skyrl_ppo_utils().PolicyLossRegistry
        before = registry.list_available()
        import rlkernels.integrations.skyrl as adapter
        assert registry.list_available() == before, "importing the adapter registered something"
        adapter.register()
        added = sorted(set(registry.list_available()) - set(before))
        print(added)
    """)
    assert out.strip() == str(sorted(["rlkernels_cispo", "rlkernels_dual_clip", "rlkernels_gspo",
                                      "rlkernels_regular", "rlkernels_sapo"]))


def test_openrlhf_policy_loss_is_untouched_until_install():
    try:
        trainers.openrlhf_loss()
    except ImportError as exc:  # pragma: no cover - reported by the skip
        pytest.skip(f"OpenRLHF 0.11.2 is not importable here ({exc})")
    _run("""
        from rlkernels.testing.trainers import openrlhf_loss
        own = openrlhf_loss().PolicyLoss
        import openrlhf.models.loss as module
        import rlkernels.integrations.openrlhf as adapter
        assert module.PolicyLoss is own, "importing the adapter rebound PolicyLoss"
        adapter.install()
        assert module.PolicyLoss is adapter.PolicyLoss
        adapter.uninstall()
        assert module.PolicyLoss is own
    """)


def test_modules_without_a_trainer_import_none():
    """prime-rl's, slime's and NeMo-RL's adapters import neither their trainer nor a stand-in for it."""
    _run("""
        import sys
        import rlkernels.integrations.prime_rl, rlkernels.integrations.slime, rlkernels.integrations.nemo_rl
        import rlkernels.integrations.areal
        loaded = [m for m in sys.modules if m.split(".")[0] in ("prime_rl", "slime", "nemo_rl", "megatron", "areal")]
        assert not loaded, loaded
    """)
