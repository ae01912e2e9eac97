"""Each adapter's trainer, the release it was tested against, and the one error an adapter raises without it."""

import importlib
import importlib.util
from types import ModuleType

# adapter -> the trainer release its parity tests run (docs/integrations.md); the install line a user needs
RELEASES = {
    "trl": "trl==1.16.0",
    "skyrl": "skyrl==0.4.0",
    "openrlhf": "openrlhf==0.11.2",
    "torchtitan": "torchtitan==0.3.0",
    "areal": "areal==1.0.4",
}


def import_trainer(adapter: str, module: str) -> ModuleType:
    """`module` of adapter's trainer, or an ImportError that says what to install: the trainer when it is missing, a
    release that has the module when the installed one lacks it, or the dependency the trainer's import needs (a
    trainer installed with --no-deps may lack one: TorchTitan without tyro)."""
    release = RELEASES[adapter]
    trainer = release.split("==")[0]
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as exc:
        missing = exc.name or ""
        if missing == trainer:
            raise _not_installed(adapter) from exc
        if missing.startswith(trainer + "."):
            raise ImportError(f"rlkernels.integrations.{adapter} needs {release}: the installed {trainer} has no "
                              f"module {missing!r} (another release?)") from exc
        raise ImportError(f"rlkernels.integrations.{adapter}: {trainer} is installed, but {module} imports "
                          f"{missing!r}, which is not: pip install {missing.split('.')[0]} (or reinstall {release} "
                          "with its dependencies)") from exc


def require_trainer(adapter: str) -> None:
    """The ImportError of `import_trainer` when adapter's trainer is not installed at all, importing none of it (an
    `install()` that patches the trainer's modules when they are imported: activation.py)."""
    try:
        spec = importlib.util.find_spec(RELEASES[adapter].split("==")[0])
    except ModuleNotFoundError:  # a finder that refuses the name (an import blocked in a test)
        spec = None
    if spec is None:
        raise _not_installed(adapter)


def _not_installed(adapter: str) -> ImportError:
    release = RELEASES[adapter]
    return ImportError(f"rlkernels.integrations.{adapter} needs {release.split('==')[0]}, which is not installed: "
                       f"pip install {release}")
