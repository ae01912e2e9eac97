"""The per-sequence stage: per-token scalars -> loss, gradient coefficients and metrics (SPEC §1, §4-§8).

Every loss of the spec is linear in per-token terms with mask-only weights a_t (the aggregation of
SPEC §7), so its gradient is
    dLoss/dlogprob_t = c_t = a_t * (dL_t/dlogprob_t + beta * dKL_t/dlogprob_t)
    dLoss/dentropy_t = e_t = -entropy_coeff * a_t
written here in closed form. The vocabulary-wide backward then needs only (c_t, e_t) per row
(SPEC §2). All of it is [N]-sized torch work with no host synchronisation.
"""

from typing import Dict, NamedTuple, Optional

import torch

from . import correction
from .config import PolicyLossConfig
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
                        norms: Optional[correction.Normalisers] = None) -> torch.Tensor:
    """a_t of SPEC §7, so that agg(X) = sum_t a_t * X_t. Empty batches give a = 0 (loss 0, never NaN).

    `final_lengths` ([S], tokens of each sequence in the mask) and `norms` (the batch-wide counts)
    come from the stage, whole over a split batch; alone, this computes them from `mask`."""
    m = mask.to(dtype)
    if final_lengths is None:
        final_lengths = seg.sum(m)
    if norms is None:
        count = m.sum()
        norms = correction.Normalisers(count, count, None, (final_lengths > 0).to(dtype).sum(),
                                       torch.as_tensor(seg.width).to(dtype), None)
    mode = config.loss_agg_mode
    if mode == "token-sum":
        return m
    if mode == "token-mean":
        n = norms.kept_tokens.clamp_min(1) if config.global_num_tokens is None else config.global_num_tokens
        return m / n
    G = norms.kept_seqs.clamp_min(1) if config.global_num_seqs is None else config.global_num_seqs
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
    d_raw = ref - lp
    d = d_raw.clamp(-CLAMP, CLAMP)
    k3_raw = torch.exp(d) - d - 1
    kl = k3_raw.clamp(-10, 10)
    # clamp passes the gradient on its closed interval, as torch.clamp's does
    live = (d_raw >= -CLAMP) & (d_raw <= CLAMP) & (k3_raw <= 10) & (k3_raw >= -10)
    return kl, torch.where(live, 1 - torch.exp(d), torch.zeros_like(lp))


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

    loss_type = config.loss_type
    delta_pg_raw = lp - l_old
    # GSPO's sequence ratio is the mean log-ratio over each sequence's tokens in the final mask
    kept_sums = None
    if loss_type == "gspo":
        kept_sums = {"pg_delta": delta_pg_raw}
    elif loss_type == "geo_mean":  # token-level clipping toward the advantage's sign, then sequence means
        sign = torch.sign(A)
        d_clip = torch.clamp(delta_pg_raw, hyper(lp, -config.clip_ratio_low), hyper(lp, config.clip_ratio_high))
        d_min = sign * torch.minimum(sign * delta_pg_raw, sign * d_clip)
        log_given = None if given_weights is None else torch.log(given_weights)
        kept_sums = {"gm_delta": d_min, "gm_adv": A, "log_weights": log_given}
    terms, table, decisions, norms, w = correction.correct(l_train, roll, mask, seg, rc, split, kept_sums)
    final_mask = decisions.mask
    metrics = Metrics()
    if terms is not None:
        correction.record_metrics(metrics, terms, mask, table, decisions, norms, rc, w)
    if given_weights is not None:  # a trainer's own weights stand where computed ones would
        w = correction.ISWeights(given_weights, given_weights, torch.ones((), dtype=dt, device=lp.device))
    weighted = w is not None and (decoupled or given_weights is not None)

    delta_pg = delta_pg_raw.clamp(-CLAMP, CLAMP)
    kl_metric = -delta_pg
    within_clamp = (delta_pg_raw >= -CLAMP) & (delta_pg_raw <= CLAMP)
    no_clip = torch.zeros_like(mask)
    applied_w = None
    if loss_type == "reinforce":
        applied_w = w.weights if w is not None else None
        wv = applied_w if applied_w is not None else torch.ones_like(lp)
        L = -A * wv * lp
        dL = -A * wv
        clipped = dual = no_clip
    elif loss_type == "gpg":  # plain policy gradient on the log-prob
        L, dL = -A * lp, -A
        clipped = dual = no_clip
    elif loss_type == "sapo":  # soft gate f(r) = sigmoid(tau (r - 1)) 4 / tau, tau by the advantage's sign
        r = torch.exp(delta_pg)
        tau = torch.where(A > 0, hyper(r, config.tau_pos), hyper(r, config.tau_neg))
        gate = torch.sigmoid(tau * (r - 1))
        L = -A * gate * 4 / tau
        dL = torch.where(within_clamp, -A * 4 * gate * (1 - gate) * r, zero)  # d f / d lp = 4 s (1 - s) r
        clipped = dual = no_clip
    elif loss_type == "gspo":  # s = exp(sg[mean log-ratio of the sequence] + lp - sg[lp]), clipped as PPO
        seq_delta = table.sum("pg_delta") / decisions.final_lengths.clamp_min(1)
        log_s = seg.expand(seq_delta)
        s_ratio = torch.exp(log_s.clamp(max=10.0))
        L1 = -A * s_ratio
        L2 = -A * torch.clamp(s_ratio, hyper(s_ratio, 1 - config.clip_ratio_low),
                              hyper(s_ratio, 1 + config.clip_ratio_high))
        clipped = L2 > L1
        L = torch.where(clipped, L2, L1)
        dL = torch.where(~clipped & (log_s <= 10.0), -A * s_ratio, zero)  # d s / d lp = s (the lp - sg[lp] term)
        dual = no_clip
        kl_metric = -delta_pg_raw  # verl's GSPO reports the unclamped log-ratio
    elif loss_type == "geo_mean":  # GMPO: -mean_i(A_i exp(mean_t d_min)) over every sequence of the batch
        n = decisions.final_lengths.clamp_min(1)
        seq_ratio = torch.exp(table.sum("gm_delta") / n)
        seq_adv = table.sum("gm_adv") / n
        seq_w = torch.ones_like(seq_ratio)
        if weighted:  # the geometric mean of each sequence's weights
            if given_weights is not None or rc.is_level == "token":
                seq_w = torch.exp(table.sum("log_weights") / n) / w.norm_factor
            else:
                seq_w = decisions.sequence_weights / w.norm_factor
            applied_w = torch.where(final_mask, seg.expand(seq_w), zero)
        seq_coef = torch.where(decisions.final_lengths > 0, -seq_adv * seq_ratio * seq_w, torch.zeros_like(n))
        per_token = seg.expand(seq_coef / n) / norms.all_seqs.clamp_min(1)
        # each token carries 1/n of its sequence's term, so that context-parallel ranks' losses add up
        geo_loss = torch.where(final_mask, per_token, zero).sum()
        live = (sign != 0) & (sign * delta_pg_raw <= sign * d_clip)  # d d_min / d lp: 1 unclipped, else 0
        geo_coef = torch.where(live, per_token, zero)
        outside = delta_pg_raw != d_clip
        clipped, dual = outside & (A > 0), outside & (A < 0)
        L = dL = torch.zeros_like(lp)  # the loss is per sequence: geo_loss / geo_coef below
        kl_metric = -delta_pg_raw
    elif loss_type in ("dppo_tv", "dppo_kl"):  # -A sg(min(r, c)) lp on tokens inside the divergence region
        r = torch.exp(delta_pg)
        cap = hyper(r, 20.0 if config.clip_ratio_c is None else config.clip_ratio_c)
        truncated = torch.minimum(r, cap)
        inside = _dppo_inside(loss_type, lp, l_old, A, config)
        L = torch.where(inside, -A * truncated * lp, zero)
        dL = torch.where(inside, -A * truncated, zero)
        clipped, dual = ~inside, (r > cap) & inside
    elif loss_type == "cispo":  # -sg(clip(r)) A lp: the clipped ratio weights the log-prob's gradient
        r = torch.exp(delta_pg)
        r_clip = torch.clamp(r, hyper(r, 1 - config.clip_ratio_low), hyper(r, 1 + config.clip_ratio_high))
        L, dL = -r_clip * A * lp, -r_clip * A
        clipped, dual = r != r_clip, no_clip
    elif loss_type == "dro":  # -(lp A - beta/2 (lp - l_old)^2), the log-ratio unclamped
        beta = hyper(lp, config.dro_beta)
        L = -(lp * A - 0.5 * beta * delta_pg_raw * delta_pg_raw)
        dL = -A + beta * delta_pg_raw
        clipped = dual = no_clip
        kl_metric = -delta_pg_raw
    else:  # "vanilla" / "ppo_clip"
        r = torch.exp(delta_pg)
        L1 = -A * r
        # clip bounds as tensors: a clip-ratio schedule must not recompile a compiled step
        L2 = -A * torch.clamp(r, hyper(r, 1 - config.clip_ratio_low), hyper(r, 1 + config.clip_ratio_high))
        clipped = L2 > L1
        Lc = torch.where(clipped, L2, L1)
        if config.clip_ratio_c is not None:
            L3 = -A * config.clip_ratio_c
            dual = (A < 0) & (L3 < Lc)
            L = torch.where(dual, L3, Lc)
        else:
            dual = no_clip
            L = Lc
        # c_t = -A * r where the unclipped branch is active (and the ±20 clamp passes it), else 0
        live = ~clipped & ~dual & within_clamp
        dL = torch.where(live, -A * r, zero)
    if loss_type not in ("reinforce", "geo_mean") and weighted:
        applied_w = w.weights
        L = L * applied_w
        dL = dL * applied_w

    a = aggregation_weights(final_mask, seg, config, dt, decisions.final_lengths, norms)
    L = torch.where(final_mask, L, zero)
    if loss_type == "geo_mean":  # its own mean over sequences, as verl's (not loss_agg_mode)
        pg_loss, coef = geo_loss, torch.where(final_mask, geo_coef, zero)
    else:
        pg_loss, coef = (a * L).sum(), a * dL
    loss = pg_loss
    n_kept = norms.kept_tokens
    metrics.total("actor/pg_loss", pg_loss)
    metrics.mean("actor/pg_clipfrac", clipped.to(dt), final_mask, n_kept)
    metrics.mean("actor/pg_clipfrac_lower", dual.to(dt), final_mask, n_kept)
    metrics.mean("actor/ppo_kl", kl_metric, final_mask, n_kept)
    if ref is not None:
        kl, dkl = kl_and_grad(lp, ref, config.kl_type)
        kl_loss = (a * torch.where(final_mask, kl, zero)).sum()
        metrics.total("actor/kl_loss", kl_loss)
        if config.kl_coef:
            loss = loss + config.kl_coef * kl_loss
            coef = coef + config.kl_coef * a * dkl
    coef_entropy = None
    if H is not None:
        ent = (a * H).sum()
        metrics.total("actor/entropy", ent)
        if config.entropy_coeff:
            loss = loss - config.entropy_coeff * ent
            coef_entropy = -config.entropy_coeff * a
    scale = split.loss_scale  # 1, or the data-parallel world size (see the docstring)
    if scale != 1:
        loss, coef = loss * scale, coef * scale
        coef_entropy = None if coef_entropy is None else coef_entropy * scale
    return StageOutput(loss, coef, coef_entropy, applied_w, final_mask, metrics.finish(split))
