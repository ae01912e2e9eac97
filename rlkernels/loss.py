"""The per-sequence stage: per-token scalars -> loss, gradient coefficients and metrics (SPEC §1, §4-§8).

Every loss of the spec is linear in per-token terms with mask-only weights a_t (the aggregation of
SPEC §7), so its gradient is
    dLoss/dlogprob_t = c_t = a_t * (dL_t/dlogprob_t + beta * dKL_t/dlogprob_t)
    dLoss/dentropy_t = e_t = -entropy_coeff * a_t
written here in closed form. The vocabulary-wide backward then needs only (c_t, e_t) per row
(SPEC §2). All of it is [N]-sized torch work with no host synchronisation.
"""

import math
from typing import Dict, NamedTuple, Optional

import torch

from . import correction
from .config import COVARIANCE_LOSSES, SEQUENCE_RATIO_LOSSES, PolicyLossConfig
from .correction import CLAMP
from .metrics import Metrics
from .segments import Segments, hyper
from .split import LOCAL, BatchSplit


class StageOutput(NamedTuple):
    loss: torch.Tensor  # 0-d
    coef_logprob: torch.Tensor  # [N] c_t
    coef_entropy: Optional[torch.Tensor]  # [N] e_t, None when the loss does not use the entropy
    is_weights: Optional[torch.Tensor]  # [N] weights multiplying the policy term, None if none do
    mask: torch.Tensor  # [N] bool, the final mask m'
    metrics: Dict[str, torch.Tensor]


def aggregation_weights(mask: torch.Tensor, seg: Segments, config: PolicyLossConfig, dtype,
                        final_lengths: Optional[torch.Tensor] = None,
                        norms: Optional[correction.Normalisers] = None, mode: Optional[str] = None) -> torch.Tensor:
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
                                       torch.as_tensor(seg.width).to(dtype), None,
                                       torch.as_tensor(float(seg.num_seqs)).to(dtype))
    mode = mode or config.loss_agg_mode
    over_all = config.seq_mean_over == "all"
    if config.loss_type == "luspo" and mode == config.loss_agg_mode:  # LUSPO's length-unbiased sum
        mode, over_all = "seq-mean-token-sum", True
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
    K = config.loss_scale_factor if config.loss_scale_factor is not None else norms.width.clamp_min(1)
    return m / (G * K)


def _dppo_inside(loss_type: str, lp: torch.Tensor, l_old: torch.Tensor, A: torch.Tensor, config) -> torch.Tensor:
    """DPPO's trust region on the sampled token's probability (bool per token): the total variation
    p - p_old (dppo_tv) or the binary KL between Bernoulli(p_old) and Bernoulli(p) (dppo_kl) within
    eps_hi (A > 0) or eps_lo (A <= 0); the binary KL only limits moves toward the advantage."""
    p, p_old = torch.exp(lp), torch.exp(l_old)
    hi, lo = hyper(lp, config.clip_ratio_high), hyper(lp, config.clip_ratio_low)
    if loss_type == "dppo_tv":
        inside = torch.where(A > 0, p - p_old <= hi, p - p_old >= -lo)
    else:  # verl's binary KL, with its 1e-8 guards
        bkl = p_old * (l_old - lp) + (1 - p_old) * torch.log((1.0 - p_old + 1e-8) / (1.0 - p + 1e-8))
        inside = torch.where(A > 0, (bkl <= hi) | (p <= p_old), (bkl <= lo) | (p >= p_old))
    return inside


def kl_and_grad(lp: torch.Tensor, ref: torch.Tensor, kl_type: str):
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


class PolicyTerm(NamedTuple):
    """One loss's per-token term: value L_t, its derivative through the log-prob directly (d) and
    through the log-ratio log r (g; chained per token, or through a sequence's mean log-ratio)."""
    value: torch.Tensor
    direct: torch.Tensor
    through_ratio: Optional[torch.Tensor]
    clipped: torch.Tensor  # [N] bool, reported as actor/pg_clipfrac
    dual: torch.Tensor  # [N] bool, reported as actor/pg_clipfrac_lower


def _ppo_clip(r: torch.Tensor, A: torch.Tensor, config: PolicyLossConfig, zero, dual_clip: bool = True) -> PolicyTerm:
    """max(-A r, -A clip(r, 1 - eps_lo, 1 + eps_hi)), with dual clip -A c for A < 0; d/dlog r = -A r
    where the unclipped branch is active."""
    L1 = -A * r
    # clip bounds as tensors: a clip-ratio schedule must not recompile a compiled step
    L2 = -A * torch.clamp(r, hyper(r, 1 - config.clip_ratio_low), hyper(r, 1 + config.clip_ratio_high))
    clipped = L2 > L1
    L = torch.where(clipped, L2, L1)
    dual = torch.zeros_like(clipped)
    if dual_clip and config.clip_ratio_c is not None:
        L3 = -A * config.clip_ratio_c
        dual = (A < 0) & (L3 < L)
        L = torch.where(dual, L3, L)
    g = torch.where(~clipped & ~dual, -A * r, zero)
    return PolicyTerm(L, torch.zeros_like(L), g, clipped, dual)


def _ratio_term(loss_type: str, r: torch.Tensor, lp: torch.Tensor, A: torch.Tensor, config: PolicyLossConfig,
                zero) -> PolicyTerm:
    """The losses written on a ratio r (token or sequence level, SEQUENCE_RATIO_LOSSES)."""
    if loss_type == "sapo":  # soft gate f(r) = sigmoid(tau (r - 1)) 4 / tau, tau by the advantage's sign
        tau = torch.where(A > 0, hyper(r, config.tau_pos), hyper(r, config.tau_neg))
        gate = torch.sigmoid(tau * (r - 1))
        none = torch.zeros_like(A, dtype=torch.bool)
        return PolicyTerm(-A * gate * 4 / tau, torch.zeros_like(r), -A * 4 * gate * (1 - gate) * r, none, none)
    if loss_type == "cispo":  # -sg(c) A lp, c the clipped (verl) or capped (TRL) ratio
        if config.cispo_cap is None:
            c = torch.clamp(r, hyper(r, 1 - config.clip_ratio_low), hyper(r, 1 + config.clip_ratio_high))
            clipped = r != c
        else:
            c = torch.minimum(r, hyper(r, config.cispo_cap))
            clipped = (r > c) & (A > 0)  # TRL's cispo_clip_ratio
        return PolicyTerm(-c * A * lp, -c * A, None, clipped, torch.zeros_like(clipped))
    return _ppo_clip(r, A, config, zero)  # vanilla / ppo_clip / luspo


@torch.compiler.disable
def _covariance_selection(loss_type: str, lp: torch.Tensor, A: torch.Tensor, mask: torch.Tensor,
                          candidates: torch.Tensor, config: PolicyLossConfig) -> torch.Tensor:
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


def _m2po_keep(lp: torch.Tensor, behaviour: torch.Tensor, A: torch.Tensor, mask: torch.Tensor,
               config: PolicyLossConfig, metrics: Metrics, n_valid: torch.Tensor) -> torch.Tensor:
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
    keep_count = ((prefix_mean <= hyper(m2, config.m2po_threshold)) & (position <= n_elig)).sum()
    rank = torch.empty_like(order)
    rank[order] = position - 1
    keep = ~eligible | (rank < keep_count)
    dt = lp.dtype
    n_elig_f = n_elig.to(dt)
    metrics.mean("actor/m2po_masked_fraction", (~keep).to(dt), mask, n_valid)
    metrics.mean("actor/m2po_trust_region_fraction", eligible.to(dt), mask, n_valid)
    metrics.mean("actor/m2po_m2_before", m2, eligible, n_elig_f)
    metrics.mean("actor/m2po_m2_after", m2, eligible & keep, keep_count.to(dt))
    return keep


def sequence_stage(
    lp: torch.Tensor, entropy: Optional[torch.Tensor], advantages: torch.Tensor, mask: torch.Tensor,
    old: Optional[torch.Tensor], rollout: Optional[torch.Tensor], ref: Optional[torch.Tensor],
    seg: Segments, config: PolicyLossConfig, split: BatchSplit = LOCAL, given_weights: Optional[torch.Tensor] = None,
) -> StageOutput:
    """lp, entropy: [N] detached statistics of the current policy; mask: [N] bool (m); the others [N].

    `given_weights`: [N] IS weights a trainer computed itself (verl's `rollout_is_weights`), used in
    place of computed ones (the config then has no IS level): they multiply the policy term in every
    mode, and no rollout_is_* metric describes them.

    `split`: the data- and context-parallel groups the batch is split over. Whole-sequence values and
    batch normalisers are combined across them (see correction), so every rank's coefficients are
    those of its tokens in the computation on the whole batch; the loss is scaled by the
    data-parallel world size, so that the mean of the ranks' gradients is the whole batch's."""
    dt = lp.dtype
    zero = torch.zeros((), dtype=dt, device=lp.device)

    def valid(x):  # off the mask values may be NaN/inf; they must not reach a sum or a gradient
        return None if x is None else torch.where(mask, x.to(dt), zero)

    lp, H, A = valid(lp), valid(entropy), valid(advantages)
    given_weights = valid(given_weights)
    old, roll, ref = valid(old), valid(rollout), valid(ref)
    rc = config.rollout_correction
    decoupled = old is not None
    l_old = old if decoupled else (roll if roll is not None else lp)  # SPEC §1 modes
    l_train = old if decoupled else lp
    behaviour = roll if roll is not None else l_old  # the sampler's log-probs where known

    loss_type = config.loss_type
    delta_pg_raw = lp - l_old
    sequence_ratio = config.ratio_level == "sequence" or loss_type in ("gspo", "topr")
    # per-sequence sums over the tokens of the final mask, combined across a context-parallel split
    kept_sums = {}
    if sequence_ratio:
        kept_sums["pg_delta"] = delta_pg_raw
    if loss_type == "geo_mean":  # token-level clipping toward the advantage's sign, then sequence means
        sign = torch.sign(A)
        d_clip = torch.clamp(delta_pg_raw, hyper(lp, -config.clip_ratio_low), hyper(lp, config.clip_ratio_high))
        d_min = sign * torch.minimum(sign * delta_pg_raw, sign * d_clip)
        kept_sums.update(gm_delta=d_min, gm_adv=A,
                         log_weights=(lambda lw: lw) if given_weights is None else torch.log(given_weights))
    elif loss_type == "topr":
        kept_sums["adv"] = A
    elif loss_type == "vespo":  # TRL's get_gamma_weights: a sequence sum of clamped log-ratios
        floor = math.log(1e-8)
        kept_sums["vespo_delta"] = delta_pg_raw.clamp(-CLAMP, CLAMP)
        clamp_log_w = lambda lw: lw.clamp(floor, CLAMP)  # noqa: E731
        kept_sums["log_weights"] = clamp_log_w if given_weights is None else clamp_log_w(torch.log(given_weights))
    if config.off_policy_mask_threshold is not None:  # DeepSeek-V3.2: the sampler against the current policy
        kept_sums["opsm"] = behaviour - lp
    terms, table, decisions, norms, w = correction.correct(l_train, roll, mask, seg, rc, split, kept_sums)
    final_mask = decisions.mask
    lengths = decisions.final_lengths.clamp_min(1)
    metrics = Metrics()
    if terms is not None:
        correction.record_metrics(metrics, terms, mask, table, decisions, norms, rc, w)
    if given_weights is not None:  # a trainer's own weights stand where computed ones would
        w = correction.ISWeights(given_weights, given_weights, torch.ones((), dtype=dt, device=lp.device))
    weighted = w is not None and (decoupled or given_weights is not None)

    # the policy ratio r: per token, or exp of each sequence's mean log-ratio (ratio_level="sequence")
    log_r = seg.expand(table.sum("pg_delta") / lengths) if config.ratio_level == "sequence" else delta_pg_raw
    bound = config.log_ratio_clamp
    if bound is None:
        r, within_clamp = torch.exp(log_r), torch.ones_like(mask)
    else:
        r = torch.exp(log_r.clamp(-bound, bound))
        within_clamp = (log_r >= -bound) & (log_r <= bound)
    kl_metric = -delta_pg_raw if bound is None else -delta_pg_raw.clamp(-bound, bound)
    none = torch.zeros_like(mask)
    applied_w = None
    geo = None
    if loss_type in ("vanilla", "ppo_clip", "cispo", "sapo", "luspo"):
        term = _ratio_term(loss_type, r, lp, A, config, zero)
    elif loss_type == "reinforce":
        applied_w = w.weights if w is not None else None
        wv = applied_w if applied_w is not None else torch.ones_like(lp)
        term = PolicyTerm(-A * wv * lp, -A * wv, None, none, none)
    elif loss_type == "gpg":  # plain policy gradient on the log-prob
        term = PolicyTerm(-A * lp, -A, None, none, none)
    elif loss_type == "gspo":  # s = exp(sg[mean log-ratio of the sequence] + lp - sg[lp]), clipped as PPO
        log_s = seg.expand(table.sum("pg_delta") / lengths)
        s_ratio = torch.exp(log_s.clamp(max=10.0))
        L1 = -A * s_ratio
        L2 = -A * torch.clamp(s_ratio, hyper(s_ratio, 1 - config.clip_ratio_low),
                              hyper(s_ratio, 1 + config.clip_ratio_high))
        clipped = L2 > L1
        # d s / d lp = s (the lp - sg[lp] term), per token
        dL = torch.where(~clipped & (log_s <= 10.0), -A * s_ratio, zero)
        term = PolicyTerm(torch.where(clipped, L2, L1), dL, None, clipped, none)
        kl_metric = -delta_pg_raw  # verl's GSPO reports the unclamped log-ratio
    elif loss_type == "geo_mean":  # GMPO: -mean_i(A_i exp(mean_t d_min)) over every sequence of the batch
        seq_ratio = torch.exp(table.sum("gm_delta") / lengths)
        seq_adv = table.sum("gm_adv") / lengths
        seq_w = torch.ones_like(seq_ratio)
        if weighted:  # the geometric mean of each sequence's weights
            if given_weights is not None or rc.is_level == "token":
                seq_w = torch.exp(table.sum("log_weights") / lengths) / w.norm_factor
            else:
                seq_w = decisions.sequence_weights / w.norm_factor
            applied_w = torch.where(final_mask, seg.expand(seq_w), zero)
        seq_coef = torch.where(decisions.final_lengths > 0, -seq_adv * seq_ratio * seq_w, torch.zeros_like(lengths))
        per_token = seg.expand(seq_coef / lengths) / norms.all_seqs.clamp_min(1)
        # each token carries 1/n of its sequence's term, so that context-parallel ranks' losses add up
        live = (sign != 0) & (sign * delta_pg_raw <= sign * d_clip)  # d d_min / d lp: 1 unclipped, else 0
        geo = (torch.where(final_mask, per_token, zero).sum(), torch.where(live, per_token, zero))
        outside = delta_pg_raw != d_clip
        term = PolicyTerm(torch.zeros_like(lp), torch.zeros_like(lp), None, outside & (A > 0), outside & (A < 0))
        kl_metric = -delta_pg_raw
    elif loss_type in ("dppo_tv", "dppo_kl"):  # -A sg(min(r, c)) lp on tokens inside the divergence region
        cap = hyper(r, 20.0 if config.clip_ratio_c is None else config.clip_ratio_c)
        truncated = torch.minimum(r, cap)
        inside = _dppo_inside(loss_type, lp, l_old, A, config)
        term = PolicyTerm(torch.where(inside, -A * truncated * lp, zero), torch.where(inside, -A * truncated, zero),
                          None, ~inside, (r > cap) & inside)
    elif loss_type == "dro":  # -(lp A - beta/2 (lp - l_old)^2), the log-ratio unclamped
        beta = hyper(lp, config.dro_beta)
        term = PolicyTerm(-(lp * A - 0.5 * beta * delta_pg_raw * delta_pg_raw), -A + beta * delta_pg_raw, None,
                          none, none)
        kl_metric = -delta_pg_raw
    elif loss_type == "topr":  # -A sg(tau_i) lp; tau_i = clip(exp(mean log-ratio), lo, hi) if mean A < 0, else 1
        w_seq = torch.exp((table.sum("pg_delta") / lengths).clamp(max=10.0))
        # a sequence that rejection emptied has no advantage left (verl sees it through response_mask)
        negative = (table.sum("adv") / lengths < 0) & (decisions.final_lengths > 0)
        lo, hi = hyper(w_seq, config.topr_negative_ratio_lower), hyper(w_seq, config.topr_negative_ratio_upper)
        taper = torch.where(negative, torch.minimum(torch.maximum(w_seq, lo), hi), torch.ones_like(w_seq))
        tau = seg.expand(taper)
        term = PolicyTerm(-A * lp * tau, -A * tau, None, none, none)
        everyone = torch.ones_like(negative)
        metrics.mean("actor/topr_negative_seq_frac", negative.to(dt), everyone, norms.all_seqs, True)
        metrics.mean("actor/topr_taper_weight_mean", taper, everyone, norms.all_seqs, True)
        kl_metric = -delta_pg_raw
    elif loss_type == "vespo":  # -sg(phi) A lp, phi = e^lambda w^k e^(-lambda w) of the sequence ratio w
        log_w = table.sum("vespo_delta")
        if "log_weights" in kept_sums and (given_weights is not None or terms is not None and
                                            terms.token_weights is not None):
            log_w = log_w + table.sum("log_weights")
        log_w = seg.expand(log_w.clamp(math.log(1e-8), CLAMP))
        nonneg = A >= 0
        k = torch.where(nonneg, hyper(lp, config.vespo_k_pos), hyper(lp, config.vespo_k_neg))
        lam = torch.where(nonneg, hyper(lp, config.vespo_lambda_pos), hyper(lp, config.vespo_lambda_neg))
        lam = lam.clamp_min(1e-4)  # TRL's floor
        phi = torch.nan_to_num(torch.exp(lam + k * log_w - lam * torch.exp(log_w)), nan=0.0, posinf=0.0, neginf=0.0)
        term = PolicyTerm(-phi * A * lp, -phi * A, None, none, none)
        metrics.mean("actor/vespo_phi_seq_mean", phi, final_mask, norms.kept_tokens)
        kl_metric = -delta_pg_raw
    else:  # clip_cov / kl_cov: verl's, on the unclamped ratio
        r_raw = torch.exp(delta_pg_raw)
        if loss_type == "clip_cov":  # PPO clip (no dual clip); a random few high-covariance tokens get no gradient
            base = _ppo_clip(r_raw, A, config, zero, dual_clip=False)
            chosen = _covariance_selection(loss_type, lp, A, final_mask, ~base.clipped, config)
            keep = (~chosen).to(dt)
            term = PolicyTerm(base.value * keep, base.direct, base.through_ratio * keep, chosen, none)
            kl_metric = -delta_pg_raw
        else:  # the top covariance tokens get a |log-ratio| penalty, the rest the unclipped -A r
            chosen = _covariance_selection(loss_type, lp, A, final_mask, final_mask, config)
            coef = hyper(lp, config.ppo_kl_coef)
            penalty = torch.where(chosen, coef * delta_pg_raw.abs(), zero)
            d_penalty = torch.where(chosen, coef * torch.sign(delta_pg_raw), zero)
            term = PolicyTerm(-A * r_raw + penalty, d_penalty, -A * r_raw, chosen, none)
            kl_metric = delta_pg_raw.abs()
    L, d, g = term.value, term.direct, term.through_ratio
    if g is not None and loss_type in SEQUENCE_RATIO_LOSSES:
        g = torch.where(within_clamp, g, zero)  # the clamp passes no gradient outside its interval
    if loss_type not in ("reinforce", "geo_mean", "vespo") and weighted:
        applied_w = w.weights
        L, d = L * applied_w, d * applied_w
        g = None if g is None else g * applied_w
    policy_keep = None  # tokens whose policy term stays (zero weight otherwise: the denominators keep them)
    if config.off_policy_mask_threshold is not None:
        seq_kl = table.sum("opsm") / lengths
        policy_keep = (A >= 0) | seg.expand(seq_kl <= hyper(seq_kl, config.off_policy_mask_threshold))
        metrics.mean("actor/off_policy_masked_fraction", (~policy_keep).to(dt), final_mask, norms.kept_tokens)
    if config.m2po_threshold is not None:
        m2_keep = _m2po_keep(lp, behaviour, A, final_mask, config, metrics, norms.kept_tokens)
        policy_keep = m2_keep if policy_keep is None else policy_keep & m2_keep
    if policy_keep is not None:
        L, d = torch.where(policy_keep, L, zero), torch.where(policy_keep, d, zero)
        g = None if g is None else torch.where(policy_keep, g, zero)

    a = aggregation_weights(final_mask, seg, config, dt, decisions.final_lengths, norms)
    L = torch.where(final_mask, L, zero)
    if geo is not None:  # GMPO: its own mean over sequences, as verl's (not loss_agg_mode)
        pg_loss, coef = geo[0], torch.where(final_mask, geo[1], zero)
        if policy_keep is not None:
            coef = torch.where(policy_keep, coef, zero)
    else:
        pg_loss, coef = (a * L).sum(), a * d
    g_total = None if g is None else a * g
    loss = pg_loss
    n_kept = norms.kept_tokens
    metrics.total("actor/pg_loss", pg_loss)
    metrics.mean("actor/pg_clipfrac", term.clipped.to(dt), final_mask, n_kept)
    metrics.mean("actor/pg_clipfrac_lower", term.dual.to(dt), final_mask, n_kept)
    metrics.mean("actor/ppo_kl", kl_metric, final_mask, n_kept)
    if ref is not None:
        kl, dkl = kl_and_grad(lp, ref, config.kl_type)
        if config.kl_bias_correction:  # k x r (DeepSeek-V3.2, TRL's use_bias_correction_kl); r carries gradient
            kl, dkl = _bias_corrected_kl(kl, dkl, lp, ref, r, log_r, within_clamp, config)
            if config.ratio_level == "sequence" and config.kl_coef:  # the ratio's part goes through the sequence
                g_kl = torch.where(within_clamp, a * kl, zero)
                g_total = config.kl_coef * g_kl if g_total is None else g_total + config.kl_coef * g_kl
        kl_loss = (a * torch.where(final_mask, kl, zero)).sum()
        metrics.total("actor/kl_loss", kl_loss)
        if config.kl_coef:
            loss = loss + config.kl_coef * kl_loss
            coef = coef + config.kl_coef * a * dkl
    if g_total is not None:  # the chain rule through the ratio: per token, or through the sequence mean
        if config.ratio_level == "sequence":
            g_total = torch.where(final_mask, seg.expand(seg.sum(g_total) / lengths), zero)
        coef = coef + g_total
    coef_entropy = None
    if H is not None:
        a_ent = a if config.entropy_agg_mode is None else aggregation_weights(
            final_mask, seg, config, dt, decisions.final_lengths, norms, mode=config.entropy_agg_mode)
        ent = (a_ent * H).sum()
        metrics.total("actor/entropy", ent)
        if config.entropy_coeff:
            loss = loss - config.entropy_coeff * ent
            coef_entropy = -config.entropy_coeff * a_ent
    scale = split.loss_scale  # 1, or the data-parallel world size (see the docstring)
    if scale != 1:
        loss, coef = loss * scale, coef * scale
        coef_entropy = None if coef_entropy is None else coef_entropy * scale
    return StageOutput(loss, coef, coef_entropy, applied_w, final_mask, metrics.finish(split))


def _bias_corrected_kl(kl, dkl, lp, ref, r, log_r, within_clamp, config: PolicyLossConfig):
    """KL x r and its derivative: through lp alone (sequence-level ratios chain the rest), or in full at
    the token level. The unclamped k3 is written e^(d + log r) - (d + 1) r, d = ref - lp: its token-level
    derivative is then -d r, where (1 - e^d) r + (e^d - d - 1) r would cancel two e^d terms (e^d ~ 1e17
    at a log-ratio of 40)."""
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


def check_split_options(config: PolicyLossConfig, dp_group, cp_group) -> None:
    """Options whose batch-global selection or per-sequence chain rule has no split form yet."""
    if cp_group is not None and config.ratio_level == "sequence":
        raise ValueError("ratio_level: 'sequence' is not supported with cp_group (its gradient needs a second "
                         "combine of per-sequence sums); use the token level or no context parallelism")
    if dp_group is not None or cp_group is not None:
        for name, on in (("loss_type", config.loss_type in COVARIANCE_LOSSES),
                         ("m2po_threshold", config.m2po_threshold is not None)):
            if on:
                raise ValueError(f"{name}: {getattr(config, name)!r} selects tokens over the whole batch; it is not "
                                 "supported with dp_group / cp_group (run it per rank without the groups, as verl "
                                 "does per micro-batch)")
