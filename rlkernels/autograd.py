"""Autograd wrappers. They call a backend's forward/backward and do nothing else: no grids, no math.

`TokenStatsFunction` is logits -> (logprobs, entropy, sum p^2); its backward receives
(c_t, e_t) = (dLoss/dlogprob_t, dLoss/dentropy_t) from whatever consumed the statistics and runs the
backend's single vocabulary-wide backward pass.

`CoefficientLossFunction` is the bridge from the per-sequence stage: a 0-d loss computed without
autograd together with its closed-form per-token coefficients; backward hands g * (c_t, e_t) back.
"""

from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class TokenStatsParams:
    backend: Any
    temperature: float
    compute_entropy: bool
    compute_sum_pi_squared: bool
    inplace_backward: bool = False


class TokenStatsFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: torch.Tensor, labels: torch.Tensor, params: TokenStatsParams):
        # logits: (N, V); labels: (N,) int64, -1 on rows that take no part
        stats = params.backend.token_stats_fwd(
            logits, labels, params.temperature, params.compute_entropy, params.compute_sum_pi_squared
        )
        ctx.save_for_backward(logits, labels, stats.row_max, stats.log_norm, stats.entropy)
        ctx.params = params
        if stats.sum_pi_squared is not None:
            ctx.mark_non_differentiable(stats.sum_pi_squared)
        return stats.logprobs, stats.entropy, stats.sum_pi_squared

    @staticmethod
    def backward(ctx, grad_logprobs, grad_entropy, _grad_sum_pi_squared):
        logits, labels, row_max, log_norm, entropy = ctx.saved_tensors
        params = ctx.params
        if grad_logprobs is None:
            grad_logprobs = torch.zeros_like(row_max)
        dlogits = params.backend.token_grad_bwd(
            logits, labels, row_max, log_norm, entropy, grad_logprobs, grad_entropy if entropy is not None else None,
            params.temperature, params.inplace_backward,
        )
        if params.inplace_backward:
            # the gradient now lives in the logits' storage: tell autograd, so that any other op
            # that saved these logits fails loudly instead of reading a gradient (flash-attn, Liger #272)
            torch.autograd.graph.increment_version(logits)
        return dlogits, None, None


class CoefficientLossFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, loss, logprobs, entropy, coef_logprob, coef_entropy):
        # loss: () value; logprobs, entropy: (N,) the differentiable statistics; coef_*: (N,) dLoss/d*
        ctx.save_for_backward(coef_logprob, coef_entropy)
        ctx.dtypes = (logprobs.dtype, None if entropy is None else entropy.dtype)
        return loss.clone()

    @staticmethod
    def backward(ctx, grad_loss):
        coef_logprob, coef_entropy = ctx.saved_tensors
        lp_dtype, ent_dtype = ctx.dtypes
        d_lp = (grad_loss * coef_logprob).to(lp_dtype)
        d_ent = None
        if ent_dtype is not None:
            d_ent = None if coef_entropy is None else (grad_loss * coef_entropy).to(ent_dtype)
        return None, d_lp, d_ent, None, None
