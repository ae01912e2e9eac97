"""The one dispatch point: which backend and which per-sequence stage each name and device get."""

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
def test_triton_rejects_float64_and_serves_float32_on_cpu_interpreter():
    with pytest.raises(ValueError, match="backend='triton'"):
        backends.select("triton", torch.zeros(2, 3, dtype=torch.float64))
    assert backends.select("triton", torch.zeros(2, 3)).name == "triton"


def test_stage_follows_the_backend():
    assert backends.select_stage("torch", torch.zeros(3)) is sequence_stage
    assert backends.select_stage("auto", torch.zeros(3)) is sequence_stage
    assert backends.select_stage("triton", torch.zeros(3, dtype=torch.float64)) is sequence_stage
    if backends.available()["triton"] and os.environ.get("TRITON_INTERPRET") == "1":
        from rlkernels.kernels.triton.seq_stage import sequence_stage_triton

        assert backends.select_stage("triton", torch.zeros(3)) is sequence_stage_triton


def test_unknown_backend_name():
    with pytest.raises(ValueError, match="backend"):
        backends.select("tpu", torch.zeros(2, 3))
