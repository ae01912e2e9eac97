"""The full form of SPEC §9.2 as two kernels: per row, KL(μ||π), KL(π||μ), χ²(π||μ) and TV between
π = softmax(z / T) and μ = softmax(r / T_r), and the gradient of any combination of them w.r.t. z.

Forward: one read of both rows gives KL both ways and χ² as online sums beside the two normalisers, as token_stats
gives the entropy: with log π = dz - log sz and log μ = dr - log sr (d relative to the running max),

    KL(μ||π) = Σ er (dr - dz) / sr + log(sz / sr),   KL(π||μ) = Σ ez (dz - dr) / sz - log(sz / sr),
    χ² + 1 = Σ e^(2 dz - dr) sr / sz²,

each sum carried onto a new max when one moves (χ²'s as a log-sum-exp, so that no term overflows), over the
entries finite on both sides. Mass against none (one side -inf) is decided once per row against the final maxima,
from the largest logit of each side there: +inf where its weight is in float32's normal range, else dropped, as the
C++ backend flushes it. TV = ½ Σ |π - μ| (and Σ π·sign(π − μ), which its gradient needs)
has no such form: its terms need both final normalisers, so it reads both rows a second time, only when asked
(with_tv). Backward: one read of both rows and one write,

    dz_v = ( a (π_v - μ_v) + b π_v (log π_v - log μ_v - KL(π||μ)) + 2 c (π_v² / μ_v - π_v (χ² + 1))
             + d π_v (s_v - Σ_u π_u s_u) / 2 ) / T,        s = sign(π - μ),

each term formed only where its coefficient is nonzero (an infinite divergence with a zero coefficient must not
turn into 0 * inf). Rows outside (active = 0) read nothing and give zeros. One temperature each (a per-token one
goes through the chunked PyTorch pass).
"""

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from .aot_spec import AotSpec, LoopGate
from .tl_math import (
    LN2,
    LOG2E,
    TRITON_DTYPES,
    all_pair_configs,
    full_block,
    grouped_rows,
    lane_dot,
    one_inverse_temperature,
    pair_config,
    safe_shift,
    slot_merge,
)
from .token_stats import device_guard, grouped_strides

STATS = 9  # kl, reverse_kl, chi2, tv, Σ π s, and (row max, log-normaliser) of z and of r


@triton.jit
def _log2_probs(z, r, sz, sr, kz, kr, bz, br):
    """log2 π and log2 μ of one block of float32 logits from the rows' two-part normalisers (the caller broadcasts
    the row values): (z - sz) kz - bz, one FADD and one FFMA (k = log2(e) / T, b = log2(e) x the log-normaliser),
    so that π = 2^tz is one ex2.approx.ftz."""
    return tl.fma(z - sz, kz, -bz), tl.fma(r - sr, kr, -br)


@triton.jit
def _pair_update(z, r, mz, mr, sz, sr, akl, arkl, cm, chi, nz, nr, kz, kr, CHAIN: tl.constexpr):
    """One block of both rows [BLOCK_N, SLOTS, VECTOR] into the per-slot online sums [BLOCK_N, SLOTS], in log2
    units relative to each slot's running shifts (dz = (z - shift_z) kz, dr likewise; e = 2^d):

        sz = Σ ez,  sr = Σ er,  akl = Σ er (dr - dz),  arkl = Σ ez (dz - dr),  χ's Σ 2^(2 dz - dr) = chi 2^cm.

    χ's sum is kept against its own running max cm (a log-sum-exp), so no term overflows however far apart the two
    rows' maxima move; a term whose π is below float32's normal range against the slot's running max is dropped,
    and so are the carried ones when a move (or the row's max, at the merge) takes the slot's max 2^126 lower. The
    two-pass backends drop against the row's final max: they differ where π leaves the range only over several
    smaller moves of a slot's max and μ there is below ~2^-252 of its own max (a reference masked with a large
    finite number instead of -inf).
    An entry whose other side is -inf (mass against none) takes no part in these sums: nz / nr keep the largest
    such z / r, and the row decides once, against its final maxima, whether that mass is real (the divergence is
    then +inf) or below float32's normal range (then it is 0, as the C++ backend and the exponential of a GPU,
    which flushes, have it; the torch backend keeps subnormal weights, to ~103 nats below the max); in akl / arkl
    such an entry stands as a finite 0 difference, so every weight of sr / sz keeps its term. When a shift moves by
    dm (from shift to shift: the shift is 0 before a slot's first finite entry) the carried sums follow: the weights
    by 2^dm (0 before the first finite entry), akl by (dm_r - dm_z) sr (each d moved by its dm), cm by
    2 dm_z - dm_r."""
    z_fin, r_fin = z > float("-inf"), r > float("-inf")
    mz_new = tl.maximum(mz, tl.max(z, axis=2))
    mr_new = tl.maximum(mr, tl.max(r, axis=2))
    shift_z, shift_r = safe_shift(mz_new), safe_shift(mr_new)
    # the weights rescale by 2^((max - shift) k): 0 while a slot has seen nothing finite (its sums are 0, and a
    # shift-to-shift factor could overflow against a 1e4 offset); the differences move shift to shift (finite)
    alpha_z = tl.math.exp2((mz - shift_z) * kz[:, None])
    alpha_r = tl.math.exp2((mr - shift_r) * kr[:, None])
    dmz = (safe_shift(mz) - shift_z) * kz[:, None]
    dmr = (safe_shift(mr) - shift_r) * kr[:, None]
    akl = alpha_r * (akl + (dmr - dmz) * sr)
    arkl = alpha_z * (arkl + (dmz - dmr) * sz)
    dz = (z - shift_z[:, :, None]) * kz[:, None, None]
    dr = (r - shift_r[:, :, None]) * kr[:, None, None]
    ez, er = tl.math.exp2(dz), tl.math.exp2(dr)
    # dr - dz where both sides are finite, else 0: one select on the difference, which both KL sums take (the
    # reverse one negated), so that the products chain into FFMAs (lane_dot)
    both = z_fin & r_fin
    diff = tl.where(both, dr - dz, 0.0)
    if CHAIN:
        akl = lane_dot(er, diff, akl)
        arkl = lane_dot(ez, -diff, arkl)
    else:
        akl += tl.sum(er * diff, axis=2)
        arkl -= tl.sum(ez * diff, axis=2)
    # χ²'s terms: π below float32's normal range against the running max (2^-126, the flushing exponential's) is
    # dropped, as the two-pass backends drop it against the final max. Arithmetic, not a select: K (dz + 126) is
    # >= 0 in range and far below 0 under it (within 1/K of the bound the term is only scaled); a predicate per
    # element spilled the loop's predicates to registers (6 instructions per pair against 3)
    w = tl.where(both, 2.0 * dz - dr, float("-inf"))
    w += tl.minimum(tl.fma(dz, 65536.0, 126.0 * 65536.0), 0.0)
    # a max that rises past float32's range above the slot's terms takes their π below it: they are dropped
    cm_carried = tl.where(dmz >= -126.0, cm + (2.0 * dmz - dmr), float("-inf"))
    cm_new = tl.maximum(cm_carried, tl.max(w, axis=2))
    c_shift = safe_shift(cm_new)
    chi = chi * tl.math.exp2(cm_carried - c_shift) + tl.sum(tl.math.exp2(w - c_shift[:, :, None]), axis=2)
    # the entries apart (one side -inf): the largest logit of each side there (a -inf on both adds nothing)
    nz = tl.maximum(nz, tl.max(tl.where(both, float("-inf"), z), axis=2))
    nr = tl.maximum(nr, tl.max(tl.where(both, float("-inf"), r), axis=2))
    sz = alpha_z * sz + tl.sum(ez, axis=2)
    sr = alpha_r * sr + tl.sum(er, axis=2)
    return mz_new, mr_new, sz, sr, akl, arkl, cm_new, chi, nz, nr


@triton.jit
def _tv_sums(z, r, sz, sr, kz, kr, bz, br, tv, s_bar):
    """The second read, TV's only (it needs both final normalisers before its first term): per-slot sums of
    |π - μ| and of π sign(π - μ) (the TV gradient's Σ π s) over one [BLOCK_N, SLOTS, VECTOR] block."""
    tz, tr = _log2_probs(z, r, sz[:, None, None], sr[:, None, None], kz[:, None, None], kr[:, None, None],
                         bz[:, None, None], br[:, None, None])
    pi, mu = tl.math.exp2(tz), tl.math.exp2(tr)
    diff = pi - mu
    tv += tl.sum(tl.abs(diff), axis=2)
    s_bar += tl.sum(tl.where(diff > 0.0, pi, tl.where(diff < 0.0, -pi, 0.0)), axis=2)
    return tv, s_bar


@triton.jit
def _row_divergences(mz, mr, sz, sr, akl, arkl, cm, chi, nz, nr, kz, kr):
    """The slots of _pair_update merged into each row's (row max of z and r, their sums of 2^d, KL(μ||π),
    KL(π||μ), χ², whether both sides have a finite entry); a side without one has its sum taken as 1."""
    # the slots onto each row's shifts: the weights by beta (tl_math.slot_merge: 0 for a slot without a finite
    # entry), the differences shift to shift, as in the loop
    row_mz, sum_z, _, beta_z = slot_merge(mz, sz, kz)
    row_mr, sum_r, _, beta_r = slot_merge(mr, sr, kr)
    dmz = (safe_shift(mz) - row_mz[:, None]) * kz[:, None]
    dmr = (safe_shift(mr) - row_mr[:, None]) * kr[:, None]
    kl = tl.sum(beta_r * (akl + (dmr - dmz) * sr), axis=1)
    rkl = tl.sum(beta_z * (arkl + (dmz - dmr) * sz), axis=1)
    cm = tl.where(dmz >= -126.0, cm + (2.0 * dmz - dmr), float("-inf"))  # a slot below the row's range: dropped
    chi_shift = safe_shift(tl.max(cm, axis=1))
    chi_row = tl.sum(chi * tl.math.exp2(cm - chi_shift[:, None]), axis=1)
    # mass against none, against the final maxima: real (+inf) where its weight is in float32's normal range
    # (2^-126, the flushing exponential's; the C++ kernel's bound, e^-87), else below it and dropped
    pi_none = (tl.max(nz, axis=1) - row_mz) * kz >= -126.0
    mu_none = (tl.max(nr, axis=1) - row_mr) * kr >= -126.0
    # a side without a finite entry (no distribution: the caller writes zeros) divides by 1, not 0
    finite = (sum_z > 0.0) & (sum_r > 0.0)
    sum_z = tl.where(sum_z > 0.0, sum_z, 1.0)
    sum_r = tl.where(sum_r > 0.0, sum_r, 1.0)
    # log2 π = dz - log2 sum_z, log2 μ = dr - log2 sum_r; the normalisers' difference as one log2 of their ratio
    # (a correctly rounded quotient: ~1 ulp of the divergence, where two ~17-bit logs would leave ~|log2 V| ulps)
    log2_ratio = tl.math.log2(sum_z / sum_r)
    kl = tl.where(mu_none, float("inf"), LN2 * (kl / sum_r + log2_ratio))
    rkl = tl.where(pi_none, float("inf"), LN2 * (rkl / sum_z - log2_ratio))
    # 2^chi_shift in two halves: the shift may pass 2^128 where the product does not
    half = tl.math.exp2(0.5 * chi_shift)
    chi2 = tl.where(pi_none, float("inf"), chi_row * (sum_r / sum_z) / sum_z * half * half - 1.0)
    return row_mz, row_mr, sum_z, sum_r, kl, rkl, chi2, finite


@triton.jit
def _tv_read(z_ptrs, r_ptrs, cols, V, has_mass, sz, sr, kz, kr, bz, br, BLOCK_N: tl.constexpr,
             BLOCK_V: tl.constexpr, SLOTS: tl.constexpr):
    """TV's read of both rows, from their final normalisers: (Σ |π - μ|, Σ π sign(π - μ)) per row."""
    tv = tl.zeros([BLOCK_N, SLOTS], tl.float32)
    s_bar = tl.zeros([BLOCK_N, SLOTS], tl.float32)
    rows_in = has_mass[:, None, None]
    v_stop = V * tl.max(has_mass.to(tl.int32), axis=0)
    v_full = (v_stop // BLOCK_V) * BLOCK_V
    for v0 in tl.range(0, v_full, BLOCK_V):
        z, r = full_block(z_ptrs + v0, rows_in, BLOCK_N), full_block(r_ptrs + v0, rows_in, BLOCK_N)
        tv, s_bar = _tv_sums(z, r, sz, sr, kz, kr, bz, br, tv, s_bar)
    if v_full < v_stop:
        tail = rows_in & ((v_full + cols)[None, :, :] < V)
        z = tl.load(z_ptrs + v_full, mask=tail, other=float("-inf")).to(tl.float32)
        r = tl.load(r_ptrs + v_full, mask=tail, other=float("-inf")).to(tl.float32)
        tv, s_bar = _tv_sums(z, r, sz, sr, kz, kr, bz, br, tv, s_bar)
    return tl.sum(tv, axis=1), tl.sum(s_bar, axis=1)


@triton.jit
def _full_divergences_fwd_kernel(
    z_ptr, r_ptr, active_ptr, stats_ptr,
    N, V, rows_per_group,
    stride_z_g, stride_z_n, stride_r_n,
    temperature, reference_temperature,
    BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, VECTOR: tl.constexpr = 8, WITH_TV: tl.constexpr = True,
):
    # One streaming read of both rows gives both normalisers, KL both ways and χ² (_pair_update's online sums);
    # TV, whose terms need both final normalisers, reads them a second time, and only when asked (WITH_TV). Each
    # loop is written as token_stats' forward is: per-thread sums per VECTOR-wide slot (no block-wide reduction
    # or barrier inside a loop), merged once per row after it; full blocks with the row mask alone, one masked
    # tail.
    SLOTS: tl.constexpr = BLOCK_V // VECTOR
    # a slot of one 16-byte load (one thread's): its sums as FFMA chains (tl_math.lane_dot)
    CHAIN: tl.constexpr = VECTOR * z_ptr.dtype.element_ty.primitive_bitwidth == 128
    pid_n = tl.program_id(0).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    active = mask_n & (tl.load(active_ptr + offs_n, mask=mask_n, other=0) != 0)
    # int64 row offsets; z may be the causal-shift view [B, T, V] (grouped rows), r is [N, V] row-strided
    z_rows = grouped_rows(z_ptr, offs_n, rows_per_group, stride_z_g, stride_z_n)
    r_rows = r_ptr + offs_n * stride_r_n
    kz = one_inverse_temperature(temperature, BLOCK_N) * LOG2E
    kr = one_inverse_temperature(reference_temperature, BLOCK_N) * LOG2E
    cols = tl.arange(0, SLOTS)[:, None] * VECTOR + tl.arange(0, VECTOR)[None, :]  # [SLOTS, VECTOR]
    z_ptrs = z_rows[:, None, None] + cols[None, :, :]
    r_ptrs = r_rows[:, None, None] + cols[None, :, :]

    mz = tl.full([BLOCK_N, SLOTS], float("-inf"), tl.float32)
    mr = tl.full([BLOCK_N, SLOTS], float("-inf"), tl.float32)
    sz = tl.zeros([BLOCK_N, SLOTS], tl.float32)
    sr = tl.zeros([BLOCK_N, SLOTS], tl.float32)
    akl = tl.zeros([BLOCK_N, SLOTS], tl.float32)
    arkl = tl.zeros([BLOCK_N, SLOTS], tl.float32)
    cm = tl.full([BLOCK_N, SLOTS], float("-inf"), tl.float32)
    chi = tl.zeros([BLOCK_N, SLOTS], tl.float32)
    nz = tl.full([BLOCK_N, SLOTS], float("-inf"), tl.float32)
    nr = tl.full([BLOCK_N, SLOTS], float("-inf"), tl.float32)
    rows_in = active[:, None, None]
    v_stop = V * tl.max(active.to(tl.int32), axis=0)
    v_full = (v_stop // BLOCK_V) * BLOCK_V
    for v0 in tl.range(0, v_full, BLOCK_V):
        z, r = full_block(z_ptrs + v0, rows_in, BLOCK_N), full_block(r_ptrs + v0, rows_in, BLOCK_N)
        mz, mr, sz, sr, akl, arkl, cm, chi, nz, nr = _pair_update(z, r, mz, mr, sz, sr, akl, arkl, cm, chi, nz, nr,
                                                                 kz, kr, CHAIN)
    if v_full < v_stop:
        tail = rows_in & ((v_full + cols)[None, :, :] < V)
        z = tl.load(z_ptrs + v_full, mask=tail, other=float("-inf")).to(tl.float32)
        r = tl.load(r_ptrs + v_full, mask=tail, other=float("-inf")).to(tl.float32)
        mz, mr, sz, sr, akl, arkl, cm, chi, nz, nr = _pair_update(z, r, mz, mr, sz, sr, akl, arkl, cm, chi, nz, nr,
                                                                 kz, kr, CHAIN)
    row_mz, row_mr, sum_z, sum_r, kl, rkl, chi2, finite = _row_divergences(mz, mr, sz, sr, akl, arkl, cm, chi, nz,
                                                                           nr, kz, kr)
    has_mass = active & finite  # a row without a finite entry on a side has no distribution: zeros
    base = stats_ptr + offs_n * 9
    tl.store(base + 0, tl.where(has_mass, kl, 0.0), mask=mask_n)
    tl.store(base + 1, tl.where(has_mass, rkl, 0.0), mask=mask_n)
    tl.store(base + 2, tl.where(has_mass, chi2, 0.0), mask=mask_n)
    log_norm_z, log_norm_r = tl.log(sum_z), tl.log(sum_r)
    tl.store(base + 5, tl.where(has_mass, row_mz, 0.0), mask=mask_n)
    tl.store(base + 6, tl.where(has_mass, log_norm_z, 0.0), mask=mask_n)
    tl.store(base + 7, tl.where(has_mass, row_mr, 0.0), mask=mask_n)
    tl.store(base + 8, tl.where(has_mass, log_norm_r, 0.0), mask=mask_n)

    if WITH_TV:  # without TV its columns stay 0 (the op reports no TV then, and nothing differentiates it)
        tv, s_bar = _tv_read(z_ptrs, r_ptrs, cols, V, has_mass, row_mz, row_mr, kz, kr, log_norm_z * LOG2E,
                             log_norm_r * LOG2E, BLOCK_N, BLOCK_V, SLOTS)
        tl.store(base + 3, tl.where(has_mass, 0.5 * tv, 0.0), mask=mask_n)
        tl.store(base + 4, tl.where(has_mass, s_bar, 0.0), mask=mask_n)


@triton.jit
def _full_divergences_bwd_kernel(
    z_ptr, r_ptr, stats_ptr, coef_ptr, grad_ptr,
    N, V, rows_per_group,
    stride_z_g, stride_z_n, stride_r_n, stride_grad_n,
    temperature, reference_temperature,
    BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr,
):
    pid_n = tl.program_id(0).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    a = tl.load(coef_ptr + offs_n * 4 + 0, mask=mask_n, other=0.0)
    b = tl.load(coef_ptr + offs_n * 4 + 1, mask=mask_n, other=0.0)
    c = tl.load(coef_ptr + offs_n * 4 + 2, mask=mask_n, other=0.0)
    d = tl.load(coef_ptr + offs_n * 4 + 3, mask=mask_n, other=0.0)
    base = stats_ptr + offs_n * 9
    rkl = tl.load(base + 1, mask=mask_n, other=0.0)
    chi2 = tl.load(base + 2, mask=mask_n, other=0.0)
    s_bar = tl.load(base + 4, mask=mask_n, other=0.0)
    sz = tl.load(base + 5, mask=mask_n, other=0.0)
    nz = tl.load(base + 6, mask=mask_n, other=0.0)
    sr = tl.load(base + 7, mask=mask_n, other=0.0)
    nr = tl.load(base + 8, mask=mask_n, other=0.0)
    # a row is read only when it carries a coefficient (the caller zeroed the rows outside)
    live_row = mask_n & ((a != 0.0) | (b != 0.0) | (c != 0.0) | (d != 0.0))
    z_rows = grouped_rows(z_ptr, offs_n, rows_per_group, stride_z_g, stride_z_n)
    r_rows = r_ptr + offs_n * stride_r_n
    g_rows = grad_ptr + offs_n * stride_grad_n
    inv_t = one_inverse_temperature(temperature, BLOCK_N)
    kz = inv_t * LOG2E
    kr = one_inverse_temperature(reference_temperature, BLOCK_N) * LOG2E
    bz, br = nz * LOG2E, nr * LOG2E
    for v0 in range(0, V, BLOCK_V):
        offs_v = v0 + tl.arange(0, BLOCK_V)
        in_v = mask_n[:, None] & (offs_v[None, :] < V)
        mask = live_row[:, None] & (offs_v[None, :] < V)
        z = tl.load(z_rows[:, None] + offs_v[None, :], mask=mask, other=float("-inf")).to(tl.float32)
        r = tl.load(r_rows[:, None] + offs_v[None, :], mask=mask, other=float("-inf")).to(tl.float32)
        tz, tr = _log2_probs(z, r, sz[:, None], sr[:, None], kz[:, None], kr[:, None], bz[:, None], br[:, None])
        pi, mu = tl.math.exp2(tz), tl.math.exp2(tr)
        live_p = pi > 0.0
        g = tl.where(a[:, None] != 0.0, a[:, None] * (pi - mu), 0.0)
        g += tl.where((b[:, None] != 0.0) & live_p, b[:, None] * pi * (LN2 * (tz - tr) - rkl[:, None]), 0.0)
        g += tl.where((c[:, None] != 0.0) & live_p,
                      2.0 * c[:, None] * (tl.math.exp2(2.0 * tz - tr) - pi * (chi2[:, None] + 1.0)), 0.0)
        sign = tl.where(pi > mu, 1.0, tl.where(pi < mu, -1.0, 0.0))
        g += tl.where(d[:, None] != 0.0, 0.5 * d[:, None] * pi * (sign - s_bar[:, None]), 0.0)
        g = tl.where(mask, g * inv_t[:, None], 0.0)
        tl.store(g_rows[:, None] + offs_v[None, :], g.to(grad_ptr.dtype.element_ty), mask=in_v)


def slot_vector(cfg, element_size: int) -> int:
    """The forward's VECTOR: one 16-byte load per slot and tensor (8 bf16 / fp16, 4 fp32), so that a slot's
    reduction stays in one thread; with 8 fp32 a slot spanned two threads and its sums needed barriers."""
    return min(16 // element_size, cfg.BLOCK_V)


class FullDivergences(NamedTuple):
    stats: torch.Tensor  # [N, 9] float32: kl, reverse_kl, chi2, tv, Σ π s, row max / log-norm of z, of r


def _checked(logits: torch.Tensor, reference: torch.Tensor):
    if logits.dim() not in (2, 3):
        raise ValueError(f"logits: expected shape (N, V) or (B, T, V), got {tuple(logits.shape)}")
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    V = logits.shape[-1]
    reference = reference.reshape(-1, V)
    if reference.stride(-1) != 1:
        reference = reference.contiguous()
    return logits, reference


def full_divergences_fwd(logits: torch.Tensor, reference: torch.Tensor, active: torch.Tensor, temperature: float,
                         reference_temperature: float, with_tv: bool = True) -> FullDivergences:
    """The [N, 9] statistics of softmax(logits / T) against softmax(reference / T_r) on the active rows; with_tv=False:
    one read of both tensors, TV and Σ π s left 0."""
    logits, reference = _checked(logits, reference)
    V = logits.shape[-1]
    N = logits.numel() // V
    stats = torch.zeros(N, STATS, dtype=torch.float32, device=logits.device)
    if N == 0:
        return FullDivergences(stats)
    rows_per_group, stride_g, stride_n = grouped_strides(logits)
    cfg = pair_config(V)
    grid = (triton.cdiv(N, cfg.BLOCK_N),)
    with device_guard(logits):
        _full_divergences_fwd_kernel[grid](
            logits, reference, active.to(torch.int8).contiguous(), stats, N, V, rows_per_group, stride_g, stride_n,
            reference.stride(0), float(temperature), float(reference_temperature),
            BLOCK_N=cfg.BLOCK_N, BLOCK_V=cfg.BLOCK_V, VECTOR=slot_vector(cfg, logits.element_size()),
            WITH_TV=bool(with_tv), num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )
    return FullDivergences(stats)


def full_divergences_bwd(logits: torch.Tensor, reference: torch.Tensor, stats: torch.Tensor, coef: torch.Tensor,
                         temperature: float, reference_temperature: float) -> torch.Tensor:
    """dLoss/dlogits (logits' shape, contiguous, their dtype) for coef = [N, 4] dLoss/d(kl, reverse_kl, chi2, tv)."""
    logits, reference = _checked(logits, reference)
    V = logits.shape[-1]
    N = logits.numel() // V
    grad = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)
    if N == 0:
        return grad
    rows_per_group, stride_g, stride_n = grouped_strides(logits)
    cfg = pair_config(V)
    grid = (triton.cdiv(N, cfg.BLOCK_N),)
    with device_guard(logits):
        _full_divergences_bwd_kernel[grid](
            logits, reference, stats.contiguous(), coef.to(torch.float32).contiguous(), grad, N, V, rows_per_group,
            stride_g, stride_n, reference.stride(0), V, float(temperature), float(reference_temperature),
            BLOCK_N=cfg.BLOCK_N, BLOCK_V=cfg.BLOCK_V, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )
    return grad


# The forward's static gate on sm_90 (aot.LOOP_GATE_TARGET): SASS instructions per element pair (one of each
# tensor) in its hottest loop, the one-read loop, by logits dtype width, for the tiers whose program streams a row;
# no barrier in any loop. History, bf16 per pair: the first two-pass form spent 36.6 + 57.6 in its two reads (7 and
# 10 barriers per iteration), the per-slot rewrite 17.4 + 32.5; the one-read form 37.9-38.1 in its one read (Triton
# 3.9; 38.4-38.9 with 3.6; fp16 a unit less, fp32 39.6-41.4): 27 MUFU.EX2 per 8 pairs (π's, μ's and χ²'s terms,
# three rescales per slot), χ²'s log-sum-exp and its float32-range rule (3) and the two largest logits against a
# -inf (4) included; TV's read, when asked, 16.9 (17.4 with masked full blocks). Gated a quarter above the most of
# Triton 3.9 and 3.6 (the device image's compiler), rounded up to a quarter.
FORWARD_LOOP_GATES = {16: 39.25, 32: 41.75}
# The backward's (one read of both rows, one write), per element pair: 57.0 with 24 non-ftz ex2 before the exp2
# form, now bf16 44.5, fp16 43.1, fp32 41.9-42.3 (Triton 3.6 the same), each gated half an instruction above.
BACKWARD_LOOP_GATES = {16: 45.0, 32: 42.75}


def aot_specs():
    """One AotSpec per (logits dtype, tier) for each of the two kernels (the reference shares the logits' dtype)."""
    specs = []
    for dtype in TRITON_DTYPES.values():
        for cfg in all_pair_configs():
            constexprs = {"BLOCK_N": cfg.BLOCK_N, "BLOCK_V": cfg.BLOCK_V}
            bwd = {"z_ptr": f"*{dtype}", "r_ptr": f"*{dtype}", "stats_ptr": "*fp32", "coef_ptr": "*fp32",
                   "grad_ptr": f"*{dtype}", "N": "i32", "V": "i32", "rows_per_group": "i32", "stride_z_g": "i64",
                   "stride_z_n": "i32", "stride_r_n": "i32", "stride_grad_n": "i32", "temperature": "fp32",
                   "reference_temperature": "fp32", **{k: "constexpr" for k in constexprs}}
            tag = f"{dtype},BLOCK_N={cfg.BLOCK_N},BLOCK_V={cfg.BLOCK_V}"
            aligned = ("z_ptr", "r_ptr", "V", "stride_z_g", "stride_z_n", "stride_r_n")
            for with_tv in (False, True):
                fwd_constexprs = {**constexprs, "VECTOR": slot_vector(cfg, 4 if dtype == "fp32" else 2),
                                  "WITH_TV": with_tv}
                fwd = {"z_ptr": f"*{dtype}", "r_ptr": f"*{dtype}", "active_ptr": "*i8", "stats_ptr": "*fp32",
                       "N": "i32", "V": "i32", "rows_per_group": "i32", "stride_z_g": "i64", "stride_z_n": "i32",
                       "stride_r_n": "i32", "temperature": "fp32", "reference_temperature": "fp32",
                       **{k: "constexpr" for k in fwd_constexprs}}
                gate = None
                if cfg.BLOCK_N == 1:
                    gate = LoopGate(elements=cfg.BLOCK_V // (32 * cfg.num_warps),
                                    per_element=FORWARD_LOOP_GATES[32 if dtype == "fp32" else 16])
                specs.append(AotSpec(name=f"full_divergences_fwd[{tag},WITH_TV={int(with_tv)}]",
                                     fn=_full_divergences_fwd_kernel, signature=fwd, constexprs=fwd_constexprs,
                                     num_warps=cfg.num_warps, num_stages=cfg.num_stages,
                                     aligned=aligned + ("stats_ptr",), loop_gate=gate))
            bwd_gate = None
            if cfg.BLOCK_N == 1:
                bwd_gate = LoopGate(elements=cfg.BLOCK_V // (32 * cfg.num_warps),
                                    per_element=BACKWARD_LOOP_GATES[32 if dtype == "fp32" else 16])
            specs.append(AotSpec(name=f"full_divergences_bwd[{tag}]", fn=_full_divergences_bwd_kernel,
                                 signature=bwd, constexprs=constexprs, num_warps=cfg.num_warps,
                                 num_stages=cfg.num_stages, aligned=aligned + ("grad_ptr", "stride_grad_n"),
                                 loop_gate=bwd_gate))
    return specs
