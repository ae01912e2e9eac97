"""SPEC §9.2, the full form: exact divergences between the trainer's π = softmax(z / T) and a second
distribution μ = softmax(r / T_r) given as logits (recomputed rollout logits, a reference model), per row:

    kl = KL(μ||π),  reverse_kl = KL(π||μ),  chi2 = χ²(π||μ) = sum π²/μ - 1,  tv = ½ sum |π - μ|

Autograd around the backend's two passes (backends.base.Backend.full_divergences_fwd / _bwd: the Triton and
C++ kernels read both rows twice forward and once backward; the chunked PyTorch form elsewhere); autograd reaches
the trainer's logits only (μ is a fixed target). The fused-linear form forms the trainer's logits a chunk of rows
at a time and hands each chunk to the same forward pass.
"""

from typing import Optional

import torch
from torch import Tensor

from .. import backends
from ..backends.base import DIVERGENCES
from ..backends.temperature import Temperature
from .vocab import refuse_double_backward


class FullDivergenceFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, reference, active, temperature: Temperature, reference_temperature: Temperature,
                backend: str, chunk_rows: Optional[int] = None):
        # logits: [N, V] or [B, T, V] row-strided (ops.logit_rows); reference: the same shape; active: [N] bool;
        # backend: the resolved name
        impl = backends.instance(backend, chunk_rows)
        stats = impl.full_divergences_fwd(logits, reference, active, temperature, reference_temperature)
        ctx.save_for_backward(logits, reference, active, stats)
        ctx.options = (temperature, reference_temperature, backend, chunk_rows)
        return tuple(stats[:, :len(DIVERGENCES)].unbind(1))

    @staticmethod
    def backward(ctx, *grads):
        refuse_double_backward()
        logits, reference, active, stats = ctx.saved_tensors
        temperature, reference_temperature, backend, chunk_rows = ctx.options
        acc = stats.dtype
        coef = torch.stack([torch.zeros_like(stats[:, 0]) if g is None else g.to(acc) for g in grads], 1)
        coef = torch.where(active[:, None], coef, torch.zeros((), dtype=acc, device=coef.device))
        grad = backends.instance(backend, chunk_rows).full_divergences_bwd(logits, reference, stats, coef,
                                                                            temperature, reference_temperature)
        return grad, None, None, None, None, None, None


@torch.no_grad()
def linear_full_divergence_values(hidden: Tensor, weight: Tensor, bias: Optional[Tensor], reference: Tensor,
                                  active: Tensor, temperature: Temperature, backend: str, chunk_rows: int) -> Tensor:
    """[N, 4] (kl, reverse_kl, chi2, tv) of softmax((hidden @ weight.T + bias) / T) against softmax(reference / T)
    ([N, V] reference logits), a chunk of rows of logits at a time through the backend's forward pass (`backend`:
    a resolved name); no autograd (metrics and masks only)."""
    from .linear import _head  # the fused-linear path's own GEMM: the same logits as its pass

    N, V = active.shape[0], weight.shape[0]
    impl = backends.instance(backend)
    out = torch.zeros(N, len(DIVERGENCES), dtype=backends.statistics_dtype(hidden.dtype), device=hidden.device)
    ref_rows = reference.reshape(-1, V)
    rows = torch.nonzero(active).squeeze(1)  # rows outside the loss never touch the head (one host sync)
    step = max(1, chunk_rows)
    for s in range(0, rows.numel(), step):
        idx = rows[s:s + step]
        t_rows = temperature.rows(idx)
        z = _head(hidden.index_select(0, idx), weight, bias)
        every = torch.ones(idx.numel(), dtype=torch.bool, device=hidden.device)
        stats = impl.full_divergences_fwd(z, ref_rows.index_select(0, idx), every, t_rows, t_rows)
        out[idx] = stats[:, :len(DIVERGENCES)].to(out.dtype)
    return out
