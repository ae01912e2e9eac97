"""One parity check shared by every backend's test file: backend vs the float64 oracle."""

import torch

import rlkernels
from rlkernels import reference

from ..cases import assert_close, interpreted, tol


def check_against_reference(batch, mode, config, *, backend, device="cpu"):
    """Run `decoupled_ppo_loss` on `backend` and the oracle on the same inputs; compare everything.

    The oracle sees the very same values upcast to float64, so the only differences are the
    backend's arithmetic precision and summation order (see cases.TOL). bf16/fp16 logits upcast
    exactly, so the float32 row applies to every statistic; only dlogits adds one rounding, and Triton's
    CPU interpreter rounds bf16 differently from a GPU."""
    stat_dtype = torch.float64 if batch.logits.dtype == torch.float64 else torch.float32
    value_tol = tol("value", stat_dtype)
    kw = {k: (None if v is None else v.to(device)) for k, v in batch.kwargs(mode).items()}
    logits = batch.logits.to(device).clone().requires_grad_(True)
    args = (batch.labels.to(device), batch.advantages.to(device), batch.response_mask.to(device))
    out = rlkernels.decoupled_ppo_loss(logits, *args, config=config, backend=backend, **kw)

    ref_logits = batch.logits.double().clone().requires_grad_(True)
    ref_kw = {k: (None if v is None else (v.double() if v.is_floating_point() else v))
              for k, v in batch.kwargs(mode).items()}
    expected = reference.decoupled_ppo_loss(
        ref_logits, batch.labels, batch.advantages.double(), batch.response_mask, config=config, **ref_kw
    )
    scale = max(1.0, float(expected.loss.detach().abs()))
    assert_close(out.loss, expected.loss, **tol("value", stat_dtype, scale=scale), name="loss")
    assert_close(out.logprobs, expected.logprobs, **value_tol, name="logprobs")
    if config.needs_entropy:
        assert_close(out.entropy, expected.entropy, **value_tol, name="entropy")
    else:
        assert out.entropy is None
    assert_close(out.is_weights, expected.is_weights, **value_tol, name="is_weights")
    assert torch.equal(out.mask.cpu(), expected.mask), "final mask differs"
    assert set(out.metrics) == set(expected.metrics), f"metric names differ: {set(out.metrics) ^ set(expected.metrics)}"
    for name, value in expected.metrics.items():
        m_scale = max(1.0, float(value.abs())) if torch.isfinite(value) else 1.0
        assert_close(out.metrics[name], value, **tol("value", stat_dtype, scale=m_scale), name=name)

    (grad,) = torch.autograd.grad(out.loss, logits)
    (ref_grad,) = torch.autograd.grad(expected.loss, ref_logits)
    # Floor the scale: the oracle takes the entropy gradient through autograd of lse - sum p*z,
    # which cancels terms of size |z| ~ 40 and so cannot resolve gradients below ~1e-14 (near
    # one-hot rows give true values of 1e-19 that it reports as 0).
    g_scale = max(1e-3, float(ref_grad.abs().max())) if ref_grad.numel() else 1.0
    assert grad.dtype == logits.dtype
    grad_tol = tol("dlogits", logits.dtype, scale=g_scale, interpreter=backend == "triton" and interpreted())
    assert_close(grad, ref_grad, **grad_tol, name="dlogits")
    return out, expected
