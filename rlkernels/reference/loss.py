"""SPEC §1, §6, §7 and the actor/* metrics of §8, unfused and in float64; gradients by autograd.

`policy_loss` is the oracle for every backend: it takes log-probs (and entropy) that carry
autograd, so the gradient a fast backend writes for the logits can be checked against
``torch.autograd.grad`` through `token_stats` + `policy_loss`.
"""

import math
from dataclasses import dataclass
from typing import Dict, Optional

import torch

from . import correction
from .sequences import masked_mean, mean_or_zero, sequence_indices
from .token_stats import token_stats

CLAMP = 20.0


@dataclass
class ReferenceOutput:
    loss: torch.Tensor
    logprobs: torch.Tensor
    entropy: Optional[torch.Tensor]
    is_weights: Optional[torch.Tensor]
    mask: torch.Tensor
    metrics: Dict[str, torch.Tensor]


def _d(x):
    return None if x is None else x.double()


def per_token_kl(lp, ref, kl_type):
    if kl_type.endswith("+"):  # straight through: this value, k2's gradient (verl's kl_penalty)
        k2 = 0.5 * (lp - ref) ** 2
        return k2 - k2.detach() + per_token_kl(lp, ref, kl_type[:-1]).detach()
    if kl_type == "k1":
        return lp - ref
    if kl_type == "k2":
        return 0.5 * (lp - ref) ** 2
    if kl_type == "abs":
        return (lp - ref).abs()
    if kl_type == "k3_unclamped":  # the textbook k3 (TRL's)
        return torch.exp(ref - lp) - (ref - lp) - 1
    d = (ref - lp).clamp(-CLAMP, CLAMP)
    return (torch.exp(d) - d - 1).clamp(-10, 10)


def aggregate(values, mask, seqs, mode, K, global_num_tokens=None, global_num_seqs=None, over_all=False):
    """SPEC §7 over the final mask; 0 (with a zero gradient) when there is nothing to average.
    `over_all`: a sequence mean divides by every sequence, empty ones included (TRL's)."""
    vm = torch.where(mask, values, torch.zeros_like(values))
    zero = vm.sum() * 0
    if mode == "token-sum":
        return vm.sum()
    if mode == "token-mean":
        n = mask.sum() if global_num_tokens is None else global_num_tokens
        return vm.sum() / n if n > 0 else zero
    nonempty = [idx for idx in seqs if mask[idx].any()]
    G = (len(seqs) if over_all else len(nonempty)) if global_num_seqs is None else global_num_seqs
    if G == 0:
        return zero
    if mode == "seq-mean-token-mean":
        return sum((vm[idx].sum() / mask[idx].sum() for idx in nonempty), zero) / G
    total = sum((vm[idx].sum() for idx in nonempty), zero) / G
    if mode == "seq-mean-token-sum":
        return total
    return total / K if K > 0 else zero  # seq-mean-token-sum-norm; K = 0 only for an empty packed batch


def _per_sequence(values, mask, seqs):
    """Each token gets the mean of `values` over its sequence's tokens in `mask` (0 for an empty one);
    differentiable."""
    out = torch.zeros_like(values)
    for idx in seqs:
        keep = mask[idx]
        n = max(int(keep.sum()), 1)
        out = out.index_put((idx,), torch.where(keep, values[idx], torch.zeros_like(values[idx])).sum().expand(
            idx.numel()) / n)
    return out


def _m2po_keep(d, A, mask, tau, quadrant):
    """M2PO: among the eligible tokens keep the longest prefix of the ascending squared log-ratios
    whose mean is <= tau; the other eligible tokens lose their policy term."""
    eligible = mask & (((A > 0) & (d > 0)) | ((A < 0) & (d < 0))) if quadrant else mask.clone()
    idx = torch.nonzero(eligible).flatten()
    m2 = (d[idx] ** 2).tolist()
    order = sorted(range(len(idx)), key=lambda i: m2[i])  # Python's sort is stable
    keep = torch.ones_like(mask)
    total = 0.0
    kept = 0
    for position, i in enumerate(order, start=1):
        total += m2[i]
        if total / position <= tau:
            kept = position
    for i in order[kept:]:
        keep[idx[i]] = False
    return keep, eligible


def _covariance_selection(loss_type, lp, A, mask, candidates, config):
    """verl's Clip-Cov (random, torch.randperm on the default CPU generator) / KL-Cov (top-k) tokens."""
    chosen = torch.zeros_like(mask)
    n = int(mask.sum())
    if n == 0:
        return chosen
    count = n + 1e-8 if loss_type == "clip_cov" else n  # verl's masked_mean for Clip-Cov, a plain mean for KL-Cov
    cov = (A - A[mask].sum() / count) * (lp - lp[mask].sum() / count)
    if loss_type == "clip_cov":
        idx = torch.nonzero(candidates & mask & (cov > config.clip_cov_lb) & (cov < config.clip_cov_ub)).flatten()
        if len(idx):
            chosen[idx[torch.randperm(len(idx))[: max(int(config.clip_cov_ratio * n), 1)]]] = True
        return chosen
    valid = torch.nonzero(mask).flatten()
    chosen[valid[torch.topk(cov[valid], max(1, int(n * config.kl_cov_ratio))).indices]] = True
    return chosen


def policy_loss(
    logprobs, advantages, response_mask, *, old_logprobs=None, rollout_logprobs=None, ref_logprobs=None,
    entropy=None, cu_seqlens=None, config, is_weights=None,
):
    """The full SPEC loss on per-token tensors ([B, T] or [N]); differentiable w.r.t. logprobs/entropy.
    `is_weights`: a trainer's own IS weights, used in place of computed ones in every mode."""
    shape = tuple(logprobs.shape)
    device = logprobs.device
    seqs, width = sequence_indices(shape, cu_seqlens, device)
    m = response_mask.reshape(-1).bool()

    def valid(x):
        # Off the mask a value may be anything (NaN advantages, -inf log-probs): it must not reach
        # the loss or, through a 0 * NaN product, the gradient.
        zero = torch.zeros((), dtype=torch.float64, device=device)
        return None if x is None else torch.where(m, x.double().reshape(-1), zero)

    lp, A, H = valid(logprobs), valid(advantages), valid(entropy)
    old, roll, ref = valid(old_logprobs), valid(rollout_logprobs), valid(ref_logprobs)
    given = valid(is_weights)
    rc = config.rollout_correction

    # SPEC §1: the three modes
    if old is not None:
        mode, l_old, l_train = "decoupled", old, old
    elif roll is not None:
        mode, l_old, l_train = "bypass", roll, lp.detach()
    else:
        mode, l_old, l_train = "on-policy", lp.detach(), None
    behaviour = roll if roll is not None else l_old

    w = None
    new_mask = m
    metrics = {}
    if roll is not None:
        delta = torch.where(m, l_train - roll, torch.zeros_like(lp))
        w_pre = norm = rs_info = None
        if rc is not None and rc.is_level is not None:
            w, w_pre, norm = correction.is_weights(delta, m, seqs, rc)
        if rc is not None and rc.rs:
            new_mask, rs_info = correction.rejection(delta, m, seqs, rc)
        metrics.update(correction.diagnostics(l_train, roll, m, seqs, rc, w_pre, norm, new_mask, rs_info))
    token_weights = w if rc is not None and rc.is_level == "token" else None
    if given is not None:
        w = token_weights = given
    weighted = w is not None and (mode == "decoupled" or given is not None)

    applied_w = None
    loss_type = config.loss_type
    raw = lp - l_old
    log_r = _per_sequence(raw, new_mask, seqs) if config.ratio_level == "sequence" else raw
    bound = config.log_ratio_clamp
    r = torch.exp(log_r if bound is None else log_r.clamp(-bound, bound))
    kl_metric = -(raw if bound is None else raw.clamp(-bound, bound)).detach()
    clipped = dual = torch.zeros_like(m)
    no_weighting = ("reinforce", "geo_mean", "vespo")
    if loss_type == "reinforce":
        applied_w = w.detach() if w is not None else torch.ones_like(lp)
        L = -A * applied_w * lp
    elif loss_type == "gpg":  # verl core_algos.compute_policy_loss_gpg
        L = -lp * A
    elif loss_type == "sapo":  # verl compute_policy_loss_sapo: gates sigmoid(tau (r - 1)) 4 / tau
        tau = torch.where(A > 0, torch.full_like(r, config.tau_pos), torch.full_like(r, config.tau_neg))
        L = -torch.sigmoid(tau * (r - 1.0)) * (4.0 / tau) * A
    elif loss_type == "gspo":  # verl compute_policy_loss_gspo, token form, over the final mask
        log_s = (lp - lp.detach() + _per_sequence(raw, new_mask, seqs).detach()).clamp(max=10.0)
        s_ratio = torch.exp(log_s)
        L1 = -A * s_ratio
        L2 = -A * s_ratio.clamp(1 - config.clip_ratio_low, 1 + config.clip_ratio_high)
        clipped = L2 > L1
        L = torch.maximum(L1, L2)
        kl_metric = -raw.detach()
    elif loss_type == "geo_mean":  # verl compute_policy_loss_geo_mean (GMPO), over the final mask
        sign = torch.sign(A)
        d_clip = raw.clamp(-config.clip_ratio_low, config.clip_ratio_high)
        d_min = sign * torch.minimum(sign * raw, sign * d_clip)
        outside = raw != d_clip
        clipped, dual = outside & (A > 0), outside & (A < 0)
        kl_metric = -raw.detach()
        total = (lp * 0.0).sum()  # stays a function of lp when no sequence has a token
        if weighted:
            applied_w = torch.zeros_like(lp)
        for idx in seqs:
            keep = new_mask[idx]
            if not keep.any():
                continue
            n = keep.sum()
            ratio = torch.exp(d_min[idx][keep].sum() / n)
            seq_w = 1.0
            if weighted:
                seq_w = torch.exp(torch.log(w[idx][keep].detach()).sum() / n)
                applied_w[idx] = torch.where(keep, seq_w, torch.zeros_like(seq_w))
            total = total + (-A[idx][keep].sum() / n * ratio * seq_w)
        geo_loss = total / max(len(seqs), 1)
        L = torch.zeros_like(lp)
    elif loss_type in ("dppo_tv", "dppo_kl"):  # verl compute_policy_loss_dppo_tv / _kl
        cap = 20.0 if config.clip_ratio_c is None else config.clip_ratio_c
        truncated = r.clamp(max=cap).detach()
        p, p_old = torch.exp(lp.detach()), torch.exp(l_old.detach())
        if loss_type == "dppo_tv":
            inside = torch.where(A > 0, p - p_old <= config.clip_ratio_high, p - p_old >= -config.clip_ratio_low)
        else:
            bkl = (p_old * (l_old.detach() - lp.detach())
                   + (1 - p_old) * torch.log((1.0 - p_old + 1e-8) / (1.0 - p + 1e-8)))
            inside = torch.where(A > 0, (bkl <= config.clip_ratio_high) | (p <= p_old),
                                 (bkl <= config.clip_ratio_low) | (p >= p_old))
        L = -A * truncated * lp * inside.double()
        clipped, dual = ~inside, (r > cap) & inside
    elif loss_type == "cispo":  # verl compute_policy_loss_cispo; TRL's absolute cap with cispo_cap
        if config.cispo_cap is None:
            c = r.clamp(1 - config.clip_ratio_low, 1 + config.clip_ratio_high)
            clipped = r != c
        else:
            c = r.clamp(max=config.cispo_cap)
            clipped = (r > c) & (A > 0)
        L = -c.detach() * A * lp
    elif loss_type == "dro":  # verl compute_policy_loss_dro
        L = -(lp * A - 0.5 * config.dro_beta * raw.square())
        kl_metric = -raw.detach()
    elif loss_type == "topr":  # verl PR #6986 compute_policy_loss_topr
        taper = torch.ones_like(lp)
        negative, tapers = [], []
        for idx in seqs:
            keep = new_mask[idx]
            n = max(int(keep.sum()), 1)
            neg = bool(A[idx][keep].sum() / n < 0)
            t = torch.ones((), dtype=torch.float64, device=device)
            if neg:
                s_mean = raw[idx][keep].sum().detach() / n
                t = torch.exp(s_mean.clamp(max=10.0)).clamp(config.topr_negative_ratio_lower,
                                                              config.topr_negative_ratio_upper)
            taper[idx] = t
            negative.append(torch.tensor(float(neg), dtype=torch.float64, device=device))
            tapers.append(t)
        L = -A * lp * taper
        metrics["actor/topr_negative_seq_frac"] = mean_or_zero(negative, device)
        metrics["actor/topr_taper_weight_mean"] = mean_or_zero(tapers, device)
        kl_metric = -raw.detach()
    elif loss_type == "vespo":  # TRL get_gamma_weights: w from the sequence's summed log-ratios
        floor = math.log(1e-8)
        log_w = torch.zeros_like(lp)
        for idx in seqs:
            keep = new_mask[idx]
            total = raw[idx][keep].clamp(-CLAMP, CLAMP).sum()
            if token_weights is not None:  # token IS weights fold into the ratio (TRL)
                total = total + torch.log(token_weights[idx][keep]).clamp(floor, CLAMP).sum()
            log_w[idx] = total.clamp(floor, CLAMP).detach()
        nonneg = A >= 0
        k = torch.where(nonneg, torch.full_like(lp, config.vespo_k_pos), torch.full_like(lp, config.vespo_k_neg))
        lam = torch.where(nonneg, torch.full_like(lp, config.vespo_lambda_pos),
                          torch.full_like(lp, config.vespo_lambda_neg)).clamp(min=1e-4)
        phi = torch.exp(lam + k * log_w - lam * torch.exp(log_w)).nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)
        L = -phi * A * lp
        metrics["actor/vespo_phi_seq_mean"] = masked_mean(phi, new_mask)
        kl_metric = -raw.detach()
    elif loss_type == "clip_cov":  # verl compute_policy_loss_clip_cov, on the unclamped ratio
        ratio = torch.exp(raw)
        L1, L2 = -A * ratio, -A * ratio.clamp(1 - config.clip_ratio_low, 1 + config.clip_ratio_high)
        chosen = _covariance_selection(loss_type, lp.detach(), A, new_mask, ~(L2 > L1), config)
        L = torch.maximum(L1, L2) * (~chosen).double()
        clipped = chosen
        kl_metric = -raw.detach()
    elif loss_type == "kl_cov":  # verl compute_policy_loss_kl_cov
        ratio = torch.exp(raw)
        chosen = _covariance_selection(loss_type, lp.detach(), A, new_mask, new_mask, config)
        L = torch.where(chosen, -A * ratio + config.ppo_kl_coef * raw.abs(), -A * ratio)
        clipped = chosen
        kl_metric = raw.abs().detach()
    else:  # vanilla / ppo_clip / luspo
        L1 = -A * r
        L2 = -A * r.clamp(1 - config.clip_ratio_low, 1 + config.clip_ratio_high)
        clipped = L2 > L1
        Lc = torch.where(clipped, L2, L1)
        if config.clip_ratio_c is not None:
            dual = (A < 0) & (-A * config.clip_ratio_c < Lc)
            L = torch.where(dual, -A * config.clip_ratio_c, Lc)
        else:
            L = Lc
    if loss_type not in no_weighting and weighted:
        applied_w = w.detach()
        L = L * applied_w
    if config.off_policy_mask_threshold is not None:  # DeepSeek-V3.2 / TRL get_off_policy_mask
        seq_kl = _per_sequence((behaviour - lp).detach(), new_mask, seqs)
        keep = (A >= 0) | (seq_kl <= config.off_policy_mask_threshold)
        metrics["actor/off_policy_masked_fraction"] = masked_mean((~keep).double(), new_mask)
        L = L * keep.double()
    if config.m2po_threshold is not None:
        d = (lp - behaviour).detach()
        keep, eligible = _m2po_keep(d, A, new_mask, config.m2po_threshold, config.m2po_quadrant)
        metrics["actor/m2po_masked_fraction"] = masked_mean((~keep).double(), new_mask)
        metrics["actor/m2po_trust_region_fraction"] = masked_mean(eligible.double(), new_mask)
        metrics["actor/m2po_m2_before"] = masked_mean(d * d, eligible)
        metrics["actor/m2po_m2_after"] = masked_mean(d * d, eligible & keep)
        L = L * keep.double()
    L = torch.where(new_mask, L, torch.zeros_like(L))

    def agg(x, agg_mode=None):
        agg_mode = agg_mode or config.loss_agg_mode
        over_all = config.seq_mean_over == "all"
        if loss_type == "luspo" and agg_mode == config.loss_agg_mode:  # LUSPO's own aggregation
            agg_mode, over_all = "seq-mean-token-sum", True
        return aggregate(x, new_mask, seqs, agg_mode, config.loss_scale_factor or width,
                         config.global_num_tokens, config.global_num_seqs, over_all)

    pg_loss = geo_loss if loss_type == "geo_mean" else agg(L)
    loss = pg_loss
    metrics["actor/pg_loss"] = pg_loss.detach()
    metrics["actor/pg_clipfrac"] = masked_mean(clipped.double(), new_mask)
    metrics["actor/pg_clipfrac_lower"] = masked_mean(dual.double(), new_mask)
    metrics["actor/ppo_kl"] = masked_mean(kl_metric, new_mask)
    if ref is not None:
        per_token = per_token_kl(lp, ref, config.kl_type)
        if config.kl_bias_correction:  # TRL use_bias_correction_kl: k x r, r with its gradient
            per_token = per_token * r
            if config.kl_type == "k3_unclamped":
                # the same value as e^(d + log r) - (d + 1) r, d = ref - lp. At the token level, inside the
                # clamp, d + log r = ref - l_old does not depend on lp: written so, autograd does not
                # carry (and cancel) two e^d ~ 1e17 terms into lp's gradient (see loss._bias_corrected_kl)
                d = ref - lp
                log_r_c = log_r if bound is None else log_r.clamp(-bound, bound)
                exponent = d + log_r_c
                if config.ratio_level == "token":
                    inside = torch.ones_like(m) if bound is None else log_r.abs() <= bound
                    exponent = torch.where(inside, ref - l_old, exponent)
                per_token = torch.exp(exponent) - (d + 1) * r
        kl = agg(per_token)
        metrics["actor/kl_loss"] = kl.detach()
        if config.kl_coef:
            loss = loss + config.kl_coef * kl
    if H is not None:
        ent = agg(H, config.entropy_agg_mode)
        metrics["actor/entropy"] = ent.detach()
        if config.entropy_coeff:
            loss = loss - config.entropy_coeff * ent

    weights_out = applied_w.reshape(shape) if (applied_w is not None and w is not None) else None
    return ReferenceOutput(
        loss=loss,
        logprobs=lp.detach().reshape(shape),
        entropy=None if H is None else H.detach().reshape(shape),
        is_weights=weights_out,
        mask=new_mask.reshape(shape),
        metrics={k: v.detach() for k, v in metrics.items()},
    )


def decoupled_ppo_loss(
    logits, labels, advantages, response_mask, *, old_logprobs=None, rollout_logprobs=None, ref_logprobs=None,
    cu_seqlens=None, config, ignore_index=-100, is_weights=None, temperature=None, sampling_support=None,
):
    """Logits -> SPEC §2 stats -> `policy_loss`. `loss` is differentiable w.r.t. `logits`.
    `temperature`: a per-token tensor in place of config.temperature; `sampling_support`: kept ids."""
    lp, H, _ = token_stats(logits, labels, temperature=config.temperature if temperature is None else temperature,
                           ignore_index=ignore_index, sampling_support=sampling_support)
    V = logits.shape[-1]
    mask = response_mask.bool() & (labels != ignore_index) & (labels >= 0) & (labels < V)
    out = policy_loss(
        lp, advantages, mask, old_logprobs=_d(old_logprobs), rollout_logprobs=_d(rollout_logprobs),
        ref_logprobs=_d(ref_logprobs), entropy=H if config.needs_entropy else None, cu_seqlens=cu_seqlens,
        config=config, is_weights=_d(is_weights),
    )
    return out
