"""The policy losses, one function per loss type, behind one table (SPEC §6, docs/losses.md).

Each loss is a per-token term L_t with its derivative written in closed form, in two parts: `direct`,
through the log-prob itself, and `through_ratio`, through the log-ratio log r (chained per token, or
through a sequence's mean log-ratio with ratio_level="sequence"). The stage (stage/loss.py) does
everything that is not the loss's own: IS weights and masks, aggregation, the KL and entropy terms,
and the chain rule to (c_t, e_t). `rlkernels/reference/policy_terms.py` is the oracle's table, written
with autograd instead of closed forms, to be read side by side with this one.

A loss type is registered with `@loss_term(name, ...)`:
- the function takes a `TermContext` and returns a `PolicyTerm`;
- `sums`: the per-token values the loss needs summed per sequence (over the tokens no token-level
  rejection drops); they come back in `ctx.sums`, whole over a context-parallel split;
- `weights_itself`: the loss applies the IS weights itself (else the stage multiplies the term by them);
- `ratio_levels`: the loss is written on a ratio r that may be taken per sequence (ratio_level="sequence");
- `batch_global`: the loss selects tokens over the whole batch (no split batches);
- `aggregation`: the (loss_agg_mode, seq_mean_over) the loss defines for itself, in place of the config's;
- `sampler_head`: the loss reads the sampler's top-k (ctx.head, SPEC §9) and returns coefficients on the
  trainer's log-probs at those ids (`head_direct`, [N, k]) beside `direct`.
What a row declares of the config (rlkernels.config checks it, tests/cases.py draws from it, docs/losses.md names
it; tests/stage/test_loss_table.py holds the three to the table):
- `options`: the config fields only this loss reads (`Option`: the rule its value keeps, the values tests draw);
- `ordered`: pairs of its options that must be ordered (lo <= hi);
- `no_token_masks`: why the token masks (TOKEN_MASKS) have no meaning for it ("" when they apply);
- `is_levels`, `is_level_refusal`: the rollout correction's IS levels it takes, and why the others have no meaning;
- `modes`: SPEC §1's modes it is defined in (without "decoupled", old log-probs are refused).
`LOSS_TYPES` and the option tuples of rlkernels.config are read off this table.
"""

import math
from dataclasses import dataclass
from typing import Callable, Dict, NamedTuple, Optional, Tuple

import torch
from torch import Tensor

from .segments import hyper, hyper_scalar

CLAMP = 20.0  # SPEC §4: every log-ratio is clamped before exp


class TermContext(NamedTuple):
    """What a loss term may read. Per-token tensors are [N] in the statistics' dtype, 0 off the mask."""
    lp: Tensor  # current log-probs
    advantages: Tensor
    log_ratio: Tensor  # lp - l_old, unclamped
    ratio: Tensor  # r: exp of the (clamped) token or sequence log-ratio
    l_old: Tensor  # the proximal log-probs of SPEC §1's mode
    behaviour: Tensor  # the sampler's log-probs where given, else l_old (the trust region of the IPO family)
    config: "PolicyLossConfig"  # noqa: F821 (duck-typed: the stage imports no config)
    sequences: "SequenceContext"
    weights: "WeightContext"
    metrics: "Metrics"  # noqa: F821 (loss-specific metrics are recorded here)
    head: Optional["HeadContext"] = None  # the sampler's top-k, for the losses that read it (sampler_head)


class HeadContext(NamedTuple):
    """The sampler's top-k H of each token and the trainer's log-probs there (SPEC §9.1), [N, k], detached."""
    logprobs: Tensor  # log p at the ids, the current policy (-inf at pads and at ids without mass)
    sampler_logprobs: Tensor  # log q at the ids, as the sampler reported them (full-vocabulary)
    slots: Tensor  # bool, the slots holding an id


class SequenceContext(NamedTuple):
    segments: "Segments"  # noqa: F821
    sums: Callable[[str], Tensor]  # name -> [S] per-sequence sum of a column the loss asked for
    lengths: Tensor  # [S] tokens of each sequence in the final mask, at least 1
    final_lengths: Tensor  # [S] the same, 0 for an empty sequence
    final_mask: Tensor  # [N] bool, m' after rejection
    kept_tokens: Tensor  # 0-d |m'| of the (whole) batch
    all_seqs: Tensor  # 0-d, every sequence of the (whole) batch, empty ones included


class WeightContext(NamedTuple):
    is_weights: Optional[Tensor]  # [N] the applied IS weights (computed or the trainer's), or None
    norm_factor: Optional[Tensor]  # 0-d batch normalisation factor of computed weights
    weighted: bool  # the stage applies IS weights to the policy term (decoupled mode, or given weights)
    token_level: bool  # per-token weights exist: the trainer's own (is_weights=), or computed at is_level="token"
    sequence_weights: Optional[Tensor]  # [S] truncated sequence weights (is_level="sequence")


class SumInputs(NamedTuple):
    """What a loss's `sums` hook may read (before rejection and IS weights are decided)."""
    lp: Tensor
    advantages: Tensor
    log_ratio: Tensor
    given_weights: Optional[Tensor]
    config: "PolicyLossConfig"  # noqa: F821


class PolicyTerm(NamedTuple):
    value: Tensor  # [N] L_t
    direct: Optional[Tensor]  # [N] dL_t / dlp through the log-prob itself (None: 0)
    through_ratio: Optional[Tensor]  # [N] dL_t / dlog r, or None
    clipped: Tensor  # [N] bool, reported as actor/pg_clipfrac
    dual: Tensor  # [N] bool, reported as actor/pg_clipfrac_lower
    kl_metric: Optional[Tensor] = None  # [N] actor/ppo_kl's per-token value (None: -log r, clamped as r is)
    applied_weights: Optional[Tensor] = None  # [N] the weights a `weights_itself` loss applied, or None
    own_mean: Optional[Tuple[Tensor, Tensor]] = None  # (loss, [N] coefficients) of a loss with its own mean
    head_direct: Optional[Tensor] = None  # [N, k] dL_t / dlog p at the sampler's head ids (sampler_head losses)


MODES = ("decoupled", "bypass", "on-policy")  # SPEC §1: old + rollout log-probs, rollout only, neither
IS_LEVELS = (None, "token", "sequence", "geometric")
# the options that zero single tokens' policy terms (any loss type whose term is per token)
TOKEN_MASKS = ("off_policy_mask_threshold", "m2po_threshold", "vaco_threshold")


class Option(NamedTuple):
    """A config field that only some loss types read: the rule its value keeps and the values the tests draw."""
    name: str
    rule: str  # "positive" (> 0), "non_negative" (>= 0), "number", "optional_positive" (> 0 or None)
    draws: Tuple = ()  # the values tests/cases.py draws
    required: bool = False  # None is refused with this loss type (an optional_positive field)


@dataclass(frozen=True)
class LossType:
    term: Callable[[TermContext], PolicyTerm]
    sums: Optional[Callable[[SumInputs], Dict[str, object]]] = None
    weights_itself: bool = False
    ratio_levels: bool = False
    batch_global: bool = False
    aggregation: Optional[Tuple[str, str]] = None
    sampler_head: bool = False
    options: Tuple[Option, ...] = ()
    ordered: Tuple[Tuple[str, str], ...] = ()
    no_token_masks: str = ""
    is_levels: Tuple[Optional[str], ...] = IS_LEVELS
    is_level_refusal: str = ""  # may name {is_level}
    modes: Tuple[str, ...] = MODES


LOSS_TERMS: Dict[str, LossType] = {}


def loss_term(*names: str, **declared):
    """Register the decorated function as the term of loss type(s) `names`; `declared`: the LossType fields past
    `term` (see the module docstring)."""
    def register(fn):
        for name in names:
            LOSS_TERMS[name] = LossType(fn, **declared)
        return fn
    return register


def _none(like: Tensor) -> Tensor:
    return torch.zeros_like(like, dtype=torch.bool)


def _ppo_clip(r: Tensor, A: Tensor, config, dual_clip: bool = True) -> PolicyTerm:
    """max(-A r, -A clip(r, 1 - eps_lo, 1 + eps_hi)), with dual clip -A c for A < 0; d/dlog r = -A r
    where the unclipped branch is active."""
    neg_A = -A
    L1 = neg_A * r
    # clip bounds as `hyper_scalar`s: a clip-ratio schedule must not recompile a compiled step
    L2 = neg_A * torch.clamp(r, hyper_scalar(r, 1 - config.clip_ratio_low), hyper_scalar(r, 1 + config.clip_ratio_high))
    clipped = L2 > L1
    L = torch.where(clipped, L2, L1)
    if dual_clip and config.clip_ratio_c is not None:
        L3 = neg_A * config.clip_ratio_c
        dual = (A < 0) & (L3 < L)
        L = torch.where(dual, L3, L)
        active = ~(clipped | dual)
    else:
        dual, active = _none(clipped), ~clipped
    g = torch.where(active, L1, torch.zeros((), dtype=r.dtype, device=r.device))
    return PolicyTerm(L, None, g, clipped, dual)


@loss_term("vanilla", "ppo_clip", ratio_levels=True)
def ppo_clip(ctx: TermContext) -> PolicyTerm:
    """PPO clip with dual clip (verl's vanilla)."""
    return _ppo_clip(ctx.ratio, ctx.advantages, ctx.config)


@loss_term("reinforce", weights_itself=True, modes=("bypass", "on-policy"))
def reinforce(ctx: TermContext) -> PolicyTerm:
    """-A sg(w) lp: bypass mode's REINFORCE with the IS weights (1 without)."""
    w = ctx.weights.is_weights
    wv = w if w is not None else torch.ones_like(ctx.lp)
    none = _none(ctx.lp)
    return PolicyTerm(-ctx.advantages * wv * ctx.lp, -ctx.advantages * wv, None, none, none, applied_weights=w)


@loss_term("gpg")
def gpg(ctx: TermContext) -> PolicyTerm:
    """Plain policy gradient on the log-prob."""
    none = _none(ctx.lp)
    return PolicyTerm(-ctx.advantages * ctx.lp, -ctx.advantages, None, none, none)


@loss_term("sapo", ratio_levels=True, options=(Option("tau_pos", "positive", (1.0, 2.0)),
                                                    Option("tau_neg", "positive", (1.05, 0.5))))
def sapo(ctx: TermContext) -> PolicyTerm:
    """Soft gate f(r) = sigmoid(tau (r - 1)) 4 / tau, tau by the advantage's sign."""
    r, A, config = ctx.ratio, ctx.advantages, ctx.config
    tau = torch.where(A > 0, hyper(r, config.tau_pos), hyper(r, config.tau_neg))
    x = tau * (r - 1)
    gate = torch.sigmoid(x)
    # the gate's slope g (1 - g) with 1 - g = sigmoid(-x): formed as 1 - g it cancels to one ulp of 1 once the gate
    # saturates (float32 at x ~ 16: 6e-8 for 1.1e-7), where the slope is still a token's whole gradient
    slope = gate * torch.sigmoid(-x)
    none = _none(A)
    return PolicyTerm(-A * gate * 4 / tau, torch.zeros_like(r), -A * 4 * slope * r, none, none)


def _sequence_log_ratio(s: SumInputs) -> Dict[str, object]:
    return {"pg_delta": s.log_ratio}


@loss_term("gspo", sums=_sequence_log_ratio)
def gspo(ctx: TermContext) -> PolicyTerm:
    """s = exp(sg[mean log-ratio of the sequence] + lp - sg[lp]), clipped as PPO (the token form)."""
    A, config, seq = ctx.advantages, ctx.config, ctx.sequences
    log_s = seq.segments.expand(seq.sums("pg_delta") / seq.lengths)
    s_ratio = torch.exp(log_s.clamp(max=10.0))
    L1 = -A * s_ratio
    lo, hi = hyper(s_ratio, 1 - config.clip_ratio_low), hyper(s_ratio, 1 + config.clip_ratio_high)
    L2 = -A * torch.clamp(s_ratio, lo, hi)
    clipped = L2 > L1
    # d s / d lp = s (the lp - sg[lp] term), per token
    dL = torch.where(~clipped & (log_s <= 10.0), -A * s_ratio, torch.zeros_like(s_ratio))
    return PolicyTerm(torch.where(clipped, L2, L1), dL, None, clipped, _none(A),
                      kl_metric=-ctx.log_ratio)  # verl's GSPO reports the unclamped log-ratio


def _geo_clipped(s) -> Tuple[Tensor, Tensor, Tensor]:
    """GMPO's token-level clip toward the advantage's sign, in log space: (sign, clipped d, d_min)."""
    sign = torch.sign(s.advantages)
    d_clip = torch.clamp(s.log_ratio, hyper(s.lp, -s.config.clip_ratio_low), hyper(s.lp, s.config.clip_ratio_high))
    return sign, d_clip, sign * torch.minimum(sign * s.log_ratio, sign * d_clip)


def _geo_sums(s: SumInputs) -> Dict[str, object]:
    _, _, d_min = _geo_clipped(s)
    # "log_weights": a callable is applied to the log of the token IS weights computed in the stage
    log_weights = (lambda lw: lw) if s.given_weights is None else torch.log(s.given_weights)
    return {"gm_delta": d_min, "gm_adv": s.advantages, "log_weights": log_weights}


@loss_term("geo_mean", sums=_geo_sums, weights_itself=True, no_token_masks="is one term per sequence")
def geo_mean(ctx: TermContext) -> PolicyTerm:
    """GMPO: -mean_i(A_i exp(mean_t d_min)) over every sequence of the batch (its own mean, as verl's)."""
    seq, w = ctx.sequences, ctx.weights
    sign, d_clip, _ = _geo_clipped(ctx)
    zero = torch.zeros_like(ctx.lp)
    seq_ratio = torch.exp(seq.sums("gm_delta") / seq.lengths)
    seq_adv = seq.sums("gm_adv") / seq.lengths
    seq_w, applied = torch.ones_like(seq_ratio), None
    if w.weighted:  # the geometric mean of each sequence's weights
        if w.token_level:
            seq_w = torch.exp(seq.sums("log_weights") / seq.lengths) / w.norm_factor
        else:
            seq_w = w.sequence_weights / w.norm_factor
        applied = torch.where(seq.final_mask, seq.segments.expand(seq_w), zero)
    seq_coef = torch.where(seq.final_lengths > 0, -seq_adv * seq_ratio * seq_w, torch.zeros_like(seq.lengths))
    per_token = seq.segments.expand(seq_coef / seq.lengths) / seq.all_seqs.clamp_min(1)
    # each token carries 1/n of its sequence's term, so that context-parallel ranks' losses add up
    live = (sign != 0) & (sign * ctx.log_ratio <= sign * d_clip)  # d d_min / d lp: 1 unclipped, else 0
    own_mean = (torch.where(seq.final_mask, per_token, zero).sum(), torch.where(live, per_token, zero))
    outside = ctx.log_ratio != d_clip
    A = ctx.advantages
    return PolicyTerm(zero, zero, None, outside & (A > 0), outside & (A < 0), kl_metric=-ctx.log_ratio,
                      applied_weights=applied, own_mean=own_mean)


@loss_term("cispo", ratio_levels=True, options=(Option("cispo_cap", "optional_positive", (None, 5.0, 1.1)),))
def cispo(ctx: TermContext) -> PolicyTerm:
    """-sg(c) A lp, c the clipped (verl) or capped (TRL's cispo_cap) ratio."""
    r, A, config = ctx.ratio, ctx.advantages, ctx.config
    if config.cispo_cap is None:
        c = torch.clamp(r, hyper(r, 1 - config.clip_ratio_low), hyper(r, 1 + config.clip_ratio_high))
        clipped = r != c
    else:
        c = torch.minimum(r, hyper(r, config.cispo_cap))
        clipped = (r > c) & (A > 0)  # TRL's cispo_clip_ratio
    return PolicyTerm(-c * A * ctx.lp, -c * A, None, clipped, torch.zeros_like(clipped))


@loss_term("dro", options=(Option("dro_beta", "optional_positive", (0.1, 1.0), required=True),))
def dro(ctx: TermContext) -> PolicyTerm:
    """-(lp A - beta/2 (lp - l_old)^2), the log-ratio unclamped."""
    d, A = ctx.log_ratio, ctx.advantages
    beta = hyper(ctx.lp, ctx.config.dro_beta)
    none = _none(A)
    return PolicyTerm(-(ctx.lp * A - 0.5 * beta * d * d), -A + beta * d, None, none, none, kl_metric=-d)


def _dppo_inside(ctx: TermContext, kind: str) -> Tensor:
    """DPPO's trust region on the sampled token's probability (bool per token): the total variation
    p - p_old (dppo_tv) or the binary KL between Bernoulli(p_old) and Bernoulli(p) (dppo_kl) within
    eps_hi (A > 0) or eps_lo (A <= 0); the binary KL only limits moves toward the advantage."""
    lp, l_old, A, config = ctx.lp, ctx.l_old, ctx.advantages, ctx.config
    p, p_old = torch.exp(lp), torch.exp(l_old)
    hi, lo = hyper(lp, config.clip_ratio_high), hyper(lp, config.clip_ratio_low)
    if kind == "tv":
        return torch.where(A > 0, p - p_old <= hi, p - p_old >= -lo)
    bkl = p_old * (l_old - lp) + (1 - p_old) * torch.log((1.0 - p_old + 1e-8) / (1.0 - p + 1e-8))  # verl's guards
    return torch.where(A > 0, (bkl <= hi) | (p <= p_old), (bkl <= lo) | (p >= p_old))


def _dppo(ctx: TermContext, kind: str) -> PolicyTerm:
    """-A sg(min(r, c)) lp on the tokens inside the divergence region."""
    r, A, config = ctx.ratio, ctx.advantages, ctx.config
    cap = hyper(r, 20.0 if config.clip_ratio_c is None else config.clip_ratio_c)
    truncated = torch.minimum(r, cap)
    inside = _dppo_inside(ctx, kind)
    zero = torch.zeros_like(r)
    return PolicyTerm(torch.where(inside, -A * truncated * ctx.lp, zero), torch.where(inside, -A * truncated, zero),
                      None, ~inside, (r > cap) & inside)


@loss_term("dppo_tv")
def dppo_tv(ctx: TermContext) -> PolicyTerm:
    return _dppo(ctx, "tv")


@loss_term("dppo_kl")
def dppo_kl(ctx: TermContext) -> PolicyTerm:
    return _dppo(ctx, "kl")


@torch.compiler.disable
def _covariance_selection(loss_type: str, lp: Tensor, A: Tensor, mask: Tensor, candidates: Tensor,
                          config) -> Tensor:
    """verl's Clip-Cov / KL-Cov token selection ([N] bool), on the covariance of the advantage and the
    log-prob over the mask. It needs counts on the host, as verl's does (one sync; a graph break under
    torch.compile), and Clip-Cov's draw is torch.randperm on the default CPU generator over the
    candidates in token order, as verl's: the same tokens under the same torch.manual_seed."""
    n = int(mask.sum())
    chosen = torch.zeros_like(mask)
    if n == 0:
        return chosen
    m = mask.to(lp.dtype)
    # Clip-Cov's means divide by n + 1e-8 (verl's masked_mean), KL-Cov's by n (a plain mean), as verl's:
    # at a threshold of 0 the difference decides whether a one-token batch's covariance is 0 or 4e-16
    count = n + 1e-8 if loss_type == "clip_cov" else n
    cov = (A - (A * m).sum() / count) * (lp - (lp * m).sum() / count)
    if loss_type == "clip_cov":
        idx = torch.nonzero(candidates & mask & (cov > config.clip_cov_lb) & (cov < config.clip_cov_ub)).flatten()
        if idx.numel():
            pick = torch.randperm(idx.numel())[: max(int(config.clip_cov_ratio * n), 1)]
            chosen[idx[pick.to(idx.device)]] = True
        return chosen
    valid = torch.nonzero(mask).flatten()
    top = torch.topk(cov[valid], max(1, int(n * config.kl_cov_ratio)), largest=True).indices
    chosen[valid[top]] = True
    return chosen


@loss_term("clip_cov", batch_global=True, options=(
    Option("clip_cov_ratio", "positive", (0.0002, 0.2)), Option("clip_cov_lb", "number", (1.0, -1.0)),
    Option("clip_cov_ub", "number", (5.0, 2.0))))
def clip_cov(ctx: TermContext) -> PolicyTerm:
    """PPO clip (no dual clip) on the unclamped ratio; a random few high-covariance tokens get no gradient."""
    A, lp, d = ctx.advantages, ctx.lp, ctx.log_ratio
    base = _ppo_clip(torch.exp(d), A, ctx.config, dual_clip=False)
    chosen = _covariance_selection("clip_cov", lp, A, ctx.sequences.final_mask, ~base.clipped, ctx.config)
    keep = (~chosen).to(lp.dtype)
    return PolicyTerm(base.value * keep, base.direct, base.through_ratio * keep, chosen, _none(A), kl_metric=-d)


@loss_term("kl_cov", batch_global=True, options=(Option("kl_cov_ratio", "positive", (0.0002, 0.2)),
                                                Option("ppo_kl_coef", "number", (1.0, 0.1))))
def kl_cov(ctx: TermContext) -> PolicyTerm:
    """The top-covariance tokens get a |log-ratio| penalty, the rest the unclipped -A r (unclamped)."""
    A, lp, d = ctx.advantages, ctx.lp, ctx.log_ratio
    r_raw = torch.exp(d)
    final_mask = ctx.sequences.final_mask
    chosen = _covariance_selection("kl_cov", lp, A, final_mask, final_mask, ctx.config)
    coef = hyper(lp, ctx.config.ppo_kl_coef)
    zero = torch.zeros_like(lp)
    penalty = torch.where(chosen, coef * d.abs(), zero)
    d_penalty = torch.where(chosen, coef * torch.sign(d), zero)
    return PolicyTerm(-A * r_raw + penalty, d_penalty, -A * r_raw, chosen, _none(A), kl_metric=d.abs())



def _topr_sums(s: SumInputs) -> Dict[str, object]:
    return {"pg_delta": s.log_ratio, "adv": s.advantages}


@loss_term("topr", sums=_topr_sums, options=(Option("topr_negative_ratio_lower", "non_negative", (0.0, 0.5)),
                                             Option("topr_negative_ratio_upper", "non_negative", (1.0, 2.0))),
           ordered=(("topr_negative_ratio_lower", "topr_negative_ratio_upper"),))
def topr(ctx: TermContext) -> PolicyTerm:
    """-A sg(tau_i) lp; tau_i = clip(exp(mean log-ratio), lo, hi) if the sequence's mean A < 0, else 1."""
    seq, config = ctx.sequences, ctx.config
    w_seq = torch.exp((seq.sums("pg_delta") / seq.lengths).clamp(max=10.0))
    # a sequence that rejection emptied has no advantage left (verl sees it through response_mask)
    negative = (seq.sums("adv") / seq.lengths < 0) & (seq.final_lengths > 0)
    lo, hi = hyper(w_seq, config.topr_negative_ratio_lower), hyper(w_seq, config.topr_negative_ratio_upper)
    taper = torch.where(negative, torch.minimum(torch.maximum(w_seq, lo), hi), torch.ones_like(w_seq))
    tau = seq.segments.expand(taper)
    everyone = torch.ones_like(negative)
    ctx.metrics.mean("actor/topr_negative_seq_frac", negative.to(w_seq.dtype), everyone, seq.all_seqs, True)
    ctx.metrics.mean("actor/topr_taper_weight_mean", taper, everyone, seq.all_seqs, True)
    A = ctx.advantages
    none = _none(A)
    return PolicyTerm(-A * ctx.lp * tau, -A * tau, None, none, none, kl_metric=-ctx.log_ratio)


# LUSPO (TRL): PPO clip's term under its own length-unbiased aggregation (a token sum per sequence, averaged over
# every sequence), which stands for loss_agg_mode wherever that applies (policy term, KL, and the entropy unless
# entropy_agg_mode names another)
loss_term("luspo", ratio_levels=True, aggregation=("seq-mean-token-sum", "all"))(ppo_clip)


def _vespo_sums(s: SumInputs) -> Dict[str, object]:
    """TRL's get_gamma_weights: a sequence sum of clamped log-ratios (and of the token IS weights' logs)."""
    floor = math.log(1e-8)
    clamp_log_w = lambda lw: lw.clamp(floor, CLAMP)  # noqa: E731
    log_weights = clamp_log_w if s.given_weights is None else clamp_log_w(torch.log(s.given_weights))
    return {"vespo_delta": s.log_ratio.clamp(-CLAMP, CLAMP), "log_weights": log_weights}


@loss_term("vespo", sums=_vespo_sums, weights_itself=True, ratio_levels=True, options=(
    Option("vespo_k_pos", "number", (2.0, 1.0)), Option("vespo_lambda_pos", "positive", (3.0, 1.5)),
    Option("vespo_k_neg", "number", (3.0, 1.0)), Option("vespo_lambda_neg", "positive", (2.0, 4.0))),
    is_levels=(None, "token"), is_level_refusal="folds token-level IS weights into its sequence ratio; "
    "is_level='sequence' has no such form (TRL raises too)")
def vespo(ctx: TermContext) -> PolicyTerm:
    """-sg(phi) A lp, phi = e^lambda w^k e^(-lambda w) of the sequence ratio w (token IS weights folded in)."""
    seq, config, lp = ctx.sequences, ctx.config, ctx.lp
    log_w = seq.sums("vespo_delta")
    if ctx.weights.token_level:
        log_w = log_w + seq.sums("log_weights")
    log_w = seq.segments.expand(log_w.clamp(math.log(1e-8), CLAMP))
    nonneg = ctx.advantages >= 0
    k = torch.where(nonneg, hyper(lp, config.vespo_k_pos), hyper(lp, config.vespo_k_neg))
    lam = torch.where(nonneg, hyper(lp, config.vespo_lambda_pos), hyper(lp, config.vespo_lambda_neg))
    lam = lam.clamp_min(1e-4)  # TRL's floor
    phi = torch.nan_to_num(torch.exp(lam + k * log_w - lam * torch.exp(log_w)), nan=0.0, posinf=0.0, neginf=0.0)
    ctx.metrics.mean("actor/vespo_phi_seq_mean", phi, seq.final_mask, seq.kept_tokens)
    A = ctx.advantages
    none = _none(A)
    return PolicyTerm(-phi * A * lp, -phi * A, None, none, none, kl_metric=-ctx.log_ratio)


# -- the 2026 trust regions on the rollout policy (SPEC §6.1): IPO, KPop, symmetric DPPO binary-TV ---------------------
# One loss, -A r on the kept tokens (+ ipo_kl_tau (log r)^2 there), with r = p / q against the sampler q (the
# rollout policy, else the proximal one) and the gradient through r; they differ in the keep rule only. r is the
# whole correction to the sampler: computed IS weights are refused by the config, a trainer's own multiply.
_KPOP_CLAMP = 1e-6  # prime-rl PR #3283: the probabilities of its binary KLs are clamped to [1e-6, 1 - 1e-6]


def clamped_ratio(log_r: Tensor, limit: Optional[float]) -> Tuple[Tensor, Tensor]:
    """(r, where the clamp passes the gradient) for r = exp(log r) with log r clamped to [-limit, limit]
    (log_ratio_clamp; None: unclamped, the gradient everywhere)."""
    if limit is None:
        return torch.exp(log_r), torch.ones_like(log_r, dtype=torch.bool)
    return torch.exp(log_r.clamp(-limit, limit)), log_r.abs() <= limit


def _rollout_trust_region(ctx: TermContext, keep: Tensor) -> PolicyTerm:
    """-A r + tau (log r)^2 on the kept tokens, 0 elsewhere (selected, never multiplied: an overflowing r off the
    region cannot make a NaN); d/dlp = -A r (inside the clamp) + 2 tau log r, with r = p / q against the sampler."""
    d = ctx.lp - ctx.behaviour
    r, within = clamped_ratio(d, ctx.config.log_ratio_clamp)
    A, zero = ctx.advantages, torch.zeros_like(d)
    tau = hyper(d, ctx.config.ipo_kl_tau)
    value = torch.where(keep, -A * r + tau * d * d, zero)
    direct = torch.where(keep, torch.where(within, -A * r, zero) + 2 * tau * d, zero)
    w = ctx.weights.is_weights  # only ever a trainer's own (the config refuses computed ones)
    if w is not None:
        value, direct = value * w, direct * w
    return PolicyTerm(value, direct, None, ~keep, _none(A), kl_metric=-d,
                      applied_weights=w)


# the IPO family (prime-rl): -A p/q against the sampler on the tokens it keeps, tau (log p/q)^2 there
_IPO_KL_TAU = Option("ipo_kl_tau", "non_negative", (0.0, 0.0, 0.01))
_ROLLOUT_TRUST_REGION = dict(
    weights_itself=True, is_levels=(None,),
    is_level_refusal="weighs each token by p/q against the sampler itself; IS weights (is_level={is_level}) would "
    "correct twice. Keep the rejection options (rs) and set is_level=None")


@loss_term("ipo", options=(Option("ipo_eps", "non_negative", (0.3, 0.05, 1.0)), _IPO_KL_TAU), **_ROLLOUT_TRUST_REGION)
def ipo(ctx: TermContext) -> PolicyTerm:
    """IPO (prime-rl): keep iff |p - q| <= ipo_eps, whatever the advantage's sign."""
    high, low = torch.maximum(ctx.lp, ctx.behaviour), torch.minimum(ctx.lp, ctx.behaviour)
    gap = torch.exp(high) * -torch.expm1(low - high)  # |p - q| without cancelling two small probabilities
    return _rollout_trust_region(ctx, gap <= hyper(gap, ctx.config.ipo_eps))


def binary_kl(log_a: Tensor, log_b: Tensor, eps: float) -> Tensor:
    """KL(Bern(a) || Bern(b)) of the pair (this token, the rest), a and b the probabilities of the log-probs given,
    each clamped to [eps, 1 - eps]. Taken from the log-probs: 1 - a as -expm1(log a), so that the clamp at 1 - eps
    holds in float32 too (where 1 - 1e-6 rounds to 1 - 1.013e-6, 1.3 % off the complement)."""
    def parts(log_x):
        log_x_clamped = log_x.clamp(math.log(eps), math.log1p(-eps))
        log_rest = torch.log(torch.clamp(-torch.expm1(log_x), eps, 1 - eps))  # log(1 - clamp(x, eps, 1 - eps))
        return torch.exp(log_x_clamped), log_x_clamped, log_rest

    a, log_a_c, log_a_rest = parts(log_a)
    _, log_b_c, log_b_rest = parts(log_b)
    return a * (log_a_c - log_b_c) + torch.exp(log_a_rest) * (log_a_rest - log_b_rest)


@loss_term("kpop", options=(Option("kpop_phi", "non_negative", (0.1, 0.01)), _IPO_KL_TAU), **_ROLLOUT_TRUST_REGION)
def kpop(ctx: TermContext) -> PolicyTerm:
    """KPop (prime-rl PR #3283): keep iff both binary KLs between p and q are <= kpop_phi."""
    phi = hyper(ctx.lp, ctx.config.kpop_phi)
    keep = ((binary_kl(ctx.lp, ctx.behaviour, _KPOP_CLAMP) <= phi)
            & (binary_kl(ctx.behaviour, ctx.lp, _KPOP_CLAMP) <= phi))
    return _rollout_trust_region(ctx, keep)


@loss_term("dppo_binary_tv", options=(Option("binary_tv_low", "non_negative", (0.2, 0.05)),
                                       Option("binary_tv_high", "non_negative", (0.2, 0.5)), _IPO_KL_TAU),
           **_ROLLOUT_TRUST_REGION)
def dppo_binary_tv(ctx: TermContext) -> PolicyTerm:
    """Symmetric DPPO binary-TV (prime-rl PR #2434): keep iff -binary_tv_low <= p - q <= binary_tv_high."""
    gap = torch.exp(ctx.lp) - torch.exp(ctx.behaviour)
    keep = (gap >= -hyper(gap, ctx.config.binary_tv_low)) & (gap <= hyper(gap, ctx.config.binary_tv_high))
    return _rollout_trust_region(ctx, keep)


@loss_term("dppo_binary_tv_signed", options=(Option("binary_tv_low", "non_negative", (0.2, 0.05)),
                                              Option("binary_tv_high", "non_negative", (0.2, 0.5)), _IPO_KL_TAU),
           **_ROLLOUT_TRUST_REGION)
def dppo_binary_tv_signed(ctx: TermContext) -> PolicyTerm:
    """DPPO binary-TV conditioned on the advantage's sign (prime-rl's default loss at 559b4477): a token whose
    update would widen the gap is dropped: p - q > binary_tv_high where A > 0, p - q < -binary_tv_low elsewhere
    (A = 0 takes the low side, as prime-rl's torch.where(A > 0, high, low); its policy term is 0 either way)."""
    gap = torch.exp(ctx.lp) - torch.exp(ctx.behaviour)
    drop = torch.where(ctx.advantages > 0, gap > hyper(gap, ctx.config.binary_tv_high),
                       gap < -hyper(gap, ctx.config.binary_tv_low))
    return _rollout_trust_region(ctx, ~drop)


# Score centering's floors on the tail masses 1 - sum_H q and 1 - sum_H p (as slime and SkyRL floor them)
SCORE_CENTERING_TAIL_FLOOR = 1e-6


def token_is_function(rc) -> Callable[[Tensor], Tensor]:
    """f of score centering: the token-level IS rule of the rollout correction. No IS level: f = 1; truncation
    to [lo, hi] (a single C: [0, C], min(r, C)); a mask band (IcePop): f(r) = r 1[lo <= r <= hi]."""
    if rc is None or rc.is_level is None:
        return torch.ones_like
    lo, hi = rc.is_range
    if rc.is_icepop:
        return lambda r: torch.where((r >= hyper(r, lo)) & (r <= hyper(r, hi)), r, torch.zeros_like(r))
    return lambda r: torch.minimum(torch.maximum(r, hyper(r, lo)), hyper(r, hi))


@loss_term("score_centering", weights_itself=True, sampler_head=True, modes=("decoupled", "bypass"),
           is_levels=(None, "token"),
           is_level_refusal="takes the token-level IS rule as its f (truncation or an IcePop band); "
           "is_level='sequence' has no per-token f. Use is_level='token' or None")
def score_centering(ctx: TermContext) -> PolicyTerm:
    """Score centering (arXiv 2609.20807, as slime and SkyRL compose it): subtract E_q[f(r) grad log p] over the
    sampler's head H from the IS-weighted score, with the tail's share alpha p:
    L_t = -A (f(r_y) log p_y - sum_H sg[q f(r) - alpha p] log p), alpha = rho f(1/rho),
    rho = (1 - sum_H q) / (1 - sum_H p); f(r_y) detached, q_y the rollout log-prob."""
    rc = ctx.config.rollout_correction
    f = token_is_function(rc)
    A, zero = ctx.advantages, torch.zeros_like(ctx.lp)
    r_y = torch.exp((ctx.lp - ctx.behaviour).clamp(-CLAMP, CLAMP))
    f_y = f(r_y)
    lp, lq, slots = ctx.head
    live = slots & (lp > float("-inf"))  # an id without trainer mass has log p = -inf and no gradient
    p = torch.where(live, torch.exp(lp), torch.zeros_like(lp))
    q = torch.where(slots, torch.exp(lq.to(lp.dtype)), torch.zeros_like(lp))
    r = torch.where(live, torch.exp((torch.where(live, lp, zero[:, None])
                                     - torch.where(slots, lq.to(lp.dtype), zero[:, None])).clamp(-CLAMP, CLAMP)),
                    zero[:, None])  # p = 0 at an id the trainer gives no mass: r = 0
    floor = SCORE_CENTERING_TAIL_FLOOR
    rho = (1 - q.sum(1)).clamp_min(floor) / (1 - p.sum(1)).clamp_min(floor)
    alpha = rho * f(1 / rho)
    w = torch.where(slots, q * f(r) - alpha[:, None] * p, zero[:, None])
    head_value = torch.where(live, w * torch.where(live, lp, zero[:, None]), zero[:, None]).sum(1)
    value = -A * (f_y * ctx.lp - head_value)
    head_direct = torch.where(live, A[:, None] * w, zero[:, None])
    mask, n = ctx.sequences.final_mask, ctx.sequences.kept_tokens
    ctx.metrics.mean("actor/score_centering_alpha_mean", alpha, mask, n)
    ctx.metrics.mean("actor/score_centering_weight_abs_mean", w.abs().sum(1), mask, n)
    clipped = f_y != r_y if rc is not None and rc.is_level is not None else _none(A)  # f truncated or masked r_y
    return PolicyTerm(value, -A * f_y, None, clipped, _none(A), kl_metric=-(ctx.lp - ctx.behaviour),
                      applied_weights=f_y, head_direct=head_direct)
