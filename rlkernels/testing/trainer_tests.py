"""A pytest plugin that runs a trainer's own tests, unmodified, against rlkernels' adapter for that trainer.

    python -m pytest -p rlkernels.testing.trainer_tests <site-packages>/tests/test_loss_aggregation.py

OpenRLHF 0.11.2 ships its tests in its wheel (`tests/` in site-packages, the release the adapter names). Its loss
and actor tests load OpenRLHF's modules from the installed files under private names and bind the class under test
at module level (`PolicyLoss = _loss_module.PolicyLoss`, `Actor = _load_actor_module().Actor`). After collection
this plugin rebinds those names in each collected test module to the adapter's (`rlkernels.integrations.openrlhf`:
its `PolicyLoss`, and OpenRLHF's `Actor` with the adapter's `actor_forward`), so every test body runs as written
against rlkernels. `deepspeed`, which OpenRLHF's `models/utils.py` imports at the top and these tests do not stub,
is an inert stand-in where it is not installed, as in rlkernels' own parity tests (trainers.py).
"""

import importlib.machinery
import importlib.util
import sys


def _stand_in_deepspeed() -> None:
    if importlib.util.find_spec("deepspeed") is None and "deepspeed" not in sys.modules:
        from .trainers import _Inert

        stand_in = _Inert("deepspeed")
        stand_in.__spec__ = importlib.machinery.ModuleSpec("deepspeed", None)
        sys.modules["deepspeed"] = stand_in


_stand_in_deepspeed()  # before collection imports the test modules


def pytest_collection_modifyitems(session, config, items):
    from rlkernels.integrations import openrlhf as adapter

    for module in {item.module for item in items if getattr(item, "module", None) is not None}:
        if hasattr(module, "PolicyLoss"):
            module.PolicyLoss = adapter.PolicyLoss
        actor = getattr(module, "Actor", None)
        if isinstance(actor, type) and actor.__name__ == "Actor":  # OpenRLHF's, with the adapter's forward
            module.Actor = type("Actor", (actor,), {"forward": adapter.actor_forward})


_ROUTED = []


def pytest_collection_finish(session):
    """Record what was routed (after pytest_collection_modifyitems): the summary says it, so a run that routed
    nothing cannot pass for one that ran the adapter."""
    from rlkernels.integrations import openrlhf as adapter

    for module in {item.module for item in session.items if getattr(item, "module", None) is not None}:
        if getattr(module, "PolicyLoss", None) is adapter.PolicyLoss:
            _ROUTED.append(f"{module.__name__}.PolicyLoss")
        actor = getattr(module, "Actor", None)
        if isinstance(actor, type) and actor.__dict__.get("forward") is adapter.actor_forward:
            _ROUTED.append(f"{module.__name__}.Actor.forward")


def pytest_terminal_summary(terminalreporter):
    terminalreporter.write_line("rlkernels routed: " + ", ".join(sorted(_ROUTED) or ["nothing"]))
