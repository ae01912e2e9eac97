"""Device helpers shared by the vocabulary kernels, and the one launch heuristic both passes use.

The heuristic lives here (not in a kernel module) so that the forward and the backward, and their
`aot_specs()`, enumerate the same table: CI compiles exactly the configurations a GPU run can pick.
"""

from typing import NamedTuple, Optional, Tuple

import triton
import triton.language as tl

LOG2E = tl.constexpr(1.4426950408889634)  # exp(x) = 2^(x log2(e)): exp2 lowers to one ex2.approx.ftz
LN2 = tl.constexpr(0.6931471805599453)


@triton.jit
def safe_shift(m_i):
    """The running max as an exp() shift: -inf (no finite entry seen yet) becomes 0.

    Subtracting an infinite max would give (-inf) - (-inf) = NaN on rows (or row prefixes) whose
    entries are all -inf; with shift 0 their exp() terms are exactly 0 and their lse stays -inf.
    """
    return tl.where(m_i == float("-inf"), 0.0, m_i)


@triton.jit
def grouped_rows(base_ptr, offs_n, rows_per_group, stride_g, stride_n):
    """Pointers to the start of rows `offs_n` (int64: N * V > 2^31 happens) of an (N, V) or (B, T, V) tensor: row n
    lies at (n // rows_per_group) * stride_g + (n % rows_per_group) * stride_n, so [B, T, V] views such as the
    causal shift model_out[:, :-1] are read where they lie."""
    return base_ptr + (offs_n // rows_per_group) * stride_g + (offs_n % rows_per_group) * stride_n


@triton.jit
def row_block_labels(labels_ptr, N, V, BLOCK_N: tl.constexpr):
    """This program's BLOCK_N rows (rows on grid axis 0, offsets int64), their bounds mask, their labels (-1 past N)
    and the rows in the pass: a label in [0, V), or -2 (the target in another vocabulary shard: the row's gradient
    without its target column)."""
    offs_n = tl.program_id(0).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    labels = tl.load(labels_ptr + offs_n, mask=mask_n, other=-1)
    in_pass = mask_n & (((labels >= 0) & (labels < V)) | (labels == -2))
    return offs_n, mask_n, labels, in_pass


@triton.jit
def full_block(ptrs, rows_in, BLOCK_N: tl.constexpr):
    """A full block of a streaming loop as float32. One row per program (BLOCK_N = 1): the loop runs only for an
    active row, so the load takes no mask (a masked load fills its registers with -inf first, 0.5 SASS instruction
    per bf16 element on sm_90); stacked rows load with their row mask, -inf off it."""
    if BLOCK_N == 1:
        x = tl.load(ptrs)
    else:
        x = tl.load(ptrs, mask=rows_in, other=float("-inf"))
    return x.to(tl.float32)


@triton.jit
def one_inverse_temperature(temperature, BLOCK_N: tl.constexpr):
    """[BLOCK_N] 1 / T of one temperature (tl.cast: a float64 scalar, from Inductor, must not widen the math:
    Liger #1366)."""
    return tl.full([BLOCK_N], 1.0, tl.float32) / tl.cast(temperature, tl.float32)


@triton.jit
def row_inverse_temperature(inv_t_ptr, offs_n, mask_n, temperature, BLOCK_N: tl.constexpr,
                            ROW_TEMPERATURE: tl.constexpr):
    """[BLOCK_N] 1 / T of rows `offs_n`: each row its own (a per-token temperature, from inv_t_ptr), or one."""
    if ROW_TEMPERATURE:
        inv_t = tl.load(inv_t_ptr + offs_n, mask=mask_n, other=1.0)
    else:
        inv_t = one_inverse_temperature(temperature, BLOCK_N)
    return inv_t


@triton.jit
def slot_update(z, m, sum_e, sum_ed, sum_e2, k, HAS_ENTROPY: tl.constexpr, HAS_SUM_PI_SQUARED: tl.constexpr,
                CHAIN: tl.constexpr = False):
    """One block [BLOCK_N, SLOTS, VECTOR] into the per-slot running statistics [BLOCK_N, SLOTS]: a slot is one
    thread's VECTOR contiguous logits, so every reduction here (axis 2) stays in the thread's registers.

    m: the slot's running max of the raw logits, shift = safe_shift(m); d = (z - shift) k in log2 units (k =
    log2(e) / T folded once, so exp2 lowers to one ex2.approx.ftz), exactly 0 at the max, whose term is an exact 1;
    sum_e = sum 2^d, sum_ed = sum 2^d d, sum_e2 = sum 4^d, rescaled whenever the shift moves. -inf padding adds exact
    zeros; a slot without a finite entry keeps all three at 0. (The one-FFMA exponent fma(z, k, -m k) saves an
    instruction per element, but its shift's rounding puts an ulp of 1 into every log-normaliser, so 1 - p_y of a
    near one-hot row, the target's gradient, loses its exactness; not taken.)"""
    m_new = tl.maximum(m, tl.max(z, axis=2))
    shift = safe_shift(m_new)
    dm = (m - shift) * k[:, None]  # -inf while nothing finite was seen: alpha = 0 and the sums stay 0
    alpha = tl.math.exp2(dm)
    d = (z - shift[:, :, None]) * k[:, None, None]
    ex = tl.math.exp2(d)
    if HAS_ENTROPY:
        # re-centre sum_ed on the new shift, alpha (sum_ed + dm sum_e); the sum_e > 0 guard stops the (-inf) * 0 of
        # a slot's first finite block. Padding and -inf logits (d = -inf, ex = 0) add 0 * -256, not 0 * -inf: 2^d
        # is an exact 0 below -150, so the floor changes no term, and ex * d stays an FFMA (a NaN d gives a NaN ex)
        sum_ed = alpha * (sum_ed + tl.where(sum_e > 0, dm, 0.0) * sum_e)
        if CHAIN:
            sum_ed = lane_dot(ex, tl.maximum(d, -256.0), sum_ed)
        else:
            sum_ed += tl.sum(ex * tl.maximum(d, -256.0), axis=2)
    if HAS_SUM_PI_SQUARED:
        if CHAIN:
            sum_e2 = lane_dot(ex, ex, alpha * alpha * sum_e2)
        else:
            sum_e2 = alpha * alpha * sum_e2 + tl.sum(ex * ex, axis=2)
    sum_e = alpha * sum_e + tl.sum(ex, axis=2)
    return m_new, sum_e, sum_ed, sum_e2


@triton.jit
def _halves(x):
    """[BLOCK_N, SLOTS, 2 W] -> its even and odd lanes, two [BLOCK_N, SLOTS, W] (W >= 2); a slot one thread holds
    moves no data."""
    return tl.split(tl.reshape(x, [x.shape[0], x.shape[1], x.shape[2] // 2, 2]))


@triton.jit
def _pair_dot(a, b, acc):
    """acc + a[..., 0] b[..., 0] + a[..., 1] b[..., 1] for [BLOCK_N, SLOTS, 2] lanes: two FFMAs."""
    a0, a1 = tl.split(a)
    b0, b1 = tl.split(b)
    return tl.fma(a1, b1, tl.fma(a0, b0, acc))


@triton.jit
def lane_dot(a, b, acc):
    """acc + sum(a * b, axis=2) over the lanes of a slot of one 16-byte load (8 of a 16-bit dtype, 4 of float32)
    as one chain of FFMAs, where tl.sum of the products (a tree) spends VECTOR / 2 FMULs and VECTOR / 2 - 1 FADDs
    more (sm_90: 0.5 instruction per element less per sum). Only for lanes one thread holds: the caller decides
    (a slot of 8 float32 spans two threads, and split there, it took shuffles)."""
    a0, a1 = _halves(a)
    b0, b1 = _halves(b)
    if a.shape[2] == 4:
        acc = _pair_dot(a1, b1, _pair_dot(a0, b0, acc))
    else:
        a00, a01 = _halves(a0)
        a10, a11 = _halves(a1)
        b00, b01 = _halves(b0)
        b10, b11 = _halves(b1)
        acc = _pair_dot(a00, b00, acc)
        acc = _pair_dot(a01, b01, acc)
        acc = _pair_dot(a10, b10, acc)
        acc = _pair_dot(a11, b11, acc)
    return acc


@triton.jit
def slot_merge(m, sum_e, k):
    """The slots of `slot_update` merged, once per row: (row_max, row_sum_e, dm, beta). Each slot's sums are
    rescaled by beta = 2^dm, dm = (its max - the row's) k, from its own shift to the row's; a slot without a finite
    entry adds 0. ln(row_sum_e) = ln sum exp((z - row_max) / T). Any other per-slot sum s merges as
    sum(beta * s, axis=1), a log2-unit one as sum(beta * (s + dm * sum_e), axis=1)."""
    row_max = safe_shift(tl.max(m, axis=1))
    dm = tl.where(m != float("-inf"), (m - row_max[:, None]) * k[:, None], 0.0)
    beta = tl.where(m != float("-inf"), tl.math.exp2(dm), 0.0)
    row_sum_e = tl.sum(beta * sum_e, axis=1)
    return row_max, row_sum_e, dm, beta


class VocabConfig(NamedTuple):
    BLOCK_V: int
    BLOCK_N: int
    num_warps: int
    num_stages: int


# (largest next_power_of_2(V) served, BLOCK_V, BLOCK_N, num_warps). Every tile holds 16 elements per
# thread (BLOCK_N * BLOCK_V == 16 * 32 * num_warps): two 16-byte loads of bf16 and no spills. Small
# vocabularies stack BLOCK_N rows per program so a program still moves >= 4 KiB; from 4096 up a row
# is one program and the loop streams BLOCK_V-wide blocks (8192 elements, 16 warps for LLM vocabularies).
VOCAB_TIERS: Tuple[Tuple[int, int, int, int], ...] = (
    (64, 64, 32, 4),
    (256, 256, 8, 4),
    (1024, 1024, 2, 4),
    (4096, 4096, 1, 8),
    (1 << 62, 8192, 1, 16),
)
# The loop body has no dot, so there is nothing for software pipelining to overlap through shared
# memory; one stage keeps SHARED at the reduction scratch only (checked in the AOT report).
NUM_STAGES = 1


def vocab_config(V: int, block_v: Optional[int] = None, block_n: Optional[int] = None) -> VocabConfig:
    """The launch configuration for a vocabulary of V entries.

    `block_v` / `block_n` are test hooks (e.g. BLOCK_V < V to exercise the multi-block loop); with
    `block_v` given and `block_n` not, one row per program.
    """
    if block_v is None and block_n is None:
        p2 = triton.next_power_of_2(max(int(V), 1))
        for limit, bv, bn, warps in VOCAB_TIERS:
            if p2 <= limit:
                return VocabConfig(bv, bn, warps, NUM_STAGES)
    bv = block_v if block_v is not None else min(triton.next_power_of_2(max(int(V), 1)), VOCAB_TIERS[-1][1])
    bn = block_n if block_n is not None else 1
    for x, name in ((bv, "block_v"), (bn, "block_n")):
        if x < 1 or x & (x - 1):
            raise ValueError(f"{name}: expected a power of two >= 1, got {x}")
    warps = max(1, min(16, (bv * bn) // 512))
    return VocabConfig(bv, bn, warps, NUM_STAGES)


def all_vocab_configs() -> Tuple[VocabConfig, ...]:
    """Every configuration `vocab_config` picks without test overrides (for `aot_specs()`)."""
    return tuple(VocabConfig(bv, bn, warps, NUM_STAGES) for _, bv, bn, warps in VOCAB_TIERS)


def pair_config(V: int) -> VocabConfig:
    """The launch configuration of a kernel that streams two [N, V] tensors at once (the full-form divergences):
    vocab_config's tier with half its columns, so that a thread holds 8 elements of each tensor, 16 in all, as the
    one-tensor kernels hold 16 of one. With 16 of each the forward took up to 137 registers per thread and kept
    19% of an A100's warps resident, below the AOT gate's floor (aot.OCCUPANCY_FLOOR)."""
    cfg = vocab_config(V)
    return VocabConfig(cfg.BLOCK_V // 2, cfg.BLOCK_N, cfg.num_warps, cfg.num_stages)


def all_pair_configs() -> Tuple[VocabConfig, ...]:
    """Every configuration `pair_config` picks (for `aot_specs()`)."""
    return tuple(VocabConfig(c.BLOCK_V // 2, c.BLOCK_N, c.num_warps, c.num_stages) for c in all_vocab_configs())


TRITON_DTYPES = {"float16": "fp16", "bfloat16": "bf16", "float32": "fp32"}
