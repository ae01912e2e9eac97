"""The per-sequence stage: per-token scalars -> loss, gradient coefficients and metrics (SPEC §1, §4-§8).

Every loss of the spec is linear in per-token terms with mask-only weights a_t (the aggregation of
SPEC §7), so its gradient is
    dLoss/dlogprob_t = c_t = a_t * (dL_t/dlogprob_t + beta * dKL_t/dlogprob_t)
    dLoss/dentropy_t = e_t = -entropy_coeff * a_t
written here in closed form. The vocabulary-wide backward then needs only (c_t, e_t) per row
(SPEC §2). All of it is [N]-sized torch work with no host synchronisation.

`run` reads in the order the loss is built: the inputs on the mask and SPEC §1's mode -> the rollout
correction (IS weights, rejection, the batch's normalisers) -> the policy ratio -> the loss type's term
(stage/policy_terms.py) -> IS weights and token masks on it -> aggregation -> KL -> entropy -> the
data-parallel scale.
"""

from typing import TYPE_CHECKING, Dict, NamedTuple, Optional

import torch
from torch import Tensor

from . import correction
from .metrics import Metrics
from .policy_terms import (
    LOSS_TERMS,
    HeadContext,
    PolicyTerm,
    SequenceContext,
    SumInputs,
    TermContext,
    WeightContext,
    binary_kl,
    clamped_ratio,
)
from .segments import Segments, hyper, hyper_scalar

if TYPE_CHECKING:  # the stage is duck-typed on the config: rlkernels.config reads this package's loss table
    from ..config import PolicyLossConfig

CLAMP = correction.CLAMP


class StageOutput(NamedTuple):
    loss: Tensor  # 0-d
    coef_logprob: Tensor  # [N] c_t
    coef_entropy: Optional[Tensor]  # [N] e_t, None when the loss does not use the entropy
    is_weights: Optional[Tensor]  # [N] weights multiplying the policy term, None if none do
    mask: Tensor  # [N] bool, the final mask m'
    metrics: Dict[str, Tensor]
    coef_head: Optional[Tensor] = None  # [N, k] dLoss/dlog p at the sampler's head ids (score centering), or None
    logprobs: Optional[Tensor] = None  # [N] the statistics' log-probs, 0 off the mask (as the output reports them)


class SamplerEvidence(NamedTuple):
    """What the pass learnt of the sampler's distribution (SPEC §9), for the stage: the divergences (rejection
    and metrics) and, for a loss that reads the sampler's top-k, the trainer's log-probs at its ids."""
    record: correction.DivergenceRecord  # the per-token divergences on the mask, detached
    head_logprobs: Optional[Tensor] = None  # [N, k] log p at batch.sampler_head.ids, detached, or None

    def head(self, batch) -> Optional[HeadContext]:
        if self.head_logprobs is None:
            return None
        return HeadContext(self.head_logprobs, batch.sampler_head.logprobs, batch.sampler_head.slots)


def aggregation_weights(mask: Tensor, seg: Segments, config: "PolicyLossConfig", dtype,
                        final_lengths: Optional[Tensor] = None,
                        norms: Optional[correction.Normalisers] = None, mode: Optional[str] = None) -> Tensor:
    """a_t of SPEC §7, so that agg(X) = sum_t a_t * X_t. Empty batches give a = 0 (loss 0, never NaN).

    `final_lengths` ([S], tokens of each sequence in the mask) and `norms` (the batch-wide counts)
    come from the stage, whole over a split batch; alone, this computes them from `mask`. `mode`:
    another aggregation than the config's (the entropy's `entropy_agg_mode`)."""
    m = mask.to(dtype)
    if final_lengths is None:
        final_lengths = seg.sum(m)
    if norms is None:
        count = m.sum()
        norms = correction.Normalisers(count, count, None, (final_lengths > 0).to(dtype).sum(),
                                       None, None,
                                       torch.as_tensor(float(seg.num_seqs)).to(dtype))
    mode = mode or config.loss_agg_mode
    over_all = config.seq_mean_over == "all"
    own = LOSS_TERMS[config.loss_type].aggregation
    if own is not None and mode == config.loss_agg_mode:  # the loss's own aggregation stands for the config's
        mode, over_all = own[0], own[1] == "all"
    if mode == "token-sum":
        return m
    if mode == "token-mean":
        n = norms.kept_tokens.clamp_min(1) if config.global_num_tokens is None else config.global_num_tokens
        return m / n
    if config.global_num_seqs is not None:
        G = config.global_num_seqs
    else:
        G = (norms.all_seqs if over_all else norms.kept_seqs).clamp_min(1)
    if mode == "seq-mean-token-mean":
        return m / (seg.expand(final_lengths.clamp_min(1)) * G)
    if mode == "seq-mean-token-sum":
        return m / G
    # a packed batch of empty sequences has width 0 and a = 0 anyway
    if config.loss_scale_factor is not None:
        K = config.loss_scale_factor
    else:
        width = seg.width_like(m) if norms.width is None else norms.width
        K = width.clamp_min(1)
    return m / (G * K)


def kl_and_grad(lp: Tensor, ref: Tensor, kl_type: str):
    """Per-token KL penalty of SPEC §6 and its derivative w.r.t. lp. "<type>+": that estimator's value
    with k2's derivative lp - ref (verl's straight-through variants)."""
    if kl_type.endswith("+"):
        return kl_and_grad(lp, ref, kl_type[:-1])[0], lp - ref
    if kl_type == "k1":
        return lp - ref, torch.ones_like(lp)
    if kl_type == "k2":
        return 0.5 * (lp - ref) ** 2, lp - ref
    if kl_type == "abs":
        return (lp - ref).abs(), torch.sign(lp - ref)
    if kl_type == "k3_unclamped":  # the textbook k3 (TRL's): e^d - d - 1, d = ref - lp
        d = ref - lp
        return torch.exp(d) - d - 1, 1 - torch.exp(d)
    d_raw = ref - lp
    d = d_raw.clamp(-CLAMP, CLAMP)
    k3_raw = torch.exp(d) - d - 1
    kl = k3_raw.clamp(-10, 10)
    # clamp passes the gradient on its closed interval, as torch.clamp's does
    live = (d_raw >= -CLAMP) & (d_raw <= CLAMP) & (k3_raw <= 10) & (k3_raw >= -10)
    return kl, torch.where(live, 1 - torch.exp(d), torch.zeros_like(lp))


def kl_gradient_passes(lp: Tensor, ref: Tensor, kl_type: str) -> Tensor:
    """Where the KL estimator's clamps pass a gradient: everywhere but k3's clamps (|ref - lp| <= 20, k3 <= 10)."""
    if kl_type != "k3":
        return torch.ones_like(lp, dtype=torch.bool)
    d_raw = ref - lp
    d = d_raw.clamp(-CLAMP, CLAMP)
    return (d_raw >= -CLAMP) & (d_raw <= CLAMP) & (torch.exp(d) - d - 1 <= 10)


class _Inputs(NamedTuple):
    """The stage's [N] inputs on the mask (0 off it), in the statistics' dtype, and SPEC §1's mode. The
    mode's policies are properties, not fields: fields that alias one another (l_old is old in decoupled
    mode, the rollout's in bypass mode) would make a compiled stage recompile when the aliasing changes
    with the mode, and Dynamo's report of that recompilation fails on a split batch."""
    lp: Tensor
    entropy: Optional[Tensor]
    advantages: Tensor
    mask: Tensor
    old: Optional[Tensor]
    rollout: Optional[Tensor]
    ref: Optional[Tensor]
    given_weights: Optional[Tensor]
    zero: Tensor  # 0-d 0 of the statistics' dtype, for every where() of the stage

    @property
    def decoupled(self) -> bool:
        return self.old is not None

    @property
    def l_old(self) -> Tensor:
        """The proximal policy: old (decoupled), the sampler's (bypass) or the current one (on-policy)."""
        return self.old if self.old is not None else (self.rollout if self.rollout is not None else self.lp)

    @property
    def l_train(self) -> Tensor:
        """The policy the IS weights are taken of: old (decoupled) or the current one."""
        return self.old if self.old is not None else self.lp

    @property
    def behaviour(self) -> Tensor:
        """The sampler's log-probs where known, else l_old."""
        return self.rollout if self.rollout is not None else self.l_old


def _masked_inputs(stats, batch) -> _Inputs:
    mask = batch.mask
    dt = stats.logprobs.dtype
    zero = torch.zeros((), dtype=dt, device=mask.device)

    def valid(x):  # off the mask values may be NaN/inf; they must not reach a sum or a gradient
        return None if x is None else torch.where(mask, x.to(dt), zero)

    return _Inputs(valid(stats.logprobs), valid(stats.entropy), valid(batch.advantages), mask,
                   valid(batch.old_logprobs), valid(batch.rollout_logprobs), valid(batch.ref_logprobs),
                   valid(batch.is_weights), zero)


class _Corrected(NamedTuple):
    table: "correction.SequenceTable"
    decisions: correction.Decisions
    norms: correction.Normalisers
    is_weights: Optional[Tensor]  # [N] the weights on the policy term: computed or the trainer's
    norm_factor: Optional[Tensor]  # 0-d batch normalisation factor of computed weights (1 for the trainer's)
    computed_token_weights: bool  # the correction computed per-token weights (is_level="token")
    weighted: bool  # the stage applies the weights (decoupled mode, or the trainer's own)
    metrics: Metrics


def _kept_sums(x: _Inputs, config: "PolicyLossConfig") -> Dict[str, object]:
    """The per-token values summed per sequence that the loss needs (over the tokens no token-level rejection
    drops), whole over a context-parallel split."""
    entry = LOSS_TERMS[config.loss_type]
    kept_sums = {}
    if config.seq_mean_advantages:
        kept_sums["advantages"] = x.advantages
    if config.ratio_level == "sequence" or entry.sums is not None:
        delta = x.lp - x.l_old
        if config.ratio_level == "sequence":
            kept_sums["pg_delta"] = delta
        if entry.sums is not None:
            kept_sums.update(entry.sums(SumInputs(x.lp, x.advantages, delta, x.given_weights, config)))
    if config.off_policy_mask_threshold is not None:  # DeepSeek-V3.2: the sampler against the current policy
        kept_sums["opsm"] = x.behaviour - x.lp
    if config.vaco_threshold is not None:
        kept_sums["vaco"] = _vaco_divergence(x.l_train, x.rollout, config.vaco_divergence)
    return kept_sums


_VACO_LOG_FLOOR, _VACO_CLAMP = -30.0, 1e-6  # open-instruct PR #1755 (5c2bf9ab): log-probs to [-30, 0], KL's clamp


def _vaco_divergence(l_train: Tensor, l_mu: Tensor, kind: str) -> Tensor:
    """VACO's per-token binary divergence between the training policy and the sampler: |mu - pi| ("tv") or
    KL(Bern(mu) || Bern(pi)) ("kl") of the sampled token's probabilities."""
    log_pi, log_mu = (v.clamp(_VACO_LOG_FLOOR, 0.0) for v in (l_train, l_mu))
    if kind == "tv":
        return (torch.exp(log_mu) - torch.exp(log_pi)).abs()
    return binary_kl(log_mu, log_pi, _VACO_CLAMP)


def _vaco_keep(x: _Inputs, c: _Corrected, seg: Segments, config: "PolicyLossConfig") -> Tensor:
    """VACO's mask ([N] bool, False = the policy term is zeroed): in a sequence whose mean divergence over m' exceeds
    vaco_threshold, the tokens whose update would move the training policy further from the sampler,
    sign(log pi - log mu) A > 0."""
    lengths = c.decisions.final_lengths
    seq_divergence = c.table.sum("vaco") / lengths.clamp_min(1)
    over = seg.expand(seq_divergence > hyper_scalar(seq_divergence, config.vaco_threshold))
    log_ratio = x.l_train.clamp(_VACO_LOG_FLOOR, 0.0) - x.rollout.clamp(_VACO_LOG_FLOOR, 0.0)
    keep = ~(over & (torch.sign(log_ratio) * x.advantages > 0))
    c.metrics.mean("actor/vaco_masked_fraction", ~keep, c.decisions.mask, c.norms.kept_tokens)
    c.metrics.mean("actor/vaco_divergence_mean", seq_divergence, lengths > 0, c.norms.kept_seqs, per_sequence=True)
    return keep


def _corrected(x: _Inputs, corrected, config: "PolicyLossConfig", batch, evidence: Optional[SamplerEvidence],
               record: bool = True) -> _Corrected:
    """correction.correct's results as the stage reads them, with the rollout_corr/* and response_length/*
    metrics recorded (unless `record` is False: a coefficients-only run)."""
    terms, table, decisions, norms, w = corrected
    metrics = Metrics(enabled=record)
    if record:
        if terms is not None:
            correction.record_metrics(metrics, terms, x.mask, table, decisions, norms, config.rollout_correction, w)
        if evidence is not None:
            correction.record_divergence_metrics(metrics, evidence.record, x.mask, table, norms)
        correction.record_length_metrics(metrics, table, norms, batch.split)
    computed_token_weights = terms is not None and terms.token_weights is not None
    weights, factor = (None, None) if w is None else (w.weights, w.norm_factor)
    if x.given_weights is not None:  # a trainer's own weights stand where computed ones would
        weights, factor = x.given_weights, torch.ones((), dtype=x.lp.dtype, device=x.lp.device)
    weighted = weights is not None and (x.decoupled or x.given_weights is not None)
    return _Corrected(table, decisions, norms, weights, factor, computed_token_weights, weighted, metrics)


class _Ratio(NamedTuple):
    delta: Tensor  # [N] lp - l_old, per token and unclamped
    log_r: Tensor  # the log-ratio r is taken of: per token, or each sequence's mean (ratio_level="sequence")
    r: Tensor
    within_clamp: Tensor  # [N] bool, where log_ratio_clamp passes the gradient

    def kl_metric(self, bound: Optional[float]) -> Tensor:
        """actor/ppo_kl's default per-token value (formed only when the metrics are)."""
        return -self.delta if bound is None else -self.delta.clamp(-bound, bound)


def _policy_ratio(x: _Inputs, c: _Corrected, seg: Segments, config: "PolicyLossConfig") -> _Ratio:
    delta = x.lp - x.l_old
    if config.ratio_level == "sequence":
        log_r = seg.expand(c.table.sum("pg_delta") / c.decisions.final_lengths.clamp_min(1))
    else:
        log_r = delta
    r, within = clamped_ratio(log_r, config.log_ratio_clamp)
    return _Ratio(delta, log_r, r, within)


def _term_context(x: _Inputs, c: _Corrected, ratio: _Ratio, seg: Segments, config: "PolicyLossConfig",
                  head=None) -> TermContext:
    d = c.decisions
    sequences = SequenceContext(seg, c.table.sum, d.final_lengths.clamp_min(1), d.final_lengths, d.mask,
                                c.norms.kept_tokens, c.norms.all_seqs)
    weights = WeightContext(c.is_weights, c.norm_factor, c.weighted,
                            x.given_weights is not None or c.computed_token_weights, d.sequence_weights)
    return TermContext(x.lp, x.advantages, ratio.delta, ratio.r, x.l_old, x.behaviour, config, sequences, weights,
                       c.metrics, head)


class _Weighted(NamedTuple):
    value: Tensor  # L
    direct: Optional[Tensor]  # d (None: 0)
    through_ratio: Optional[Tensor]  # g
    applied_weights: Optional[Tensor]
    keep: Optional[Tensor]  # [N] bool, tokens whose policy term a token mask kept (None: every token)
    head_direct: Optional[Tensor] = None  # [N, k] the term's coefficients on the head's log-probs


def _weigh_and_mask(term: PolicyTerm, x: _Inputs, c: _Corrected, ratio: _Ratio, seg: Segments,
                    config: "PolicyLossConfig") -> _Weighted:
    """The IS weights on the policy term (unless the loss applied them itself), and the token masks that
    zero it (OPSM, M2PO: zero weight, the denominators keep the tokens)."""
    entry = LOSS_TERMS[config.loss_type]
    zero = x.zero
    L, d, g = term.value, term.direct, term.through_ratio
    if g is not None and entry.ratio_levels:
        g = torch.where(ratio.within_clamp, g, zero)  # the clamp passes no gradient outside its interval
    applied = term.applied_weights
    if not entry.weights_itself and c.weighted:
        applied = c.is_weights
        L, d = L * applied, None if d is None else d * applied
        g = None if g is None else g * applied
    keep = None
    final_mask, n_kept = c.decisions.mask, c.norms.kept_tokens
    if config.off_policy_mask_threshold is not None:
        seq_kl = c.table.sum("opsm") / c.decisions.final_lengths.clamp_min(1)
        keep = (x.advantages >= 0) | seg.expand(seq_kl <= hyper_scalar(seq_kl, config.off_policy_mask_threshold))
        c.metrics.mean("actor/off_policy_masked_fraction", ~keep, final_mask, n_kept)
    if config.m2po_threshold is not None:
        m2_keep = _m2po_keep(x.lp, x.behaviour, x.advantages, final_mask, config, c.metrics, n_kept)
        keep = m2_keep if keep is None else keep & m2_keep
    if config.vaco_threshold is not None:
        vaco_keep = _vaco_keep(x, c, seg, config)
        keep = vaco_keep if keep is None else keep & vaco_keep
    head = term.head_direct
    if keep is not None:
        L, d = torch.where(keep, L, zero), None if d is None else torch.where(keep, d, zero)
        g = None if g is None else torch.where(keep, g, zero)
        head = None if head is None else torch.where(keep[:, None], head, zero)
    return _Weighted(L, d, g, applied, keep, head)


def _m2po_keep(lp: Tensor, behaviour: Tensor, A: Tensor, mask: Tensor, config: "PolicyLossConfig",
               metrics: Metrics, n_valid: Tensor) -> Tensor:
    """M2PO's second-moment mask ([N] bool, False = the token's policy term is zeroed): over the
    eligible tokens (the active trust-region quadrants A > 0, r > 1 and A < 0, r < 1; or every token),
    keep the longest prefix of the ascending squared log-ratios (current vs behaviour) whose mean is
    <= tau, one selection over the batch (sort, cumsum; no host sync)."""
    d = lp - behaviour
    m2 = d * d
    eligible = mask
    if config.m2po_quadrant:
        eligible = mask & (((A > 0) & (d > 0)) | ((A < 0) & (d < 0)))
    inf = torch.full_like(m2, float("inf"))
    sorted_m2, order = torch.sort(torch.where(eligible, m2, inf), stable=True)
    n_elig = eligible.sum()
    position = torch.arange(1, m2.numel() + 1, device=m2.device)
    prefix_mean = torch.cumsum(torch.where(position <= n_elig, sorted_m2, torch.zeros_like(m2)), 0) / position
    keep_count = ((prefix_mean <= hyper_scalar(m2, config.m2po_threshold)) & (position <= n_elig)).sum()
    rank = torch.empty_like(order)
    rank[order] = position - 1
    keep = ~eligible | (rank < keep_count)
    dt = lp.dtype
    n_elig_f = n_elig.to(dt)
    metrics.mean("actor/m2po_masked_fraction", ~keep, mask, n_valid)
    metrics.mean("actor/m2po_trust_region_fraction", eligible, mask, n_valid)
    metrics.mean("actor/m2po_m2_before", m2, eligible, n_elig_f)
    metrics.mean("actor/m2po_m2_after", m2, eligible & keep, keep_count.to(dt))
    return keep


class _Total(NamedTuple):
    loss: Tensor  # 0-d
    coef: Optional[Tensor]  # [N] c_t so far (None: 0)
    through_ratio: Optional[Tensor]  # [N] a_t g_t, still to be chained (per token or through the sequence)


def _aggregate(term: PolicyTerm, w: _Weighted, c: _Corrected, a: Tensor, zero: Tensor) -> _Total:
    """SPEC §7 on the policy term, and its metrics."""
    final_mask, n_kept = c.decisions.mask, c.norms.kept_tokens
    L = torch.where(final_mask, w.value, zero)
    if term.own_mean is not None:  # GMPO: its own mean over sequences, as verl's (not loss_agg_mode)
        pg_loss, coef = term.own_mean[0], torch.where(final_mask, term.own_mean[1], zero)
        if w.keep is not None:
            coef = torch.where(w.keep, coef, zero)
    else:
        pg_loss, coef = (a * L).sum(), None if w.direct is None else a * w.direct
    c.metrics.total("actor/pg_loss", pg_loss)
    c.metrics.mean("actor/pg_clipfrac", term.clipped, final_mask, n_kept)
    c.metrics.mean("actor/pg_clipfrac_lower", term.dual, final_mask, n_kept)
    return _Total(pg_loss, coef, None if w.through_ratio is None else a * w.through_ratio)


def _add_kl(total: _Total, x: _Inputs, c: _Corrected, ratio: _Ratio, a: Tensor, config: "PolicyLossConfig"
            ) -> _Total:
    """beta * agg(KL(current || reference)) (SPEC §6), with its coefficients."""
    zero = x.zero
    kl, dkl = kl_and_grad(x.lp, x.ref, config.kl_type)
    g_total = total.through_ratio
    if config.kl_score_gradient and config.kl_type == "k3_unclamped":
        # dk + k = (1 - e^d) + (e^d - d - 1) = -d, d = ref - lp: formed so, since the two e^d terms (1e17 at 40 nats)
        # cancel to 0 or to 1e10 in float32
        dkl = x.lp - x.ref
    elif config.kl_score_gradient:  # k x exp(lp - sg lp) (NeMo-RL): the value k, the gradient dk + k where k's passes
        dkl = dkl + torch.where(kl_gradient_passes(x.lp, x.ref, config.kl_type), kl, zero)
    if config.kl_bias_correction:  # k x r (DeepSeek-V3.2, TRL's use_bias_correction_kl); r carries gradient
        kl, dkl = _bias_corrected_kl(kl, dkl, x, ratio, config)
        if config.ratio_level == "sequence" and config.kl_coef:  # the ratio's part goes through the sequence
            g_kl = torch.where(ratio.within_clamp, a * kl, zero)
            g_total = config.kl_coef * g_kl if g_total is None else g_total + config.kl_coef * g_kl
    kl_loss = (a * torch.where(c.decisions.mask, kl, zero)).sum()
    c.metrics.total("actor/kl_loss", kl_loss)
    if not config.kl_coef:
        return total._replace(through_ratio=g_total)
    return _Total(total.loss + config.kl_coef * kl_loss, _plus(total.coef, config.kl_coef * a * dkl), g_total)


def _add_log_ratio_sq(total: _Total, x: _Inputs, c: _Corrected, a: Tensor, config: "PolicyLossConfig") -> _Total:
    """log_ratio_sq_coef * agg((lp - l_mu)^2), the Kimi-K2.5 term (SPEC §6.1), against the sampler (else the
    proximal policy), aggregated as the loss over m', never IS-weighted; its coefficients 2 tau a_t d_t."""
    d = torch.where(c.decisions.mask, x.lp - x.behaviour, x.zero)
    square = (a * d * d).sum()
    c.metrics.total("actor/log_ratio_sq", square)
    tau = hyper(a, config.log_ratio_sq_coef)
    return _Total(total.loss + tau * square, _plus(total.coef, 2 * tau * a * d), total.through_ratio)


def _bias_corrected_kl(kl: Tensor, dkl: Tensor, x: _Inputs, ratio: _Ratio, config: "PolicyLossConfig"):
    """KL x r and its derivative: through lp alone (sequence-level ratios chain the rest), or in full at
    the token level. The unclamped k3 is written e^(d + log r) - (d + 1) r, d = ref - lp: its token-level
    derivative is then -d r, where (1 - e^d) r + (e^d - d - 1) r would cancel two e^d terms (e^d ~ 1e17
    at a log-ratio of 40)."""
    lp, ref, r, log_r, within_clamp = x.lp, x.ref, ratio.r, ratio.log_r, ratio.within_clamp
    value = kl * r
    if config.kl_type == "k3_unclamped":
        d = ref - lp
        bound = config.log_ratio_clamp
        value = torch.exp(d + (log_r if bound is None else log_r.clamp(-bound, bound))) - (d + 1) * r
    if config.ratio_level == "sequence":
        return value, dkl * r
    if config.kl_type == "k3_unclamped":
        return value, torch.where(within_clamp, (lp - ref) * r, dkl * r)
    return value, dkl * r + torch.where(within_clamp, value, torch.zeros_like(value))


def _chain_through_ratio(total: _Total, x: _Inputs, c: _Corrected, seg: Segments, config: "PolicyLossConfig"
                         ) -> Tensor:
    """c_t with the ratio's part chained: per token, or through each sequence's mean log-ratio."""
    if total.through_ratio is None:
        return torch.zeros_like(x.lp) if total.coef is None else total.coef
    g = total.through_ratio
    if config.ratio_level == "sequence":
        g = torch.where(c.decisions.mask, seg.expand(seg.sum(g) / c.decisions.final_lengths.clamp_min(1)), x.zero)
    return _plus(total.coef, g)


def _plus(coef: Optional[Tensor], term: Tensor) -> Tensor:
    """coef + term, with None for a coefficient of 0 so far (0 + term is term: the same value, one launch less)."""
    return term if coef is None else coef + term


def _entropy_term(x: _Inputs, c: _Corrected, a: Tensor, seg: Segments, config: "PolicyLossConfig"):
    """(-entropy_coeff * agg(H), e_t): the entropy bonus (0 and None without one) and its metric."""
    if x.entropy is None:
        return 0.0, None
    a_ent = a if config.entropy_agg_mode is None else aggregation_weights(
        c.decisions.mask, seg, config, a.dtype, c.decisions.final_lengths, c.norms, mode=config.entropy_agg_mode)
    ent = (a_ent * x.entropy).sum()
    c.metrics.total("actor/entropy", ent)
    if not config.adaptive_entropy and not config.entropy_coeff:  # adaptive: 0 is a value, not "off"
        return 0.0, None
    return -config.entropy_coeff * ent, -config.entropy_coeff * a_ent


def forward_gradient_blocker(batch, config: "PolicyLossConfig") -> Optional[str]:
    """Why the coefficients (c_t, e_t) of this batch and config are not per-token functions of the token's own
    statistics (ℓθ_t, H_t) and θ-free constants, or None when they are (SPEC §2.1: then the fused-linear path
    forms the gradient in its forward pass, a chunk of rows at a time, from `run(..., corrected=)`).

    A sequence or batch statistic of the current policy in a coefficient, a weight, a mask or a normaliser
    makes the coefficients wait for every row: the sequence-level ratio (GSPO, GMPO, ratio_level="sequence"),
    the loss types with per-sequence sums or batch-global selections, OPSM and M2PO, and, in bypass mode, where
    the IS weights and rejection are taken of the current policy, any rollout correction or VACO; and bypass
    mode on a split batch, whose collectives must not depend on the form a rank takes."""
    entry = LOSS_TERMS[config.loss_type]
    if getattr(batch, "sampler_head", None) is not None:
        return "the sampler's top-k or logits (SPEC §9: its divergences and masks read the current policy's pass)"
    if config.ratio_level == "sequence":
        return "ratio_level='sequence' (each token's ratio is its sequence's mean)"
    if entry.sums is not None:
        return f"loss_type={config.loss_type!r} (per-sequence sums of the current policy)"
    if entry.batch_global:
        return f"loss_type={config.loss_type!r} (a selection over the whole batch)"
    if config.off_policy_mask_threshold is not None:
        return "off_policy_mask_threshold (a sequence KL of the current policy)"
    if config.m2po_threshold is not None:
        return "m2po_threshold (a batch-wide selection on the current policy)"
    if batch.old_logprobs is None and (config.rollout_correction is not None or config.vaco_threshold is not None):
        return "bypass mode with a rollout correction (its weights and masks are of the current policy)"
    if correction_reads_current_policy(batch) and batch.split is not None and batch.split.combines_metrics:
        # its mismatch metrics read the current policy: the one-pass form would combine the split twice, and a
        # rank that takes the other form (no gradient wanted there) would then wait on a collective forever
        return "bypass mode on a dp_group / cp_group split (its correction is combined after the pass)"
    return None


def correct(stats, batch, config: "PolicyLossConfig"):
    """The rollout correction of `run` on its own (correction.correct's results: weights, rejection, the
    batch's normalisers, the sequence table), for `run(..., corrected=)`. Where forward_gradient_blocker is
    None it does not depend on stats.logprobs (and there is no sampler evidence): computed once, it serves
    every chunk of rows."""
    x = _masked_inputs(stats, batch)
    return correction.correct(x.l_train, x.rollout, x.mask, batch.segments, config.rollout_correction, batch.split,
                              _kept_sums(x, config))


def kept_mask(corrected) -> Tensor:
    """m' of `correct(...)`'s results: the tokens the loss keeps. Every other token's coefficients are exactly
    0 (its aggregation weight a_t is), whatever the current policy."""
    _, _, decisions, _, _ = corrected
    return decisions.mask


def correction_reads_current_policy(batch) -> bool:
    """Whether `correct` reads stats.logprobs: in bypass mode (the sampler's log-probs without old ones) its
    mismatch terms are of the current policy; otherwise it reads only π_old, μ and the mask."""
    return batch.old_logprobs is None and batch.rollout_logprobs is not None


def run(stats, batch, config: "PolicyLossConfig", corrected=None, metrics: bool = True,
        evidence: Optional[SamplerEvidence] = None) -> StageOutput:
    """The loss of SPEC §1-§8 from the current policy's statistics.

    stats: `.logprobs`, `.entropy` ([N] detached, the statistics' dtype; entropy may be None).
    batch: an `inputs.PreparedBatch`: the mask m, advantages, old / rollout / ref log-probs and a
        trainer's own `is_weights` ([N] or None; off the mask anything), the sequence `segments` and the
        data- / context-parallel `split`. Whole-sequence values and batch normalisers are combined
        across the split (see correction), so every rank's coefficients are those of its tokens in the
        computation on the whole batch; the loss is scaled by the data-parallel world size, so that the
        mean of the ranks' gradients is the whole batch's.
    corrected: `correct(...)`'s results, computed once for a batch whose coefficients are per-token
        (forward_gradient_blocker None), or None to compute them here.
    metrics: False: the coefficients only (the metrics come back empty; with `corrected`, no collective runs).
    evidence: the sampler's divergences and head (SPEC §9) from the pass, or None.
    """
    seg = batch.segments
    x = _masked_inputs(stats, batch)
    if corrected is None:
        # called here, not in a helper: on a split batch its collectives are graph breaks of a compiled stage,
        # and Dynamo's guards on a helper's return value across a break (a Metrics object whose records vary by
        # config) fail to evaluate on recompilation
        corrected = correction.correct(x.l_train, x.rollout, x.mask, seg, config.rollout_correction, batch.split,
                                       _kept_sums(x, config), None if evidence is None else evidence.record)
    c = _corrected(x, corrected, config, batch, evidence, metrics)
    if config.seq_mean_advantages:  # AReaL's GSPO: each token takes its sequence's mean advantage over m'
        mean = seg.expand(c.table.sum("advantages") / c.decisions.final_lengths.clamp_min(1))
        x = x._replace(advantages=torch.where(c.decisions.mask, mean, torch.zeros_like(mean)))
    ratio = _policy_ratio(x, c, seg, config)
    head = None if evidence is None else evidence.head(batch)
    term = LOSS_TERMS[config.loss_type].term(_term_context(x, c, ratio, seg, config, head))
    weighted = _weigh_and_mask(term, x, c, ratio, seg, config)
    a = aggregation_weights(c.decisions.mask, seg, config, x.lp.dtype, c.decisions.final_lengths, c.norms)
    total = _aggregate(term, weighted, c, a, x.zero)
    coef_head = None  # the head's log-probs enter the loss as the token's own (a_t, m', no IS weight)
    if weighted.head_direct is not None:
        coef_head = torch.where(c.decisions.mask[:, None], a[:, None] * weighted.head_direct, x.zero)
    if c.metrics.enabled:
        kl_metric = ratio.kl_metric(config.log_ratio_clamp) if term.kl_metric is None else term.kl_metric
        c.metrics.mean("actor/ppo_kl", kl_metric, c.decisions.mask, c.norms.kept_tokens)
    if x.ref is not None:
        total = _add_kl(total, x, c, ratio, a, config)
    if config.log_ratio_sq_coef:
        total = _add_log_ratio_sq(total, x, c, a, config)
    coef = _chain_through_ratio(total, x, c, seg, config)
    bonus, coef_entropy = _entropy_term(x, c, a, seg, config)
    loss = total.loss + bonus if coef_entropy is not None else total.loss
    scale = batch.split.loss_scale  # 1, or the data-parallel world size (see the docstring)
    if scale != 1:
        loss, coef = loss * scale, coef * scale
        coef_entropy = None if coef_entropy is None else coef_entropy * scale
        coef_head = None if coef_head is None else coef_head * scale
    finished = c.metrics.finish(batch.split)  # every metric reduction, and the split's metric combine
    return StageOutput(loss, coef, coef_entropy, weighted.applied_weights, c.decisions.mask, finished, coef_head,
                       x.lp)


def check_split_options(config: "PolicyLossConfig", dp_group, cp_group) -> None:
    """Options whose batch-global selection or per-sequence chain rule has no split form yet."""
    if cp_group is not None and config.ratio_level == "sequence":
        raise ValueError("ratio_level: 'sequence' is not supported with cp_group (its gradient needs a second "
                         "combine of per-sequence sums); use the token level or no context parallelism")
    if dp_group is not None or cp_group is not None:
        for name, on in (("loss_type", LOSS_TERMS[config.loss_type].batch_global),
                         ("m2po_threshold", config.m2po_threshold is not None)):
            if on:
                raise ValueError(f"{name}: {getattr(config, name)!r} selects tokens over the whole batch; it is not "
                                 "supported with dp_group / cp_group (run it per rank without the groups, as verl "
                                 "does per micro-batch)")
