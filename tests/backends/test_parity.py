"""Every backend against the float64 oracle over the whole option product (SPEC §1-§8), through the public
API: one check (parity.check_against_reference), parametrised over the backends and the logits' dtypes.

Example budgets follow each backend's speed: Triton runs on the CPU through TRITON_INTERPRET=1 (set by
conftest), ~500x slower than on a GPU, on smaller shapes; the CUDA kernels need a GPU (skipped, saying so,
elsewhere). The torch backend also runs float64 (the kernels read fp16/bf16/fp32 only) and with
chunk_rows=3, which forces several chunks even on tiny batches so that chunk seams are always exercised.
"""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlkernels import backends

from ..cases import TRITON_DEVICE, problems, scaled, triton_here
from .parity import check_against_reference

F64, F32, BF16, F16 = torch.float64, torch.float32, torch.bfloat16, torch.float16
TRITON_SMALL = dict(max_seqs=4, max_len=6, max_vocab=40)  # the interpreter's speed sets the size
NEEDS = {
    "cpu": pytest.mark.skipif(not backends.available()["cpu"], reason="the CPU kernels could not be built here"),
    "triton": [triton_here,
               pytest.mark.skipif(not backends.available()["triton"], reason="Triton is not importable here")],
    "cuda": pytest.mark.gpu,
}
# (backend, dtype): (device, problems() options, examples)
CASES = {
    ("torch", F64): ("cpu", dict(chunk_rows=[None, 3]), 300),
    ("torch", F32): ("cpu", dict(chunk_rows=[None, 3]), 150),
    ("torch", BF16): ("cpu", dict(chunk_rows=[None, 3]), 40),
    ("torch", F16): ("cpu", dict(chunk_rows=[None, 3]), 40),
    ("cpu", F32): ("cpu", {}, 150),
    ("cpu", BF16): ("cpu", {}, 40),
    ("cpu", F16): ("cpu", {}, 40),
    ("triton", F32): (TRITON_DEVICE, TRITON_SMALL, 150),
    ("triton", BF16): (TRITON_DEVICE, TRITON_SMALL, 30),
    ("triton", F16): (TRITON_DEVICE, TRITON_SMALL, 30),
    ("cuda", F32): ("cuda", {}, 60),
}


def _parity(backend, dtype):
    device, options, examples = CASES[(backend, dtype)]

    @settings(max_examples=scaled(examples))
    @given(data=st.data())
    def check(data):
        batch, mode, config = data.draw(problems(dtype, **options))
        check_against_reference(batch, mode, config, backend=backend, device=device)

    return check


@pytest.mark.parametrize("backend, dtype", [
    pytest.param(backend, dtype, id=f"{backend}-{str(dtype).split('.')[1]}", marks=NEEDS.get(backend, ()))
    for backend, dtype in CASES])
def test_backend_matches_the_oracle(backend, dtype):
    _parity(backend, dtype)()
