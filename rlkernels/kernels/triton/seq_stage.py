"""The per-sequence stage of SPEC §3-§8 as Triton kernels: a drop-in for `rlkernels.loss.sequence_stage`.

One program per sequence reads the per-token scalars (ℓθ, ℓold, ℓμ, ℓref, A, H, m) twice (three
times for seq-mean-token-mean): pass 1 builds the sequence statistics on the original mask (IS
weights, the k1/k2/k3 sums and maxima of the rejection options, the rollout_corr/* terms), pass 2
decides the final mask m' and writes the per-token outputs, pass 3 (seq-mean-token-mean only)
writes c_t once the kept length of the sequence is known. Everything that depends on the whole
batch (N', G, K, the IS batch mean, every metric's denominator) is a scalar finished from per-
sequence partials [S, NUM_P] / [S, NUM_X] by fixed-order torch reductions and a one-program
kernel; c_t and e_t are then scaled by that global factor. No float atomics, no host sync.

Launches: [IS batch-mean pre-pass + 6 torch ops] + stage kernel + column sum/amax/logsumexp + finish kernel
+ 1-2 elementwise scalings (c_t, e_t).
"""

import math
from typing import Dict, List, Optional, Tuple

import torch
import triton
import triton.language as tl

from rlkernels.config import RS_OPTIONS, PolicyLossConfig
from rlkernels.loss import StageOutput
from rlkernels.segments import Segments

from .aot_spec import AotSpec

CLAMP: tl.constexpr = tl.constexpr(20.0)  # SPEC §4: every log-ratio is clamped to ±20 before exp
_MIN_BATCH_MEAN = 1e-8  # SPEC §4: batch normalisation is skipped when the mean weight is below this

# Columns of the per-sequence sum partials [S, NUM_P]; each column sums over sequences to a
# metric numerator or denominator. Unused columns are never written nor read.
P_CNT: tl.constexpr = tl.constexpr(0)  # |y_i| on the original mask m
P_NONEMPTY: tl.constexpr = tl.constexpr(1)
P_KL: tl.constexpr = tl.constexpr(2)
P_K3KL: tl.constexpr = tl.constexpr(3)
P_CHI2T: tl.constexpr = tl.constexpr(4)
P_CHI2S: tl.constexpr = tl.constexpr(5)
P_TV: tl.constexpr = tl.constexpr(6)
P_TPPL: tl.constexpr = tl.constexpr(7)
P_RPPL: tl.constexpr = tl.constexpr(8)
P_TLOG: tl.constexpr = tl.constexpr(9)
P_RLOG: tl.constexpr = tl.constexpr(10)
P_DIFF: tl.constexpr = tl.constexpr(11)
P_ABSDIFF: tl.constexpr = tl.constexpr(12)
P_PPLR: tl.constexpr = tl.constexpr(13)
P_ISW: tl.constexpr = tl.constexpr(14)
P_ISX: tl.constexpr = tl.constexpr(15)
P_ISX2: tl.constexpr = tl.constexpr(16)
P_ISHI: tl.constexpr = tl.constexpr(17)
P_ISLO: tl.constexpr = tl.constexpr(18)
P_REJ: tl.constexpr = tl.constexpr(19)
P_SEQREJ: tl.constexpr = tl.constexpr(20)
P_CNTF: tl.constexpr = tl.constexpr(21)  # |y_i| on the final mask m'
P_NONEMPTYF: tl.constexpr = tl.constexpr(22)
P_PG: tl.constexpr = tl.constexpr(23)
P_CLIP: tl.constexpr = tl.constexpr(24)
P_DUAL: tl.constexpr = tl.constexpr(25)
P_PPOKL: tl.constexpr = tl.constexpr(26)
P_KLL: tl.constexpr = tl.constexpr(27)
P_ENT: tl.constexpr = tl.constexpr(28)
P_RS: tl.constexpr = tl.constexpr(29)  # option j: 29 + 2j (sum of its values), 30 + 2j (tokens it drops)
P_RHO2S: tl.constexpr = tl.constexpr(51)  # rho_seq^2 = exp(2 clamp(S_i)) on non-empty sequences
P_ISM2: tl.constexpr = tl.constexpr(52)  # sum_t (x_t - mean_i x)^2 around the sequence's own mean (token IS)
NUM_P: tl.constexpr = tl.constexpr(64)
# partial-sum columns that hold exponents and are reduced by logsumexp (the perplexity means)
_LSE_COLUMNS = [int(P_TPPL), int(P_RPPL), int(P_PPLR)]

# Columns of the per-sequence max partials [S, NUM_X] (-inf = no contribution); minima are stored negated.
X_WIDTH: tl.constexpr = tl.constexpr(0)
X_DIFFMAX: tl.constexpr = tl.constexpr(1)
X_DIFFMIN: tl.constexpr = tl.constexpr(2)
X_ISMAX: tl.constexpr = tl.constexpr(3)
X_ISMIN: tl.constexpr = tl.constexpr(4)
X_RS: tl.constexpr = tl.constexpr(5)  # option j: 5 + 2j (max), 6 + 2j (-min)
NUM_X: tl.constexpr = tl.constexpr(32)

# Slots of the finished [NUM_OUT] vector; metrics are 0-d views into it.
O_LOSS: tl.constexpr = tl.constexpr(0)
O_SCALE: tl.constexpr = tl.constexpr(1)  # the global aggregation factor g (c_t = g * c_t_unscaled)
O_PG: tl.constexpr = tl.constexpr(2)
O_CLIP: tl.constexpr = tl.constexpr(3)
O_DUAL: tl.constexpr = tl.constexpr(4)
O_PPOKL: tl.constexpr = tl.constexpr(5)
O_KLL: tl.constexpr = tl.constexpr(6)
O_ENT: tl.constexpr = tl.constexpr(7)
O_KL: tl.constexpr = tl.constexpr(8)
O_K3KL: tl.constexpr = tl.constexpr(9)
O_CHI2T: tl.constexpr = tl.constexpr(10)
O_CHI2S: tl.constexpr = tl.constexpr(11)
O_TV: tl.constexpr = tl.constexpr(12)
O_TPPL: tl.constexpr = tl.constexpr(13)
O_RPPL: tl.constexpr = tl.constexpr(14)
O_TLOG: tl.constexpr = tl.constexpr(15)
O_RLOG: tl.constexpr = tl.constexpr(16)
O_DIFF: tl.constexpr = tl.constexpr(17)
O_ABSDIFF: tl.constexpr = tl.constexpr(18)
O_DIFFMAX: tl.constexpr = tl.constexpr(19)
O_DIFFMIN: tl.constexpr = tl.constexpr(20)
O_PPLR: tl.constexpr = tl.constexpr(21)
O_CSTAR: tl.constexpr = tl.constexpr(22)
O_ISMEAN: tl.constexpr = tl.constexpr(23)
O_ISSTD: tl.constexpr = tl.constexpr(24)
O_ISMIN: tl.constexpr = tl.constexpr(25)
O_ISMAX: tl.constexpr = tl.constexpr(26)
O_ISHI: tl.constexpr = tl.constexpr(27)
O_ISLO: tl.constexpr = tl.constexpr(28)
O_ESS: tl.constexpr = tl.constexpr(29)
O_REJ: tl.constexpr = tl.constexpr(30)
O_SEQREJ: tl.constexpr = tl.constexpr(31)
O_RS: tl.constexpr = tl.constexpr(32)  # option j: 32 + 4j mean, +1 max, +2 min, +3 masked_fraction
NUM_OUT: tl.constexpr = tl.constexpr(80)

# Structural codes (constexpr kernel arguments).
AGG_CODES = {
    "token-mean": 0, "token-sum": 1, "seq-mean-token-sum": 2, "seq-mean-token-mean": 3, "seq-mean-token-sum-norm": 4,
}
KL_CODES = {None: 0, "k1": 1, "k2": 2, "k3": 3, "low_var_kl": 3}
IS_LEVEL_CODES = {None: 0, "token": 1, "sequence": 2}
RS_BITS = {name: 1 << j for j, name in enumerate(RS_OPTIONS)}  # token_k1 = 1, ..., seq_max_k3 = 1024


# ---------------------------------------------------------------------------------------------
# device helpers
# ---------------------------------------------------------------------------------------------
@triton.jit
def _sequence_bounds(cu_ptr, pid_s, T, PACKED: tl.constexpr):
    """[start, end) of sequence pid_s as int64 token offsets: cu_seqlens (packed) or row pid_s of [S, T]."""
    if PACKED:
        start = tl.load(cu_ptr + pid_s).to(tl.int64)
        end = tl.load(cu_ptr + pid_s + 1).to(tl.int64)
    else:
        start = pid_s * T
        end = start + T
    return start, end


@triton.jit
def _clamp(x, lo, hi):
    # torch.clamp semantics: NaN stays NaN (tl.minimum/maximum may drop it on some backends)
    return tl.where(x < lo, lo, tl.where(x > hi, hi, x))


@triton.jit
def _nan_maximum(a, b):
    # elementwise max that propagates NaN as torch.amax does (a + b is NaN when either is)
    return tl.where((a != a) | (b != b), a + b, tl.where(a > b, a, b))


@triton.jit
def _nan_max(x):
    # [BLOCK] -> scalar max, NaN if any element is NaN (tl.max alone may ignore NaN)
    has_nan = tl.max((x != x).to(tl.int32), axis=0) > 0
    top = tl.max(tl.where(x != x, float("-inf"), x), axis=0)
    return tl.where(has_nan, float("nan"), top)


@triton.jit
def _load_valid(ptr, offs, inb, valid):
    # values off the mask may be NaN/inf; zero them before they reach a sum (as loss.sequence_stage does)
    x = tl.load(ptr + offs, mask=inb, other=0.0).to(tl.float32)
    return tl.where(valid, x, 0.0)


@triton.jit
def _truncate(raw, is_lo, is_hi, IS_ICEPOP: tl.constexpr):
    # SPEC §4: TIS min(raw, C) (NaN stays, as clamp_max), or IcePop: raw inside [lo, hi], else 0
    if IS_ICEPOP:
        w = tl.where((raw >= is_lo) & (raw <= is_hi), raw, 0.0)
    else:
        w = tl.where(raw > is_hi, is_hi, raw)
    return w


@triton.jit
def _store_option(psum_row, pmax_row, J: tl.constexpr, total, dropped, vmax, vnegmin):
    tl.store(psum_row + P_RS + 2 * J, total)
    tl.store(psum_row + P_RS + 2 * J + 1, dropped)
    tl.store(pmax_row + X_RS + 2 * J, vmax)
    tl.store(pmax_row + X_RS + 2 * J + 1, vnegmin)


@triton.jit
def _seq_option(psum_row, pmax_row, J: tl.constexpr, v, lo, hi, IS_K1: tl.constexpr, nonempty, n_len):
    # a sequence-level rejection option: keep decision for its sequence value v, plus its partials
    if IS_K1:  # keep lo <= rho <= hi with rho = exp(-v), compared in log space (SPEC §5)
        keep = (-v >= lo) & (-v <= hi)
    else:
        keep = v <= hi
    _store_option(psum_row, pmax_row, J, tl.where(nonempty, v, 0.0), tl.where(keep, 0.0, n_len),
                  tl.where(nonempty, v, float("-inf")), tl.where(nonempty, -v, float("-inf")))
    return keep


@triton.jit
def _token_block(
    offs, inb,
    lp_ptr, ent_ptr, adv_ptr, mask_ptr, old_ptr, roll_ptr, ref_ptr,
    keep_seq, w_seq, is_factor,
    clip_lo, clip_hi, clip_c, is_lo, is_hi, rs_lo_tk1, rs_hi_tk1, rs_hi_tk2, rs_hi_tk3,
    DECOUPLED: tl.constexpr, HAS_ROLL: tl.constexpr, IS_LEVEL: tl.constexpr, IS_ICEPOP: tl.constexpr,
    IS_BN: tl.constexpr, RS: tl.constexpr, REINFORCE: tl.constexpr, HAS_DUAL: tl.constexpr,
    KL_TYPE: tl.constexpr, HAS_ENT: tl.constexpr,
):
    """Per-token terms of SPEC §5-§6 for one block: final mask, applied weight, L, dL/dℓ, flags, KL."""
    valid = tl.load(mask_ptr + offs, mask=inb, other=0) != 0
    lp = _load_valid(lp_ptr, offs, inb, valid)
    adv = _load_valid(adv_ptr, offs, inb, valid)
    if DECOUPLED:
        l_old = _load_valid(old_ptr, offs, inb, valid)
    elif HAS_ROLL:
        l_old = _load_valid(roll_ptr, offs, inb, valid)
    else:
        l_old = lp
    keep = valid & keep_seq
    w = tl.zeros_like(lp) + 1.0
    w_trunc = w
    if HAS_ROLL:
        if (RS & 7) or (IS_LEVEL == 1):  # 7 = token_k1 | token_k2 | token_k3
            if DECOUPLED:
                dh = _clamp(l_old - _load_valid(roll_ptr, offs, inb, valid), -CLAMP, CLAMP)
            else:
                dh = _clamp(lp - l_old, -CLAMP, CLAMP)
            if RS & 1:  # token_k1: -k1 = dh compared to [log lo, log hi]
                keep = keep & (dh >= rs_lo_tk1) & (dh <= rs_hi_tk1)
            if RS & 2:
                keep = keep & (tl.where(valid, 0.5 * dh * dh, 0.0) <= rs_hi_tk2)
            if RS & 4:
                keep = keep & (tl.where(valid, (tl.exp(dh) - 1.0) - dh, 0.0) <= rs_hi_tk3)
            if IS_LEVEL == 1:
                w = tl.where(valid, _truncate(tl.exp(dh), is_lo, is_hi, IS_ICEPOP), 0.0)
        if IS_LEVEL == 2:
            w = tl.where(valid, w_seq, 0.0)
        w_trunc = w
        if IS_BN:
            w = w / is_factor
    # SPEC §6 policy term; c_t = -A * w * r on the unclipped branch (and where the ±20 clamp passes it)
    dpg_raw = lp - l_old
    dpg = _clamp(dpg_raw, -CLAMP, CLAMP)
    if REINFORCE:
        L = -adv * w * lp
        dL = -adv * w
        clipped = valid & False
        dual = valid & False
    else:
        r = tl.exp(dpg)
        L1 = -adv * r
        L2 = -adv * _clamp(r, clip_lo, clip_hi)
        clipped = L2 > L1
        Lc = tl.where(clipped, L2, L1)
        if HAS_DUAL:
            L3 = -adv * clip_c
            dual = (adv < 0) & (L3 < Lc)
            L = tl.where(dual, L3, Lc)
        else:
            dual = valid & False
            L = Lc
        live = (~clipped) & (~dual) & (dpg_raw >= -CLAMP) & (dpg_raw <= CLAMP)
        dL = tl.where(live, -adv * r, 0.0)
        if DECOUPLED and (IS_LEVEL > 0):
            L = L * w
            dL = dL * w
    kl = tl.zeros_like(lp)
    dkl = tl.zeros_like(lp)
    if KL_TYPE > 0:
        ref = _load_valid(ref_ptr, offs, inb, valid)
        if KL_TYPE == 1:
            kl = lp - ref
            dkl = tl.zeros_like(lp) + 1.0
        elif KL_TYPE == 2:
            kl = 0.5 * ((lp - ref) * (lp - ref))
            dkl = lp - ref
        else:  # k3 / low_var_kl, clamped to [-10, 10]; the clamps pass the gradient on their closed interval
            d_raw = ref - lp
            d = _clamp(d_raw, -CLAMP, CLAMP)
            k3_raw = (tl.exp(d) - d) - 1.0
            kl = _clamp(k3_raw, -10.0, 10.0)
            live_kl = (d_raw >= -CLAMP) & (d_raw <= CLAMP) & (k3_raw <= 10.0) & (k3_raw >= -10.0)
            dkl = tl.where(live_kl, 1.0 - tl.exp(d), 0.0)
    if HAS_ENT:
        H = _load_valid(ent_ptr, offs, inb, valid)
    else:
        H = tl.zeros_like(lp)
    return valid, keep, w_trunc, w, L, dL, clipped, dual, -dpg, kl, dkl, H


# ---------------------------------------------------------------------------------------------
# kernels
# ---------------------------------------------------------------------------------------------
@triton.jit
def _is_weight_sums_kernel(
    # data ptrs
    ltr_ptr, roll_ptr, mask_ptr, cu_ptr, out_ptr,
    # sizes
    T,
    # scalars
    is_lo, is_hi,
    # constexpr
    PACKED: tl.constexpr, IS_LEVEL: tl.constexpr, IS_ICEPOP: tl.constexpr, BLOCK_T: tl.constexpr,
):
    # One program per sequence: [|y_i|, sum_t w_t] of the truncated IS weights, for the batch mean of
    # SPEC §4 (is_batch_normalize). Grid (S,); reads 2 floats + 1 byte per token, writes 8 B per sequence.
    pid_s = tl.program_id(0).to(tl.int64)
    start, end = _sequence_bounds(cu_ptr, pid_s, T, PACKED)
    acc_len = tl.zeros([BLOCK_T], tl.float32)
    acc_d = tl.zeros([BLOCK_T], tl.float32)
    acc_w = tl.zeros([BLOCK_T], tl.float32)
    for t0 in range(start, end, BLOCK_T):
        offs = t0 + tl.arange(0, BLOCK_T)
        inb = offs < end
        valid = tl.load(mask_ptr + offs, mask=inb, other=0) != 0
        delta = _load_valid(ltr_ptr, offs, inb, valid) - _load_valid(roll_ptr, offs, inb, valid)
        acc_len += valid.to(tl.float32)
        if IS_LEVEL == 1:
            w = _truncate(tl.exp(_clamp(delta, -CLAMP, CLAMP)), is_lo, is_hi, IS_ICEPOP)
            acc_w += tl.where(valid, w, 0.0)
        else:
            acc_d += delta
    n_len = tl.sum(acc_len, axis=0)
    if IS_LEVEL == 1:
        w_sum = tl.sum(acc_w, axis=0)
    else:  # one weight per sequence from the unclamped sum, on each of its tokens
        w_seq = _truncate(tl.exp(_clamp(tl.sum(acc_d, axis=0), -CLAMP, CLAMP)), is_lo, is_hi, IS_ICEPOP)
        w_sum = tl.where(n_len > 0, n_len * w_seq, 0.0)
    tl.store(out_ptr + pid_s * 2, n_len)
    tl.store(out_ptr + pid_s * 2 + 1, w_sum)


@triton.jit
def _seq_stage_fwd_kernel(
    # data ptrs: per-token inputs [N]
    lp_ptr, ent_ptr, adv_ptr, mask_ptr, old_ptr, roll_ptr, ref_ptr,
    # data ptrs: per-token outputs [N]
    coef_ptr, coef_ent_ptr, w_out_ptr, mask_out_ptr,
    # data ptrs: per-sequence partials [S, NUM_P], [S, NUM_X]; cu_seqlens [S + 1]; IS batch factor (0-d)
    psum_ptr, pmax_ptr, cu_ptr, is_factor_ptr,
    # sizes
    T,
    # scalars (fp32, run time)
    clip_lo, clip_hi, clip_c, kl_coef, neg_ent_coeff,
    is_lo, is_hi, log_is_lo, log_is_hi,
    rs_lo_tk1, rs_hi_tk1, rs_hi_tk2, rs_hi_tk3,
    rs_lo_sk1, rs_hi_sk1, rs_hi_sk2, rs_hi_sk3,
    rs_lo_mk1, rs_hi_mk1, rs_hi_mk2, rs_hi_mk3,
    rs_hi_xk2, rs_hi_xk3,
    # constexpr
    PACKED: tl.constexpr, DECOUPLED: tl.constexpr, HAS_ROLL: tl.constexpr, IS_LEVEL: tl.constexpr,
    IS_ICEPOP: tl.constexpr, IS_BN: tl.constexpr, RS: tl.constexpr, REINFORCE: tl.constexpr,
    HAS_DUAL: tl.constexpr, KL_TYPE: tl.constexpr, HAS_ENT: tl.constexpr, WRITE_E: tl.constexpr,
    RETURN_W: tl.constexpr, RETURN_MASK: tl.constexpr, AGG: tl.constexpr, BLOCK_T: tl.constexpr,
):
    # One program per sequence (grid (S,), pid int64, 64-bit token offsets). Pass 1 (with a rollout):
    # statistics on m; pass 2: m', weights, c_t/e_t before the global factor, actor partials; pass 3
    # (seq-mean-token-mean): c_t/e_t with 1/|y'_i|. Reads <= 7 floats + 1 byte per token per pass,
    # writes <= 3 floats + 1 byte per token. Hazards: ratios clamped before exp, NaN kept out of
    # masked sums by where (never by multiplying a 0/1 mask into inf), max identity -inf.
    pid_s = tl.program_id(0).to(tl.int64)
    start, end = _sequence_bounds(cu_ptr, pid_s, T, PACKED)
    psum_row = psum_ptr + pid_s * NUM_P
    pmax_row = pmax_ptr + pid_s * NUM_X
    tl.store(pmax_row + X_WIDTH, (end - start).to(tl.float32))
    zero = tl.zeros([BLOCK_T], tl.float32)
    ninf = zero - float("inf")

    # ---- pass 1: sequence statistics on the original mask (SPEC §4, §5, §8) ----
    keep_seq = start <= end  # AND of the sequence-level rejection options
    w_seq = 1.0
    seq_mean_x = 0.0
    is_factor = 1.0
    if IS_BN:
        is_factor = tl.load(is_factor_ptr)
    if HAS_ROLL:
        acc_len = zero
        acc_delta = zero
        acc_tr = zero
        acc_ro = zero
        acc_k1 = zero
        acc_k2 = zero
        acc_k3 = zero
        acc_k3kl = zero
        acc_chi2 = zero
        acc_tv = zero
        max_k2 = ninf
        max_k3 = ninf
        max_t1 = ninf
        neg_t1 = ninf
        drop_t1 = zero
        max_t2 = ninf
        neg_t2 = ninf
        drop_t2 = zero
        max_t3 = ninf
        neg_t3 = ninf
        drop_t3 = zero
        acc_w = zero
        acc_x = zero
        acc_x2 = zero
        max_w = ninf
        neg_w = ninf
        cnt_hi = zero
        cnt_lo = zero
        for t0 in range(start, end, BLOCK_T):
            offs = t0 + tl.arange(0, BLOCK_T)
            inb = offs < end
            valid = tl.load(mask_ptr + offs, mask=inb, other=0) != 0
            if DECOUPLED:
                l_tr = _load_valid(old_ptr, offs, inb, valid)
            else:
                l_tr = _load_valid(lp_ptr, offs, inb, valid)
            l_ro = _load_valid(roll_ptr, offs, inb, valid)
            delta = l_tr - l_ro  # 0 off the mask
            dh = _clamp(delta, -CLAMP, CLAMP)
            rho = tl.exp(dh)
            acc_len += valid.to(tl.float32)
            acc_delta += delta
            acc_tr += l_tr
            acc_ro += l_ro
            acc_k3kl += tl.where(valid, (rho - dh) - 1.0, 0.0)
            acc_chi2 += tl.where(valid, rho * rho - 1.0, 0.0)
            acc_tv += tl.where(valid, 0.5 * tl.abs(rho - 1.0), 0.0)
            k1 = tl.where(valid, -dh, 0.0)
            k2 = tl.where(valid, 0.5 * dh * dh, 0.0)
            k3 = tl.where(valid, (rho - 1.0) - dh, 0.0)
            acc_k1 += k1
            acc_k2 += k2
            acc_k3 += k3
            if RS & 512:
                max_k2 = _nan_maximum(max_k2, tl.where(valid, k2, float("-inf")))
            if RS & 1024:
                max_k3 = _nan_maximum(max_k3, tl.where(valid, k3, float("-inf")))
            if RS & 1:
                max_t1 = _nan_maximum(max_t1, tl.where(valid, k1, float("-inf")))
                neg_t1 = _nan_maximum(neg_t1, tl.where(valid, -k1, float("-inf")))
                drop_t1 += tl.where(valid & ~((-k1 >= rs_lo_tk1) & (-k1 <= rs_hi_tk1)), 1.0, 0.0)
            if RS & 2:
                max_t2 = _nan_maximum(max_t2, tl.where(valid, k2, float("-inf")))
                neg_t2 = _nan_maximum(neg_t2, tl.where(valid, -k2, float("-inf")))
                drop_t2 += tl.where(valid & ~(k2 <= rs_hi_tk2), 1.0, 0.0)
            if RS & 4:
                max_t3 = _nan_maximum(max_t3, tl.where(valid, k3, float("-inf")))
                neg_t3 = _nan_maximum(neg_t3, tl.where(valid, -k3, float("-inf")))
                drop_t3 += tl.where(valid & ~(k3 <= rs_hi_tk3), 1.0, 0.0)
            if IS_LEVEL == 1:
                w = tl.where(valid, _truncate(rho, is_lo, is_hi, IS_ICEPOP), 0.0)
                x = _clamp(w, 0.0, is_hi)
                acc_w += w
                acc_x += x
                acc_x2 += x * x
                max_w = _nan_maximum(max_w, tl.where(valid, w, float("-inf")))
                neg_w = _nan_maximum(neg_w, tl.where(valid, -w, float("-inf")))
                cnt_hi += tl.where(valid & (dh > log_is_hi), 1.0, 0.0)
                cnt_lo += tl.where(valid & (dh < log_is_lo), 1.0, 0.0)
        n_len = tl.sum(acc_len, axis=0)
        nonempty = n_len > 0
        len_c = tl.where(nonempty, n_len, 1.0)
        seq_delta = tl.sum(acc_delta, axis=0)  # unclamped S_i
        seq_delta_hat = _clamp(seq_delta, -CLAMP, CLAMP)
        mean_tr = tl.sum(acc_tr, axis=0) / len_c
        mean_ro = tl.sum(acc_ro, axis=0) / len_c
        diff = mean_ro - mean_tr
        tl.store(psum_row + P_CNT, n_len)
        tl.store(psum_row + P_NONEMPTY, tl.where(nonempty, 1.0, 0.0))
        tl.store(psum_row + P_KL, tl.sum(-acc_delta, axis=0))
        tl.store(psum_row + P_K3KL, tl.sum(acc_k3kl, axis=0))
        tl.store(psum_row + P_CHI2T, tl.sum(acc_chi2, axis=0))
        rho2_seq = tl.exp(2.0 * seq_delta_hat)
        tl.store(psum_row + P_CHI2S, tl.where(nonempty, rho2_seq - 1.0, 0.0))
        tl.store(psum_row + P_RHO2S, tl.where(nonempty, rho2_seq, 0.0))
        tl.store(psum_row + P_TV, tl.sum(acc_tv, axis=0))
        # perplexity means are exp(logsumexp - log G) (finite whenever the mean is): these columns
        # hold the exponents, -inf for empty sequences, and are reduced by logsumexp, not sum
        tl.store(psum_row + P_TPPL, tl.where(nonempty, -mean_tr, float("-inf")))
        tl.store(psum_row + P_RPPL, tl.where(nonempty, -mean_ro, float("-inf")))
        tl.store(psum_row + P_TLOG, tl.where(nonempty, -mean_tr, 0.0))
        tl.store(psum_row + P_RLOG, tl.where(nonempty, -mean_ro, 0.0))
        tl.store(psum_row + P_DIFF, tl.where(nonempty, diff, 0.0))
        tl.store(psum_row + P_ABSDIFF, tl.where(nonempty, tl.abs(diff), 0.0))
        tl.store(psum_row + P_PPLR, tl.where(nonempty, diff, float("-inf")))
        tl.store(pmax_row + X_DIFFMAX, tl.where(nonempty, diff, float("-inf")))
        tl.store(pmax_row + X_DIFFMIN, tl.where(nonempty, -diff, float("-inf")))
        if IS_LEVEL == 1:
            seq_mean_x = tl.sum(acc_x, axis=0) / len_c
            tl.store(psum_row + P_ISW, tl.sum(acc_w, axis=0))
            tl.store(psum_row + P_ISX, tl.sum(acc_x, axis=0))
            tl.store(psum_row + P_ISX2, tl.sum(acc_x2, axis=0))
            tl.store(psum_row + P_ISHI, tl.sum(cnt_hi, axis=0))
            tl.store(psum_row + P_ISLO, tl.sum(cnt_lo, axis=0))
            tl.store(pmax_row + X_ISMAX, _nan_max(max_w))
            tl.store(pmax_row + X_ISMIN, _nan_max(neg_w))
        if IS_LEVEL == 2:
            w_seq = _truncate(tl.exp(seq_delta_hat), is_lo, is_hi, IS_ICEPOP)
            x_seq = _clamp(w_seq, 0.0, is_hi)
            tl.store(psum_row + P_ISW, tl.where(nonempty, n_len * w_seq, 0.0))
            tl.store(psum_row + P_ISX, tl.where(nonempty, n_len * x_seq, 0.0))
            tl.store(psum_row + P_ISX2, tl.where(nonempty, n_len * (x_seq * x_seq), 0.0))
            tl.store(psum_row + P_ISHI, tl.where(nonempty & (seq_delta_hat > log_is_hi), 1.0, 0.0))
            tl.store(psum_row + P_ISLO, tl.where(nonempty & (seq_delta_hat < log_is_lo), 1.0, 0.0))
            tl.store(pmax_row + X_ISMAX, tl.where(nonempty, w_seq, float("-inf")))
            tl.store(pmax_row + X_ISMIN, tl.where(nonempty, -w_seq, float("-inf")))
        sum_k1 = tl.sum(acc_k1, axis=0)
        sum_k2 = tl.sum(acc_k2, axis=0)
        sum_k3 = tl.sum(acc_k3, axis=0)
        # token options: mean over m, max/min over m, tokens dropped
        if RS & 1:
            _store_option(psum_row, pmax_row, 0, sum_k1, tl.sum(drop_t1, axis=0), _nan_max(max_t1), _nan_max(neg_t1))
        if RS & 2:
            _store_option(psum_row, pmax_row, 1, sum_k2, tl.sum(drop_t2, axis=0), _nan_max(max_t2), _nan_max(neg_t2))
        if RS & 4:
            _store_option(psum_row, pmax_row, 2, sum_k3, tl.sum(drop_t3, axis=0), _nan_max(max_t3), _nan_max(neg_t3))
        # sequence options: one value per sequence, applied to all its tokens
        if RS & 8:
            keep_seq = keep_seq & _seq_option(
                psum_row, pmax_row, 3, sum_k1, rs_lo_sk1, rs_hi_sk1, True, nonempty, n_len)
        if RS & 16:
            keep_seq = keep_seq & _seq_option(psum_row, pmax_row, 4, sum_k2, 0.0, rs_hi_sk2, False, nonempty, n_len)
        if RS & 32:
            keep_seq = keep_seq & _seq_option(psum_row, pmax_row, 5, sum_k3, 0.0, rs_hi_sk3, False, nonempty, n_len)
        if RS & 64:
            keep_seq = keep_seq & _seq_option(
                psum_row, pmax_row, 6, sum_k1 / len_c, rs_lo_mk1, rs_hi_mk1, True, nonempty, n_len)
        if RS & 128:
            keep_seq = keep_seq & _seq_option(
                psum_row, pmax_row, 7, sum_k2 / len_c, 0.0, rs_hi_mk2, False, nonempty, n_len)
        if RS & 256:
            keep_seq = keep_seq & _seq_option(
                psum_row, pmax_row, 8, sum_k3 / len_c, 0.0, rs_hi_mk3, False, nonempty, n_len)
        if RS & 512:  # an empty sequence has max 0 (SPEC §5)
            keep_seq = keep_seq & _seq_option(
                psum_row, pmax_row, 9, tl.where(nonempty, _nan_max(max_k2), 0.0), 0.0, rs_hi_xk2, False,
                nonempty, n_len)
        if RS & 1024:
            keep_seq = keep_seq & _seq_option(
                psum_row, pmax_row, 10, tl.where(nonempty, _nan_max(max_k3), 0.0), 0.0, rs_hi_xk3, False,
                nonempty, n_len)

    # ---- pass 2: final mask, per-token outputs, actor partials over m' (SPEC §6-§8) ----
    acc_cnt = zero
    acc_f = zero
    acc_rej = zero
    acc_pg = zero
    acc_clip = zero
    acc_dual = zero
    acc_ppokl = zero
    acc_kll = zero
    acc_ent = zero
    acc_m2 = zero
    for t0 in range(start, end, BLOCK_T):
        offs = t0 + tl.arange(0, BLOCK_T)
        inb = offs < end
        valid, keep, w_trunc, w, L, dL, clipped, dual, neg_dpg, kl, dkl, H = _token_block(
            offs, inb, lp_ptr, ent_ptr, adv_ptr, mask_ptr, old_ptr, roll_ptr, ref_ptr,
            keep_seq, w_seq, is_factor, clip_lo, clip_hi, clip_c, is_lo, is_hi,
            rs_lo_tk1, rs_hi_tk1, rs_hi_tk2, rs_hi_tk3,
            DECOUPLED, HAS_ROLL, IS_LEVEL, IS_ICEPOP, IS_BN, RS, REINFORCE, HAS_DUAL, KL_TYPE, HAS_ENT,
        )
        mf = keep.to(tl.float32)
        acc_cnt += valid.to(tl.float32)
        acc_f += mf
        acc_rej += tl.where(valid & ~keep, 1.0, 0.0)
        acc_pg += tl.where(keep, L, 0.0)
        acc_clip += tl.where(keep & clipped, 1.0, 0.0)
        acc_dual += tl.where(keep & dual, 1.0, 0.0)
        acc_ppokl += tl.where(keep, neg_dpg, 0.0)
        acc_kll += tl.where(keep, kl, 0.0)
        acc_ent += mf * H  # as (a * H).sum(): a is 0 off m'
        if IS_LEVEL == 1:  # two-pass variance of x = clamp(w, 0, hi), first around the sequence mean
            x_dev = _clamp(w_trunc, 0.0, is_hi) - seq_mean_x
            acc_m2 += tl.where(valid, x_dev * x_dev, 0.0)
        if RETURN_W:
            tl.store(w_out_ptr + offs, w, mask=inb)
        if RETURN_MASK:
            tl.store(mask_out_ptr + offs, keep.to(tl.int8), mask=inb)
        if AGG != 3:  # the per-sequence factor is 1: write now; the global factor comes later
            coef = mf * dL
            if KL_TYPE > 0:
                coef = coef + tl.where(kl_coef != 0.0, (kl_coef * mf) * dkl, 0.0)
            tl.store(coef_ptr + offs, coef, mask=inb)
            if WRITE_E:
                tl.store(coef_ent_ptr + offs, neg_ent_coeff * mf, mask=inb)
    n_len = tl.sum(acc_cnt, axis=0)
    n_f = tl.sum(acc_f, axis=0)
    n_rej = tl.sum(acc_rej, axis=0)
    seq_scale = 1.0
    if AGG == 3:
        seq_scale = 1.0 / tl.where(n_f > 0, n_f, 1.0)
    if not HAS_ROLL:
        tl.store(psum_row + P_CNT, n_len)
        tl.store(psum_row + P_NONEMPTY, tl.where(n_len > 0, 1.0, 0.0))
    if RS:
        tl.store(psum_row + P_REJ, n_rej)
        tl.store(psum_row + P_SEQREJ, tl.where((n_len > 0) & (n_rej > 0), 1.0, 0.0))
    tl.store(psum_row + P_CNTF, n_f)
    tl.store(psum_row + P_NONEMPTYF, tl.where(n_f > 0, 1.0, 0.0))
    tl.store(psum_row + P_PG, tl.sum(acc_pg, axis=0) * seq_scale)
    tl.store(psum_row + P_CLIP, tl.sum(acc_clip, axis=0))
    tl.store(psum_row + P_DUAL, tl.sum(acc_dual, axis=0))
    tl.store(psum_row + P_PPOKL, tl.sum(acc_ppokl, axis=0))
    tl.store(psum_row + P_KLL, tl.sum(acc_kll, axis=0) * seq_scale)
    tl.store(psum_row + P_ENT, tl.sum(acc_ent, axis=0) * seq_scale)
    if IS_LEVEL == 1:
        tl.store(psum_row + P_ISM2, tl.sum(acc_m2, axis=0))

    # ---- pass 3 (seq-mean-token-mean): c_t and e_t need 1/|y'_i|, known only now ----
    if AGG == 3:
        for t0 in range(start, end, BLOCK_T):
            offs = t0 + tl.arange(0, BLOCK_T)
            inb = offs < end
            valid, keep, w_trunc, w, L, dL, clipped, dual, neg_dpg, kl, dkl, H = _token_block(
                offs, inb, lp_ptr, ent_ptr, adv_ptr, mask_ptr, old_ptr, roll_ptr, ref_ptr,
                keep_seq, w_seq, is_factor, clip_lo, clip_hi, clip_c, is_lo, is_hi,
                rs_lo_tk1, rs_hi_tk1, rs_hi_tk2, rs_hi_tk3,
                DECOUPLED, HAS_ROLL, IS_LEVEL, IS_ICEPOP, IS_BN, RS, REINFORCE, HAS_DUAL, KL_TYPE, HAS_ENT,
            )
            a = keep.to(tl.float32) * seq_scale
            coef = a * dL
            if KL_TYPE > 0:
                coef = coef + tl.where(kl_coef != 0.0, (kl_coef * a) * dkl, 0.0)
            tl.store(coef_ptr + offs, coef, mask=inb)
            if WRITE_E:
                tl.store(coef_ent_ptr + offs, neg_ent_coeff * a, mask=inb)


@triton.jit
def _seq_stage_finish_kernel(
    # data ptrs: column totals [NUM_P] (sums) and [NUM_X] (maxima) over sequences; output [NUM_OUT];
    # the per-sequence partials [S, NUM_P] (read only for the IS weight variance)
    psum_ptr, pmax_ptr, out_ptr, psum_rows_ptr,
    # sizes
    S,
    # scalars (fp32; <= 0 means "use the local count")
    kl_coef, ent_coeff, num_tokens, num_seqs, scale_k,
    # constexpr
    HAS_ROLL: tl.constexpr, IS_LEVEL: tl.constexpr, RS: tl.constexpr, KL_TYPE: tl.constexpr,
    HAS_ENT: tl.constexpr, AGG: tl.constexpr, BLOCK_S: tl.constexpr,
):
    # One program: turns the column totals into the global factor g of SPEC §7, the loss and every
    # metric of SPEC §8 (means over an empty set are 0). Reads <= 96 floats (+ 8 B per sequence with
    # IS weights, for a variance that does not cancel), writes NUM_OUT floats.
    n_tok = tl.load(psum_ptr + P_CNT)
    n_seq = tl.load(psum_ptr + P_NONEMPTY)
    n_tok_d = tl.where(n_tok > 0, n_tok, 1.0)
    n_seq_d = tl.where(n_seq > 0, n_seq, 1.0)
    if HAS_ROLL:
        tl.store(out_ptr + O_KL, tl.load(psum_ptr + P_KL) / n_tok_d)
        tl.store(out_ptr + O_K3KL, tl.load(psum_ptr + P_K3KL) / n_tok_d)
        tl.store(out_ptr + O_CHI2T, tl.load(psum_ptr + P_CHI2T) / n_tok_d)
        chi2_seq = tl.load(psum_ptr + P_CHI2S) / n_seq_d
        tl.store(out_ptr + O_CHI2S, chi2_seq)
        tl.store(out_ptr + O_TV, tl.load(psum_ptr + P_TV) / n_tok_d)
        log_n_seq = tl.log(n_seq_d)
        tl.store(out_ptr + O_TPPL, tl.exp(tl.load(psum_ptr + P_TPPL) - log_n_seq))
        tl.store(out_ptr + O_RPPL, tl.exp(tl.load(psum_ptr + P_RPPL) - log_n_seq))
        tl.store(out_ptr + O_TLOG, tl.load(psum_ptr + P_TLOG) / n_seq_d)
        tl.store(out_ptr + O_RLOG, tl.load(psum_ptr + P_RLOG) / n_seq_d)
        tl.store(out_ptr + O_DIFF, tl.load(psum_ptr + P_DIFF) / n_seq_d)
        tl.store(out_ptr + O_ABSDIFF, tl.load(psum_ptr + P_ABSDIFF) / n_seq_d)
        tl.store(out_ptr + O_DIFFMAX, tl.where(n_seq > 0, tl.load(pmax_ptr + X_DIFFMAX), 0.0))
        tl.store(out_ptr + O_DIFFMIN, tl.where(n_seq > 0, -tl.load(pmax_ptr + X_DIFFMIN), 0.0))
        tl.store(out_ptr + O_PPLR, tl.exp(tl.load(psum_ptr + P_PPLR) - log_n_seq))
        # sqrt(2 (1 + chi2_seq)) as sqrt(2 E[rho_seq^2]): 1 + chi2_seq rounds to 0 when every rho_seq is tiny
        tl.store(out_ptr + O_CSTAR, tl.sqrt(2.0 * (tl.load(psum_ptr + P_RHO2S) / n_seq_d)))
        if IS_LEVEL > 0:
            mean_x = tl.load(psum_ptr + P_ISX) / n_tok_d
            mean_x2 = tl.load(psum_ptr + P_ISX2) / n_tok_d
            # variance without E[x^2] - E[x]^2 cancellation (Chan et al.): sum_i M2_i + sum_i n_i (m_i - m)^2,
            # M2_i around each sequence's own mean (0 for sequence-level weights, constant per sequence)
            acc_between = tl.zeros([BLOCK_S], tl.float32)
            for s0 in range(0, S, BLOCK_S):
                offs_s = (s0 + tl.arange(0, BLOCK_S)).to(tl.int64)
                in_s = offs_s < S
                n_i = tl.load(psum_rows_ptr + offs_s * NUM_P + P_CNT, mask=in_s, other=0.0)
                sx_i = tl.load(psum_rows_ptr + offs_s * NUM_P + P_ISX, mask=in_s, other=0.0)
                dev = sx_i / tl.where(n_i > 0, n_i, 1.0) - mean_x
                acc_between += tl.where(n_i > 0, n_i * (dev * dev), 0.0)
            m2 = tl.sum(acc_between, axis=0)
            if IS_LEVEL == 1:
                m2 = m2 + tl.load(psum_ptr + P_ISM2)
            tl.store(out_ptr + O_ISMEAN, tl.load(psum_ptr + P_ISW) / n_tok_d)
            tl.store(out_ptr + O_ISSTD, tl.sqrt(m2 / n_tok_d))
            tl.store(out_ptr + O_ISMIN, tl.where(n_tok > 0, -tl.load(pmax_ptr + X_ISMIN), 0.0))
            tl.store(out_ptr + O_ISMAX, tl.where(n_tok > 0, tl.load(pmax_ptr + X_ISMAX), 0.0))
            if IS_LEVEL == 1:
                frac_d = n_tok_d
            else:
                frac_d = n_seq_d
            tl.store(out_ptr + O_ISHI, tl.load(psum_ptr + P_ISHI) / frac_d)
            tl.store(out_ptr + O_ISLO, tl.load(psum_ptr + P_ISLO) / frac_d)
            # ESS = 1 / mean((x / mean x)^2) = mean_x^2 / mean(x^2); 0 when every weight is 0
            tiny = 1.1754943508222875e-38
            mean_c = tl.where(mean_x < tiny, tiny, mean_x)
            ratio = (mean_x2 / mean_c) / mean_c
            ess = 1.0 / tl.where(ratio < tiny, tiny, ratio)
            tl.store(out_ptr + O_ESS, tl.where(mean_x > 0, ess, 0.0))
        if RS:
            for j in tl.static_range(11):
                if RS & (1 << j):
                    if j < 3:
                        opt_d = n_tok_d
                    else:
                        opt_d = n_seq_d
                    tl.store(out_ptr + O_RS + 4 * j, tl.load(psum_ptr + P_RS + 2 * j) / opt_d)
                    tl.store(out_ptr + O_RS + 4 * j + 1, tl.where(n_tok > 0, tl.load(pmax_ptr + X_RS + 2 * j), 0.0))
                    neg_min = tl.load(pmax_ptr + X_RS + 2 * j + 1)
                    tl.store(out_ptr + O_RS + 4 * j + 2, tl.where(n_tok > 0, -neg_min, 0.0))
                    tl.store(out_ptr + O_RS + 4 * j + 3, tl.load(psum_ptr + P_RS + 2 * j + 1) / n_tok_d)
            tl.store(out_ptr + O_REJ, tl.load(psum_ptr + P_REJ) / n_tok_d)
            tl.store(out_ptr + O_SEQREJ, tl.load(psum_ptr + P_SEQREJ) / n_seq_d)
    # SPEC §7: agg(X) = g * sum_i s_i sum_t m'_t X_t
    n_f = tl.load(psum_ptr + P_CNTF)
    n_f_d = tl.where(n_f > 0, n_f, 1.0)
    g_f = tl.load(psum_ptr + P_NONEMPTYF)
    g_d = tl.where(num_seqs > 0, num_seqs, tl.where(g_f > 0, g_f, 1.0))
    if AGG == 0:
        scale = 1.0 / tl.where(num_tokens > 0, num_tokens, n_f_d)
    elif AGG == 1:
        scale = n_f * 0.0 + 1.0
    elif AGG == 4:
        width = tl.load(pmax_ptr + X_WIDTH)
        k = tl.where(scale_k > 0, scale_k, tl.where(width > 1.0, width, 1.0))
        scale = 1.0 / (g_d * k)
    else:
        scale = 1.0 / g_d
    pg_loss = tl.load(psum_ptr + P_PG) * scale
    loss = pg_loss
    tl.store(out_ptr + O_SCALE, scale)
    tl.store(out_ptr + O_PG, pg_loss)
    tl.store(out_ptr + O_CLIP, tl.load(psum_ptr + P_CLIP) / n_f_d)
    tl.store(out_ptr + O_DUAL, tl.load(psum_ptr + P_DUAL) / n_f_d)
    tl.store(out_ptr + O_PPOKL, tl.load(psum_ptr + P_PPOKL) / n_f_d)
    if KL_TYPE > 0:
        kl_loss = tl.load(psum_ptr + P_KLL) * scale
        tl.store(out_ptr + O_KLL, kl_loss)
        loss = loss + tl.where(kl_coef != 0.0, kl_coef * kl_loss, 0.0)
    if HAS_ENT:
        ent = tl.load(psum_ptr + P_ENT) * scale
        tl.store(out_ptr + O_ENT, ent)
        loss = loss - tl.where(ent_coeff != 0.0, ent_coeff * ent, 0.0)
    tl.store(out_ptr + O_LOSS, loss)


# ---------------------------------------------------------------------------------------------
# launcher
# ---------------------------------------------------------------------------------------------
def _block_t(longest: int) -> int:
    # one block covers a whole short sequence; 1024 tokens per iteration beyond that
    return min(max(triton.next_power_of_2(max(longest, 1)), 16), 1024)


_FINISH_BLOCK_S = 256  # sequences per iteration of the finish kernel's variance loop
_FINISH_WARPS = 4


def _num_warps(block_t: int) -> int:
    # the all-options variant needs 239 registers per thread at BLOCK_T=1024 with 4 warps, 128 with 8 (sm_90, no spills)
    return 8 if block_t >= 512 else 4


def _rs_args(rs) -> Tuple[int, List[float]]:
    """Bit flags and the 14 fp32 thresholds (k1 bounds in log space) of the rejection options."""
    bounds = dict(rs)
    flags = 0
    for name in bounds:
        flags |= RS_BITS[name]

    def k1(name):
        lo, hi = bounds.get(name, (1.0, 1.0))
        return [math.log(lo), math.log(hi)]

    def up(name):
        return [float(bounds.get(name, 0.0))]

    args = (k1("token_k1") + up("token_k2") + up("token_k3")
            + k1("seq_sum_k1") + up("seq_sum_k2") + up("seq_sum_k3")
            + k1("seq_mean_k1") + up("seq_mean_k2") + up("seq_mean_k3")
            + up("seq_max_k2") + up("seq_max_k3"))
    return flags, args


def _metric_slots(has_roll: bool, rs, is_level, has_ref: bool, has_ent: bool) -> List[Tuple[str, int]]:
    """The metric keys of `loss.sequence_stage`, in its order, with their slot in the output vector."""
    slots: List[Tuple[str, int]] = []
    if has_roll:
        if rs:
            for name, _ in rs:
                j = RS_OPTIONS.index(name)
                base = int(O_RS) + 4 * j
                prefix = f"rollout_corr/rollout_rs_{name}"
                slots += [(f"{prefix}_mean", base), (f"{prefix}_max", base + 1), (f"{prefix}_min", base + 2),
                          (f"{prefix}_masked_fraction", base + 3)]
            slots += [("rollout_corr/rollout_rs_masked_fraction", int(O_REJ)),
                      ("rollout_corr/rollout_rs_seq_masked_fraction", int(O_SEQREJ))]
        names = [("kl", O_KL), ("k3_kl", O_K3KL), ("chi2_token", O_CHI2T), ("chi2_seq", O_CHI2S), ("tv_token", O_TV),
                 ("training_ppl", O_TPPL), ("rollout_ppl", O_RPPL), ("training_log_ppl", O_TLOG),
                 ("rollout_log_ppl", O_RLOG), ("log_ppl_diff", O_DIFF), ("log_ppl_abs_diff", O_ABSDIFF),
                 ("log_ppl_diff_max", O_DIFFMAX), ("log_ppl_diff_min", O_DIFFMIN), ("ppl_ratio", O_PPLR),
                 ("c_star", O_CSTAR)]
        if is_level is not None:
            names += [("rollout_is_mean", O_ISMEAN), ("rollout_is_std", O_ISSTD), ("rollout_is_min", O_ISMIN),
                      ("rollout_is_max", O_ISMAX), ("rollout_is_ratio_fraction_high", O_ISHI),
                      ("rollout_is_ratio_fraction_low", O_ISLO), ("rollout_is_eff_sample_size", O_ESS)]
        slots += [(f"rollout_corr/{k}", int(v)) for k, v in names]
    slots += [("actor/pg_loss", int(O_PG)), ("actor/pg_clipfrac", int(O_CLIP)),
              ("actor/pg_clipfrac_lower", int(O_DUAL)), ("actor/ppo_kl", int(O_PPOKL))]
    if has_ref:
        slots.append(("actor/kl_loss", int(O_KLL)))
    if has_ent:
        slots.append(("actor/entropy", int(O_ENT)))
    return slots


def _cu_seqlens(seg: Segments, device) -> torch.Tensor:
    cu = seg.cu_seqlens
    if cu is not None:
        return cu.to(device=device, dtype=torch.int64).contiguous()
    # seq_id is non-decreasing, so the first token of sequence s is where s would be inserted
    return torch.searchsorted(seg.seq_id, torch.arange(seg.num_seqs + 1, device=device, dtype=seg.seq_id.dtype))


def sequence_stage_triton(
    lp: torch.Tensor, entropy: Optional[torch.Tensor], advantages: torch.Tensor, mask: torch.Tensor,
    old: Optional[torch.Tensor], rollout: Optional[torch.Tensor], ref: Optional[torch.Tensor],
    seg: Segments, config: PolicyLossConfig,
) -> StageOutput:
    """Fused SPEC §4-§8 per-sequence stage; same contract as `rlkernels.loss.sequence_stage`.

    Args:
        lp: [N] detached ℓθ; entropy: [N] detached H or None; advantages: [N]; mask: [N] bool (m).
        old, rollout, ref: [N] ℓold, ℓμ, ℓref or None (the mode of SPEC §1 follows from which are given).
        seg: the `Segments` of the flat token axis (padded rows or packed cu_seqlens).
        config: the `PolicyLossConfig`; thresholds reach the kernels as fp32 run-time arguments.
    Returns:
        StageOutput(loss 0-d, coef_logprob [N], coef_entropy [N] or None, is_weights [N] or None,
        mask [N] bool (m'), metrics {name: 0-d}); computed in fp32, returned in lp's dtype.
    """
    device = lp.device
    out_dtype = lp.dtype
    N = lp.numel()
    S = seg.num_seqs
    rc = config.rollout_correction
    has_roll = rollout is not None
    decoupled = old is not None
    is_level = rc.is_level if (has_roll and rc is not None) else None
    rs = rc.rs if (has_roll and rc is not None) else ()
    reinforce = config.loss_type == "reinforce"
    apply_w = is_level is not None and (reinforce or decoupled)
    has_ref = ref is not None
    has_ent = entropy is not None
    write_e = has_ent and config.entropy_coeff != 0.0
    is_bn = is_level is not None and rc.is_batch_normalize
    agg = AGG_CODES[config.loss_agg_mode]

    def flat(x):
        return None if x is None else x.reshape(-1).to(torch.float32).contiguous()

    lp_f, ent_f, adv_f = flat(lp), flat(entropy), flat(advantages)
    old_f, roll_f, ref_f = flat(old), flat(rollout), flat(ref)
    mask_b = mask.reshape(-1).to(torch.bool).contiguous()
    mask_u8 = mask_b.view(torch.uint8)
    packed = seg.padded_T is None
    T = 0 if packed else int(seg.padded_T)
    cu = _cu_seqlens(seg, device) if packed else lp_f
    block_t = _block_t(N if packed else T)

    if is_level is not None:
        is_lo, is_hi = rc.is_bounds
    else:
        is_lo, is_hi = 1.0, 1.0
    rs_flags, rs_vals = _rs_args(rs)

    is_factor = None
    if is_bn:
        sums = torch.empty((S, 2), dtype=torch.float32, device=device)
        if S > 0:
            _is_weight_sums_kernel[(S,)](
                old_f if decoupled else lp_f, roll_f, mask_u8, cu, sums, T, is_lo, is_hi,
                PACKED=packed, IS_LEVEL=IS_LEVEL_CODES[is_level], IS_ICEPOP=rc.is_icepop, BLOCK_T=block_t,
                num_warps=_num_warps(block_t),
            )
        lengths, w_sums = sums[:, 0], sums[:, 1]
        if is_level == "token":
            mean = w_sums.sum() / lengths.sum().clamp_min(1)
        else:  # over non-empty sequences, one weight each
            nonempty = lengths > 0
            per_seq = torch.where(nonempty, w_sums / lengths.clamp_min(1), torch.zeros_like(w_sums))
            mean = per_seq.sum() / nonempty.sum().clamp_min(1)
        is_factor = torch.where(mean > _MIN_BATCH_MEAN, mean, torch.ones_like(mean))

    coef = torch.empty(N, dtype=torch.float32, device=device)
    coef_ent = torch.empty(N, dtype=torch.float32, device=device) if write_e else None
    w_out = torch.empty(N, dtype=torch.float32, device=device) if apply_w else None
    mask_out = torch.empty(N, dtype=torch.uint8, device=device) if rs else None
    psum = torch.empty((S, int(NUM_P)), dtype=torch.float32, device=device)
    pmax = torch.empty((S, int(NUM_X)), dtype=torch.float32, device=device)
    dummy = lp_f
    if S > 0:
        _seq_stage_fwd_kernel[(S,)](
            lp_f, ent_f if has_ent else dummy, adv_f, mask_u8, old_f if decoupled else dummy,
            roll_f if has_roll else dummy, ref_f if has_ref else dummy,
            coef, coef_ent if write_e else coef, w_out if apply_w else coef,
            mask_out if rs else mask_u8,
            psum, pmax, cu, is_factor if is_bn else dummy,
            T,
            1.0 - config.clip_ratio_low, 1.0 + config.clip_ratio_high,
            config.clip_ratio_c if config.clip_ratio_c is not None else 0.0,
            config.kl_coef, -config.entropy_coeff,
            is_lo, is_hi, math.log(is_lo), math.log(is_hi),
            *rs_vals,
            PACKED=packed, DECOUPLED=decoupled, HAS_ROLL=has_roll, IS_LEVEL=IS_LEVEL_CODES[is_level],
            IS_ICEPOP=bool(is_level is not None and rc.is_icepop), IS_BN=is_bn, RS=rs_flags, REINFORCE=reinforce,
            HAS_DUAL=config.clip_ratio_c is not None, KL_TYPE=KL_CODES[config.kl_type] if has_ref else 0,
            HAS_ENT=has_ent, WRITE_E=write_e, RETURN_W=apply_w, RETURN_MASK=bool(rs), AGG=agg, BLOCK_T=block_t,
            num_warps=_num_warps(block_t),
        )
        psum_tot = psum.sum(0)  # fixed-order reductions over sequences: deterministic
        pmax_tot = pmax.amax(0)
        psum_tot[_LSE_COLUMNS] = torch.logsumexp(psum[:, _LSE_COLUMNS], dim=0)
    else:
        psum_tot = torch.zeros(int(NUM_P), dtype=torch.float32, device=device)
        psum_tot[_LSE_COLUMNS] = float("-inf")
        pmax_tot = torch.full((int(NUM_X),), float("-inf"), dtype=torch.float32, device=device)
    out = torch.zeros(int(NUM_OUT), dtype=torch.float32, device=device)
    _seq_stage_finish_kernel[(1,)](
        psum_tot, pmax_tot, out, psum if S > 0 else psum_tot, S,
        config.kl_coef, config.entropy_coeff,
        config.global_num_tokens if config.global_num_tokens is not None else -1.0,
        config.global_num_seqs if config.global_num_seqs is not None else -1.0,
        config.loss_scale_factor if config.loss_scale_factor is not None else -1.0,
        HAS_ROLL=has_roll, IS_LEVEL=IS_LEVEL_CODES[is_level], RS=rs_flags,
        KL_TYPE=KL_CODES[config.kl_type] if has_ref else 0, HAS_ENT=has_ent, AGG=agg, BLOCK_S=_FINISH_BLOCK_S,
        num_warps=_FINISH_WARPS,
    )
    scale = out[int(O_SCALE)]
    if agg != AGG_CODES["token-sum"]:
        coef = coef * scale
        if write_e:
            coef_ent = coef_ent * scale
    final_mask = mask_out.view(torch.bool) if rs else mask_b

    if out_dtype != torch.float32:
        out = out.to(out_dtype)
        coef = coef.to(out_dtype)
        coef_ent = None if coef_ent is None else coef_ent.to(out_dtype)
        w_out = None if w_out is None else w_out.to(out_dtype)
        is_factor = None if is_factor is None else is_factor.to(out_dtype)
    metrics: Dict[str, torch.Tensor] = {
        name: out[slot] for name, slot in _metric_slots(has_roll, rs, is_level, has_ref, has_ent)
    }
    if is_bn:
        metrics["rollout_corr/rollout_is_batch_norm_factor"] = is_factor
    # keep the torch order: rollout_corr/* (batch-norm factor last) before actor/*
    order = [k for k in metrics if k.startswith("rollout_corr/")] + [k for k in metrics if k.startswith("actor/")]
    metrics = {k: metrics[k] for k in order}
    return StageOutput(out[int(O_LOSS)], coef, coef_ent, w_out, final_mask, metrics)


# ---------------------------------------------------------------------------------------------
# ahead-of-time compile specs
# ---------------------------------------------------------------------------------------------
_FWD_PTRS = ("lp_ptr", "ent_ptr", "adv_ptr", "mask_ptr", "old_ptr", "roll_ptr", "ref_ptr",
             "coef_ptr", "coef_ent_ptr", "w_out_ptr", "mask_out_ptr", "psum_ptr", "pmax_ptr", "cu_ptr",
             "is_factor_ptr")
_FWD_SCALARS = ("clip_lo", "clip_hi", "clip_c", "kl_coef", "neg_ent_coeff", "is_lo", "is_hi", "log_is_lo",
                "log_is_hi", "rs_lo_tk1", "rs_hi_tk1", "rs_hi_tk2", "rs_hi_tk3", "rs_lo_sk1", "rs_hi_sk1",
                "rs_hi_sk2", "rs_hi_sk3", "rs_lo_mk1", "rs_hi_mk1", "rs_hi_mk2", "rs_hi_mk3", "rs_hi_xk2",
                "rs_hi_xk3")
_FWD_CONSTEXPRS = ("PACKED", "DECOUPLED", "HAS_ROLL", "IS_LEVEL", "IS_ICEPOP", "IS_BN", "RS", "REINFORCE",
                   "HAS_DUAL", "KL_TYPE", "HAS_ENT", "WRITE_E", "RETURN_W", "RETURN_MASK", "AGG", "BLOCK_T")


def _fwd_spec(name: str, **cx) -> AotSpec:
    ptr_types = {"mask_ptr": "*u8", "mask_out_ptr": "*u8", "cu_ptr": "*i64"}
    sig = {p: ptr_types.get(p, "*fp32") for p in _FWD_PTRS}
    sig["T"] = "i32"
    sig.update({s: "fp32" for s in _FWD_SCALARS})
    sig.update({c: "constexpr" for c in _FWD_CONSTEXPRS})
    aligned = tuple(p for p in _FWD_PTRS if p != "is_factor_ptr")
    label = ",".join(f"{k}={int(v)}" for k, v in cx.items())
    return AotSpec(f"seq_stage_fwd[{name}:{label}]", _seq_stage_fwd_kernel, sig, dict(cx),
                   num_warps=_num_warps(cx["BLOCK_T"]), aligned=aligned)


def aot_specs() -> List[AotSpec]:
    """Representative constexpr configurations of the launcher: each loss type x IS level x agg mode,
    with and without rejection options, both layouts, and the pre-pass and finish kernels."""
    specs: List[AotSpec] = []
    base = dict(PACKED=True, DECOUPLED=True, HAS_ROLL=True, IS_LEVEL=0, IS_ICEPOP=False, IS_BN=False, RS=0,
                REINFORCE=False, HAS_DUAL=True, KL_TYPE=0, HAS_ENT=False, WRITE_E=False, RETURN_W=False,
                RETURN_MASK=False, AGG=0, BLOCK_T=1024)
    all_rs = (1 << len(RS_OPTIONS)) - 1
    some_rs = RS_BITS["seq_mean_k1"] | RS_BITS["token_k3"]  # Geo-RS + a token option
    # ppo_clip (decoupled) x IS level x agg mode; rejection on for every other one, layouts alternate
    for is_level in (0, 1, 2):
        for agg in range(5):
            rs = some_rs if (is_level + agg) % 2 else 0
            specs.append(_fwd_spec("ppo", **dict(base, IS_LEVEL=is_level, AGG=agg, RS=rs, RETURN_MASK=bool(rs),
                                                 RETURN_W=is_level > 0, PACKED=agg % 2 == 0)))
    # reinforce (bypass) x IS level x {token-mean, seq-mean-token-mean}: the agg modes differ only by pass 3
    for is_level in (0, 1, 2):
        for agg in (0, 3):
            specs.append(_fwd_spec("reinforce", **dict(base, REINFORCE=True, DECOUPLED=False, IS_LEVEL=is_level,
                                                       AGG=agg, RS=some_rs if agg else 0, RETURN_MASK=bool(agg),
                                                       RETURN_W=is_level > 0)))
    # the heaviest variants: every option, icepop + batch normalisation, KL, entropy, padded small block
    specs.append(_fwd_spec("all", **dict(base, IS_LEVEL=2, IS_BN=True, RS=all_rs, RETURN_MASK=True, RETURN_W=True,
                                         KL_TYPE=3, HAS_ENT=True, WRITE_E=True, AGG=3)))
    specs.append(_fwd_spec("icepop", **dict(base, IS_LEVEL=1, IS_ICEPOP=True, IS_BN=True, RETURN_W=True, KL_TYPE=2,
                                            HAS_ENT=True, PACKED=False, BLOCK_T=256)))
    specs.append(_fwd_spec("onpolicy", **dict(base, DECOUPLED=False, HAS_ROLL=False, KL_TYPE=1, HAS_DUAL=False)))
    specs.append(_fwd_spec("bypass", **dict(base, DECOUPLED=False, IS_LEVEL=1, RS=RS_BITS["seq_sum_k1"],
                                            RETURN_MASK=True, BLOCK_T=16)))
    for is_level in (1, 2):
        specs.append(AotSpec(
            f"is_weight_sums[IS_LEVEL={is_level}]", _is_weight_sums_kernel,
            {"ltr_ptr": "*fp32", "roll_ptr": "*fp32", "mask_ptr": "*u8", "cu_ptr": "*i64", "out_ptr": "*fp32",
             "T": "i32", "is_lo": "fp32", "is_hi": "fp32", "PACKED": "constexpr", "IS_LEVEL": "constexpr",
             "IS_ICEPOP": "constexpr", "BLOCK_T": "constexpr"},
            {"PACKED": True, "IS_LEVEL": is_level, "IS_ICEPOP": False, "BLOCK_T": 1024}, num_warps=8,
            aligned=("ltr_ptr", "roll_ptr", "mask_ptr")))
    fin_sig = {"psum_ptr": "*fp32", "pmax_ptr": "*fp32", "out_ptr": "*fp32", "psum_rows_ptr": "*fp32", "S": "i32",
               "kl_coef": "fp32", "ent_coeff": "fp32", "num_tokens": "fp32", "num_seqs": "fp32", "scale_k": "fp32",
               "HAS_ROLL": "constexpr", "IS_LEVEL": "constexpr", "RS": "constexpr", "KL_TYPE": "constexpr",
               "HAS_ENT": "constexpr", "AGG": "constexpr", "BLOCK_S": "constexpr"}
    for agg in range(5):
        cx = dict(HAS_ROLL=True, IS_LEVEL=agg % 3, RS=all_rs if agg % 2 else 0, KL_TYPE=3, HAS_ENT=True, AGG=agg,
                  BLOCK_S=_FINISH_BLOCK_S)
        specs.append(AotSpec(f"seq_stage_finish[AGG={agg},IS_LEVEL={agg % 3}]", _seq_stage_finish_kernel, fin_sig, cx,
                             num_warps=_FINISH_WARPS, aligned=("psum_ptr", "pmax_ptr", "out_ptr", "psum_rows_ptr")))
    return specs
