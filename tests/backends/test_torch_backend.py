"""The torch backend against the float64 oracle over the whole option product (SPEC §1-§8)."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ..cases import batches, configs
from .parity import check_against_reference

MODES = ("decoupled", "bypass", "on-policy")


@st.composite
def problems(draw, dtype):
    mode = draw(st.sampled_from(MODES))
    batch = draw(batches(dtype=dtype))
    # chunk_rows=3 forces several chunks even on tiny batches, so chunk seams are always exercised
    config = draw(configs(mode, chunk_rows=draw(st.sampled_from([None, 3]))))
    return batch, mode, config


@settings(max_examples=300)
@given(problems(torch.float64))
def test_torch_backend_matches_reference_float64(problem):
    batch, mode, config = problem
    check_against_reference(batch, mode, config, backend="torch")


@settings(max_examples=150)
@given(problems(torch.float32))
def test_torch_backend_matches_reference_float32(problem):
    batch, mode, config = problem
    check_against_reference(batch, mode, config, backend="torch")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@settings(max_examples=40)
@given(data=st.data())
def test_torch_backend_half_inputs(dtype, data):
    # bf16/fp16 logits are upcast exactly to fp32, so the fp32 tolerance applies to the statistics;
    # only dlogits is rounded once more, to the logits dtype (2^-8 for bf16, 2^-11 for fp16).
    mode = data.draw(st.sampled_from(MODES))
    batch = data.draw(batches(dtype=dtype))
    config = data.draw(configs(mode))
    check_against_reference_half(batch, mode, config, dtype)


def check_against_reference_half(batch, mode, config, dtype):
    import rlkernels
    from rlkernels import reference

    from ..cases import assert_close

    kw = batch.kwargs(mode)
    logits = batch.logits.clone().requires_grad_(True)
    out = rlkernels.decoupled_ppo_loss(logits, batch.labels, batch.advantages, batch.response_mask, config=config, backend="torch", **kw)
    ref_logits = batch.logits.double().requires_grad_(True)
    ref_kw = {k: (None if v is None else (v.double() if v.is_floating_point() else v)) for k, v in kw.items()}
    exp = reference.decoupled_ppo_loss(ref_logits, batch.labels, batch.advantages.double(), batch.response_mask, config=config, **ref_kw)
    scale = max(1.0, float(exp.loss.detach().abs()))
    assert_close(out.loss, exp.loss, rtol=2e-5, atol=1e-5 * scale, name="loss")
    (g,) = torch.autograd.grad(out.loss, logits)
    (rg,) = torch.autograd.grad(exp.loss, ref_logits)
    assert g.dtype == dtype
    rounding = 2.0**-8 if dtype == torch.bfloat16 else 2.0**-11
    g_scale = max(1e-3, float(rg.abs().max())) if rg.numel() else 1.0  # floor: see parity.py
    assert_close(g, rg, rtol=rounding, atol=1e-5 * g_scale, name="dlogits")
