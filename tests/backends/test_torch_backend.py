"""The torch backend against the float64 oracle over the whole option product (SPEC §1-§8)."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ..cases import problems, scaled
from .parity import check_against_reference

# chunk_rows=3 forces several chunks even on tiny batches, so chunk seams are always exercised
CHUNK_ROWS = [None, 3]


@settings(max_examples=scaled(300))
@given(problems(torch.float64, chunk_rows=CHUNK_ROWS))
def test_torch_backend_matches_reference_float64(problem):
    batch, mode, config = problem
    check_against_reference(batch, mode, config, backend="torch")


@settings(max_examples=scaled(150))
@given(problems(torch.float32, chunk_rows=CHUNK_ROWS))
def test_torch_backend_matches_reference_float32(problem):
    batch, mode, config = problem
    check_against_reference(batch, mode, config, backend="torch")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@settings(max_examples=scaled(40))
@given(data=st.data())
def test_torch_backend_half_inputs(dtype, data):
    batch, mode, config = data.draw(problems(dtype, chunk_rows=CHUNK_ROWS))
    check_against_reference(batch, mode, config, backend="torch")
