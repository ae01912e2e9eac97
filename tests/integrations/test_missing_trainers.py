"""An adapter whose trainer (or one of its trainer's dependencies) is missing says what to install, the same way for
every trainer (rlkernels/integrations/requirements.py), in a fresh interpreter where the import is blocked."""

import subprocess
import sys
import textwrap

import pytest

from rlkernels.integrations.requirements import RELEASES

# adapter -> the call that first needs its trainer
ENTRY = {
    "skyrl": "import rlkernels.integrations.skyrl as a; a.register()",
    "openrlhf": "import rlkernels.integrations.openrlhf as a; a.install()",
    "areal": "import rlkernels.integrations.areal as a; a.install()",
    "torchtitan": "import rlkernels.integrations.torchtitan",
    "trl": "import rlkernels.integrations.trl",
}
BLOCKER = """
import sys
class Blocked:
    def find_spec(self, name, path=None, target=None):
        if name == {blocked!r} or name.startswith({blocked!r} + "."):
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
sys.meta_path.insert(0, Blocked())
for name in [m for m in sys.modules if m == {blocked!r} or m.startswith({blocked!r} + ".")]:
    del sys.modules[name]
try:
    {entry}
except ImportError as exc:
    print(type(exc).__name__, exc)
else:
    print("no error")
"""


def _attempt(adapter: str, blocked: str) -> str:
    code = BLOCKER.format(blocked=blocked, entry=ENTRY[adapter])
    run = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=180)
    assert run.returncode == 0, run.stderr[-2000:]
    return run.stdout.strip()


def test_every_adapter_has_an_entry():
    assert set(ENTRY) == set(RELEASES)


@pytest.mark.parametrize("adapter", sorted(ENTRY))
def test_a_missing_trainer_is_named_with_its_release(adapter):
    trainer, _ = RELEASES[adapter].split("==")
    out = _attempt(adapter, trainer)
    assert out.startswith("ImportError ") and f"pip install {RELEASES[adapter]}" in out, out
    assert f"rlkernels.integrations.{adapter} needs {trainer}, which is not installed" in out, out


def test_a_missing_dependency_is_named_not_the_trainer():
    """TorchTitan installed without tyro (its config module's dependency): the error names tyro, not torchtitan."""
    pytest.importorskip("torchtitan")
    out = _attempt("torchtitan", "tyro")
    if out == "no error":
        pytest.skip("torchtitan.components.loss does not import tyro in this release")
    assert "torchtitan is installed, but torchtitan.components.loss imports 'tyro'" in out and \
        "pip install tyro" in out, out
