"""The per-sequence stage of the common PPO family in two launches (SPEC §4-§7): what ~60 [N]-sized torch ops (or a
compiled graph of ~50 generated kernels) compute for the loss and its gradient coefficients.

    _sequence_kernel   one program per sequence, two reads of its tokens. The first sums what the sequence's
                       decisions need (masked length, log-ratio, k1 / k3 statistics over m or the tokens the
                       token-level options keep, the tokens outside seq_all_k1's bounds, and with a sequence-level
                       policy ratio its log-ratio); the decisions follow (IS weight, rejection). The second forms each
                       token's IS weight, final mask, policy term and its derivative, the KL penalty's derivative,
                       and the sequence's sums of the loss's terms (and of the derivatives in its mean log-ratio,
                       the policy term's and the bias-corrected KL's, which the finish chains to each of its tokens).
    _finish_kernel     one program per block of tokens. Each first reduces the [S] record to the batch's
                       normalisers and, with is_batch_normalize, the IS weights' mean (a few KB, read from L2 by every
                       program: no atomics, no ticket, the same bits every run). Program 0 writes the loss; every
                       program scales its tokens' coefficients by their aggregation weight a_t.

Every hyperparameter is a run-time float argument, so a new clip ratio, threshold or coefficient launches the same
binary; only the option *set* (which correction, which KL type, which aggregation) is constexpr. The arithmetic is
the torch stage's, in float32, in a different summation order: stage/fused.py says which configs this covers and
tests/stage/test_fused_stage.py holds it to the torch stage.
"""

import math

import torch
import triton
import triton.language as tl

from ..stage_options import (
    AGGREGATIONS,
    BINARY_EPS,
    CHAINED_TERMS,
    FINISH_HYPERPARAMETERS,
    SEQUENCE_HYPERPARAMETERS,
    SEQUENCE_LEVEL_TERMS,
    option_codes,
)
from .aot_spec import AotSpec
from .token_stats import device_guard

BLOCK = 512  # tokens per step of a sequence's reads and per finish program
BLOCK_S = 256  # sequences per step of the finish programs' record reduction
# per-sequence record: policy-term sum, KL sum, entropy sum (over m'), final length, width, the IS weights' sum (the
# token weights', or the sequence's one weight), masked length, the sum over m' of the weighted policy derivative in
# the sequence's log-ratio (ratio_level="sequence": each token's coefficient is the sequence's mean of it), and the KL
# sum over m' where the bias-corrected KL's ratio is the sequence's and its clamp passes the gradient (0 elsewhere),
# the sum over m' of (log p/q)^2 against the sampler (log_ratio_sq_coef's term)
RECORD_WIDTH = 10
RECORD = tl.constexpr(RECORD_WIDTH)
CLAMP = tl.constexpr(20.0)  # SPEC §4: every importance log-ratio is clamped to [-20, 20] before exp
# the binary divergences' probabilities are clamped to [eps, 1 - eps] (correction.BINARY_EPS), their logs to the logs
BINARY_LO = tl.constexpr(BINARY_EPS)
BINARY_HI = tl.constexpr(1.0 - BINARY_EPS)
LOG_BINARY_LO = tl.constexpr(math.log(BINARY_EPS))
LOG_BINARY_HI = tl.constexpr(math.log1p(-BINARY_EPS))


@triton.jit
def _clamp(x, lo, hi):
    """torch.clamp: NaN stays NaN (a GPU's min / max would return the bound), as the torch stage's decisions see it."""
    return tl.minimum(tl.maximum(x, lo, propagate_nan=tl.PropagateNan.ALL), hi, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def on_mask(ptr, idx, inside, m):
    """A per-token input as float32 on the mask, 0 off it (padding may hold NaN: it must reach no sum), as the torch
    stage's inputs are (loss._masked_inputs)."""
    return tl.where(m, tl.load(ptr + idx, mask=inside, other=0.0).to(tl.float32), 0.0)


@triton.jit
def _truncated(raw, live, lo, hi, IS_MASK: tl.constexpr):
    """SPEC §4: raw clamped to [lo, hi] (IcePop: 0 outside it), 0 where not `live`."""
    if IS_MASK:  # nested selects: `live` may be a 0-d flag, which the interpreter cannot `&` with a block
        return tl.where(live, tl.where(raw >= lo, tl.where(raw <= hi, raw, 0.0), 0.0), 0.0)
    return tl.where(live, _clamp(raw, lo, hi), 0.0)


@triton.jit
def kl_and_grad(lp, ref, KL_TYPE: tl.constexpr, KL_STRAIGHT: tl.constexpr):
    """SPEC §6's penalty and its derivative in lp (stage/loss.py kl_and_grad); KL_STRAIGHT: k2's derivative."""
    if KL_TYPE == 1:
        kl = lp - ref
        dkl = tl.full(lp.shape, 1.0, tl.float32)
    elif KL_TYPE == 2:
        kl = 0.5 * ((lp - ref) * (lp - ref))
        dkl = lp - ref
    elif KL_TYPE == 3:
        kl = tl.abs(lp - ref)
        dkl = tl.where(lp > ref, 1.0, tl.where(lp < ref, -1.0, 0.0))
    elif KL_TYPE == 4:
        d_raw = ref - lp
        d = _clamp(d_raw, -CLAMP, CLAMP)
        k3_raw = tl.exp(d) - d - 1.0
        kl = _clamp(k3_raw, -10.0, 10.0)
        live = (d_raw >= -CLAMP) & (d_raw <= CLAMP) & (k3_raw <= 10.0) & (k3_raw >= -10.0)
        dkl = tl.where(live, 1.0 - tl.exp(d), 0.0)
    else:
        d = ref - lp
        kl = tl.exp(d) - d - 1.0
        dkl = 1.0 - tl.exp(d)
    if KL_STRAIGHT:
        dkl = lp - ref
    return kl, dkl


@triton.jit
def _kl_score(lp, ref, kl, dkl, KL_TYPE: tl.constexpr, KL_STRAIGHT: tl.constexpr):
    """kl_score_gradient's derivative (NeMo-RL: k x exp(lp - sg lp)): dkl + k where the estimator's clamps pass a
    gradient (loss.kl_gradient_passes: everywhere but k3's, |ref - lp| <= 20 and k3 <= 10)."""
    if KL_TYPE == 4 and not KL_STRAIGHT:
        d_raw = ref - lp
        d = _clamp(d_raw, -CLAMP, CLAMP)
        passes = (d_raw >= -CLAMP) & (d_raw <= CLAMP) & (tl.exp(d) - d - 1.0 <= 10.0)
        score = dkl + tl.where(passes, kl, 0.0)
    elif KL_TYPE == 5 and not KL_STRAIGHT:  # (1 - e^d) + (e^d - d - 1) = -d: the e^d terms cancel exactly
        score = lp - ref
    else:
        score = dkl + kl
    return score


@triton.jit
def _bias_corrected_kl(lp, ref, log_r, kl, dkl, ratio_clamp, RATIO_CLAMP: tl.constexpr, KL_TYPE: tl.constexpr,
                       KL_STRAIGHT: tl.constexpr, TOKEN_RATIO: tl.constexpr):
    """kl_bias_correction (DeepSeek-V3.2's, TRL's use_bias_correction_kl; loss._bias_corrected_kl): the penalty
    times the policy ratio r = exp(log_r) and its derivative in lp. The token's ratio (TOKEN_RATIO) adds its own
    derivative r k where the clamp passes it; the sequence's goes through its mean log-ratio, which the finish chains.
    The unclamped k3 is e^(d + log r) - (d + 1) r, d = ref - lp, with -d r its token-level derivative (two e^d terms
    of ~1e17 would cancel otherwise)."""
    r = _policy_ratio(log_r, ratio_clamp, RATIO_CLAMP)
    value = kl * r
    corrected = dkl * r
    UNCLAMPED_K3: tl.constexpr = KL_TYPE == 5 and not KL_STRAIGHT
    if UNCLAMPED_K3:
        d = ref - lp
        if RATIO_CLAMP:
            value = tl.exp(d + _clamp(log_r, -ratio_clamp, ratio_clamp)) - (d + 1.0) * r
        else:
            value = tl.exp(d + log_r) - (d + 1.0) * r
    if TOKEN_RATIO:  # r's own derivative joins where the clamp passes it (everywhere without one)
        if UNCLAMPED_K3:
            passed = (lp - ref) * r
        else:
            passed = corrected + value
        if RATIO_CLAMP:
            corrected = tl.where(tl.abs(log_r) <= ratio_clamp, passed, corrected)
        else:
            corrected = passed
    return value, corrected


@triton.jit
def _policy_ratio(log_r, ratio_clamp, RATIO_CLAMP: tl.constexpr):
    """r = exp(log_r), log_r clamped to [-log_ratio_clamp, log_ratio_clamp] (policy_terms.clamped_ratio)."""
    if RATIO_CLAMP:
        r = tl.exp(_clamp(log_r, -ratio_clamp, ratio_clamp))
    else:
        r = tl.exp(log_r)
    return r


@triton.jit
def ppo_term(lp, l_old, adv, ratio_clamp, clip_lo, clip_hi, clip_c, RATIO_CLAMP: tl.constexpr,
             DUAL_CLIP: tl.constexpr):
    """PPO's clipped term with dual clip of the token's policy ratio exp(lp - l_old) and its derivative in lp,
    unweighted. Shared with the gradient formed in the forward (forward_grad.py), which must form a token's
    coefficient in the very operations the stage does."""
    return ppo_clip(lp - l_old, adv, ratio_clamp, clip_lo, clip_hi, clip_c, RATIO_CLAMP, DUAL_CLIP)


@triton.jit
def ppo_clip(log_r, adv, ratio_clamp, clip_lo, clip_hi, clip_c, RATIO_CLAMP: tl.constexpr, DUAL_CLIP: tl.constexpr):
    """PPO's clipped term with dual clip (policy_terms._ppo_clip) of the ratio exp(log_r) (log_r clamped to
    log_ratio_clamp), and its derivative in log_r, unweighted."""
    r = _policy_ratio(log_r, ratio_clamp, RATIO_CLAMP)
    neg_adv = -adv
    l1 = neg_adv * r
    l2 = neg_adv * _clamp(r, clip_lo, clip_hi)
    clipped = l2 > l1
    term = tl.where(clipped, l2, l1)
    active = ~clipped
    if DUAL_CLIP:
        l3 = neg_adv * clip_c
        dual = (adv < 0) & (l3 < term)
        term = tl.where(dual, l3, term)
        active = active & ~dual
    grad = tl.where(active, l1, 0.0)
    if RATIO_CLAMP:
        grad = tl.where(tl.abs(log_r) <= ratio_clamp, grad, 0.0)
    return term, grad


@triton.jit
def gspo_term(log_s, adv, clip_lo, clip_hi):
    """GSPO's token form (policy_terms.gspo): s = exp(min(log_s, 10)) of the sequence's mean log-ratio log_s, clipped
    as PPO, and its derivative in the token's lp (d s / d lp = s), unweighted."""
    s = tl.exp(tl.minimum(log_s, 10.0, propagate_nan=tl.PropagateNan.ALL))
    neg_adv = -adv
    l1 = neg_adv * s
    l2 = neg_adv * _clamp(s, clip_lo, clip_hi)
    clipped = l2 > l1
    return tl.where(clipped, l2, l1), tl.where(clipped, 0.0, tl.where(log_s <= 10.0, l1, 0.0))


@triton.jit
def cispo_term(lp, log_r, adv, ratio_clamp, clip_lo, clip_hi, cispo_cap, RATIO_CLAMP: tl.constexpr,
               CISPO_CAP: tl.constexpr):
    """CISPO (policy_terms.cispo): -sg(c) A lp with c = clip(r, lo, hi) or min(r, cap) of the ratio exp(log_r)
    (log_r clamped to log_ratio_clamp), and its derivative in lp, -c A, unweighted."""
    r = _policy_ratio(log_r, ratio_clamp, RATIO_CLAMP)
    if CISPO_CAP:
        c = tl.minimum(r, cispo_cap, propagate_nan=tl.PropagateNan.ALL)
    else:
        c = _clamp(r, clip_lo, clip_hi)
    grad = -c * adv
    return grad * lp, grad


@triton.jit
def sapo_term(log_r, adv, ratio_clamp, tau_pos, tau_neg, RATIO_CLAMP: tl.constexpr):
    """SAPO's soft gate (policy_terms.sapo): -A g 4 / tau with g = sigmoid(tau (r - 1)), tau by the advantage's sign,
    of the ratio exp(log_r) (log_r clamped to log_ratio_clamp), and its derivative in log_r, -A 4 g (1 - g) r where the
    clamp passes it, unweighted; 1 - g formed as sigmoid(-x), which keeps the slope of a saturated gate."""
    r = _policy_ratio(log_r, ratio_clamp, RATIO_CLAMP)
    tau = tl.where(adv > 0, tau_pos, tau_neg)
    x = tau * (r - 1.0)
    gate = tl.sigmoid(x)
    slope = gate * tl.sigmoid(-x)
    neg_adv = -adv
    grad = neg_adv * 4.0 * slope * r
    if RATIO_CLAMP:
        grad = tl.where(tl.abs(log_r) <= ratio_clamp, grad, 0.0)
    return neg_adv * gate * 4.0 / tau, grad


@triton.jit
def dro_term(lp, l_old, adv, beta):
    """DRO (policy_terms.dro): -(lp A - beta/2 d^2), d = lp - l_old unclamped, and its derivative in lp, -A + beta d,
    unweighted."""
    d = lp - l_old
    return -(lp * adv - 0.5 * beta * d * d), -adv + beta * d


@triton.jit
def dppo_term(lp, l_old, adv, ratio_clamp, clip_c, eps_lo, eps_hi, POLICY: tl.constexpr, RATIO_CLAMP: tl.constexpr,
              DUAL_CLIP: tl.constexpr):
    """verl's DPPO (policy_terms._dppo): -A sg(min(r, c)) lp on the tokens inside the region (c: clip_ratio_c, else
    20), 0 elsewhere, and its derivative in lp, unweighted. The region (policy_terms._dppo_inside): p - p_old within
    eps_hi where A > 0, within -eps_lo elsewhere (POLICY 12, dppo_tv); or the binary KL of (p_old, p) within them or
    a move against the advantage (13, dppo_kl, verl's 1e-8 guards)."""
    r = _policy_ratio(lp - l_old, ratio_clamp, RATIO_CLAMP)
    if DUAL_CLIP:
        truncated = tl.minimum(r, clip_c, propagate_nan=tl.PropagateNan.ALL)
    else:
        truncated = tl.minimum(r, 20.0, propagate_nan=tl.PropagateNan.ALL)
    p = tl.exp(lp)
    p_old = tl.exp(l_old)
    if POLICY == 12:
        inside = tl.where(adv > 0, p - p_old <= eps_hi, p - p_old >= -eps_lo)
    else:
        bkl = p_old * (l_old - lp) + (1.0 - p_old) * tl.log((1.0 - p_old + 1e-8) / (1.0 - p + 1e-8))
        inside = tl.where(adv > 0, (bkl <= eps_hi) | (p <= p_old), (bkl <= eps_lo) | (p >= p_old))
    grad = -adv * truncated
    return tl.where(inside, grad * lp, 0.0), tl.where(inside, grad, 0.0)


@triton.jit
def _one_minus_exp(x):
    """1 - e^x = -expm1(x) for x <= 0, to a few ulps where x is near 0 (Kahan's: (1 - u) x / log u, u = e^x), which
    1 - e^x would lose to cancellation; Triton has no expm1 outside libdevice."""
    u = tl.exp(x)
    near = tl.where(u == 1.0, -x, (1.0 - u) * x / tl.log(u))
    return tl.where(x > -1.0, near, 1.0 - u)  # below -1, 1 - u cancels nothing (and log u of a denormal is coarse)


@triton.jit
def trust_region_term(lp, behaviour, adv, gap_lo, gap_hi, ipo_eps, ratio_clamp, tau, POLICY: tl.constexpr,
                      RATIO_CLAMP: tl.constexpr):
    """prime-rl's trust regions on the sampler (policy_terms._rollout_trust_region): -A r + tau d^2 on the kept
    tokens, 0 elsewhere, and its derivative in lp, (-A r where the clamp passes it) + 2 tau d there, unweighted; d =
    lp - log q, r = exp(d). Kept: p - q inside [-gap_lo, gap_hi] (POLICY 5, dppo_binary_tv), not past the bound on
    the advantage's side (6, dppo_binary_tv_signed: p - q > gap_hi drops a token where A > 0, p - q < -gap_lo
    elsewhere), or |p - q| <= ipo_eps (7, IPO); selected, never multiplied, so an overflowing r off the region makes
    no NaN."""
    d = lp - behaviour
    r = _policy_ratio(d, ratio_clamp, RATIO_CLAMP)
    if POLICY == 7:  # |p - q| = e^high (1 - e^(low - high)): no cancellation of two small probabilities
        high = tl.maximum(lp, behaviour)
        keep = tl.exp(high) * _one_minus_exp(tl.minimum(lp, behaviour) - high) <= ipo_eps
    else:
        gap = tl.exp(lp) - tl.exp(behaviour)
        if POLICY == 5:
            keep = (gap >= -gap_lo) & (gap <= gap_hi)
        else:
            keep = ~tl.where(adv > 0, gap > gap_hi, gap < -gap_lo)
    scaled = -adv * r
    direct = scaled
    if RATIO_CLAMP:
        direct = tl.where(tl.abs(d) <= ratio_clamp, direct, 0.0)
    return tl.where(keep, scaled + tau * d * d, 0.0), tl.where(keep, direct + 2.0 * tau * d, 0.0)


@triton.jit
def _mismatch(old_ptr, rollout_ptr, idx, inside, m):
    """A token's trainer-sampler mismatch (correction.token_terms): delta = log π_old - log μ on the mask, delta
    clamped to [-20, 20] (SPEC §4), and k3 of the clamped delta (0 off the mask)."""
    delta = on_mask(old_ptr, idx, inside, m) - on_mask(rollout_ptr, idx, inside, m)
    delta_hat = _clamp(delta, -CLAMP, CLAMP)
    return delta, delta_hat, tl.where(m, tl.exp(delta_hat) - 1.0 - delta_hat, 0.0)


@triton.jit
def _token_keeps(m, delta_hat, k3, k1_lo, k1_hi, k2_max, k3_max, KINDS: tl.constexpr):
    """The tokens of m whose k-statistics of the set KINDS (stage_options.TOKEN_KINDS bits) are inside their bounds
    (correction._keeps: k1 in [k1_lo, k1_hi], k2 <= k2_max, k3 <= k3_max); a NaN statistic fails."""
    keep = m
    if KINDS & 1:
        keep = keep & (-delta_hat <= k1_hi) & (-delta_hat >= k1_lo)
    if KINDS & 2:
        keep = keep & (0.5 * delta_hat * delta_hat <= k2_max)
    if KINDS & 4:
        keep = keep & (k3 <= k3_max)
    return keep


@triton.jit
def _binary_parts(log_x):
    """(x, log x, log(1 - x)) of a probability given by its log, x clamped to [eps, 1 - eps] (policy_terms.binary_kl:
    1 - x formed as -expm1(log x))."""
    log_clamped = _clamp(log_x, LOG_BINARY_LO, LOG_BINARY_HI)
    return tl.exp(log_clamped), log_clamped, tl.log(_clamp(_one_minus_exp(log_x), BINARY_LO, BINARY_HI))


@triton.jit
def _binary_stats(old_ptr, rollout_ptr, idx, inside, m, BKL: tl.constexpr, BTV: tl.constexpr):
    """The sampled token's binary KL(μ || π_old) of (token, rest) and its probability gap |μ - π_old| (correction's
    bkl and btv: OpenRLHF's binary_kl and tv gates), 0 off the mask and where not asked for."""
    train = on_mask(old_ptr, idx, inside, m)
    rollout = on_mask(rollout_ptr, idx, inside, m)
    mu, log_mu, log_mu_rest = _binary_parts(rollout)
    pi, log_pi, log_pi_rest = _binary_parts(train)
    bkl = tl.zeros(idx.shape, tl.float32)
    btv = tl.zeros(idx.shape, tl.float32)
    if BKL:
        bkl = tl.where(m, mu * (log_mu - log_pi) + tl.exp(log_mu_rest) * (log_mu_rest - log_pi_rest), 0.0)
    if BTV:
        btv = tl.where(m, tl.abs(mu - pi), 0.0)
    return bkl, btv


@triton.jit
def _binary_keeps(keep, bkl, btv, bkl_max, btv_max, KINDS: tl.constexpr):
    """_token_keeps' twin for the binary divergences (KINDS bits 8: bkl <= bkl_max, 16: btv <= btv_max)."""
    if KINDS & 8:
        keep = keep & (bkl <= bkl_max)
    if KINDS & 16:
        keep = keep & (btv <= btv_max)
    return keep


@triton.jit
def _proximal(lp, old_ptr, rollout_ptr, idx, inside, m, PROXIMAL: tl.constexpr):
    """l_old of SPEC §1 on the mask: π_old (decoupled), μ (bypass), or the current log-prob (on-policy)."""
    if PROXIMAL == 1:
        l_old = on_mask(old_ptr, idx, inside, m)
    elif PROXIMAL == 2:
        l_old = on_mask(rollout_ptr, idx, inside, m)
    else:
        l_old = lp
    return l_old


@triton.jit(do_not_specialize=["seq_len"])
def _sequence_kernel(
    # inputs [N] (any float dtype; mask bool) and the packed offsets [S + 1]
    lp_ptr, entropy_ptr, adv_ptr, mask_ptr, old_ptr, rollout_ptr, ref_ptr, given_ptr, cu_ptr,
    # outputs [N] float32 / bool, and the [S, RECORD] record
    lp_out_ptr, grad_ptr, dkl_ptr, sq_ptr, weights_ptr, kept_ptr, record_ptr,
    # the padded layout's T (HAS_CU False)
    seq_len,
    # hyperparameters
    is_lo, is_hi, k1_sum_lo, k1_sum_hi, k1_mean_lo, k1_mean_hi, k3_sum_max, k3_mean_max, ratio_clamp, clip_lo,
    clip_hi, clip_c, token_k1_lo, token_k1_hi, token_k2_max, token_k3_max, all_k1_lo, all_k1_hi, cispo_cap,
    binary_tv_low, binary_tv_high, ipo_kl_tau, ipo_eps, dro_beta, tau_pos, tau_neg, eps_lo, eps_hi, k2_sum_max,
    k2_mean_max, k2_max_bound, k3_max_bound, token_bkl_max, token_btv_max, bkl_mean_max, btv_mean_max, opsm_threshold,
    # the option set
    HAS_CU: tl.constexpr, HAS_ENTROPY: tl.constexpr, PROXIMAL: tl.constexpr, WEIGHTED: tl.constexpr,
    IS_LEVEL: tl.constexpr, IS_MASK: tl.constexpr, RS_K1_SUM: tl.constexpr, RS_K1_MEAN: tl.constexpr,
    RS_K3_SUM: tl.constexpr, RS_K3_MEAN: tl.constexpr, RATIO_CLAMP: tl.constexpr, DUAL_CLIP: tl.constexpr,
    KL_TYPE: tl.constexpr, KL_STRAIGHT: tl.constexpr, POLICY: tl.constexpr, SEQ_MEAN_ADVANTAGES: tl.constexpr,
    ZERO_WEIGHT: tl.constexpr, KL_SCORE: tl.constexpr, RS_TOKEN: tl.constexpr, RS_ALL: tl.constexpr,
    SEQ_TOKENS_KEPT: tl.constexpr, GIVEN_WEIGHTS: tl.constexpr, CISPO_CAP: tl.constexpr,
    KL_BIAS_CORRECTION: tl.constexpr, SAMPLER: tl.constexpr, LOG_RATIO_SQ: tl.constexpr, RS_K2: tl.constexpr,
    RS_K3_MAX: tl.constexpr, RS_BINARY: tl.constexpr, OPSM: tl.constexpr, BLOCK: tl.constexpr,
):
    # Long on purpose: the two reads and the decisions between them are one sequence's work, in the torch stage's
    # order (correction.token_terms -> decide -> loss.run), and split into helpers they would pass a dozen values.
    s = tl.program_id(0).to(tl.int64)
    if HAS_CU:
        start = tl.load(cu_ptr + s)
        end = tl.load(cu_ptr + s + 1)
    else:
        start = s * seq_len
        end = start + seq_len
    offs = tl.arange(0, BLOCK)
    HAS_RS: tl.constexpr = RS_K1_SUM or RS_K1_MEAN or RS_K3_SUM or RS_K3_MEAN or RS_TOKEN != 0 or RS_ALL or \
        RS_K2 != 0 or RS_K3_MAX or RS_BINARY != 0
    # the binary divergences: of each token (RS_TOKEN bits 8, 16) or their means over the sequence (RS_BINARY bits)
    BKL: tl.constexpr = (RS_TOKEN & 8) != 0 or (RS_BINARY & 1) != 0
    BTV: tl.constexpr = (RS_TOKEN & 16) != 0 or (RS_BINARY & 2) != 0
    BINARY_TOKEN: tl.constexpr = RS_TOKEN >= 8
    PEAKS: tl.constexpr = RS_K2 >= 4 or RS_K3_MAX  # a k2 or k3 maximum over the sequence
    HAS_CORRECTION: tl.constexpr = HAS_RS or IS_LEVEL != 0
    # ratio_level="sequence" (PPO, CISPO, SAPO): the ratio the bias-corrected KL multiplies is the sequence's too
    SEQUENCE_LEVEL: tl.constexpr = POLICY == 1 or POLICY == 4 or POLICY == 11
    SEQUENCE_RATIO: tl.constexpr = SEQUENCE_LEVEL or POLICY == 2  # the policy ratio is the sequence's (GSPO's too)
    CHAINED: tl.constexpr = POLICY == 1 or POLICY == 11  # the derivative in log_s, chained by the finish
    TRUST_REGION: tl.constexpr = POLICY >= 5 and POLICY <= 7  # taken against the behaviour policy

    # -- first read: the sums the sequence's decisions read (correction.token_terms); vectors summed once at the end
    length_acc = tl.zeros([BLOCK], tl.float32)
    delta_acc = tl.zeros([BLOCK], tl.float32)
    k1_acc = tl.zeros([BLOCK], tl.float32)
    k3_acc = tl.zeros([BLOCK], tl.float32)
    pg_delta_acc = tl.zeros([BLOCK], tl.float32)
    adv_acc = tl.zeros([BLOCK], tl.float32)
    kept_length_acc = tl.zeros([BLOCK], tl.float32)  # the tokens the token_* options keep
    rejecting_acc = tl.zeros([BLOCK], tl.float32)  # the tokens outside seq_all_k1's band
    k2_acc = tl.zeros([BLOCK], tl.float32)
    k2_peak = tl.full([BLOCK], float("-inf"), tl.float32)  # maxima over m (correction's add_max)
    k3_peak = tl.full([BLOCK], float("-inf"), tl.float32)
    nan_acc = tl.zeros([BLOCK], tl.float32)  # a NaN statistic makes its maximum NaN, as torch's max
    bkl_acc = tl.zeros([BLOCK], tl.float32)
    btv_acc = tl.zeros([BLOCK], tl.float32)
    opsm_acc = tl.zeros([BLOCK], tl.float32)  # the sampler's log-ratio to the current policy (OPSM)
    for off in range(start, end, BLOCK):
        idx = off + offs
        inside = idx < end
        m = tl.load(mask_ptr + idx, mask=inside, other=0) != 0
        length_acc += m.to(tl.float32)
        token_keep = m
        if HAS_CORRECTION:
            delta, delta_hat, k3_token = _mismatch(old_ptr, rollout_ptr, idx, inside, m)
            if BKL or BTV:
                bkl, btv = _binary_stats(old_ptr, rollout_ptr, idx, inside, m, BKL, BTV)
            if RS_TOKEN != 0:
                token_keep = _token_keeps(m, delta_hat, k3_token, token_k1_lo, token_k1_hi, token_k2_max, token_k3_max,
                                          RS_TOKEN & 7)
                if BINARY_TOKEN:
                    token_keep = _binary_keeps(token_keep, bkl, btv, token_bkl_max, token_btv_max, RS_TOKEN)
                kept_length_acc += token_keep.to(tl.float32)
            if RS_ALL:  # seq_all_k1's band
                inside_all = _token_keeps(m, delta_hat, k3_token, all_k1_lo, all_k1_hi, 0.0, 0.0, 1)
                rejecting_acc += (m & ~inside_all).to(tl.float32)
            if SEQ_TOKENS_KEPT:  # the sequence statistics over the tokens the token options keep (SkyRL's order)
                delta_acc += tl.where(token_keep, delta, 0.0)
                k1_acc += tl.where(token_keep, -delta_hat, 0.0)
                k3_acc += tl.where(token_keep, k3_token, 0.0)
            else:
                delta_acc += delta
                k1_acc += -delta_hat
                k3_acc += k3_token
            if RS_K2 != 0 or RS_K3_MAX:  # k2 summed, and k2 / k3 at their largest, over m or the tokens kept
                if SEQ_TOKENS_KEPT:
                    k2_token = tl.where(token_keep, 0.5 * delta_hat * delta_hat, 0.0)
                    k3_over = tl.where(token_keep, k3_token, 0.0)
                else:
                    k2_token = tl.where(m, 0.5 * delta_hat * delta_hat, 0.0)
                    k3_over = k3_token
                k2_acc += k2_token
                if PEAKS:
                    k2_peak = tl.maximum(k2_peak, tl.where(m, k2_token, float("-inf")))
                    k3_peak = tl.maximum(k3_peak, tl.where(m, k3_over, float("-inf")))
                    nan_acc += tl.where(k2_token != k2_token, 1.0, 0.0)  # k3 is NaN with k2 (a NaN delta)
            if RS_BINARY != 0:  # the binary divergences' sums, over m or the tokens kept
                if SEQ_TOKENS_KEPT:
                    bkl_acc += tl.where(token_keep, bkl, 0.0)
                    btv_acc += tl.where(token_keep, btv, 0.0)
                else:
                    bkl_acc += bkl
                    btv_acc += btv
        # what loss._kept_sums sums: the tokens no token option drops (every token of m with zero_weight)
        summed = m if ZERO_WEIGHT else token_keep
        if SEQUENCE_RATIO:  # the sequence's policy log-ratio (pg_delta)
            lp = on_mask(lp_ptr, idx, inside, m)
            pg_delta_acc += tl.where(summed, lp - _proximal(lp, old_ptr, rollout_ptr, idx, inside, m, PROXIMAL), 0.0)
        if SEQ_MEAN_ADVANTAGES:
            adv_acc += tl.where(summed, on_mask(adv_ptr, idx, inside, m), 0.0)
        if OPSM:  # loss._kept_sums' opsm: the behaviour policy's log-prob less the current one
            lp = on_mask(lp_ptr, idx, inside, m)
            if SAMPLER:
                opsm_acc += tl.where(summed, on_mask(rollout_ptr, idx, inside, m) - lp, 0.0)
            else:
                opsm_acc += tl.where(summed, _proximal(lp, old_ptr, rollout_ptr, idx, inside, m, PROXIMAL) - lp, 0.0)
    length = tl.sum(length_acc, 0)
    count = tl.maximum(length, 1.0)
    kept_length = length
    if RS_TOKEN != 0:
        kept_length = tl.sum(kept_length_acc, 0)
    # what a sequence statistic's mean divides by: its tokens in m, or those the token options keep
    if SEQ_TOKENS_KEPT:
        stat_count = tl.maximum(kept_length, 1.0)
    else:
        stat_count = count

    # -- the sequence's decisions (correction.decide): its IS weight and whether rejection keeps it
    seq_weight = 0.0
    if IS_LEVEL >= 2:
        log_ratio = tl.sum(delta_acc, 0)
        if IS_LEVEL == 3:
            log_ratio = log_ratio / stat_count
        log_ratio = _clamp(log_ratio, -CLAMP, CLAMP)
        seq_weight = _truncated(tl.exp(log_ratio), length > 0, is_lo, is_hi, IS_MASK)
    # whether rejection keeps the sequence, as a 1.0 / 0.0 flag (0-d booleans do not combine with blocks in the
    # interpreter); a statistic that is NaN fails every bound, as the torch comparisons do
    keep = 1.0
    if RS_K1_SUM or RS_K1_MEAN:
        k1 = tl.sum(k1_acc, 0)
        if RS_K1_SUM:  # k1 in [-log hi, -log lo] (SPEC §5, compared in log space)
            keep = tl.where((k1 <= k1_sum_hi) & (k1 >= k1_sum_lo), keep, 0.0)
        if RS_K1_MEAN:
            keep = tl.where((k1 / stat_count <= k1_mean_hi) & (k1 / stat_count >= k1_mean_lo), keep, 0.0)
    if RS_K3_SUM or RS_K3_MEAN:
        k3 = tl.sum(k3_acc, 0)
        if RS_K3_SUM:
            keep = tl.where(k3 <= k3_sum_max, keep, 0.0)
        if RS_K3_MEAN:
            keep = tl.where(k3 / stat_count <= k3_mean_max, keep, 0.0)
    if RS_ALL:  # every token of the sequence inside seq_all_k1's band
        keep = tl.where(tl.sum(rejecting_acc, 0) == 0.0, keep, 0.0)
    if RS_K2 & 3:
        k2 = tl.sum(k2_acc, 0)
        if RS_K2 & 1:
            keep = tl.where(k2 <= k2_sum_max, keep, 0.0)
        if RS_K2 & 2:
            keep = tl.where(k2 / stat_count <= k2_mean_max, keep, 0.0)
    if RS_BINARY & 1:
        keep = tl.where(tl.sum(bkl_acc, 0) / stat_count <= bkl_mean_max, keep, 0.0)
    if RS_BINARY & 2:
        keep = tl.where(tl.sum(btv_acc, 0) / stat_count <= btv_mean_max, keep, 0.0)
    if PEAKS:  # the maxima: 0 for a sequence without a token in m, NaN where a statistic is
        has_nan = tl.sum(nan_acc, 0) > 0.0
        if RS_K2 & 4:
            peak = tl.where(has_nan, float("nan"), tl.where(length > 0, tl.max(k2_peak, 0), 0.0))
            keep = tl.where(peak <= k2_max_bound, keep, 0.0)
        if RS_K3_MAX:
            peak = tl.where(has_nan, float("nan"), tl.where(length > 0, tl.max(k3_peak, 0), 0.0))
            keep = tl.where(peak <= k3_max_bound, keep, 0.0)
    keep_block = (tl.zeros([BLOCK], tl.float32) + keep) != 0.0
    # m' = m & keep; with rs_mode="zero_weight" m' = m, and rejection zeroes the IS weights instead
    if ZERO_WEIGHT:
        final_count = count
        seq_weight = tl.where(keep != 0.0, seq_weight, 0.0)
    else:
        final_count = tl.where(keep != 0.0, tl.maximum(kept_length, 1.0), 1.0)  # over 1 where rejection emptied it
    # the sequence's mean policy log-ratio and advantage over its final mask, as blocks
    log_s = tl.zeros([BLOCK], tl.float32)
    seq_log_ratio = 0.0
    if SEQUENCE_RATIO:
        seq_log_ratio = tl.sum(pg_delta_acc, 0) / final_count
        log_s += seq_log_ratio
    seq_adv = tl.zeros([BLOCK], tl.float32)
    if SEQ_MEAN_ADVANTAGES:  # AReaL's: each token of m' takes its sequence's mean advantage
        seq_adv += tl.sum(adv_acc, 0) / final_count
    # OPSM: whether the sequence's mean sampler-to-current log-ratio over m' is within delta (a NaN one is not), as
    # a block (a 0-d flag does not combine with blocks in the interpreter)
    opsm_within = tl.zeros([BLOCK], tl.float32)
    if OPSM:
        opsm_within += tl.where(tl.sum(opsm_acc, 0) / final_count <= opsm_threshold, 1.0, 0.0)

    # -- second read: each token's weight, final mask, policy term and derivatives, and the sequence's loss sums
    pg_acc = tl.zeros([BLOCK], tl.float32)
    kl_acc = tl.zeros([BLOCK], tl.float32)
    h_acc = tl.zeros([BLOCK], tl.float32)
    kept_acc = tl.zeros([BLOCK], tl.float32)
    w_acc = tl.zeros([BLOCK], tl.float32)
    g_acc = tl.zeros([BLOCK], tl.float32)
    sq_acc = tl.zeros([BLOCK], tl.float32)
    for off in range(start, end, BLOCK):
        idx = off + offs
        inside = idx < end
        m = tl.load(mask_ptr + idx, mask=inside, other=0) != 0
        token_keep = m
        if RS_TOKEN != 0:  # the first read's decision again, from π_old and μ (cheaper than storing it)
            _, delta_hat, k3_token = _mismatch(old_ptr, rollout_ptr, idx, inside, m)
            token_keep = _token_keeps(m, delta_hat, k3_token, token_k1_lo, token_k1_hi, token_k2_max, token_k3_max,
                                      RS_TOKEN & 7)
            if BINARY_TOKEN:
                bkl, btv = _binary_stats(old_ptr, rollout_ptr, idx, inside, m, RS_TOKEN & 8, RS_TOKEN & 16)
                token_keep = _binary_keeps(token_keep, bkl, btv, token_bkl_max, token_btv_max, RS_TOKEN)
        if ZERO_WEIGHT:
            kept = m
        else:
            kept = token_keep & keep_block
        lp = on_mask(lp_ptr, idx, inside, m)
        if SEQ_MEAN_ADVANTAGES:
            adv = tl.where(kept, seq_adv, 0.0)
        else:
            adv = on_mask(adv_ptr, idx, inside, m)
        l_old = _proximal(lp, old_ptr, rollout_ptr, idx, inside, m, PROXIMAL)
        if TRUST_REGION or LOG_RATIO_SQ:  # the sampler's log-probs where given, else l_old (loss._Inputs.behaviour)
            if SAMPLER:
                behaviour = on_mask(rollout_ptr, idx, inside, m)
            else:
                behaviour = l_old
        w = tl.zeros([BLOCK], tl.float32)
        if IS_LEVEL == 1:
            behaviour = on_mask(rollout_ptr, idx, inside, m)
            delta_hat = _clamp(l_old - behaviour, -CLAMP, CLAMP)
            w = _truncated(tl.exp(delta_hat), m, is_lo, is_hi, IS_MASK)
        elif IS_LEVEL >= 2:
            w = tl.where(m, seq_weight, 0.0)
        elif GIVEN_WEIGHTS:  # a trainer's own, on the mask (loss._masked_inputs)
            w = on_mask(given_ptr, idx, inside, m)
        if ZERO_WEIGHT:
            w = tl.where(token_keep & keep_block, w, 0.0)
        if WEIGHTED:
            tl.store(weights_ptr + idx, w, mask=inside)
            w_acc += w

        if POLICY == 0:
            term, grad = ppo_term(lp, l_old, adv, ratio_clamp, clip_lo, clip_hi, clip_c, RATIO_CLAMP, DUAL_CLIP)
        elif POLICY == 1:  # d term / d log_s, which the finish chains through the sequence's mean
            term, grad = ppo_clip(log_s, adv, ratio_clamp, clip_lo, clip_hi, clip_c, RATIO_CLAMP, DUAL_CLIP)
        elif POLICY == 2:
            term, grad = gspo_term(log_s, adv, clip_lo, clip_hi)
        elif POLICY == 3:
            term, grad = cispo_term(lp, lp - l_old, adv, ratio_clamp, clip_lo, clip_hi, cispo_cap, RATIO_CLAMP,
                                    CISPO_CAP)
        elif POLICY == 4:  # the sequence's ratio, its gradient through lp alone (sg(c))
            term, grad = cispo_term(lp, log_s, adv, ratio_clamp, clip_lo, clip_hi, cispo_cap, RATIO_CLAMP, CISPO_CAP)
        elif POLICY == 8:  # GPG: -A lp
            term = -adv * lp
            grad = -adv
        elif POLICY == 9:
            term, grad = dro_term(lp, l_old, adv, dro_beta)
        elif POLICY == 10:
            term, grad = sapo_term(lp - l_old, adv, ratio_clamp, tau_pos, tau_neg, RATIO_CLAMP)
        elif POLICY == 11:  # d term / d log_s, chained as PPO's
            term, grad = sapo_term(log_s, adv, ratio_clamp, tau_pos, tau_neg, RATIO_CLAMP)
        elif POLICY >= 12:
            term, grad = dppo_term(lp, l_old, adv, ratio_clamp, clip_c, eps_lo, eps_hi, POLICY, RATIO_CLAMP, DUAL_CLIP)
        else:
            term, grad = trust_region_term(lp, behaviour, adv, binary_tv_low, binary_tv_high, ipo_eps, ratio_clamp,
                                           ipo_kl_tau, POLICY, RATIO_CLAMP)
        if WEIGHTED:
            term = term * w
            grad = grad * w
        if OPSM:  # zero policy term for A < 0 in a sequence too far off-policy (loss._weigh_and_mask)
            opsm_keep = (adv >= 0) | (opsm_within != 0.0)
            term = tl.where(opsm_keep, term, 0.0)
            grad = tl.where(opsm_keep, grad, 0.0)
        pg_acc += tl.where(kept, term, 0.0)
        if CHAINED:
            g_acc += tl.where(kept, grad, 0.0)
        else:
            tl.store(grad_ptr + idx, grad, mask=inside)
        if KL_TYPE != 0:
            ref = on_mask(ref_ptr, idx, inside, m)
            kl, dkl = kl_and_grad(lp, ref, KL_TYPE, KL_STRAIGHT)
            if KL_SCORE:
                dkl = _kl_score(lp, ref, kl, dkl, KL_TYPE, KL_STRAIGHT)
            if KL_BIAS_CORRECTION:
                if SEQUENCE_LEVEL:
                    kl, dkl = _bias_corrected_kl(lp, ref, log_s, kl, dkl, ratio_clamp, RATIO_CLAMP, KL_TYPE,
                                                 KL_STRAIGHT, False)
                else:
                    kl, dkl = _bias_corrected_kl(lp, ref, lp - l_old, kl, dkl, ratio_clamp, RATIO_CLAMP, KL_TYPE,
                                                 KL_STRAIGHT, True)
            kl_acc += tl.where(kept, kl, 0.0)
            tl.store(dkl_ptr + idx, dkl, mask=inside)
        if LOG_RATIO_SQ:  # the log-ratio against the sampler on m' (loss._add_log_ratio_sq)
            d_sq = tl.where(kept, lp - behaviour, 0.0)
            sq_acc += d_sq * d_sq
            tl.store(sq_ptr + idx, d_sq, mask=inside)
        if HAS_ENTROPY:
            h = on_mask(entropy_ptr, idx, inside, m)
            h_acc += tl.where(kept, h, 0.0)
        kept_acc += kept.to(tl.float32)
        tl.store(lp_out_ptr + idx, lp, mask=inside)
        tl.store(kept_ptr + idx, kept, mask=inside)
    row = record_ptr + s * RECORD
    tl.store(row, tl.sum(pg_acc, 0))
    tl.store(row + 1, tl.sum(kl_acc, 0))
    tl.store(row + 2, tl.sum(h_acc, 0))
    tl.store(row + 3, tl.sum(kept_acc, 0))
    tl.store(row + 4, (end - start).to(tl.float32))
    if IS_LEVEL == 1:  # what is_batch_normalize averages: the token weights' sum, or the sequence's one weight
        tl.store(row + 5, tl.sum(w_acc, 0))
    else:
        tl.store(row + 5, seq_weight)
    tl.store(row + 6, length)
    tl.store(row + 7, tl.sum(g_acc, 0))
    # the bias-corrected KL's sum where it goes through the sequence's ratio: the finish chains it to each token
    kl_chained = 0.0
    if KL_BIAS_CORRECTION and SEQUENCE_LEVEL and KL_TYPE != 0:
        kl_chained = tl.sum(kl_acc, 0)
        if RATIO_CLAMP:
            kl_chained = tl.where(tl.abs(seq_log_ratio) <= ratio_clamp, kl_chained, 0.0)
    tl.store(row + 8, kl_chained)
    tl.store(row + 9, tl.sum(sq_acc, 0))


@triton.jit
def _normalisers(record_ptr, S, global_tokens, global_seqs, scale_factor, SEQ_MEAN_OVER_ALL: tl.constexpr,
                 GLOBAL_TOKENS: tl.constexpr, GLOBAL_SEQS: tl.constexpr, SCALE_FACTOR: tl.constexpr,
                 BLOCK_S: tl.constexpr):
    """The batch's normalisers from the [S] record (correction.normalisers, loss.aggregation_weights): the kept
    tokens, the sequences G, and the width K of seq-mean-token-sum-norm, or the config's global values."""
    offs_s = tl.arange(0, BLOCK_S)
    kept_tokens_acc = tl.zeros([BLOCK_S], tl.float32)
    kept_seqs_acc = tl.zeros([BLOCK_S], tl.float32)
    width_acc = tl.zeros([BLOCK_S], tl.float32)
    for s0 in range(0, S, BLOCK_S):
        seqs = s0 + offs_s
        row = record_ptr + seqs.to(tl.int64) * RECORD
        final_length = tl.load(row + 3, mask=seqs < S, other=0.0)
        kept_tokens_acc += final_length
        kept_seqs_acc += (final_length > 0).to(tl.float32)
        width_acc = tl.maximum(width_acc, tl.load(row + 4, mask=seqs < S, other=0.0))
    if GLOBAL_TOKENS:
        tokens = global_tokens
    else:
        tokens = tl.maximum(tl.sum(kept_tokens_acc, 0), 1.0)
    if GLOBAL_SEQS:
        seqs_count = global_seqs
    elif SEQ_MEAN_OVER_ALL:
        seqs_count = tl.maximum(S.to(tl.float32), 1.0)
    else:
        seqs_count = tl.maximum(tl.sum(kept_seqs_acc, 0), 1.0)
    if SCALE_FACTOR:
        width = scale_factor
    else:
        width = tl.maximum(tl.max(width_acc, 0), 1.0)
    return tokens, seqs_count, width


@triton.jit
def _weight_mean(record_ptr, S, NORMALIZE: tl.constexpr, BLOCK_S: tl.constexpr):
    """The batch mean of the truncated IS weights, or 1 where it is not above 1e-8 (correction.normalisers, .weights):
    over the masked tokens (NORMALIZE 1, token weights) or the non-empty sequences (2, one weight each)."""
    offs_s = tl.arange(0, BLOCK_S)
    total_acc = tl.zeros([BLOCK_S], tl.float32)
    count_acc = tl.zeros([BLOCK_S], tl.float32)
    for s0 in range(0, S, BLOCK_S):
        seqs = s0 + offs_s
        row = record_ptr + seqs.to(tl.int64) * RECORD
        total_acc += tl.load(row + 5, mask=seqs < S, other=0.0)
        length = tl.load(row + 6, mask=seqs < S, other=0.0)
        if NORMALIZE == 1:
            count_acc += length
        else:
            count_acc += (length > 0).to(tl.float32)
    mean = tl.sum(total_acc, 0) / tl.maximum(tl.sum(count_acc, 0), 1.0)
    return tl.where(mean > 1e-8, mean, 1.0)


@triton.jit
def _per_token(tokens, seqs_count, width, AGGREGATION: tl.constexpr):
    """The denominator a_t = m'_t / per_token has in the aggregation modes that are not per sequence (seq-mean-token-
    mean divides by each sequence's length and the sequences: _aggregation_weight)."""
    if AGGREGATION == 0:
        per_token = 1.0
    elif AGGREGATION == 1:
        per_token = tokens
    elif AGGREGATION == 3:
        per_token = seqs_count
    else:
        per_token = seqs_count * width  # 4
    return per_token


@triton.jit
def _aggregation_weight(kept, final_length, per_token, seqs_count, AGGREGATION: tl.constexpr):
    """a_t of loss.aggregation_weights: kept (1.0 / 0.0, m'_t; or 1.0 for a sequence's sum) over its denominator."""
    if AGGREGATION == 2:
        a = kept / (tl.maximum(final_length, 1.0) * seqs_count)
    elif AGGREGATION == 0:
        a = kept
    else:
        a = kept / per_token
    return a


@triton.jit(do_not_specialize=["N", "S", "blocks_per_program"])
def _finish_kernel(
    record_ptr, kept_ptr, grad_ptr, dkl_ptr, sq_ptr, seq_id_ptr, coef_ptr, coef_entropy_ptr, weights_ptr, loss_ptr,
    N, S, blocks_per_program,
    kl_coef, entropy_coeff, global_tokens, global_seqs, scale_factor, log_ratio_sq_coef,
    AGGREGATION: tl.constexpr, SEQ_MEAN_OVER_ALL: tl.constexpr, GLOBAL_TOKENS: tl.constexpr,
    GLOBAL_SEQS: tl.constexpr, SCALE_FACTOR: tl.constexpr, NORMALIZE: tl.constexpr, HAS_KL: tl.constexpr,
    HAS_ENTROPY: tl.constexpr, ENTROPY_AGGREGATION: tl.constexpr, CHAINED: tl.constexpr, KL_CHAINED: tl.constexpr,
    LOG_RATIO_SQ: tl.constexpr, BLOCK: tl.constexpr, BLOCK_S: tl.constexpr, FACTORS: tl.constexpr = False,
):
    # Long on purpose: the batch's scalars, the loss and the tokens' coefficients share the normalisers, which every
    # program computes itself (no second launch, no atomics). FACTORS: the factors a coefficient is formed from
    # instead (forward_grad.py forms it): a_t for coef, the IS weights as the sequence kernel wrote them, the
    # batch normalisation's factor for the loss. ENTROPY_AGGREGATION: the entropy bonus's mode (entropy_agg_mode,
    # else the loss's); CHAINED: each token's policy coefficient is its sequence's mean over m' (record column 7: PPO
    # and SAPO on the sequence's ratio); KL_CHAINED: the bias-corrected KL's part through the sequence's ratio too,
    # its sum over m' (record column 8) chained as kl_coef a_t times its mean. LOG_RATIO_SQ: log_ratio_sq_coef's
    # term, its sums in record column 9 and each token's log-ratio against the sampler in sq.
    pid = tl.program_id(0)
    offs_s = tl.arange(0, BLOCK_S)
    tokens, seqs_count, width = _normalisers(record_ptr, S, global_tokens, global_seqs, scale_factor,
                                             SEQ_MEAN_OVER_ALL, GLOBAL_TOKENS, GLOBAL_SEQS, SCALE_FACTOR, BLOCK_S)
    factor = 1.0
    if NORMALIZE != 0:  # is_batch_normalize: the IS weights over their batch mean (correction.weights)
        factor = _weight_mean(record_ptr, S, NORMALIZE, BLOCK_S)
    per_token = _per_token(tokens, seqs_count, width, AGGREGATION)
    per_token_entropy = _per_token(tokens, seqs_count, width, ENTROPY_AGGREGATION)
    PER_SEQUENCE: tl.constexpr = AGGREGATION == 2 or ENTROPY_AGGREGATION == 2 or CHAINED or KL_CHAINED

    if FACTORS:
        if pid == 0:
            tl.store(loss_ptr, factor)
    # -- the loss (program 0): the per-sequence sums weighted as a_t weighs their tokens
    elif pid == 0:
        pg_acc = tl.zeros([BLOCK_S], tl.float32)
        kl_acc = tl.zeros([BLOCK_S], tl.float32)
        sq_acc = tl.zeros([BLOCK_S], tl.float32)
        h_acc = tl.zeros([BLOCK_S], tl.float32)
        for s0 in range(0, S, BLOCK_S):
            seqs = s0 + offs_s
            row = record_ptr + seqs.to(tl.int64) * RECORD
            inside = seqs < S
            final_length = tl.load(row + 3, mask=inside, other=0.0)
            one = tl.full([BLOCK_S], 1.0, tl.float32)
            a = _aggregation_weight(one, final_length, per_token, seqs_count, AGGREGATION)
            pg_acc += a * tl.load(row, mask=inside, other=0.0)
            kl_acc += a * tl.load(row + 1, mask=inside, other=0.0)
            if LOG_RATIO_SQ:
                sq_acc += a * tl.load(row + 9, mask=inside, other=0.0)
            if HAS_ENTROPY:
                a_entropy = _aggregation_weight(one, final_length, per_token_entropy, seqs_count,
                                                ENTROPY_AGGREGATION)
                h_acc += a_entropy * tl.load(row + 2, mask=inside, other=0.0)
        loss = tl.sum(pg_acc, 0)
        if NORMALIZE != 0:
            loss = loss / factor
        if HAS_KL:
            loss = loss + kl_coef * tl.sum(kl_acc, 0)
        if LOG_RATIO_SQ:
            loss = loss + log_ratio_sq_coef * tl.sum(sq_acc, 0)
        if HAS_ENTROPY:
            loss = loss + -entropy_coeff * tl.sum(h_acc, 0)
        tl.store(loss_ptr, loss)

    # -- each token's coefficients: c_t = a_t (g_t + beta dKL_t), e_t = -entropy_coeff a_t (loss.run), over the
    # program's blocks of tokens (several where the record is long: its reduction above is every program's cost)
    first = pid.to(tl.int64) * blocks_per_program * BLOCK
    for b in range(0, blocks_per_program):
        idx = first + b * BLOCK + tl.arange(0, BLOCK)
        inside = idx < N
        kept = tl.load(kept_ptr + idx, mask=inside, other=0).to(tl.float32)
        final_length = tl.zeros([BLOCK], tl.float32)
        sid = tl.zeros([BLOCK], tl.int64)
        if PER_SEQUENCE:
            sid = tl.load(seq_id_ptr + idx, mask=inside, other=0)
            final_length = tl.load(record_ptr + sid * RECORD + 3, mask=inside, other=1.0)
        a = _aggregation_weight(kept, final_length, per_token, seqs_count, AGGREGATION)
        if FACTORS:
            tl.store(coef_ptr + idx, a, mask=inside)
        else:
            if CHAINED:  # the sequence's sum of the derivative in its mean log-ratio, over m'
                grad = tl.load(record_ptr + sid * RECORD + 7, mask=inside, other=0.0)
            else:
                grad = tl.load(grad_ptr + idx, mask=inside, other=0.0)
            if NORMALIZE != 0:
                grad = grad / factor
                tl.store(weights_ptr + idx, tl.load(weights_ptr + idx, mask=inside, other=0.0) / factor, mask=inside)
            if CHAINED:  # loss._chain_through_ratio: a sum of a_t g_t over the sequence's final length
                coef = tl.where(kept != 0.0, (a * grad) / tl.maximum(final_length, 1.0), 0.0)
            else:
                coef = a * grad
            if HAS_KL:
                coef = (kl_coef * a) * tl.load(dkl_ptr + idx, mask=inside, other=0.0) + coef
                if KL_CHAINED:  # loss._add_kl's part through the sequence's ratio, chained as the policy's
                    kl_sum = tl.load(record_ptr + sid * RECORD + 8, mask=inside, other=0.0)
                    coef += tl.where(kept != 0.0, ((kl_coef * a) * kl_sum) / tl.maximum(final_length, 1.0), 0.0)
            if LOG_RATIO_SQ:  # 2 tau a_t d_t
                coef += ((2.0 * log_ratio_sq_coef) * a) * tl.load(sq_ptr + idx, mask=inside, other=0.0)
            tl.store(coef_ptr + idx, coef, mask=inside)
        if HAS_ENTROPY:
            if ENTROPY_AGGREGATION == AGGREGATION:
                a_entropy = a
            else:
                a_entropy = _aggregation_weight(kept, final_length, per_token_entropy, seqs_count, ENTROPY_AGGREGATION)
            tl.store(coef_entropy_ptr + idx, -entropy_coeff * a_entropy, mask=inside)


def stage_fwd(inputs, options: dict, hyper: dict, factors: bool = False) -> tuple:
    """Launch the two kernels. `inputs`: stage.fused.KernelInputs ([N] tensors, None where absent; the packed
    offsets or the padded T; seq_id), `options`: the stage's option set (stage_options.option_codes), `hyper`: the float
    hyperparameters (a dict of the kernels' argument names). Returns (loss 0-d, lp [N], coef [N], coef_entropy [N]
    or None, weights [N] or None, kept [N] bool), float32 but kept. `factors`: what a coefficient is formed from
    instead of the coefficients (forward_grad.py, which forms them from the pass's log-probs): coef is each token's
    a_t, the weights are not normalised, and the loss is the batch normalisation's factor (1 without it)."""
    codes = option_codes(options)
    lp = inputs.lp
    N, S, device = lp.shape[0], inputs.num_seqs, lp.device
    f32 = dict(dtype=torch.float32, device=device)
    # two float32 allocations, views of each: what the call reports (log-probs, IS weights: a caller may edit them
    # in place) apart from what the backward saves (the coefficients), which share no version counter with them
    reported = torch.empty((1 + bool(codes["WEIGHTED"])) * N, **f32)
    lp_out = reported[:N]
    weights = reported[N:] if codes["WEIGHTED"] else None
    columns = 2 + bool(codes["KL_TYPE"]) + (inputs.entropy is not None) + bool(codes["LOG_RATIO_SQ"])
    internal = torch.empty(columns * N + S * RECORD_WIDTH + 1, **f32)
    views = iter(internal[i * N:(i + 1) * N] for i in range(columns))
    grad, coef = next(views), next(views)
    dkl = next(views) if codes["KL_TYPE"] else grad
    coef_entropy = next(views) if inputs.entropy is not None else None
    sq = next(views) if codes["LOG_RATIO_SQ"] else grad
    record = internal[columns * N:columns * N + S * RECORD_WIDTH]
    loss = internal[-1]
    kept = torch.empty(N, dtype=torch.bool, device=device)
    # each finish program reduces the whole record: for a long one, fewer programs with more tokens each
    blocks_per_program = max(1, triton.cdiv(S, BLOCK))
    # the kernels index every input as contiguous (a strided view is copied); an absent one's pointer: any tensor
    # (its loads are compiled out)
    given = lambda t: lp if t is None else t.contiguous()  # noqa: E731
    h = hyper
    with device_guard(lp):
        if S:  # an empty grid is no launch (CUDA refuses it); the finish then reads an empty record: loss 0
            _sequence_kernel[(S,)](
                lp.contiguous(), given(inputs.entropy), given(inputs.advantages), inputs.mask.contiguous(),
                given(inputs.old), given(inputs.rollout), given(inputs.ref), given(inputs.is_weights),
                given(inputs.cu_seqlens if inputs.cu_seqlens is not None else inputs.seq_id),
                lp_out, grad, dkl, sq, lp_out if weights is None else weights, kept, record, inputs.seq_len,
                *(h[name] for name in SEQUENCE_HYPERPARAMETERS),
                HAS_CU=inputs.cu_seqlens is not None, HAS_ENTROPY=inputs.entropy is not None,
                **{k: codes[k] for k in _SEQUENCE_OPTIONS}, BLOCK=BLOCK,
            )
        _finish_kernel[(max(1, triton.cdiv(N, BLOCK * blocks_per_program)),)](
            record, kept, grad, dkl, sq, given(inputs.seq_id), coef, coef if coef_entropy is None else coef_entropy,
            coef if weights is None else weights, loss, N, S, blocks_per_program,
            *(h[name] for name in FINISH_HYPERPARAMETERS),
            **{k: codes[k] for k in _FINISH_OPTIONS}, HAS_KL=codes["KL_TYPE"] != 0,
            HAS_ENTROPY=coef_entropy is not None, CHAINED=codes["POLICY"] in CHAINED_TERMS,
            KL_CHAINED=codes["KL_TYPE"] != 0 and codes["KL_BIAS_CORRECTION"] and
            codes["POLICY"] in SEQUENCE_LEVEL_TERMS,
            LOG_RATIO_SQ=codes["LOG_RATIO_SQ"], BLOCK=BLOCK, BLOCK_S=BLOCK_S, FACTORS=factors,
        )
    return loss, lp_out, coef, coef_entropy, weights, kept


_SEQUENCE_OPTIONS = ("PROXIMAL", "WEIGHTED", "IS_LEVEL", "IS_MASK", "RS_K1_SUM", "RS_K1_MEAN", "RS_K3_SUM",
                     "RS_K3_MEAN", "RATIO_CLAMP", "DUAL_CLIP", "KL_TYPE", "KL_STRAIGHT", "POLICY",
                     "SEQ_MEAN_ADVANTAGES", "ZERO_WEIGHT", "KL_SCORE", "RS_TOKEN", "RS_ALL", "SEQ_TOKENS_KEPT",
                     "GIVEN_WEIGHTS", "CISPO_CAP", "KL_BIAS_CORRECTION", "SAMPLER", "LOG_RATIO_SQ", "RS_K2",
                     "RS_K3_MAX", "RS_BINARY", "OPSM")
_FINISH_OPTIONS = ("AGGREGATION", "SEQ_MEAN_OVER_ALL", "GLOBAL_TOKENS", "GLOBAL_SEQS", "SCALE_FACTOR", "NORMALIZE",
                   "ENTROPY_AGGREGATION")


def _sequence_option_sets():
    """The sequence kernel's option sets aot_specs compiles: the families of stage/fused.py and the trainers' sets
    named beside them, each flag on and off at least once."""
    base = dict(PROXIMAL=1, WEIGHTED=False, IS_LEVEL=0, IS_MASK=False, RS_K1_SUM=False, RS_K1_MEAN=False,
                RS_K3_SUM=False, RS_K3_MEAN=False, RATIO_CLAMP=True, DUAL_CLIP=True, KL_TYPE=0, KL_STRAIGHT=False,
                POLICY=0, SEQ_MEAN_ADVANTAGES=False, ZERO_WEIGHT=False, KL_SCORE=False, RS_TOKEN=0, RS_ALL=False,
                SEQ_TOKENS_KEPT=False, GIVEN_WEIGHTS=False, CISPO_CAP=False, KL_BIAS_CORRECTION=False, SAMPLER=False,
                LOG_RATIO_SQ=False, RS_K2=0, RS_K3_MAX=False, RS_BINARY=0, OPSM=False)
    return [
        dict(base, PROXIMAL=0, DUAL_CLIP=False, RATIO_CLAMP=False),
        dict(base, WEIGHTED=True, IS_LEVEL=2, RS_K1_SUM=True, KL_TYPE=4),
        dict(base, WEIGHTED=True, IS_LEVEL=1, RS_K1_MEAN=True, KL_TYPE=1, KL_STRAIGHT=True),
        dict(base, WEIGHTED=True, IS_LEVEL=3, IS_MASK=True, RS_K3_SUM=True, RS_K3_MEAN=True, KL_TYPE=5),
        dict(base, PROXIMAL=2, KL_TYPE=2),
        dict(base, KL_TYPE=3),
        dict(base, WEIGHTED=True, IS_LEVEL=2, RS_K1_SUM=True, KL_TYPE=4, POLICY=1),  # TRL's GSPO with seq-MIS
        dict(base, WEIGHTED=True, IS_LEVEL=1, IS_MASK=True, RS_K3_MEAN=True, KL_TYPE=1, POLICY=2),  # verl's GSPO
        dict(base, PROXIMAL=0, DUAL_CLIP=False, POLICY=2),
        # AReaL's GSPO (sequence means of the advantages); NeMo-RL's zero-weight rejection with the KL's score term
        dict(base, POLICY=1, SEQ_MEAN_ADVANTAGES=True, WEIGHTED=True, IS_LEVEL=1, RS_K1_SUM=True, KL_TYPE=4),
        dict(base, WEIGHTED=True, IS_LEVEL=1, RS_K1_MEAN=True, ZERO_WEIGHT=True, KL_TYPE=4, KL_SCORE=True),
        dict(base, WEIGHTED=True, IS_LEVEL=2, RS_K3_SUM=True, ZERO_WEIGHT=True, KL_TYPE=1, KL_STRAIGHT=True,
             KL_SCORE=True),
        # token-level rejection: SkyRL's (token and every-token k1, the sequence statistics over the kept tokens),
        # with zero weights (OpenRLHF's order), and every kind at once with geometric IS
        dict(base, WEIGHTED=True, IS_LEVEL=1, RS_TOKEN=1, RS_ALL=True, RS_K1_MEAN=True, SEQ_TOKENS_KEPT=True),
        dict(base, WEIGHTED=True, IS_LEVEL=1, RS_TOKEN=5, ZERO_WEIGHT=True, KL_TYPE=4),
        dict(base, WEIGHTED=True, IS_LEVEL=3, RS_TOKEN=7, RS_ALL=True, RS_K3_SUM=True, SEQ_TOKENS_KEPT=True, POLICY=1,
             SEQ_MEAN_ADVANTAGES=True),
        # a trainer's own IS weights (verl's, TRL's), with a sequence rejection
        dict(base, WEIGHTED=True, GIVEN_WEIGHTS=True, RS_K1_MEAN=True, KL_TYPE=4),
        # CISPO: verl's clip of the token's ratio, TRL's cap of the sequence's
        dict(base, WEIGHTED=True, IS_LEVEL=1, RS_K1_SUM=True, POLICY=3),
        dict(base, POLICY=4, CISPO_CAP=True, RATIO_CLAMP=False, KL_TYPE=5),
        # the bias-corrected KL (TRL's, DeepSeek-V3.2's): of the token's ratio, and through the sequence's (TRL's GSPO)
        dict(base, WEIGHTED=True, IS_LEVEL=1, KL_TYPE=4, KL_BIAS_CORRECTION=True),
        dict(base, POLICY=1, RATIO_CLAMP=False, KL_TYPE=5, KL_BIAS_CORRECTION=True),
        # prime-rl's default (bypass mode: the sampler is the proximal policy, with its own weights or its log-ratio
        # square), the symmetric band in decoupled mode with a rejection, and the square beside PPO
        dict(base, PROXIMAL=2, SAMPLER=True, POLICY=6, RATIO_CLAMP=False, DUAL_CLIP=False, LOG_RATIO_SQ=True),
        dict(base, PROXIMAL=2, SAMPLER=True, POLICY=6, RATIO_CLAMP=False, WEIGHTED=True, GIVEN_WEIGHTS=True),
        dict(base, SAMPLER=True, POLICY=5, RS_K1_MEAN=True, KL_TYPE=4),
        dict(base, PROXIMAL=2, SAMPLER=True, POLICY=7, RATIO_CLAMP=False),  # prime-rl's IPO
        # GPG, DRO, SAPO of the token's ratio (verl's) and of the sequence's (TRL's, with GSPO's bias-corrected KL)
        dict(base, PROXIMAL=0, POLICY=8, KL_TYPE=1), dict(base, WEIGHTED=True, IS_LEVEL=1, POLICY=9),
        dict(base, WEIGHTED=True, IS_LEVEL=2, RS_K1_SUM=True, POLICY=10, KL_TYPE=4),
        dict(base, POLICY=11, KL_TYPE=4, KL_BIAS_CORRECTION=True, RATIO_CLAMP=False),
        # AReaL's k2 rejection (sum, mean, max), the k3 maximum, over m or over the tokens kept
        dict(base, WEIGHTED=True, IS_LEVEL=1, RS_K2=7, RS_K3_MAX=True), dict(base, RS_K2=4, RS_TOKEN=2,
                                                                           SEQ_TOKENS_KEPT=True),
        # OpenRLHF's binary-KL and TV gates, of each token and of the sequence's mean, zeroing the weights
        dict(base, WEIGHTED=True, IS_LEVEL=1, IS_MASK=True, RS_TOKEN=8, ZERO_WEIGHT=True),
        dict(base, WEIGHTED=True, IS_LEVEL=1, IS_MASK=True, RS_BINARY=1, ZERO_WEIGHT=True),
        dict(base, WEIGHTED=True, IS_LEVEL=1, RS_TOKEN=17, RS_BINARY=2, SEQ_TOKENS_KEPT=True),
        # DeepSeek-V3.2's off-policy sequence mask (TRL's off_policy_mask_threshold), on the sampler and on π_old
        dict(base, SAMPLER=True, OPSM=True, KL_TYPE=4, KL_BIAS_CORRECTION=True), dict(base, OPSM=True, POLICY=1),
        # verl's DPPO regions
        dict(base, POLICY=12, DUAL_CLIP=False), dict(base, WEIGHTED=True, IS_LEVEL=1, POLICY=13, KL_TYPE=4),
        dict(base, SAMPLER=True, WEIGHTED=True, IS_LEVEL=1, RS_K1_SUM=True, LOG_RATIO_SQ=True),
    ]


def aot_specs():
    """The option sets a launch can take, each flag on and off at least once: the families of stage/fused.py and the
    trainers' sets named beside them, both layouts and every aggregation, the entropy's own; the inputs in float32
    (bf16 advantages or log-probs load through the same code)."""
    sequence_sets = _sequence_option_sets()
    pointers = ("lp_ptr", "entropy_ptr", "adv_ptr", "mask_ptr", "old_ptr", "rollout_ptr", "ref_ptr", "given_ptr",
                "cu_ptr", "lp_out_ptr", "grad_ptr", "dkl_ptr", "sq_ptr", "weights_ptr", "kept_ptr", "record_ptr")
    types = dict(zip(pointers, ("*fp32",) * 3 + ("*i1",) + ("*fp32",) * 4 + ("*i64",) + ("*fp32",) * 5
                     + ("*i1", "*fp32")))
    specs = []
    for i, options in enumerate(sequence_sets):
        for has_cu in (True, False):
            constexprs = dict(options, HAS_CU=has_cu, HAS_ENTROPY=i % 2 == 1, BLOCK=BLOCK)
            signature = {**types, "seq_len": "i32", **{f: "fp32" for f in SEQUENCE_HYPERPARAMETERS},
                         **{k: "constexpr" for k in constexprs}}
            specs.append(AotSpec(name=f"sequence_stage[set={i},HAS_CU={int(has_cu)}]", fn=_sequence_kernel,
                                 signature=signature, constexprs=constexprs, num_warps=4, num_stages=1))
    for aggregation in AGGREGATIONS.values():
        for i, flags in enumerate(((False, False, False, False, False), (True, True, True, True, True))):
            constexprs = dict(zip(("SEQ_MEAN_OVER_ALL", "GLOBAL_TOKENS", "GLOBAL_SEQS", "SCALE_FACTOR", "HAS_KL"),
                                  flags), AGGREGATION=aggregation, NORMALIZE=aggregation % 3, HAS_ENTROPY=i == 1,
                              ENTROPY_AGGREGATION=(aggregation + i) % len(AGGREGATIONS), CHAINED=i == 1,
                              KL_CHAINED=i == 1, LOG_RATIO_SQ=i == 1,
                              BLOCK=BLOCK, BLOCK_S=BLOCK_S, FACTORS=False)
            signature = {"record_ptr": "*fp32", "kept_ptr": "*i1", "grad_ptr": "*fp32", "dkl_ptr": "*fp32",
                         "sq_ptr": "*fp32",
                         "seq_id_ptr": "*i64", "coef_ptr": "*fp32", "coef_entropy_ptr": "*fp32",
                         "weights_ptr": "*fp32", "loss_ptr": "*fp32",
                         "N": "i32", "S": "i32", "blocks_per_program": "i32",
                         **{f: "fp32" for f in FINISH_HYPERPARAMETERS},
                         **{k: "constexpr" for k in constexprs}}
            specs.append(AotSpec(name=f"finish_stage[AGGREGATION={aggregation},flags={i}]", fn=_finish_kernel,
                                 signature=signature, constexprs=constexprs, num_warps=4, num_stages=1))
            if i == 1:  # the factors mode (forward_grad.py's decisions), every flag on
                specs.append(AotSpec(name=f"finish_stage[AGGREGATION={aggregation},flags={i},FACTORS=1]",
                                     fn=_finish_kernel, signature=signature,
                                     constexprs={**constexprs, "CHAINED": False, "KL_CHAINED": False,
                                                 "LOG_RATIO_SQ": False, "FACTORS": True},
                                     num_warps=4, num_stages=1))
    return specs
