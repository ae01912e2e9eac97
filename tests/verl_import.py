"""verl 0.9.1 for the tests that run verl's own code: imported once (ray and transformers stood in for
during the import only, as the benchmarks do), or a module-level skip that says why."""

import pytest


def import_verl_or_skip():
    """(rollout_corr_helper, core_algos, ActorConfig); afterwards `verl.*` imports as usual."""
    try:
        from rlkernels.testing.peers import import_verl

        return import_verl()
    except ImportError as exc:  # pragma: no cover - reported by the skip
        pytest.skip(f"verl 0.9.1 is not importable here ({exc}); pip install --no-deps verl==0.9.1 and the peers "
                    "extra", allow_module_level=True)
