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


def test_a_spec_looked_up_or_an_import_that_fails_leaves_the_patch_waiting(package, tmp_path):
    import importlib.util

    seen = []
    when_imported(package + "other", lambda module: seen.append("other"))
    assert importlib.util.find_spec(package + "other") is not None  # an availability check (runpy does one)
    assert seen == []
    broken = tmp_path / PACKAGE / "broken.py"
    broken.write_text("raise RuntimeError('first try')\n")
    when_imported(package + "broken", lambda module: seen.append("broken"))
    with pytest.raises(RuntimeError):
        import rlk_activation_probe.broken  # noqa: F401
    broken.write_text("VALUE = 2\n")
    importlib.invalidate_caches()
    import rlk_activation_probe.broken  # noqa: F401, F811
    import rlk_activation_probe.other  # noqa: F401

    assert seen == ["broken", "other"]


def test_cancel_drops_only_the_named_patch(package):
    seen = []

    def first(module):
        seen.append("first")

    def second(module):
        seen.append("second")

    when_imported(package + "other", first)
    when_imported(package + "other", second)
    cancel(package + "other", first)
    import rlk_activation_probe.other  # noqa: F401

    assert seen == ["second"]


def test_two_rebindings_on_one_module_come_back_independently(package):
    loss_rebinding = Rebinding("Loss", Ours, [package + "loss"])
    actor_rebinding = Rebinding("Actor.forward", ours_forward, [package + "loss"])
    loss_rebinding.install()
    actor_rebinding.install()
    loss_rebinding.uninstall()  # before the import: the other one still waits
    from rlk_activation_probe import loss

    assert loss.Loss is not Ours and loss.Actor().forward() == "ours"
    actor_rebinding.uninstall()
    assert loss.Actor().forward() == "theirs"


def test_uninstall_puts_back_what_each_module_held(package):
    """A module re-imported after the patch holds a new object: uninstall() restores each module's own, not the first
    module's."""
    import importlib

    rebinding = Rebinding("VALUE", 99, [package + "other"])
    from rlk_activation_probe import other

    rebinding.install()
    assert other.VALUE == 99
    rebinding.uninstall()
    assert other.VALUE == 1
    reloaded = importlib.reload(other)
    reloaded.VALUE = 7  # the reloaded module's own value
    rebinding.install()
    assert reloaded.VALUE == 99
    rebinding.uninstall()
    assert reloaded.VALUE == 7


def test_a_patch_waits_once_however_often_it_is_installed(package):
    """A loss object built or unpickled once per step installs again each time: its patch runs once on import."""
    seen = []

    class Probe:
        def patch(self, module):
            seen.append(module.VALUE)

    probe = Probe()
    for _ in range(3):
        when_imported(package + "other", probe.patch)  # equal bound methods, three objects
    import rlk_activation_probe.other  # noqa: F401

    assert seen == [1]
