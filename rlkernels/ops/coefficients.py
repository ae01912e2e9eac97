"""Autograd glue: no grids, no math.

The vocabulary-wide passes carry their autograd formula in custom_ops.py (`rlkernels::token_stats`,
whose backward receives (c_t, e_t) = (dLoss/dlogprob_t, dLoss/dentropy_t) and runs the backend's
single backward pass). `CoefficientLossFunction` is the bridge from the per-sequence stage: a 0-d
loss computed without autograd, together with its closed-form per-token coefficients; its backward
hands g * (c_t, e_t) back to whatever produced the statistics.
"""

import torch

from .vocab import refuse_double_backward


class CoefficientLossFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, loss, logprobs, entropy, coef_logprob, coef_entropy):
        # loss: () value; logprobs, entropy: (N,) the differentiable statistics; coef_*: (N,) dLoss/d*
        ctx.save_for_backward(coef_logprob, coef_entropy)
        ctx.dtypes = (logprobs.dtype, None if entropy is None else entropy.dtype)
        return loss.clone()

    @staticmethod
    def backward(ctx, grad_loss):
        refuse_double_backward()
        coef_logprob, coef_entropy = ctx.saved_tensors
        lp_dtype, ent_dtype = ctx.dtypes
        d_lp = (grad_loss * coef_logprob).to(lp_dtype)
        d_ent = None
        if ent_dtype is not None:
            d_ent = None if coef_entropy is None else (grad_loss * coef_entropy).to(ent_dtype)
        return None, d_lp, d_ent, None, None
