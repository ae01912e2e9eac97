"""The one dispatch point: which backend each name and device get, and how the one per-sequence stage runs."""

import os

import pytest
import torch

from rlkernels import backends
from rlkernels.loss import sequence_stage


class CudaLike:
    """Stands in for a CUDA tensor where only .is_cuda / .dtype / .device are read (no GPU here)."""

    is_cuda = True
    dtype = torch.bfloat16
    device = torch.device("cuda", 0)


def test_auto_picks_torch_on_cpu():
    assert backends.select("auto", torch.zeros(2, 3)).name == "torch"


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
    eager = sequence_stage
    assert backends.select_stage(torch.zeros(3), None) is eager
    assert backends.select_stage(torch.zeros(3), False) is eager
    assert backends.select_stage(CudaLike(), False) is eager
    compiled = backends.select_stage(CudaLike(), None)
    assert compiled is not eager and compiled is backends.select_stage(torch.zeros(3), True)


@pytest.mark.parametrize("name", ["triton", "cuda"])
def test_kernel_backends_name_the_dtype_for_float64(name):
    with pytest.raises(ValueError, match="float64"):
        backends.select(name, torch.zeros(2, 3, dtype=torch.float64))


def test_unknown_backend_name():
    with pytest.raises(ValueError, match="backend"):
        backends.select("tpu", torch.zeros(2, 3))
