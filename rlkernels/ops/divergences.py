"""SPEC §9.2, the full form: exact divergences between the trainer's π = softmax(z / T) and a second
distribution μ = softmax(r / T_r) given as logits (recomputed rollout logits, a reference model), per row, read
in one pass over both tensors, a chunk of rows at a time: peak extra memory O(chunk * V), never [N, V].

    kl = KL(μ||π),  reverse_kl = KL(π||μ),  chi2 = χ²(π||μ) = sum π²/μ - 1,  tv = ½ sum |π - μ|

The backward reads both tensors again and forms, for coefficients (a, b, c, d) of the four,

    dz_v = ( a (π_v - μ_v) + b π_v (log π_v - log μ_v - KL(π||μ)) + 2 c (π_v² / μ_v - π_v (χ² + 1))
             + d π_v (s_v - sum_u π_u s_u) / 2 ) / T,              s = sign(π - μ);

autograd reaches the trainer's logits only (μ is a fixed target). On the Triton backend (one temperature each)
the two kernels of kernels/triton/divergences.py do it: two reads of both rows forward, one backward. Elsewhere
(the CPU and CUDA backends, torch, a per-token temperature) it is chunked PyTorch (docs/spec.md §9.2).
"""

from typing import Iterator, Optional, Tuple

import torch
from torch import Tensor

from ..backends.base import inverse_temperature, row_groups, statistics_dtype
from ..backends.torch_backend import CHUNK_ELEMENTS
from .vocab import refuse_double_backward


def _log_softmax(rows: Tensor, inv_t, acc) -> Tensor:
    z = rows.to(acc)
    top = z.amax(1, keepdim=True)
    z = z - torch.where(torch.isfinite(top), top, torch.zeros_like(top))  # shift first: exact differences at 1e4
    return torch.log_softmax(z * inv_t, dim=1)


def _chunks(logits: Tensor, reference: Tensor, chunk_rows: Optional[int]) -> Iterator[Tuple[int, int, Tensor, Tensor]]:
    V = logits.shape[-1]
    ref_rows = reference.reshape(-1, V)  # the target's rows (a view unless its strides forbid one)
    step = chunk_rows or max(1, CHUNK_ELEMENTS // max(V, 1))
    for start, block in row_groups(logits):
        for s in range(0, block.shape[0], step):
            e = min(block.shape[0], s + step)
            yield start + s, start + e, block[s:e], ref_rows[start + s:start + e]


def _rows(inv_t, s: int, e: int):
    return inv_t[s:e] if isinstance(inv_t, Tensor) else inv_t


def _terms(lp: Tensor, lq: Tensor):
    """(π, μ, live π > 0, π²/μ where π > 0) with the empty branches' logs replaced before any product."""
    zero = torch.zeros((), dtype=lp.dtype, device=lp.device)
    pi, mu = lp.exp(), lq.exp()
    live = pi > 0
    ratio_sq = torch.where(live, torch.exp(2 * torch.where(live, lp, zero) - torch.where(live, lq, zero)), zero)
    return pi, mu, live, ratio_sq


def _stats(lp: Tensor, lq: Tensor) -> Tensor:
    """[rows, 4] (kl, reverse_kl, chi2, tv)."""
    zero = torch.zeros((), dtype=lp.dtype, device=lp.device)
    pi, mu, live, ratio_sq = _terms(lp, lq)
    mu_live = mu > 0
    kl = torch.where(mu_live, mu * (torch.where(mu_live, lq, zero) - torch.where(mu_live, lp, zero)), zero).sum(1)
    reverse_kl = torch.where(live, pi * (torch.where(live, lp, zero) - torch.where(live, lq, zero)), zero).sum(1)
    chi2 = ratio_sq.sum(1) - 1
    tv = 0.5 * (pi - mu).abs().sum(1)
    return torch.stack([kl, reverse_kl, chi2, tv], 1)


def _triton_kernels():
    from ..kernels.triton import divergences

    return divergences


class FullDivergenceFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, reference, active, temperature, reference_temperature, chunk_rows, backend="torch"):
        # logits: [N, V] or [B, T, V] row-strided (ops.logit_rows); reference: the same shape; active: [N] bool;
        # the temperatures: floats or [N] tensors; backend: the resolved name ("triton": the kernels)
        N = active.shape[0]
        acc = statistics_dtype(logits.dtype)
        if backend == "triton":
            stats = _triton_kernels().full_divergences_fwd(logits, reference, active, temperature,
                                                           reference_temperature).stats
            ctx.save_for_backward(logits, reference, active, stats)
            ctx.options = (temperature, reference_temperature, chunk_rows, backend)
            return tuple(stats[:, :4].unbind(1))
        out = torch.zeros(N, 4, dtype=acc, device=logits.device)
        inv_t, inv_r = inverse_temperature(temperature, acc), inverse_temperature(reference_temperature, acc)
        with torch.no_grad():
            for s, e, z, r in _chunks(logits, reference, chunk_rows):
                out[s:e] = _stats(_log_softmax(z, _rows(inv_t, s, e), acc), _log_softmax(r, _rows(inv_r, s, e), acc))
        out = torch.where(active[:, None], out, torch.zeros((), dtype=acc, device=out.device))
        ctx.save_for_backward(logits, reference, active, out)
        ctx.options = (temperature, reference_temperature, chunk_rows, backend)
        return tuple(out.unbind(1))

    @staticmethod
    def backward(ctx, *grads):
        refuse_double_backward()
        logits, reference, active, stats = ctx.saved_tensors
        temperature, reference_temperature, chunk_rows, backend = ctx.options
        acc = stats.dtype
        coef = torch.stack([torch.zeros_like(stats[:, 0]) if g is None else g.to(acc) for g in grads], 1)
        coef = torch.where(active[:, None], coef, torch.zeros((), dtype=acc, device=coef.device))
        if backend == "triton":
            grad = _triton_kernels().full_divergences_bwd(logits, reference, stats, coef, temperature,
                                                          reference_temperature)
            return grad, None, None, None, None, None, None
        grad = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)
        flat = grad.view(-1, logits.shape[-1])
        inv_t, inv_r = inverse_temperature(temperature, acc), inverse_temperature(reference_temperature, acc)
        for s, e, z, r in _chunks(logits, reference, chunk_rows):
            t_rows = _rows(inv_t, s, e)
            lp, lq = _log_softmax(z, t_rows, acc), _log_softmax(r, _rows(inv_r, s, e), acc)
            pi, mu, live, ratio_sq = _terms(lp, lq)
            a, b, c, d = (coef[s:e, i:i + 1] for i in range(4))
            reverse_kl, chi2 = stats[s:e, 1:2], stats[s:e, 2:3]
            zero = torch.zeros((), dtype=acc, device=lp.device)
            log_ratio = torch.where(live, torch.where(live, lp, zero) - torch.where(live, lq, zero), zero)
            sign = torch.sign(pi - mu)
            # a divergence without a coefficient contributes nothing, even where it is +inf (0 * inf = NaN)
            g = torch.where(a != 0, a * (pi - mu), zero) \
                + torch.where(b != 0, b * (pi * (log_ratio - reverse_kl)), zero) \
                + torch.where(c != 0, 2 * c * (ratio_sq - pi * (chi2 + 1)), zero) \
                + torch.where(d != 0, 0.5 * d * pi * (sign - (pi * sign).sum(1, keepdim=True)), zero)
            flat[s:e] = (g * t_rows).to(grad.dtype)
        return grad, None, None, None, None, None, None


@torch.no_grad()
def linear_full_divergence_values(hidden: Tensor, weight: Tensor, bias: Optional[Tensor], reference: Tensor,
                                  active: Tensor, temperature, chunk_rows: int) -> Tensor:
    """[N, 4] (kl, reverse_kl, chi2, tv) of softmax((hidden @ weight.T + bias) / T) against softmax(reference / T)
    ([N, V] reference logits), a chunk of rows of logits at a time; no autograd (metrics and masks only)."""
    from .linear import _head  # the fused-linear path's own GEMM: the same logits as its pass

    N, V = active.shape[0], weight.shape[0]
    acc = statistics_dtype(hidden.dtype)
    out = torch.zeros(N, 4, dtype=acc, device=hidden.device)
    inv_t = inverse_temperature(temperature, acc)
    ref_rows = reference.reshape(-1, V)
    rows = torch.nonzero(active).squeeze(1)  # rows outside the loss never touch the head (one host sync)
    step = max(1, chunk_rows)
    for s in range(0, rows.numel(), step):
        idx = rows[s:s + step]
        t_rows = inv_t.index_select(0, idx) if isinstance(inv_t, Tensor) else inv_t
        z = _head(hidden.index_select(0, idx), weight, bias)
        out[idx] = _stats(_log_softmax(z, t_rows, acc), _log_softmax(ref_rows.index_select(0, idx), t_rows, acc))
    return out
