"""Token gradient backward (SPEC §2): per-row coefficients (c_t, e_t) -> dlogits, one read and one write of [N, V]."""

from typing import Optional

import torch
import triton
import triton.language as tl

from ..temperature import row_temperature
from .aot_spec import AotSpec, LoopGate
from .tl_math import (
    LN2,
    LOG2E,
    TRITON_DTYPES,
    all_vocab_configs,
    grouped_rows,
    row_block_labels,
    row_inverse_temperature,
    vocab_config,
)
from .token_stats import device_guard, grouped_strides


@triton.jit
def _dlogit(z, row_max, k, b, a, q, HAS_ENTROPY: tl.constexpr):
    """dlogits but for the target's + c / T, elementwise (the caller broadcasts the row values): t = log2 p =
    (z - row_max) k - b (one FADD and one FFMA; k = log2(e) / T, b = log2(e) log_norm), p = 2^t (one
    ex2.approx.ftz), g = p (a + q t) with the row's c, e, H and 1/T folded into a and q."""
    t = tl.fma(z - row_max, k, -b)
    p = tl.math.exp2(t)
    if HAS_ENTROPY:
        # where p = 0, t may be -inf: 0 * -256, not 0 * -inf (2^t is an exact 0 below -150, so the floor changes
        # no nonzero term)
        return p * (a + q * tl.maximum(t, -256.0))
    return p * a


@triton.jit
def _grad_block(in_ptrs, out_ptrs, v0, cols, load_mask, store_mask, row_max, k, b, a, q, HAS_ENTROPY: tl.constexpr):
    """`_dlogit` of one [BLOCK_N, BLOCK_V] block, stored; its target column is written again after the blocks."""
    z = tl.load(in_ptrs[:, None] + (v0 + cols)[None, :], mask=load_mask, other=float("-inf")).to(tl.float32)
    g = _dlogit(z, row_max[:, None], k[:, None], b[:, None], a[:, None], q[:, None], HAS_ENTROPY)
    tl.store(out_ptrs[:, None] + (v0 + cols)[None, :], g.to(out_ptrs.dtype.element_ty), mask=store_mask)


@triton.jit
def _row_full_blocks(in_ptrs, out_ptrs, v_lo, v_full, cols, active, row_max, k, b, a, q, HAS_ENTROPY: tl.constexpr,
                     BLOCK_V: tl.constexpr):
    """The full blocks of one row's span (a program of one row, in the grid): loaded and stored unmasked (a masked
    load fills its registers with -inf first: 0.5 SASS instruction per bf16 element on sm_90); a row that carries
    no coefficient writes zeros without reading."""
    if tl.max(active.to(tl.int32), axis=0) != 0:
        for v0 in tl.range(v_lo, v_full, BLOCK_V):
            z = tl.load(in_ptrs[:, None] + (v0 + cols)[None, :]).to(tl.float32)
            g = _dlogit(z, row_max[:, None], k[:, None], b[:, None], a[:, None], q[:, None], HAS_ENTROPY)
            tl.store(out_ptrs[:, None] + (v0 + cols)[None, :], g.to(out_ptrs.dtype.element_ty))
    else:
        zeros = tl.zeros([1, BLOCK_V], out_ptrs.dtype.element_ty)
        for v0 in tl.range(v_lo, v_full, BLOCK_V):
            tl.store(out_ptrs[:, None] + (v0 + cols)[None, :], zeros)


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
    SPLIT: tl.constexpr = 1,
):
    # Grid (cdiv(N, BLOCK_N), cdiv(V, SPLIT * BLOCK_V)): rows on axis 0; each program writes its rows' SPLIT
    # blocks of dlogits = (c (onehot - p) - e p (log p + H)) / T, reading and writing each element once in the
    # logits dtype (dlogits_ptr may alias logits_ptr: a program writes only what it read). Full blocks run with the
    # row mask alone (uniform over a vector), one masked tail follows; the row's coefficients are folded once per
    # program, and the target column is written after the blocks. Hazards: log p is formed from
    # (row_max, log_norm) (no fp32 lse); the target column c (1 - p_y) is formed in fp32; p = 0 terms are 0, not
    # 0 * -inf; rows with c = e = 0 or a skipped label read nothing (their -inf padding gives p = 0) and write
    # zeros; a row without a finite logit (log_norm = -inf) gets p = 0, not NaN.
    # label -2: target in another vocabulary shard: the row's gradient without the + c column
    offs_n, mask_n, labels, valid = row_block_labels(labels_ptr, N, V, BLOCK_N)
    c = tl.load(coef_logprob_ptr + offs_n, mask=valid, other=0.0)
    inv_t = row_inverse_temperature(inv_t_ptr, offs_n, mask_n, temperature, BLOCK_N, ROW_TEMPERATURE)
    if HAS_ENTROPY:
        e = tl.load(coef_entropy_ptr + offs_n, mask=valid, other=0.0)
        active = valid & ((c != 0.0) | (e != 0.0))
        h = tl.load(entropy_ptr + offs_n, mask=active, other=0.0)
        # g = -p (c + e (ln p + H)) / T = p (a + q t), ln p = t ln 2: a = -(c + e H) / T, q = -e ln(2) / T
        a = -(c + e * h) * inv_t
        q = -e * LN2 * inv_t
    else:
        active = valid & (c != 0.0)
        a = -c * inv_t
        q = a  # unused
    row_max = tl.load(row_max_ptr + offs_n, mask=active, other=0.0)
    log_norm = tl.load(log_norm_ptr + offs_n, mask=active, other=0.0)
    # a row without a distribution (log_norm = -inf) takes log_norm = +inf: p = 0 everywhere and
    # the row's gradient is c / T at the target (-inf - -inf would be NaN)
    log_norm = tl.where(log_norm == float("-inf"), float("inf"), log_norm)
    k = inv_t * LOG2E
    b = log_norm * LOG2E
    c_t = c * inv_t
    in_ptrs = grouped_rows(logits_ptr, offs_n, rows_per_group, stride_logits_g, stride_logits_n)
    out_ptrs = grouped_rows(dlogits_ptr, offs_n, rows_per_group, stride_dlogits_g, stride_dlogits_n)

    cols = tl.arange(0, BLOCK_V)
    v_lo = tl.program_id(1) * (SPLIT * BLOCK_V)
    v_hi = tl.minimum(v_lo + SPLIT * BLOCK_V, V)
    v_full = v_lo + ((v_hi - v_lo) // BLOCK_V) * BLOCK_V
    # the target column is written apart, after the blocks, so that no element compares its column with the label;
    # its logit is read first (an in-place backward overwrites it)
    has_target = active & (labels >= v_lo) & (labels < v_hi)
    z_y = tl.load(in_ptrs + labels, mask=has_target, other=0.0).to(tl.float32)
    rows_in, rows_out = active[:, None], mask_n[:, None]
    if BLOCK_N == 1:
        _row_full_blocks(in_ptrs, out_ptrs, v_lo, v_full, cols, active, row_max, k, b, a, q, HAS_ENTROPY, BLOCK_V)
        if v_full < v_hi:
            in_row = (v_full + cols)[None, :] < V
            _grad_block(in_ptrs, out_ptrs, v_full, cols, rows_in & in_row, rows_out & in_row, row_max, k, b, a, q,
                        HAS_ENTROPY)
    else:
        # the stacked tiers' rows fit one block: one masked loop (a body and a tail both compiled took up to 125
        # registers on fp32)
        for v0 in range(v_lo, v_hi, BLOCK_V):
            in_row = (v0 + cols)[None, :] < V
            _grad_block(in_ptrs, out_ptrs, v0, cols, rows_in & in_row, rows_out & in_row, row_max, k, b, a, q,
                        HAS_ENTROPY)
    # every thread's block stores land before the target's: another thread wrote the target column's p_y a
    tl.debug_barrier()
    # the target's g plus c / T in fp32: c (1 - p_y) is rounded once, at its store
    g_y = _dlogit(z_y, row_max, k, b, a, q, HAS_ENTROPY) + c_t
    tl.store(out_ptrs + labels, g_y.to(out_ptrs.dtype.element_ty), mask=has_target)


# Blocks per program where a row streams in many (the tier of LLM vocabularies): 4 x 8192 columns, so a row of
# V = 151,936 takes 5 programs side by side on grid axis 1 (at most cdiv(2^31, 32768) = 65,536 - far below for any
# vocabulary) and each program's per-row loads and coefficients are paid once per 32,768 columns.
GRAD_SPLIT = 4


def grad_split(cfg) -> int:
    """The backward's SPLIT constexpr for a VocabConfig (see GRAD_SPLIT)."""
    return GRAD_SPLIT if cfg.BLOCK_N == 1 and cfg.BLOCK_V >= 8192 else 1


def token_grad_bwd(
    logits: torch.Tensor, labels: torch.Tensor, row_max: torch.Tensor, log_norm: torch.Tensor,
    entropy: Optional[torch.Tensor], coef_logprob: torch.Tensor, coef_entropy: Optional[torch.Tensor],
    temperature, inplace: bool, *, block_v: int = None, block_n: int = None, split: int = None,
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
        block_v, block_n, split: test hooks overriding the launch heuristic (powers of two; blocks per program).
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
    split = grad_split(cfg) if split is None else split
    grid = (triton.cdiv(N, cfg.BLOCK_N), triton.cdiv(V, split * cfg.BLOCK_V))
    scalar, inv_t = row_temperature(temperature)
    with device_guard(logits):
        _token_grad_bwd_kernel[grid](
            src, labels, row_max, log_norm, h, c, e, out,
            c if inv_t is None else inv_t,  # never read when ROW_TEMPERATURE is off
            N, V, rows_per_group,
            stride_g, stride_n, out_stride_g, out_stride_n,
            scalar,
            HAS_ENTROPY=has_entropy, BLOCK_N=cfg.BLOCK_N, BLOCK_V=cfg.BLOCK_V, ROW_TEMPERATURE=inv_t is not None,
            SPLIT=split, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )
    if inplace and out is not logits:
        # logits with a non-unit V stride were computed through a contiguous copy
        logits.copy_(out)
        return logits
    return out


# The hot loop's static gate on sm_90 (aot.LOOP_GATE_TARGET), SASS instructions per element by (logits dtype width,
# HAS_ENTROPY), for the tiers whose program streams one row: the most either compiler reaches (Triton 3.9, or 3.6,
# the device image's: bf16 7.8 and 9.75, fp32 7.0 and 8.4; the loop it replaced spent 20.0 and 25.0, 4 of them on
# a 64-bit label compare per element, and 8.3 and 10.3 with masked loads, whose -inf fill cost 0.5), a quarter of
# an instruction above, rounded up to the next quarter. No barrier in the loop, no non-ftz ex2.
BACKWARD_LOOP_GATES = {(16, False): 8.25, (16, True): 10.0, (32, False): 7.25, (32, True): 8.75}


def aot_specs():
    """One AotSpec per (logits dtype, HAS_ENTROPY, tier) the launcher can pick (in place or not: same code)."""
    specs = []
    for dtype in TRITON_DTYPES.values():
        for has_entropy in (False, True):
            for row_t in (False, True):
                for cfg in all_vocab_configs():
                    constexprs = {"HAS_ENTROPY": has_entropy, "BLOCK_N": cfg.BLOCK_N, "BLOCK_V": cfg.BLOCK_V,
                                  "ROW_TEMPERATURE": row_t, "SPLIT": grad_split(cfg)}
                    signature = {
                        "logits_ptr": f"*{dtype}", "labels_ptr": "*i64", "row_max_ptr": "*fp32",
                        "log_norm_ptr": "*fp32", "entropy_ptr": "*fp32", "coef_logprob_ptr": "*fp32",
                        "coef_entropy_ptr": "*fp32", "dlogits_ptr": f"*{dtype}", "inv_t_ptr": "*fp32", "N": "i32",
                        "V": "i32", "rows_per_group": "i32", "stride_logits_g": "i64", "stride_logits_n": "i32",
                        "stride_dlogits_g": "i64", "stride_dlogits_n": "i32", "temperature": "fp32",
                        **{k: "constexpr" for k in constexprs},
                    }
                    gate = None
                    if cfg.BLOCK_N == 1:
                        gate = LoopGate(elements=cfg.BLOCK_V // (32 * cfg.num_warps),
                                        per_element=BACKWARD_LOOP_GATES[32 if dtype == "fp32" else 16, has_entropy])
                    specs.append(AotSpec(
                        name=(f"token_grad_bwd[{dtype},BLOCK_N={cfg.BLOCK_N},BLOCK_V={cfg.BLOCK_V},"
                              f"HAS_ENTROPY={int(has_entropy)},ROW_TEMPERATURE={int(row_t)}]"),
                        fn=_token_grad_bwd_kernel, signature=signature, constexprs=constexprs, loop_gate=gate,
                        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
                        # what the JIT sees on a real launch: 16-byte aligned allocations, V % 16 == 0
                        aligned=("logits_ptr", "labels_ptr", "row_max_ptr", "log_norm_ptr", "entropy_ptr",
                                 "coef_logprob_ptr", "coef_entropy_ptr", "dlogits_ptr", "inv_t_ptr", "V",
                                 "stride_logits_g", "stride_logits_n", "stride_dlogits_g", "stride_dlogits_n"),
                    ))
    return specs
