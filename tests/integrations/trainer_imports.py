"""The trainers' own loss code for the parity tests (rlkernels.testing.trainers), or a module-level skip that says
what to install: CI installs all four (README's test command), so none is skipped there."""

import pytest


def trainer_or_skip(loader: str, name: str):
    """rlkernels.testing.trainers.<loader>() (the trainer `name`'s modules), or skip the calling test module."""
    try:
        from rlkernels.testing import trainers

        return getattr(trainers, loader)()
    except ImportError as exc:  # pragma: no cover - reported by the skip
        pytest.skip(f"{name} is not importable here ({exc})", allow_module_level=True)
