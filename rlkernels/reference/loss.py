"""SPEC §1, §6, §7 and the actor/* metrics of §8, unfused and in float64; gradients by autograd.

`policy_loss` is the oracle for every backend: it takes log-probs (and entropy) that carry
autograd, so the gradient a fast backend writes for the logits can be checked against
``torch.autograd.grad`` through `token_stats` + `policy_loss`.
"""

from dataclasses import dataclass
from typing import Dict, Optional

import torch

from . import correction
from .divergences import head_logprobs
from .policy_terms import REFERENCE_TERMS, ReferenceContext, per_sequence_mean
from .sequences import masked_mean, sequence_indices
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


def _vaco_keep(l_train, roll, A, mask, seqs, config, metrics):
    """VACO: sequences whose mean binary divergence (sampler vs training policy, log-probs clamped to [-30, 0])
    over the final mask exceeds the threshold lose the tokens that move away from the sampler."""
    pi, mu = torch.exp(l_train.clamp(-30, 0)), torch.exp(roll.clamp(-30, 0))
    if config.vaco_divergence == "tv":
        div = (mu - pi).abs()
    else:
        mu_c, pi_c = mu.clamp(1e-6, 1 - 1e-6), pi.clamp(1e-6, 1 - 1e-6)
        div = mu_c * torch.log(mu_c / pi_c) + (1 - mu_c) * torch.log((1 - mu_c) / (1 - pi_c))
    seq_div = per_sequence_mean(div, mask, seqs)
    away = torch.sign(l_train.clamp(-30, 0) - roll.clamp(-30, 0)) * A > 0
    keep = ~((seq_div > config.vaco_threshold) & away)
    metrics["actor/vaco_masked_fraction"] = masked_mean((~keep).double(), mask)
    means = [seq_div[idx][0] for idx in seqs if mask[idx].any()]
    metrics["actor/vaco_divergence_mean"] = (torch.stack(means).mean() if means else
                                             torch.zeros((), dtype=torch.float64, device=A.device))
    return keep


def policy_loss(
    logprobs, advantages, response_mask, *, old_logprobs=None, rollout_logprobs=None, ref_logprobs=None,
    entropy=None, cu_seqlens=None, config, is_weights=None, head=None,
):
    """The full SPEC loss on per-token tensors ([B, T] or [N]); differentiable w.r.t. logprobs/entropy.
    `is_weights`: a trainer's own IS weights, used in place of computed ones in every mode. `head`: (log p at the
    sampler's top-k ids [..., k] with autograd, the sampler's log-probs there, the ids) for score centering."""
    # Long on purpose: the oracle reads top to bottom in the spec's order, so that it can be checked against
    # docs/spec.md line by line; helpers would hide the order the steps run in.
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

    w = w_pre = None
    new_mask = m
    metrics = {}
    if roll is not None:
        delta = torch.where(m, l_train - roll, torch.zeros_like(lp))
        norm = rs_info = token_kept = None
        if rc is not None and rc.is_level is not None:
            token_kept = correction.token_rejection(delta, m, rc, l_train, roll)
            w, w_pre, norm = correction.is_weights(delta, m, seqs, rc, token_kept)
        if rc is not None and rc.rs:
            new_mask, rs_info = correction.rejection(delta, m, seqs, rc, l_train, roll)
            if rc.rs_mode == "zero_weight":  # the rejected tokens stay in the mask with weight 0
                w_pre = torch.where(new_mask, w_pre, torch.zeros_like(w_pre))
                w = torch.where(new_mask, w, torch.zeros_like(w))
        metrics.update(correction.diagnostics(l_train, roll, m, seqs, rc, w_pre, norm, new_mask, rs_info,
                                              token_kept))
        if rc is not None and rc.rs and rc.rs_mode == "zero_weight":
            new_mask = m
    metrics.update(correction.response_length_metrics(m, seqs))
    # VESPO folds the truncated token weights into its sequence ratio before any batch normalisation (SPEC §6)
    token_weights = w_pre if rc is not None and rc.is_level == "token" else None
    if given is not None:
        w = token_weights = given
    weighted = w is not None and (mode == "decoupled" or given is not None)

    if config.seq_mean_advantages:  # each token takes its sequence's mean advantage over the final mask
        A = torch.where(new_mask, per_sequence_mean(A, new_mask, seqs), torch.zeros_like(A))
    loss_type = config.loss_type
    raw = lp - l_old
    log_r = per_sequence_mean(raw, new_mask, seqs) if config.ratio_level == "sequence" else raw
    bound = config.log_ratio_clamp
    r = torch.exp(log_r if bound is None else log_r.clamp(-bound, bound))
    if head is not None:
        k = head[2].shape[-1]
        head = (torch.where(m[:, None], head[0].double().reshape(-1, k), torch.zeros((), dtype=torch.float64)),
                head[1].double().reshape(-1, k), torch.where(m[:, None], head[2].reshape(-1, k), -1))
    term = REFERENCE_TERMS[loss_type](ReferenceContext(lp, A, raw, r, l_old, behaviour, new_mask, seqs, config, w,
                                                       weighted, token_weights, metrics, head))
    L, clipped, dual = term.value, term.clipped, term.dual
    kl_metric = term.kl_metric if term.kl_metric is not None else -(raw if bound is None else
                                                                     raw.clamp(-bound, bound)).detach()
    applied_w = term.applied_weights
    if not term.weights_applied and weighted:
        applied_w = w.detach()
        L = L * applied_w
    if config.off_policy_mask_threshold is not None:  # DeepSeek-V3.2 / TRL get_off_policy_mask
        seq_kl = per_sequence_mean((behaviour - lp).detach(), new_mask, seqs)
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
    if config.vaco_threshold is not None:  # open-instruct PR #1755 (5c2bf9ab) compute_rho_correction, algo "vaco"
        keep = _vaco_keep(l_train.detach(), roll, A, new_mask, seqs, config, metrics)
        L = L * keep.double()
    L = torch.where(new_mask, L, torch.zeros_like(L))

    def agg(x, agg_mode=None):
        agg_mode = agg_mode or config.loss_agg_mode
        over_all = config.seq_mean_over == "all"
        if term.aggregation is not None and agg_mode == config.loss_agg_mode:  # the loss's own aggregation
            agg_mode, over_all = term.aggregation
        return aggregate(x, new_mask, seqs, agg_mode, config.loss_scale_factor or width,
                         config.global_num_tokens, config.global_num_seqs, over_all)

    pg_loss = term.own_loss if term.own_loss is not None else agg(L)
    loss = pg_loss
    metrics["actor/pg_loss"] = pg_loss.detach()
    metrics["actor/pg_clipfrac"] = masked_mean(clipped.double(), new_mask)
    metrics["actor/pg_clipfrac_lower"] = masked_mean(dual.double(), new_mask)
    metrics["actor/ppo_kl"] = masked_mean(kl_metric, new_mask)
    if ref is not None:
        per_token = per_token_kl(lp, ref, config.kl_type)
        if config.kl_score_gradient:  # k x exp(lp - sg lp): the value k, plus k grad(lp) where k's clamps pass one
            d = ref - lp.detach()
            passes = ((d.abs() <= CLAMP) & (torch.exp(d.clamp(-CLAMP, CLAMP)) - d.clamp(-CLAMP, CLAMP) - 1 <= 10)
                      if config.kl_type == "k3" else torch.ones_like(m))
            if config.kl_type == "k3_unclamped":
                # its gradient dk + k is (1 - e^d) + (e^d - d - 1) = -d exactly: the value k with the gradient -d,
                # since the two e^d terms (1e17 at 40 nats) cancel to ±32 even in float64
                per_token = per_token.detach() + (lp.detach() - ref) * (lp - lp.detach())
            else:
                per_token = per_token + torch.where(passes, per_token.detach() * (lp - lp.detach()), 0.0)
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
    if config.log_ratio_sq_coef:  # Kimi-K2.5 (arXiv 2602.02276): tau (log p/q)^2, aggregated as the loss
        d = lp - behaviour
        square = agg(torch.where(new_mask, d * d, torch.zeros_like(d)))
        metrics["actor/log_ratio_sq"] = square.detach()
        loss = loss + config.log_ratio_sq_coef * square
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
    sampler_topk_ids=None, sampler_topk_logprobs=None,
):
    """Logits -> SPEC §2 stats -> `policy_loss`. `loss` is differentiable w.r.t. `logits`.
    `temperature`: a per-token tensor in place of config.temperature; `sampling_support`: kept ids;
    `sampler_topk_ids` / `_logprobs`: the sampler's top-k (score centering, SPEC §9)."""
    t = config.temperature if temperature is None else temperature
    lp, H, _ = token_stats(logits, labels, temperature=t, ignore_index=ignore_index,
                           sampling_support=sampling_support)
    head = None
    if sampler_topk_ids is not None:
        head = (head_logprobs(logits, sampler_topk_ids, t), sampler_topk_logprobs, sampler_topk_ids.long())
    V = logits.shape[-1]
    mask = response_mask.bool() & (labels != ignore_index) & (labels >= 0) & (labels < V)
    out = policy_loss(
        lp, advantages, mask, old_logprobs=_d(old_logprobs), rollout_logprobs=_d(rollout_logprobs),
        ref_logprobs=_d(ref_logprobs), entropy=H if config.needs_entropy else None, cu_seqlens=cu_seqlens,
        config=config, is_weights=_d(is_weights), head=head,
    )
    return out
