"""rlkernels/integrations/activation.py: a patch on a module's first import, and a `Rebinding` with its way back,
on a package written to disk and imported through the import system, as a trainer's worker imports the trainer."""

import sys
import textwrap

import pytest

from rlkernels.integrations.activation import Rebinding, cancel, when_imported

PACKAGE = "rlk_activation_probe"


@pytest.fixture
def package(tmp_path, monkeypatch):
    """A package whose `loss` module defines `Loss` and a class `Actor`, `models` imports `Loss` from it and
    `trainer` imports it from `models` (OpenRLHF's chain); `other` has neither."""
    root = tmp_path / PACKAGE
    root.mkdir()
    (root / "__init__.py").write_text("")
    (root / "loss.py").write_text(textwrap.dedent("""
        class Loss:
            pass

        class Actor:
            def forward(self):
                return "theirs"
    """))
    (root / "models.py").write_text("from .loss import Actor, Loss\n")
    (root / "trainer.py").write_text("from .models import Loss\n")
    (root / "other.py").write_text("VALUE = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield f"{PACKAGE}."
    for name in [m for m in sys.modules if m == PACKAGE or m.startswith(PACKAGE + ".")]:
        del sys.modules[name]
    for name in ("loss", "models", "trainer", "other"):
        cancel(f"{PACKAGE}.{name}")


class Ours:
    pass


def ours_forward(self):
    return "ours"


def test_when_imported_runs_after_the_module_executes_and_once(package):
    seen = []
    when_imported(package + "other", lambda module: seen.append(module.VALUE))
    assert seen == []
    import rlk_activation_probe.other as other  # noqa: F401

    assert seen == [1]
    del sys.modules[package + "other"]
    import rlk_activation_probe.other  # noqa: F401, F811  (a second import: the watch has ended)

    assert seen == [1]
    when_imported(package + "other", lambda module: seen.append(2))  # already imported: now
    assert seen == [1, 2]


def test_cancel_drops_a_waiting_patch(package):
    seen = []
    when_imported(package + "other", seen.append)
    cancel(package + "other")
    import rlk_activation_probe.other  # noqa: F401

    assert seen == []


def test_rebinding_reaches_the_modules_that_import_the_patched_name_and_comes_back(package):
    rebinding = Rebinding("Loss", Ours, [package + name for name in ("loss", "models", "trainer", "other")])
    rebinding.install()
    from rlk_activation_probe import loss, models, other, trainer

    original = rebinding.original
    assert original is not None and original.__module__ == package + "loss"
    assert loss.Loss is models.Loss is trainer.Loss is Ours  # bound through the import chain
    assert not hasattr(other, "Loss")  # a module without the name is left alone
    rebinding.uninstall()
    assert loss.Loss is models.Loss is trainer.Loss is original


def test_rebinding_a_dotted_attribute_of_an_imported_module(package):
    from rlk_activation_probe import loss

    rebinding = Rebinding("Actor.forward", ours_forward, [package + "loss"])
    rebinding.install()  # already imported: patched now
    assert loss.Actor().forward() == "ours"
    rebinding.uninstall()
    assert loss.Actor().forward() == "theirs"
