"""Token statistics forward (SPEC §2): (row_max, log_norm), logprob, and on request entropy and sum p^2,
from one read of the [N, V] logits."""

import contextlib
from typing import NamedTuple, Optional

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
    full_block,
    grouped_rows,
    row_inverse_temperature,
    slot_merge,
    slot_update,
    vocab_config,
)


@triton.jit
def row_stream(row_ptrs, rows_in, V, k, HAS_ENTROPY: tl.constexpr, HAS_SUM_PI_SQUARED: tl.constexpr,
               CHAIN: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, VECTOR: tl.constexpr,
               STAGES: tl.constexpr):
    """The stream of BLOCK_N rows' logits: each VECTOR-wide slot's running (max, sum e, sum e d, sum e^2)
    (`tl_math.slot_update`), for `slot_merge` to merge once per row. `rows_in`: [BLOCK_N] the rows that read (a
    tile with none skips the stream entirely). Full blocks load unmasked but for the row mask, one masked tail
    follows; STAGES > 1 prefetches blocks through shared memory (cp.async). The forward kernel's and the gradient
    formed in the forward's (forward_grad.py), which must reproduce its statistics bit for bit."""
    SLOTS: tl.constexpr = BLOCK_V // VECTOR
    cols = tl.arange(0, SLOTS)[:, None] * VECTOR + tl.arange(0, VECTOR)[None, :]  # [SLOTS, VECTOR]
    block_ptrs = row_ptrs[:, None, None] + cols[None, :, :]
    rows_in_3d = rows_in[:, None, None]
    m = tl.full([BLOCK_N, SLOTS], float("-inf"), tl.float32)
    sum_e = tl.zeros([BLOCK_N, SLOTS], tl.float32)
    sum_ed = tl.zeros([BLOCK_N, SLOTS], tl.float32)
    sum_e2 = tl.zeros([BLOCK_N, SLOTS], tl.float32)
    v_stop = V * tl.max(rows_in.to(tl.int32), axis=0)
    v_full = (v_stop // BLOCK_V) * BLOCK_V
    for v0 in tl.range(0, v_full, BLOCK_V, num_stages=STAGES):
        z = full_block(block_ptrs + v0, rows_in_3d, BLOCK_N)
        m, sum_e, sum_ed, sum_e2 = slot_update(z, m, sum_e, sum_ed, sum_e2, k, HAS_ENTROPY, HAS_SUM_PI_SQUARED, CHAIN)
    if v_full < v_stop:
        tail = rows_in_3d & ((v_full + cols)[None, :, :] < V)
        z = tl.load(block_ptrs + v_full, mask=tail, other=float("-inf")).to(tl.float32)
        m, sum_e, sum_ed, sum_e2 = slot_update(z, m, sum_e, sum_ed, sum_e2, k, HAS_ENTROPY, HAS_SUM_PI_SQUARED, CHAIN)
    return m, sum_e, sum_ed, sum_e2


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
    ROW_TEMPERATURE: tl.constexpr = False, VECTOR: tl.constexpr = 8, STAGES: tl.constexpr = 1,
):
    # One program per BLOCK_N rows (grid (cdiv(N, BLOCK_N),), rows on axis 0 only) reads each logit once
    # (N*V*sizeof(dtype) bytes) and writes 3-5 fp32 per row. The loop is written for instruction economy (the
    # H200 issues ~15 thread-instructions per bf16 element at its copy rate): each thread keeps running statistics
    # per VECTOR-wide slot (`tl_math.slot_update`), so no block-wide reduction or barrier runs inside it, and the slots
    # merge once per row after it; full blocks load unmasked but for the row mask (uniform over a vector), one
    # masked tail follows; STAGES > 1 prefetches blocks through shared memory (cp.async). Hazards: -inf is the
    # max identity and a -inf max is never subtracted (safe_shift); p*d terms with p = 0 are 0, not 0 * -inf;
    # skipped rows (label outside [0, V)) read no logits when a program holds one row (every LLM vocabulary).
    # a slot of one 16-byte load (one thread's): its sums as FFMA chains (tl_math.lane_dot)
    CHAIN: tl.constexpr = VECTOR * logits_ptr.dtype.element_ty.primitive_bitwidth == 128
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
    k = inv_t * LOG2E
    # the target logit is read before the stream, so its latency hides behind it
    z_y = tl.load(row_ptrs + labels, mask=has_target, other=0.0).to(tl.float32)

    m, sum_e, sum_ed, sum_e2 = row_stream(row_ptrs, active, V, k, HAS_ENTROPY, HAS_SUM_PI_SQUARED, CHAIN, BLOCK_N,
                                          BLOCK_V, VECTOR, STAGES)

    # the slots merged, once per row (`slot_merge`)
    row_max, row_sum_e, dm, beta = slot_merge(m, sum_e, k)

    # A row without a finite entry has no distribution: row_max 0, log_norm -inf, logprob -inf,
    # entropy 0 and sum p^2 0, never NaN (the torch backend's convention). A NaN or +inf logit makes row_sum_e NaN,
    # which stays in every statistic (`!=`, not `>`: NaN != 0 holds), as in the CUDA and C++ kernels.
    has_mass = row_sum_e != 0.0
    log_norm = tl.log(row_sum_e)
    logprob = tl.where(has_mass, (z_y - row_max) * inv_t - log_norm, float("-inf"))
    tl.store(row_max_ptr + offs_n, tl.where(active, row_max, 0.0), mask=mask_n)
    tl.store(log_norm_ptr + offs_n, tl.where(active, log_norm, 0.0), mask=mask_n)
    tl.store(logprobs_ptr + offs_n, tl.where(has_target, logprob, 0.0), mask=mask_n)
    if HAS_ENTROPY:
        # H = lse - sum p (z - row_max) / T = ln(sum_e) - ln(2) sum_ed / sum_e, both over the row's shift
        row_sum_ed = tl.sum(beta * (sum_ed + dm * sum_e), axis=1)
        entropy = log_norm - LN2 * row_sum_ed / row_sum_e
        tl.store(entropy_ptr + offs_n, tl.where(active & has_mass, entropy, 0.0), mask=mask_n)
    if HAS_SUM_PI_SQUARED:
        row_sum_e2 = tl.sum(beta * beta * sum_e2, axis=1)
        sum_pi_squared = row_sum_e2 / (row_sum_e * row_sum_e)
        tl.store(sum_pi_squared_ptr + offs_n, tl.where(active & has_mass, sum_pi_squared, 0.0), mask=mask_n)


# The stream's shape per launch configuration. VECTOR: a slot's contiguous logits, one 16-byte load (8 bf16 / fp16,
# 4 fp32), so that a slot is one thread's and its sums chain in its registers (with 8 fp32 a slot spanned two
# threads: shuffles in the loop, 8.7 and 14.7 SASS instructions per element plain and with entropy and sum p^2 on
# sm_90, against 7.6 and 12.2 with 4). STAGES: blocks prefetched through shared memory (cp.async) where a program
# streams one row in many blocks. It stays 1 until a GPU measures it: on sm_90 three stages add 1.8 SASS
# instructions per bf16 element and 2 barriers to the loop (the H200's issue budget at its copy rate is ~15.6 per
# element), while 4 CTAs of 16 warps per SM, 32 bytes in flight per thread, already hold ~64 KiB of loads per SM.
SLOT_BYTES = 16
STREAM_STAGES = 1


def stream_shape(cfg, element_size: int) -> dict:
    """The forward kernel's VECTOR and STAGES constexprs for a VocabConfig and the logits' element size (see
    SLOT_BYTES, STREAM_STAGES)."""
    streams = cfg.BLOCK_N == 1 and cfg.BLOCK_V >= 4096
    return dict(VECTOR=min(SLOT_BYTES // element_size, cfg.BLOCK_V), STAGES=STREAM_STAGES if streams else 1)


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
            **stream_shape(cfg, logits.element_size()),
            num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )
    return TokenStatsResult(row_max, log_norm, logprobs, entropy, sum_pi_squared)


# The hot loop's static gate on sm_90 (aot.LOOP_GATE_TARGET), SASS instructions per element by (logits dtype
# width, HAS_ENTROPY, HAS_SUM_PI_SQUARED), for the tiers whose program streams one row: the most either compiler
# reaches (Triton 3.9, or 3.6, the device image's): bf16 8.25 / 9.5 / 10.75 / 12.0, fp16 a quarter less, fp32
# 7.7 / 9.2 / 10.7 / 12.6. The block-reduction loop the rewrite replaced spent 15.3 and 23.7 with 4 and 8 barriers;
# its first form 8.75 and 13.25, before the unmasked full blocks (-0.5), the FFMA chains (-0.75 with entropy and
# sum p^2) and float32's one-thread slots (-1 to -2.5). A quarter of an instruction above, rounded up to the next
# quarter, so that a compiler release may move it slightly and a regression fails. No barrier, no non-ftz ex2.
FORWARD_LOOP_GATES = {
    (16, False, False): 8.5, (16, False, True): 9.75, (16, True, False): 11.0, (16, True, True): 12.25,
    (32, False, False): 8.0, (32, False, True): 9.5, (32, True, False): 11.0, (32, True, True): 13.0,
}


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
                            **stream_shape(cfg, 4 if dtype == "fp32" else 2),
                        }
                        gate = None
                        if cfg.BLOCK_N == 1:
                            width = 32 if dtype == "fp32" else 16
                            gate = LoopGate(elements=cfg.BLOCK_V // (32 * cfg.num_warps),
                                            per_element=FORWARD_LOOP_GATES[width, has_entropy, has_s2],
                                            staged=constexprs["STAGES"] > 1)
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
                            fn=_token_stats_fwd_kernel, signature=signature, constexprs=constexprs, loop_gate=gate,
                            num_warps=cfg.num_warps, num_stages=cfg.num_stages,
                            # what the JIT sees on a real launch: torch allocations are 16-byte aligned and
                            # LLM vocabularies (and so the row stride) are multiples of 16
                            aligned=("logits_ptr", "labels_ptr", "row_max_ptr", "log_norm_ptr", "logprobs_ptr",
                                     "entropy_ptr", "sum_pi_squared_ptr", "inv_t_ptr", "V", "stride_logits_g",
                                     "stride_logits_n"),
                        ))
    return specs
