"""The Triton backend (token kernels + fused per-sequence stage) against the float64 oracle, over the
same option product as the torch backend. Without a GPU it runs through TRITON_INTERPRET=1 (set by
conftest), so the example counts are smaller: the interpreter is ~500x slower than the GPU."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlkernels import backends

from ..cases import problems, scaled
from .parity import check_against_reference

pytestmark = [
    pytest.mark.interpret,
    pytest.mark.skipif(not backends.available()["triton"], reason="Triton is not importable here"),
]
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SMALL = dict(max_seqs=4, max_len=6, max_vocab=40)  # the interpreter's speed sets the size


@settings(max_examples=scaled(150))
@given(problems(torch.float32, **SMALL))
def test_triton_backend_matches_reference_float32(problem):
    batch, mode, config = problem
    check_against_reference(batch, mode, config, backend="triton", device=DEVICE)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@settings(max_examples=scaled(30))
@given(data=st.data())
def test_triton_backend_half_inputs(dtype, data):
    batch, mode, config = data.draw(problems(dtype, **SMALL))
    check_against_reference(batch, mode, config, backend="triton", device=DEVICE)
