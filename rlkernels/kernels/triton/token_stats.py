"""Token statistics forward (SPEC §2): (row_max, log_norm), logprob, and on request entropy and sum p^2,
from one read of the [N, V] logits."""

import contextlib
from typing import NamedTuple, Optional

import torch
import triton
import triton.language as tl

from ..temperature import row_temperature
from .aot_spec import AotSpec
from .tl_math import TRITON_DTYPES, all_vocab_configs, grouped_rows, row_inverse_temperature, safe_shift, vocab_config


@triton.jit
def _token_stats_fwd_kernel(
    # data ptrs
    logits_ptr, labels_ptr, row_max_ptr, log_norm_ptr, logprobs_ptr, entropy_ptr, sum_pi_squared_ptr,
    inv_t_ptr,  # (N,) 1 / T per row when ROW_TEMPERATURE
    # shapes
    N, V, rows_per_group,
    # strides
    stride_logits_g, stride_logits_n,
    # scalars
    temperature,
    # constexpr
    HAS_ENTROPY: tl.constexpr, HAS_SUM_PI_SQUARED: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr,
    ROW_TEMPERATURE: tl.constexpr = False,
):
    # One program per BLOCK_N rows (grid (cdiv(N, BLOCK_N),), rows on axis 0 only): an online max /
    # sum-exp over BLOCK_V-wide blocks reads each logit once (N*V*sizeof(dtype) bytes) and writes 3-5
    # fp32 per row. Hazards: -inf is the max identity and a -inf max is never subtracted (safe_shift);
    # p*zs terms with p = 0 are 0, not 0 * -inf; skipped rows (label outside [0, V)) read no logits.
    pid_n = tl.program_id(0).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    labels = tl.load(labels_ptr + offs_n, mask=mask_n, other=-1)
    # label -2: the target lies in another vocabulary shard (ops/vocab_parallel.py): the row's
    # statistics are computed, its logprob is not
    has_target = mask_n & (labels >= 0) & (labels < V)
    active = has_target | (mask_n & (labels == -2))
    row_ptrs = grouped_rows(logits_ptr, offs_n, rows_per_group, stride_logits_g, stride_logits_n)
    inv_t = row_inverse_temperature(inv_t_ptr, offs_n, mask_n, temperature, BLOCK_N, ROW_TEMPERATURE)

    # m_i: running max of the raw logits z (T > 0 keeps the argmax); with shift = safe_shift(m_i),
    # d = (z - shift) / T is exact up to one rounding of the product (Sterbenz), and
    # l_i = sum exp(d), t_i = sum exp(d) * d, s_i = sum exp(2 d), rescaled whenever the shift moves.
    # Entropy from t_i (not lse - sum p * zs) stays free of cancellation under large common offsets.
    m_i = tl.full([BLOCK_N], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_N], tl.float32)
    t_i = tl.zeros([BLOCK_N], tl.float32)
    s_i = tl.zeros([BLOCK_N], tl.float32)
    # a tile with no active row skips the loop entirely (not one masked iteration per block)
    v_stop = V * tl.max(active.to(tl.int32), axis=0)
    for v0 in range(0, v_stop, BLOCK_V):
        offs_v = v0 + tl.arange(0, BLOCK_V)
        mask = active[:, None] & (offs_v[None, :] < V)
        # padding feeds a max: -inf (its exp is an exact 0 in every sum)
        z = tl.load(row_ptrs[:, None] + offs_v[None, :], mask=mask, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m_i, tl.max(z, axis=1))
        shift = safe_shift(m_new)
        dm = (m_i - shift) * inv_t  # -inf while no finite entry was seen: alpha = 0 and l = t = s = 0
        alpha = tl.exp(dm)
        d = (z - shift[:, None]) * inv_t[:, None]
        ex = tl.exp(d)
        if HAS_ENTROPY:
            # re-centre t on the new shift, t' = alpha * (t + dm * l); the l_i > 0 guard stops the
            # (-inf) * 0 of the first block with a finite entry. ex = 0 terms add 0, not 0 * -inf.
            t_i = alpha * (t_i + tl.where(l_i > 0, dm, 0.0) * l_i) + tl.sum(tl.where(ex > 0, ex * d, 0.0), axis=1)
        if HAS_SUM_PI_SQUARED:
            s_i = alpha * alpha * s_i + tl.sum(ex * ex, axis=1)
        l_i = alpha * l_i + tl.sum(ex, axis=1)
        m_i = m_new

    # A row without a finite entry has no distribution: row_max 0, log_norm -inf, logprob -inf,
    # entropy 0 and sum p^2 0, never NaN (the torch backend's convention). A NaN or +inf logit makes l_i NaN,
    # which stays in every statistic (`!=`, not `>`: NaN != 0 holds), as in the CUDA and C++ kernels.
    has_mass = l_i != 0.0
    row_max = safe_shift(m_i)
    log_norm = tl.log(l_i)
    z_y = tl.load(row_ptrs + labels, mask=has_target, other=0.0).to(tl.float32)
    logprob = tl.where(has_mass, (z_y - row_max) * inv_t - log_norm, float("-inf"))
    tl.store(row_max_ptr + offs_n, tl.where(active, row_max, 0.0), mask=mask_n)
    tl.store(log_norm_ptr + offs_n, tl.where(active, log_norm, 0.0), mask=mask_n)
    tl.store(logprobs_ptr + offs_n, tl.where(has_target, logprob, 0.0), mask=mask_n)
    if HAS_ENTROPY:
        # H = lse - sum p zs = log l - t / l
        tl.store(entropy_ptr + offs_n, tl.where(active & has_mass, log_norm - t_i / l_i, 0.0), mask=mask_n)
    if HAS_SUM_PI_SQUARED:
        tl.store(sum_pi_squared_ptr + offs_n, tl.where(active & has_mass, s_i / (l_i * l_i), 0.0), mask=mask_n)


class TokenStatsResult(NamedTuple):
    """What the launcher returns, field for field backends.base.RowStats (kernels import nothing above them)."""

    row_max: torch.Tensor
    log_norm: torch.Tensor
    logprobs: torch.Tensor
    entropy: Optional[torch.Tensor]
    sum_pi_squared: Optional[torch.Tensor]


def grouped_strides(logits: torch.Tensor):
    """(rows per group, group stride, row stride) of (N, V) or (B, T, V) logits: flat row n starts at
    (n // rows) * group_stride + (n % rows) * row_stride."""
    if logits.dim() == 2:
        return max(logits.shape[0], 1), 0, logits.stride(0)
    return max(logits.shape[1], 1), logits.stride(0), logits.stride(1)


def device_guard(t: torch.Tensor):
    # Triton launches on the current CUDA device; logits on cuda:1 need it switched
    return torch.cuda.device(t.device) if t.is_cuda else contextlib.nullcontext()


def token_stats_fwd(
    logits: torch.Tensor, labels: torch.Tensor, temperature, compute_entropy: bool,
    compute_sum_pi_squared: bool, *, block_v: int = None, block_n: int = None,
) -> TokenStatsResult:
    """Log-normaliser, logprob (and entropy, sum p^2) of every row of softmax(logits / T) in one pass (SPEC §2).

    Args:
        logits: (N, V) or (B, T, V) float16/bfloat16/float32, any strides (copied only if the V stride is not 1).
        labels: (N,) integer; rows with a label outside [0, V) give 0 everywhere and are not read.
        temperature: T > 0, passed to the kernel as an fp32 run-time scalar; or an (N,) tensor of per-row
            temperatures (a per-token temperature), passed as 1 / T in float32.
        block_v, block_n: test hooks overriding the launch heuristic (powers of two).
    Returns:
        TokenStatsResult(row_max, log_norm, logprobs, entropy, sum_pi_squared), (N,) float32 each, with
        lse = row_max / T + log_norm kept in two parts (see backends.base.RowStats); entropy /
        sum_pi_squared are None unless requested.
    """
    if logits.dim() not in (2, 3):
        raise ValueError(f"logits: expected shape (N, V) or (B, T, V), got {tuple(logits.shape)}")
    if logits.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise TypeError(f"logits: expected float16, bfloat16 or float32 for the Triton backend, got {logits.dtype}")
    V = logits.shape[-1]
    N = logits.numel() // V
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    rows_per_group, stride_g, stride_n = grouped_strides(logits)
    labels = labels.to(torch.int64).contiguous()
    dev = logits.device
    new = lambda: torch.empty(N, dtype=torch.float32, device=dev)  # noqa: E731
    row_max, log_norm, logprobs = new(), new(), new()
    entropy = new() if compute_entropy else None
    sum_pi_squared = new() if compute_sum_pi_squared else None
    if N == 0:
        return TokenStatsResult(row_max, log_norm, logprobs, entropy, sum_pi_squared)
    cfg = vocab_config(V, block_v, block_n)
    grid = (triton.cdiv(N, cfg.BLOCK_N),)
    scalar, inv_t = row_temperature(temperature)
    with device_guard(logits):
        _token_stats_fwd_kernel[grid](
            logits, labels, row_max, log_norm, logprobs,
            logprobs if entropy is None else entropy,  # never written when the flag is off
            logprobs if sum_pi_squared is None else sum_pi_squared,
            logprobs if inv_t is None else inv_t,  # never read when ROW_TEMPERATURE is off
            N, V, rows_per_group,
            stride_g, stride_n,
            scalar,
            HAS_ENTROPY=compute_entropy, HAS_SUM_PI_SQUARED=compute_sum_pi_squared,
            BLOCK_N=cfg.BLOCK_N, BLOCK_V=cfg.BLOCK_V, ROW_TEMPERATURE=inv_t is not None,
            num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )
    return TokenStatsResult(row_max, log_norm, logprobs, entropy, sum_pi_squared)


def aot_specs():
    """One AotSpec per (logits dtype, HAS_ENTROPY, HAS_SUM_PI_SQUARED, tier) the launcher can pick."""
    specs = []
    for dtype in TRITON_DTYPES.values():
        for has_entropy in (False, True):
            for has_s2 in (False, True):
                for row_t in (False, True):
                    for cfg in all_vocab_configs():
                        constexprs = {
                            "HAS_ENTROPY": has_entropy, "HAS_SUM_PI_SQUARED": has_s2,
                            "BLOCK_N": cfg.BLOCK_N, "BLOCK_V": cfg.BLOCK_V, "ROW_TEMPERATURE": row_t,
                        }
                        signature = {
                            "logits_ptr": f"*{dtype}", "labels_ptr": "*i64", "row_max_ptr": "*fp32",
                            "log_norm_ptr": "*fp32", "logprobs_ptr": "*fp32",
                            "entropy_ptr": "*fp32", "sum_pi_squared_ptr": "*fp32", "inv_t_ptr": "*fp32",
                            "N": "i32", "V": "i32", "rows_per_group": "i32", "stride_logits_g": "i64",
                            "stride_logits_n": "i32", "temperature": "fp32",
                            **{k: "constexpr" for k in constexprs},
                        }
                        specs.append(AotSpec(
                            name=(f"token_stats_fwd[{dtype},BLOCK_N={cfg.BLOCK_N},BLOCK_V={cfg.BLOCK_V},"
                                  f"HAS_ENTROPY={int(has_entropy)},HAS_SUM_PI_SQUARED={int(has_s2)},"
                                  f"ROW_TEMPERATURE={int(row_t)}]"),
                            fn=_token_stats_fwd_kernel, signature=signature, constexprs=constexprs,
                            num_warps=cfg.num_warps, num_stages=cfg.num_stages,
                            # what the JIT sees on a real launch: torch allocations are 16-byte aligned and
                            # LLM vocabularies (and so the row stride) are multiples of 16
                            aligned=("logits_ptr", "labels_ptr", "row_max_ptr", "log_norm_ptr", "logprobs_ptr",
                                     "entropy_ptr", "sum_pi_squared_ptr", "inv_t_ptr", "V", "stride_logits_g",
                                     "stride_logits_n"),
                        ))
    return specs
