"""Token gradient backward (SPEC §2): per-row coefficients (c_t, e_t) -> dlogits, one read and one write of [N, V]."""

from typing import Optional

import torch
import triton
import triton.language as tl

from ..temperature import row_temperature
from .aot_spec import AotSpec
from .tl_math import (
    TRITON_DTYPES,
    all_vocab_configs,
    grouped_rows,
    row_block_labels,
    row_inverse_temperature,
    vocab_config,
)
from .token_stats import device_guard, grouped_strides


@triton.jit
def _token_grad_bwd_kernel(
    # data ptrs
    logits_ptr, labels_ptr, row_max_ptr, log_norm_ptr, entropy_ptr, coef_logprob_ptr, coef_entropy_ptr,
    dlogits_ptr, inv_t_ptr,  # inv_t_ptr: (N,) 1 / T per row when ROW_TEMPERATURE
    # shapes
    N, V, rows_per_group,
    # strides
    stride_logits_g, stride_logits_n, stride_dlogits_g, stride_dlogits_n,
    # scalars
    temperature,
    # constexpr
    HAS_ENTROPY: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, ROW_TEMPERATURE: tl.constexpr = False,
):
    # One program per BLOCK_N rows (grid (cdiv(N, BLOCK_N),), rows on axis 0 only) writes
    # dlogits = (c (onehot - p) - e p (log p + H)) / T block by block: reads N*V and writes N*V
    # elements of the logits dtype (dlogits_ptr may alias logits_ptr). Hazards: log p is formed as
    # (z - row_max) / T - log_norm (no fp32 lse); the target column c (1 - p_y) is formed in fp32;
    # p = 0 terms are 0, not 0 * -inf; rows with c = e = 0 or a skipped label write zeros unread;
    # a row without a finite logit (log_norm = -inf) gets p = 0, not NaN.
    # label -2: target in another vocabulary shard: the row's gradient without the + c column
    offs_n, mask_n, labels, valid = row_block_labels(labels_ptr, N, V, BLOCK_N)
    c = tl.load(coef_logprob_ptr + offs_n, mask=valid, other=0.0)
    if HAS_ENTROPY:
        e = tl.load(coef_entropy_ptr + offs_n, mask=valid, other=0.0)
        active = valid & ((c != 0.0) | (e != 0.0))
        h = tl.load(entropy_ptr + offs_n, mask=active, other=0.0)
    else:
        active = valid & (c != 0.0)
    row_max = tl.load(row_max_ptr + offs_n, mask=active, other=0.0)
    log_norm = tl.load(log_norm_ptr + offs_n, mask=active, other=0.0)
    # a row without a distribution (log_norm = -inf) takes log_norm = +inf: p = 0 everywhere and
    # the row's gradient is c / T at the target (-inf - -inf would be NaN)
    log_norm = tl.where(log_norm == float("-inf"), float("inf"), log_norm)
    inv_t = row_inverse_temperature(inv_t_ptr, offs_n, mask_n, temperature, BLOCK_N, ROW_TEMPERATURE)
    in_ptrs = grouped_rows(logits_ptr, offs_n, rows_per_group, stride_logits_g, stride_logits_n)
    out_ptrs = grouped_rows(dlogits_ptr, offs_n, rows_per_group, stride_dlogits_g, stride_dlogits_n)

    for v0 in range(0, V, BLOCK_V):
        offs_v = v0 + tl.arange(0, BLOCK_V)
        mask_v = offs_v < V
        # inactive rows load nothing: their padding -inf gives p = 0 and the where() below a clean +0
        z = tl.load(in_ptrs[:, None] + offs_v[None, :], mask=active[:, None] & mask_v[None, :],
                    other=float("-inf")).to(tl.float32)
        log_p = (z - row_max[:, None]) * inv_t[:, None] - log_norm[:, None]
        p = tl.exp(log_p)
        if HAS_ENTROPY:
            # dH/dzs = -p (log p + H); where p = 0, log p may be -inf and the term is 0 by the limit
            g = tl.where(p > 0.0, -p * (c[:, None] + e[:, None] * (log_p + h[:, None])), 0.0)
        else:
            g = -p * c[:, None]
        # the target column gets + c: c (1 - p_y) in fp32, rounded to the output dtype only once below
        g = tl.where(offs_v[None, :] == labels[:, None], g + c[:, None], g)
        g = tl.where(active[:, None], g * inv_t[:, None], 0.0)
        tl.store(out_ptrs[:, None] + offs_v[None, :], g.to(dlogits_ptr.dtype.element_ty),
                 mask=mask_n[:, None] & mask_v[None, :])


def token_grad_bwd(
    logits: torch.Tensor, labels: torch.Tensor, row_max: torch.Tensor, log_norm: torch.Tensor,
    entropy: Optional[torch.Tensor], coef_logprob: torch.Tensor, coef_entropy: Optional[torch.Tensor],
    temperature, inplace: bool, *, block_v: int = None, block_n: int = None,
) -> torch.Tensor:
    """dlogits = (c*(onehot - p) + e*(-p*(log p + H))) / T in the logits dtype (SPEC §2), one pass.

    Args:
        logits: (N, V) or (B, T, V) float16/bfloat16/float32, any strides with unit stride along V
            (else copied); labels: (N,) integer.
        row_max, log_norm: (N,) float32 from `token_stats_fwd` (log p = (z - row_max)/T - log_norm).
        entropy: (N,) float32 H, needed when `coef_entropy` is given.
        coef_logprob, coef_entropy: (N,) c = dLoss/dlogprob and e = dLoss/dH (any float dtype and
            stride); `coef_entropy=None` compiles the entropy term out.
        temperature: T > 0, or an (N,) tensor of per-row temperatures.
        inplace: write dlogits into the logits' storage (the caller bumps the version counter).
        block_v, block_n: test hooks overriding the launch heuristic (powers of two).
    Returns:
        dlogits shaped like logits (contiguous) in the logits dtype; the logits tensor itself when `inplace`.
    """
    if logits.dim() not in (2, 3):
        raise ValueError(f"logits: expected shape (N, V) or (B, T, V), got {tuple(logits.shape)}")
    if logits.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise TypeError(f"logits: expected float16, bfloat16 or float32 for the Triton backend, got {logits.dtype}")
    if coef_entropy is not None and entropy is None:
        raise ValueError("entropy: expected the forward's (N,) entropy since coef_entropy is given, got None")
    V = logits.shape[-1]
    N = logits.numel() // V
    # expanded (stride-0) rows would be written by several programs at once; the public API refuses
    # every overlapping layout before it gets here
    if inplace and logits.numel() > 1 and torch._debug_has_internal_overlap(logits) == 1:
        # rows that share memory (expand, stride 0) would be written by several programs at once
        raise ValueError("logits: an in-place backward needs logits whose elements do not share memory "
                         f"(got strides {logits.stride()} for shape {tuple(logits.shape)})")
    src = logits if logits.stride(-1) == 1 else logits.contiguous()
    out = src if inplace else torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)
    if N == 0:
        return logits if inplace else out
    f32 = lambda t: t.to(torch.float32).contiguous()  # noqa: E731  (coefficients may arrive expanded, stride 0)
    labels = labels.to(torch.int64).contiguous()
    row_max, log_norm, c = f32(row_max), f32(log_norm), f32(coef_logprob)
    has_entropy = coef_entropy is not None
    e = f32(coef_entropy) if has_entropy else c
    h = f32(entropy) if has_entropy else c  # never read when the flag is off
    rows_per_group, stride_g, stride_n = grouped_strides(src)
    _, out_stride_g, out_stride_n = grouped_strides(out)
    cfg = vocab_config(V, block_v, block_n)
    grid = (triton.cdiv(N, cfg.BLOCK_N),)
    scalar, inv_t = row_temperature(temperature)
    with device_guard(logits):
        _token_grad_bwd_kernel[grid](
            src, labels, row_max, log_norm, h, c, e, out,
            c if inv_t is None else inv_t,  # never read when ROW_TEMPERATURE is off
            N, V, rows_per_group,
            stride_g, stride_n, out_stride_g, out_stride_n,
            scalar,
            HAS_ENTROPY=has_entropy, BLOCK_N=cfg.BLOCK_N, BLOCK_V=cfg.BLOCK_V, ROW_TEMPERATURE=inv_t is not None,
            num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )
    if inplace and out is not logits:
        # logits with a non-unit V stride were computed through a contiguous copy
        logits.copy_(out)
        return logits
    return out


def aot_specs():
    """One AotSpec per (logits dtype, HAS_ENTROPY, tier) the launcher can pick (in place or not: same code)."""
    specs = []
    for dtype in TRITON_DTYPES.values():
        for has_entropy in (False, True):
            for row_t in (False, True):
                for cfg in all_vocab_configs():
                    constexprs = {"HAS_ENTROPY": has_entropy, "BLOCK_N": cfg.BLOCK_N, "BLOCK_V": cfg.BLOCK_V,
                                  "ROW_TEMPERATURE": row_t}
                    signature = {
                        "logits_ptr": f"*{dtype}", "labels_ptr": "*i64", "row_max_ptr": "*fp32",
                        "log_norm_ptr": "*fp32", "entropy_ptr": "*fp32", "coef_logprob_ptr": "*fp32",
                        "coef_entropy_ptr": "*fp32", "dlogits_ptr": f"*{dtype}", "inv_t_ptr": "*fp32", "N": "i32",
                        "V": "i32", "rows_per_group": "i32", "stride_logits_g": "i64", "stride_logits_n": "i32",
                        "stride_dlogits_g": "i64", "stride_dlogits_n": "i32", "temperature": "fp32",
                        **{k: "constexpr" for k in constexprs},
                    }
                    specs.append(AotSpec(
                        name=(f"token_grad_bwd[{dtype},BLOCK_N={cfg.BLOCK_N},BLOCK_V={cfg.BLOCK_V},"
                              f"HAS_ENTROPY={int(has_entropy)},ROW_TEMPERATURE={int(row_t)}]"),
                        fn=_token_grad_bwd_kernel, signature=signature, constexprs=constexprs,
                        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
                        # what the JIT sees on a real launch: 16-byte aligned allocations, V % 16 == 0
                        aligned=("logits_ptr", "labels_ptr", "row_max_ptr", "log_norm_ptr", "entropy_ptr",
                                 "coef_logprob_ptr", "coef_entropy_ptr", "dlogits_ptr", "inv_t_ptr", "V",
                                 "stride_logits_g", "stride_logits_n", "stride_dlogits_g", "stride_dlogits_n"),
                    ))
    return specs
