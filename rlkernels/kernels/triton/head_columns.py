"""The sampler's top-k (SPEC §9.1) beside the plain passes: the head's log-probs after the forward (k reads per row:
`head_logprobs_fwd`), and the head's columns of the backward: over a plain backward's dlogits for the
coefficient c + sum_j C_j (token_grad_bwd), each row's k ids and its label get their exact gradient

    dz_v = ( a_v - (c + sum_j C_j) p_v - e p_v (log p_v + H) ) / T,   a_v = c 1[v = y] + sum_j C_j 1[v = h_j],

formed in fp32 and rounded once (the target's 1 - p is never a rounded -c p plus c). k + 1 reads and writes per row,
one launch: the fix-ups the torch backend makes with ~60 ops around the kernel (backends/torch_backend.py).
"""

import torch
import triton
import triton.language as tl

from ..temperature import row_temperature
from .aot_spec import AotSpec
from .tl_math import TRITON_DTYPES, grouped_rows, row_block_labels, row_inverse_temperature
from .token_stats import device_guard, grouped_strides

BLOCK_N, BLOCK_K = 16, 32


@triton.jit
def _head_columns_kernel(
    # data ptrs
    logits_ptr, labels_ptr, ids_ptr, row_max_ptr, log_norm_ptr, entropy_ptr, coef_logprob_ptr, coef_total_ptr,
    coef_head_ptr, coef_entropy_ptr, dlogits_ptr, inv_t_ptr,
    # shapes
    N, V, K, rows_per_group,
    # strides
    stride_logits_g, stride_logits_n, stride_dlogits_g, stride_dlogits_n,
    # scalars
    temperature,
    # constexpr
    HAS_ENTROPY: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, ROW_TEMPERATURE: tl.constexpr = False,
):
    # Long on purpose: a row's three steps (its label's coefficient and whether it carries any, the label's column,
    # the ids' columns) stay in one program, so that each column has one writer.
    # One program per BLOCK_N rows (rows on grid axis 0). Each column is written once: an id equal to the label is
    # the label's column, written with the label's a = c + C_j (two stores of one address by two threads would race,
    # and their values could differ by a contraction). Pads (-1), ids outside [0, V) and rows outside the loss write
    # nothing (the plain backward's values stay).
    offs_n, mask_n, labels, active = row_block_labels(labels_ptr, N, V, BLOCK_N)
    has_label = mask_n & (labels >= 0) & (labels < V)
    c = tl.load(coef_logprob_ptr + offs_n, mask=active, other=0.0)
    c_total = tl.load(coef_total_ptr + offs_n, mask=active, other=0.0)  # the plain backward's p coefficient
    if HAS_ENTROPY:
        e = tl.load(coef_entropy_ptr + offs_n, mask=active, other=0.0)
        h = tl.load(entropy_ptr + offs_n, mask=active, other=0.0)
    row_max = tl.load(row_max_ptr + offs_n, mask=active, other=0.0)
    log_norm = tl.load(log_norm_ptr + offs_n, mask=active, other=0.0)
    log_norm = tl.where(log_norm == float("-inf"), float("inf"), log_norm)  # no distribution: p = 0
    inv_t = row_inverse_temperature(inv_t_ptr, offs_n, mask_n, temperature, BLOCK_N, ROW_TEMPERATURE)
    in_ptrs = grouped_rows(logits_ptr, offs_n, rows_per_group, stride_logits_g, stride_logits_n)
    out_ptrs = grouped_rows(dlogits_ptr, offs_n, rows_per_group, stride_dlogits_g, stride_dlogits_n)

    # the label's own a: c plus the coefficient of an id equal to it (ids are distinct within a row); and whether the
    # row has any coefficient: one without stays exactly 0, as the plain backward left it, whatever its p (NaN on a
    # row holding a NaN logit, one the rollout correction rejected)
    matched = tl.zeros([BLOCK_N], tl.float32)
    any_head = tl.zeros([BLOCK_N], tl.int32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        slot = active[:, None] & (offs_k[None, :] < K)
        ids = tl.load(ids_ptr + offs_n[:, None] * K + offs_k[None, :], mask=slot, other=-1)
        coef = tl.load(coef_head_ptr + offs_n[:, None] * K + offs_k[None, :], mask=slot, other=0.0)
        matched += tl.sum(tl.where(ids == labels[:, None], coef, 0.0), axis=1)
        any_head = tl.maximum(any_head, tl.max(tl.where(coef != 0.0, 1, 0), axis=1))
    carries = (c != 0.0) | (any_head > 0)
    if HAS_ENTROPY:
        carries = carries | (e != 0.0)
    active = active & carries
    has_label = has_label & carries

    # the label's column
    # (names of their own: a name the loop below reassigns must keep its shape, the compiler checks it)
    z_y = tl.load(in_ptrs + labels, mask=has_label, other=float("-inf")).to(tl.float32)
    log_p_y = (z_y - row_max) * inv_t - log_norm
    p_y = tl.exp(log_p_y)
    value_y = (c + matched) - c_total * p_y
    if HAS_ENTROPY:
        value_y = value_y - tl.where(p_y > 0.0, e * p_y * (log_p_y + h), 0.0)
    tl.store(out_ptrs + labels, (value_y * inv_t).to(dlogits_ptr.dtype.element_ty), mask=has_label)

    # the ids' columns
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        slot = active[:, None] & (offs_k[None, :] < K)
        ids = tl.load(ids_ptr + offs_n[:, None] * K + offs_k[None, :], mask=slot, other=-1)
        coef = tl.load(coef_head_ptr + offs_n[:, None] * K + offs_k[None, :], mask=slot, other=0.0)
        write = slot & (ids >= 0) & (ids < V) & (ids != labels[:, None])
        z = tl.load(in_ptrs[:, None] + ids, mask=write, other=float("-inf")).to(tl.float32)
        log_p = (z - row_max[:, None]) * inv_t[:, None] - log_norm[:, None]
        p = tl.exp(log_p)
        value = coef - c_total[:, None] * p
        if HAS_ENTROPY:
            value = value - tl.where(p > 0.0, e[:, None] * p * (log_p + h[:, None]), 0.0)
        tl.store(out_ptrs[:, None] + ids, (value * inv_t[:, None]).to(dlogits_ptr.dtype.element_ty), mask=write)


@triton.jit
def _head_logprobs_kernel(
    logits_ptr, labels_ptr, ids_ptr, row_max_ptr, log_norm_ptr, out_ptr, inv_t_ptr,
    N, V, K, rows_per_group, stride_logits_g, stride_logits_n, temperature,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, ROW_TEMPERATURE: tl.constexpr = False,
):
    # log p_j = (z_j - row_max) / T - log_norm from the pass's normaliser (backends.base.head_logprobs): -inf at
    # pads, at ids past V, at ids whose logit is -inf (or NaN) and on rows without a distribution (a NaN normaliser
    # stays NaN); 0 on rows outside the pass. [N, K] float32 out, contiguous.
    offs_n, mask_n, labels, active = row_block_labels(labels_ptr, N, V, BLOCK_N)
    row_max = tl.load(row_max_ptr + offs_n, mask=active, other=0.0)
    log_norm = tl.load(log_norm_ptr + offs_n, mask=active, other=0.0)
    has_distribution = active & (log_norm != float("-inf"))
    inv_t = row_inverse_temperature(inv_t_ptr, offs_n, mask_n, temperature, BLOCK_N, ROW_TEMPERATURE)
    in_ptrs = grouped_rows(logits_ptr, offs_n, rows_per_group, stride_logits_g, stride_logits_n)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        slot = mask_n[:, None] & (offs_k[None, :] < K)
        ids = tl.load(ids_ptr + offs_n[:, None] * K + offs_k[None, :], mask=slot & active[:, None], other=-1)
        read = has_distribution[:, None] & (ids >= 0) & (ids < V)
        z = tl.load(in_ptrs[:, None] + ids, mask=read, other=float("-inf")).to(tl.float32)
        lp = tl.where(z > float("-inf"), (z - row_max[:, None]) * inv_t[:, None] - log_norm[:, None],
                      float("-inf"))
        lp = tl.where(active[:, None], lp, 0.0)
        tl.store(out_ptr + offs_n[:, None] * K + offs_k[None, :], lp, mask=slot)


def head_logprobs_fwd(logits: torch.Tensor, labels: torch.Tensor, head_ids: torch.Tensor, row_max: torch.Tensor,
                      log_norm: torch.Tensor, temperature) -> torch.Tensor:
    """[N, k] float32 log p at head_ids (-1 pads) of logits (N, V) or (B, T, V) with unit stride along V, from the
    forward's row_max and log_norm ([N] float32); temperature: T or an [N] tensor (see the kernel)."""
    V = logits.shape[-1]
    N = labels.shape[0]
    K = head_ids.shape[1]
    out = torch.empty(N, K, dtype=torch.float32, device=logits.device)
    if N == 0 or K == 0:
        return out
    f32 = lambda t: t.to(torch.float32).contiguous()  # noqa: E731
    rows_per_group, stride_g, stride_n = grouped_strides(logits)
    scalar, inv_t = row_temperature(temperature)
    row_max = f32(row_max)
    with device_guard(logits):
        _head_logprobs_kernel[(triton.cdiv(N, BLOCK_N),)](
            logits, labels.to(torch.int64).contiguous(), head_ids.to(torch.int64).contiguous(), row_max,
            f32(log_norm), out, row_max if inv_t is None else inv_t, N, V, K, rows_per_group, stride_g, stride_n,
            scalar, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, ROW_TEMPERATURE=inv_t is not None,
        )
    return out


def write_head_columns(logits: torch.Tensor, dlogits: torch.Tensor, labels: torch.Tensor, head_ids: torch.Tensor,
                       row_max: torch.Tensor, log_norm: torch.Tensor, entropy, coef_logprob: torch.Tensor,
                       coef_total: torch.Tensor, coef_head: torch.Tensor, coef_entropy, temperature) -> None:
    """Overwrite dlogits' head columns in place (see the module docstring). logits / dlogits: (N, V) or (B, T, V)
    with unit stride along V; labels [N]; head_ids [N, k] (-1 pads, distinct within a row); row_max, log_norm,
    entropy (or None), c, c + sum_j C_j [N] and C [N, k] (0 at pads, rows outside, ids without mass); temperature:
    T or an [N] tensor."""
    V = logits.shape[-1]
    N = logits.numel() // V if V else 0
    K = head_ids.shape[1] if head_ids.dim() == 2 else 0
    if N == 0 or K == 0 or V == 0:
        return
    f32 = lambda t: t.to(torch.float32).contiguous()  # noqa: E731
    has_entropy = coef_entropy is not None
    c = f32(coef_logprob)
    rows_per_group, stride_g, stride_n = grouped_strides(logits)
    _, out_stride_g, out_stride_n = grouped_strides(dlogits)
    scalar, inv_t = row_temperature(temperature)
    with device_guard(logits):
        _head_columns_kernel[(triton.cdiv(N, BLOCK_N),)](
            logits, labels.to(torch.int64).contiguous(), head_ids.to(torch.int64).contiguous(), f32(row_max),
            f32(log_norm), f32(entropy) if has_entropy else c, c, f32(coef_total), f32(coef_head),
            f32(coef_entropy) if has_entropy else c, dlogits, c if inv_t is None else inv_t,
            N, V, K, rows_per_group, stride_g, stride_n, out_stride_g, out_stride_n, scalar,
            HAS_ENTROPY=has_entropy, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, ROW_TEMPERATURE=inv_t is not None,
        )


def aot_specs():
    """One AotSpec per (logits dtype, HAS_ENTROPY, ROW_TEMPERATURE) the launchers can pick."""
    specs = []
    for dtype in TRITON_DTYPES.values():
        for row_t in (False, True):
            constexprs = {"BLOCK_N": BLOCK_N, "BLOCK_K": BLOCK_K, "ROW_TEMPERATURE": row_t}
            signature = {
                "logits_ptr": f"*{dtype}", "labels_ptr": "*i64", "ids_ptr": "*i64", "row_max_ptr": "*fp32",
                "log_norm_ptr": "*fp32", "out_ptr": "*fp32", "inv_t_ptr": "*fp32", "N": "i32", "V": "i32",
                "K": "i32", "rows_per_group": "i32", "stride_logits_g": "i64", "stride_logits_n": "i32",
                "temperature": "fp32", **{k: "constexpr" for k in constexprs},
            }
            specs.append(AotSpec(
                name=f"head_logprobs_fwd[{dtype},ROW_TEMPERATURE={int(row_t)}]", fn=_head_logprobs_kernel,
                signature=signature, constexprs=constexprs, num_warps=4, num_stages=1,
                aligned=("logits_ptr", "labels_ptr", "ids_ptr", "row_max_ptr", "log_norm_ptr", "out_ptr",
                         "inv_t_ptr", "V", "stride_logits_g", "stride_logits_n"),
            ))
        for has_entropy in (False, True):
            for row_t in (False, True):
                constexprs = {"HAS_ENTROPY": has_entropy, "BLOCK_N": BLOCK_N, "BLOCK_K": BLOCK_K,
                              "ROW_TEMPERATURE": row_t}
                signature = {
                    "logits_ptr": f"*{dtype}", "labels_ptr": "*i64", "ids_ptr": "*i64", "row_max_ptr": "*fp32",
                    "log_norm_ptr": "*fp32", "entropy_ptr": "*fp32", "coef_logprob_ptr": "*fp32",
                    "coef_total_ptr": "*fp32", "coef_head_ptr": "*fp32", "coef_entropy_ptr": "*fp32",
                    "dlogits_ptr": f"*{dtype}", "inv_t_ptr": "*fp32", "N": "i32", "V": "i32", "K": "i32",
                    "rows_per_group": "i32", "stride_logits_g": "i64", "stride_logits_n": "i32",
                    "stride_dlogits_g": "i64", "stride_dlogits_n": "i32", "temperature": "fp32",
                    **{k: "constexpr" for k in constexprs},
                }
                specs.append(AotSpec(
                    name=f"head_columns[{dtype},HAS_ENTROPY={int(has_entropy)},ROW_TEMPERATURE={int(row_t)}]",
                    fn=_head_columns_kernel, signature=signature, constexprs=constexprs, num_warps=4, num_stages=1,
                    aligned=("logits_ptr", "labels_ptr", "ids_ptr", "row_max_ptr", "log_norm_ptr", "entropy_ptr",
                             "coef_logprob_ptr", "coef_total_ptr", "coef_head_ptr", "coef_entropy_ptr",
                             "dlogits_ptr", "inv_t_ptr", "V", "stride_logits_g", "stride_logits_n",
                             "stride_dlogits_g", "stride_dlogits_n"),
                ))
    return specs
