"""Backend dispatch (backends.resolve / select: which backend each name, device and dtype get) and stage.select (the
per-sequence stage, eager or compiled)."""

import os
import subprocess
import sys

import pytest
import torch

from rlkernels import backends, stage


class CudaLike:
    """Stands in for a CUDA tensor where only .is_cuda / .dtype / .device are read (no GPU here)."""

    is_cuda = True
    dtype = torch.bfloat16
    device = torch.device("cuda", 0)


def test_auto_picks_the_cpu_kernels_on_cpu_and_torch_for_float64():
    expected = "cpu" if backends.available()["cpu"] else "torch"
    assert backends.select("auto", torch.zeros(2, 3)).name == expected
    assert backends.select("auto", torch.zeros(2, 3, dtype=torch.float64)).name == "torch"


def _auto_name_in_a_fresh_process(env):
    code = "import torch; from rlkernels import backends; print(backends.select('auto', torch.zeros(2, 3)).name)"
    run = subprocess.run([sys.executable, "-W", "always", "-c", code], capture_output=True, text=True, timeout=300,
                         env=dict(os.environ, **env))
    assert run.returncode == 0, run.stderr
    return run.stdout.strip(), run.stderr


def test_cpu_kernels_can_be_turned_off():
    name, _ = _auto_name_in_a_fresh_process({"RLKERNELS_CPU_KERNELS": "0"})
    assert name == "torch"


def test_a_failed_cpu_build_warns_and_keeps_the_torch_backend(tmp_path):
    """No usable compiler: a warning that says so, and "auto" runs the torch backend."""
    env = {"RLKERNELS_CACHE": str(tmp_path), "CXX": "false", "PATH": "/nonexistent"}
    name, err = _auto_name_in_a_fresh_process(env)
    assert name == "torch"
    assert "the CPU kernels are unavailable, using the torch backend" in err


@pytest.mark.skipif(not backends.available()["triton"], reason="Triton is not importable here")
def test_auto_picks_triton_on_cuda():
    assert backends.select("auto", CudaLike()).name == "triton"


def test_cuda_backend_without_a_build_raises_clearly():
    if backends.available()["cuda"]:
        pytest.skip("the CUDA extension is built in this environment")
    with pytest.raises(RuntimeError, match="CUDA extension is not built"):
        backends.select("cuda", torch.zeros(2, 3))


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="CPU Triton needs the interpreter")
def test_triton_serves_float32_on_cpu_interpreter():
    assert backends.select("triton", torch.zeros(2, 3)).name == "triton"


def test_one_stage_eager_on_cpu_compiled_on_cuda_or_on_request():
    eager = stage.run
    assert stage.select(torch.zeros(3), None) is eager
    assert stage.select(torch.zeros(3), False) is eager
    assert stage.select(CudaLike(), False) is eager
    compiled = stage.select(CudaLike(), None)
    assert compiled is not eager and compiled is stage.select(torch.zeros(3), True)


@pytest.mark.parametrize("name", ["triton", "cuda"])
def test_kernel_backends_name_the_dtype_for_float64(name):
    with pytest.raises(ValueError, match="float64"):
        backends.select(name, torch.zeros(2, 3, dtype=torch.float64))


def test_unknown_backend_name():
    with pytest.raises(ValueError, match="backend"):
        backends.select("tpu", torch.zeros(2, 3))
