"""Autograd glue: no grids, no math.

The vocabulary-wide passes carry their autograd formula in custom_ops.py (`rlkernels::token_stats`,
whose backward receives (c_t, e_t) = (dLoss/dlogprob_t, dLoss/dentropy_t) and runs the backend's
single backward pass). `CoefficientLossFunction` is the bridge from the per-sequence stage: a 0-d
loss computed without autograd, together with its closed-form per-token coefficients; its backward
hands g * (c_t, e_t) back to whatever produced the statistics. `ForwardGradientFunction` is the one-pass forms'
(fused-linear, and logits: dlogits in the `hidden` slot): the gradients were formed in the forward for g = 1, and
its backward scales them by g.
"""

import torch

from .vocab import refuse_double_backward


class CoefficientLossFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, loss, logprobs, entropy, coef_logprob, coef_entropy, head_logprobs=None, coef_head=None):
        # loss: () value; logprobs, entropy: (N,) the differentiable statistics; coef_*: (N,) dLoss/d*;
        # head_logprobs: (N, k) log-probs at the sampler's head ids (SPEC §9.1) with coef_head (N, k), or None
        ctx.save_for_backward(coef_logprob, coef_entropy, coef_head)
        ctx.dtypes = (logprobs.dtype, None if entropy is None else entropy.dtype,
                      None if head_logprobs is None else head_logprobs.dtype)
        return loss.clone()

    @staticmethod
    def backward(ctx, grad_loss):
        refuse_double_backward()
        coef_logprob, coef_entropy, coef_head = ctx.saved_tensors
        lp_dtype, ent_dtype, head_dtype = ctx.dtypes
        d_lp = (grad_loss * coef_logprob).to(lp_dtype)
        d_ent = None
        if ent_dtype is not None:
            d_ent = None if coef_entropy is None else (grad_loss * coef_entropy).to(ent_dtype)
        d_head = None if head_dtype is None or coef_head is None else (grad_loss * coef_head).to(head_dtype)
        return None, d_lp, d_ent, None, None, d_head, None


class ForwardGradientFunction(torch.autograd.Function):
    """loss -> (hidden, weight, bias) with dLoss/d* formed in the forward (ops.linear_forward_gradient) for a
    unit incoming gradient; the backward hands back g * each.

    With `read_scale` (validate=True) g is read on the host (one synchronisation) and for g = 1 (a plain
    loss.backward()) the backward hands back the very tensors the forward filled: without a retained graph
    autograd frees its saved copies first and takes them as they are (into .grad, or on into the model's
    backward), so the step holds each gradient once, as the two-pass form does. Any other g (a scaled loss, a
    retained graph's second pass, gradcheck) gets fresh d * g, with g a host float: the product is formed in
    float32 and rounded once (a 0-d tensor would be rounded to a half-precision d's dtype first). Without it
    (validate=False: no host reads) every g is applied on the device, d * g: one pass over the gradients and one
    transient copy each, exact for g = 1 and for powers of two (a loss averaged over 2^k micro-batches), else
    rounded once more for a half-precision d (g is rounded to its dtype first). On CPU tensors g is read as with
    validation whatever `read_scale` says: the host is the device, nothing waits."""

    @staticmethod
    def forward(ctx, loss, hidden, weight, bias, d_hidden, d_weight, d_bias, read_scale=True):
        ctx.save_for_backward(d_hidden, d_weight, d_bias)
        ctx.read_scale = read_scale
        return loss.clone()

    @staticmethod
    def backward(ctx, grad_loss):
        refuse_double_backward()
        if ctx.read_scale or grad_loss.device.type == "cpu":
            g = float(grad_loss) if grad_loss.device.type != "cpu" else _host_value(grad_loss)
            scaled = lambda d: None if d is None else (d if g == 1.0 else d * g)  # noqa: E731
        else:
            scaled = lambda d: None if d is None else d * grad_loss.to(d.dtype)  # noqa: E731
        d_hidden, d_weight, d_bias = ctx.saved_tensors
        return None, scaled(d_hidden), scaled(d_weight), scaled(d_bias), None, None, None, None


def _host_value(t: torch.Tensor) -> float:
    """A CPU tensor's value: no device to wait for (rlkernels/testing/launches.py counts no sync for it)."""
    return float(t)
