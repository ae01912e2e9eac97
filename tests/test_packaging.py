"""Packaging: one version, metadata in pyproject.toml, csrc/ and the contract in the sdist, no
dependency that the package never imports."""

import ast
import importlib.metadata
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import rlkernels

ROOT = Path(__file__).resolve().parents[1]


def test_version_is_written_once():
    assert importlib.metadata.version("rlkernels") == rlkernels.__version__
    for name in ("setup.py", "pyproject.toml"):
        text = (ROOT / name).read_text()
        assert rlkernels.__version__ not in text, f"{name} repeats the version; it lives in rlkernels/__init__.py"


def _imported_modules() -> set:
    names = set()
    for path in (ROOT / "rlkernels").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names.update(a.name.split(".")[0] for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names.add(node.module.split(".")[0])
    return names


# declared although rlkernels does not import them, each with the reason
INDIRECT = {"numpy": "torch warns 'Failed to initialize NumPy' on every import without it"}


def test_every_runtime_dependency_is_imported():
    requires = [r for r in importlib.metadata.requires("rlkernels") or [] if "extra ==" not in r]
    imported = _imported_modules()
    for requirement in requires:
        name = requirement.split(";")[0].split(">")[0].split("=")[0].split("<")[0].strip()
        assert name in imported or name in INDIRECT, f"dependency {name!r} is declared but never imported by rlkernels"


def test_sdist_ships_csrc_and_the_contract(tmp_path):
    subprocess.run([sys.executable, "setup.py", "-q", "sdist", "-d", str(tmp_path)], cwd=ROOT, check=True,
                   capture_output=True, timeout=300)
    (archive,) = tmp_path.glob("rlkernels-*.tar.gz")
    with tarfile.open(archive) as tar:
        names = {n.split("/", 1)[1] for n in tar.getnames() if "/" in n}
    sources = [p for p in (ROOT / "csrc").rglob("*") if p.suffix in (".cu", ".cuh", ".cpp")]
    expected = {p.relative_to(ROOT).as_posix() for p in sources}
    expected |= {"docs/spec.md", "pyproject.toml", "setup.py", "rlkernels/__init__.py"}
    assert expected <= names, f"missing from the sdist: {sorted(expected - names)}"


def test_wheel_carries_the_cpu_kernel_source(tmp_path):
    """A non-editable install compiles the CPU kernels from the copy inside the package."""
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                    str(tmp_path), str(ROOT)], check=True, capture_output=True, timeout=300)
    (wheel,) = tmp_path.glob("rlkernels-*.whl")
    with zipfile.ZipFile(wheel) as zf:
        assert "rlkernels/_csrc/cpu/token_passes.cpp" in zf.namelist()
