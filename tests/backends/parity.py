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
    if config.metrics == "loss_only":  # none computed (the oracle's are all it computes)
        assert out.metrics == {}, f"metrics='loss_only' returned {sorted(out.metrics)}"
    else:
        assert set(out.metrics) == set(expected.metrics), \
            f"metric names differ: {set(out.metrics) ^ set(expected.metrics)}"
    for name, value in (expected.metrics if config.metrics == "all" else {}).items():
        m_scale = max(1.0, float(value.abs())) if torch.isfinite(value) else 1.0
        mean = expected.metrics.get(name[:-len("_std")] + "_mean") if name.endswith("_std") else None
        if mean is not None and torch.isfinite(mean):
            # a spread is taken from (count, mean, M2) moments: in float32 its error is eps x |mean|, not eps x std
            # (equal weights of 4.9e8, e^20 at the clamp, give a std of 64 where the oracle's is 6e-8)
            m_scale = max(m_scale, float(mean.abs()))
        assert_close(out.metrics[name], value, **tol("value", stat_dtype, scale=m_scale), name=name)

    (grad,) = torch.autograd.grad(out.loss, logits)
    (ref_grad,) = torch.autograd.grad(expected.loss, ref_logits)
    # Floor the scale: the oracle takes the entropy gradient through autograd of lse - sum p*z,
    # which cancels terms of size |z| ~ 40 and so cannot resolve gradients below ~1e-14 (near
    # one-hot rows give true values of 1e-19 that it reports as 0).
    g_scale = max(1e-3, float(ref_grad.abs().max())) if ref_grad.numel() else 1.0
    assert grad.dtype == logits.dtype
    grad_tol = tol("dlogits", logits.dtype, scale=g_scale, interpreter=backend == "triton" and interpreted())
    if stat_dtype == torch.float32:
        grad_tol["atol"] = max(grad_tol["atol"], _label_column_floor(batch, config, ref_grad))
    assert_close(grad, ref_grad, **grad_tol, name="dlogits")
    return out, expected


def _label_column_floor(batch, config, ref_grad, temperature=None, support=None) -> float:
    """The label column's gradient is (c_t / T)(p_y - 1): in float32, p_y - 1 of a confident token (p_y
    near 1) carries the rounding of p_y (and of the row's log-normaliser), an absolute ~2^-23 that no
    scale of the gradient's own size covers (the row's entries are all ~|c_t|/T (1 - p_y)). This floor
    is 2^-23 |c_t| / T at the worst row, with c_t / T recovered from the float64 oracle's label column."""
    labels = batch.labels.reshape(-1)
    V = batch.logits.shape[-1]
    valid = (labels >= 0) & (labels < V)
    if not valid.any():
        return 0.0
    t = config.temperature if temperature is None else torch.broadcast_to(
        torch.as_tensor(temperature, dtype=torch.float64), batch.labels.shape).reshape(-1)[valid, None]
    z = batch.logits.double().reshape(-1, V)[valid] / t
    if support is not None:  # a kept set: p is renormalised over it
        from rlkernels.ops.kept_set import kept_mask
        z = z.masked_fill(~kept_mask(support.reshape(-1, support.shape[-1])[valid], V), float("-inf"))
    p_y = torch.softmax(z, -1).gather(1, labels[valid, None]).squeeze(1)
    g_y = ref_grad.reshape(-1, V)[valid].gather(1, labels[valid, None]).squeeze(1)
    finite = torch.isfinite(g_y) & (p_y < 1)
    if not finite.any():
        return 0.0
    return float(2.0**-23 * (g_y[finite] / (p_y[finite] - 1)).abs().max())
