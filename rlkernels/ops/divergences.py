"""SPEC §9.2, the full form: exact divergences between the trainer's π = softmax(z / T) and a second
distribution μ = softmax(r / T_r) given as logits (recomputed rollout logits, a reference model), per row:

    kl = KL(μ||π),  reverse_kl = KL(π||μ),  chi2 = χ²(π||μ) = sum π²/μ - 1,  tv = ½ sum |π - μ|

`rlkernels::full_divergences` and its backward `rlkernels::full_divergences_grad` are custom ops around the
backend's two passes (backends.base.Backend.full_divergences_fwd / _bwd: the Triton kernel reads both rows once
forward, twice when TV is wanted, and once backward; the C++ kernels twice forward; the chunked PyTorch form
elsewhere), so torch.compile sees opaque ops whose
temperatures stay tensor inputs (a float argument would specialise the graph, and a kernel cannot take the
symbolic float a traced host read gives). Autograd reaches the trainer's logits only (μ is a fixed target). The
fused-linear form forms the trainer's logits a chunk of rows at a time and hands each chunk to the same pass.
"""

from typing import Optional

import torch
from torch import Tensor

from .. import backends
from ..backends.base import DIVERGENCE_STATS, DIVERGENCES
from ..backends.temperature import Temperature
from .linear import HeadOptions, _head, loss_rows  # the fused-linear path's own GEMM: the same logits as its pass
from .vocab import refuse_double_backward


@torch.library.custom_op("rlkernels::full_divergences", mutates_args=())
def full_divergences_op(logits: Tensor, reference: Tensor, active: Tensor, temperature: Tensor,
                        reference_temperature: Tensor, backend: str, chunk_rows: int, with_tv: bool = True) -> Tensor:
    # logits: (N, V) or (B, T, V) row-strided (ops.logit_rows); reference: the same shape; active: (N,) bool;
    # the temperatures: Temperature.tensor; backend: the resolved name; with_tv=False: TV (a second read of both
    # tensors on the GPU) not wanted, its column unspecified. Returns (N, DIVERGENCE_STATS).
    impl = backends.instance(backend, chunk_rows or None)
    return impl.full_divergences_fwd(logits, reference, active, Temperature(temperature),
                                     Temperature(reference_temperature), with_tv)


@full_divergences_op.register_fake
def _(logits, reference, active, temperature, reference_temperature, backend, chunk_rows, with_tv=True):
    return logits.new_empty((active.shape[0], DIVERGENCE_STATS), dtype=backends.statistics_dtype(logits.dtype))


@torch.library.custom_op("rlkernels::full_divergences_grad", mutates_args=())
def full_divergences_grad(logits: Tensor, reference: Tensor, stats: Tensor, coef: Tensor, temperature: Tensor,
                          reference_temperature: Tensor, backend: str, chunk_rows: int) -> Tensor:
    impl = backends.instance(backend, chunk_rows or None)
    return impl.full_divergences_bwd(logits, reference, stats, coef, Temperature(temperature),
                                     Temperature(reference_temperature))


@full_divergences_grad.register_fake
def _(logits, reference, stats, coef, temperature, reference_temperature, backend, chunk_rows):
    return torch.empty_like(logits, memory_format=torch.contiguous_format)


def _setup_context(ctx, inputs, output):
    logits, reference, active, temperature, reference_temperature, backend, chunk_rows, _ = inputs
    ctx.save_for_backward(logits, reference, active, output, temperature, reference_temperature)
    ctx.options = (backend, chunk_rows)


def _backward(ctx, grad_stats):
    refuse_double_backward()
    logits, reference, active, stats, temperature, reference_temperature = ctx.saved_tensors
    backend, chunk_rows = ctx.options
    if grad_stats is None:
        return None, None, None, None, None, None, None, None
    coef = grad_stats[:, :len(DIVERGENCES)].to(stats.dtype)
    coef = torch.where(active[:, None], coef, torch.zeros((), dtype=stats.dtype, device=coef.device))
    grad = full_divergences_grad(logits, reference, stats, coef, temperature, reference_temperature, backend,
                                 chunk_rows)
    return grad, None, None, None, None, None, None, None


full_divergences_op.register_autograd(_backward, setup_context=_setup_context)


def full_divergence_stats(logits: Tensor, reference: Tensor, active: Tensor, temperature: Temperature,
                          reference_temperature: Temperature, backend: str, chunk_rows: Optional[int] = None,
                          with_tv: bool = True):
    """(kl, reverse_kl, chi2, tv), each [N], with autograd to `logits` (a resolved `backend`); tv None without
    with_tv (the GPU kernel then reads both tensors once instead of twice)."""
    stats = full_divergences_op(logits, reference, active, temperature.tensor, reference_temperature.tensor, backend,
                                chunk_rows or 0, with_tv)
    return divergence_columns(stats, with_tv)


def divergence_columns(stats: Tensor, with_tv: bool):
    """(kl, reverse_kl, chi2, tv) from the first columns of [N, >= 4] statistics; tv None without with_tv (its
    column unspecified then)."""
    kl, reverse_kl, chi2, tv = stats[:, :len(DIVERGENCES)].unbind(1)
    return kl, reverse_kl, chi2, tv if with_tv else None


@torch.no_grad()
def linear_full_divergence_values(hidden: Tensor, weight: Tensor, bias: Optional[Tensor], reference: Tensor,
                                  active: Tensor, temperature: Temperature, head: HeadOptions,
                                  with_tv: bool = True) -> Tensor:
    """[N, 4] (kl, reverse_kl, chi2, tv) of softmax((hidden @ weight.T + bias) / T) against softmax(reference / T)
    ([N, V] reference logits), a chunk of rows of logits at a time through the backend's forward pass (`head`: its
    resolved backend, rows per chunk and row selection); no autograd (metrics and masks only). with_tv=False: the
    tv column unspecified (the backend may skip its second read)."""
    N, V = active.shape[0], weight.shape[0]
    impl = backends.instance(head.backend)
    out = torch.zeros(N, len(DIVERGENCES), dtype=backends.statistics_dtype(hidden.dtype), device=hidden.device)
    ref_rows = reference.reshape(-1, V)
    # rows outside the loss never touch the head (one host sync), or with select_rows=False every row does (no sync)
    rows = loss_rows(active, head.select_rows)
    step = max(1, head.chunk_rows)
    for s in range(0, rows.numel(), step):
        idx = rows[s:s + step]
        t_rows = temperature.rows(idx)
        z = _head(hidden.index_select(0, idx), weight, bias)
        every = torch.ones(idx.numel(), dtype=torch.bool, device=hidden.device)
        stats = impl.full_divergences_fwd(z, ref_rows.index_select(0, idx), every, t_rows, t_rows, with_tv)
        out[idx] = stats[:, :len(DIVERGENCES)].to(out.dtype)
    if not head.select_rows:  # every row was computed: those outside the loss are 0, as when skipped
        out = torch.where(active[:, None], out, torch.zeros((), dtype=out.dtype, device=out.device))
    return out
