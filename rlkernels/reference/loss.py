"""SPEC §1, §6, §7 and the actor/* metrics of §8, unfused and in float64; gradients by autograd.

`policy_loss` is the oracle for every backend: it takes log-probs (and entropy) that carry
autograd, so the gradient a fast backend writes for the logits can be checked against
``torch.autograd.grad`` through `token_stats` + `policy_loss`.
"""

from dataclasses import dataclass
from typing import Dict, Optional

import torch

from . import correction
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
    d = (ref - lp).clamp(-CLAMP, CLAMP)
    return (torch.exp(d) - d - 1).clamp(-10, 10)


def aggregate(values, mask, seqs, mode, K, global_num_tokens=None, global_num_seqs=None):
    """SPEC §7 over the final mask; 0 (with a zero gradient) when there is nothing to average."""
    vm = torch.where(mask, values, torch.zeros_like(values))
    zero = vm.sum() * 0
    if mode == "token-sum":
        return vm.sum()
    if mode == "token-mean":
        n = mask.sum() if global_num_tokens is None else global_num_tokens
        return vm.sum() / n if n > 0 else zero
    nonempty = [idx for idx in seqs if mask[idx].any()]
    G = len(nonempty) if global_num_seqs is None else global_num_seqs
    if G == 0:
        return zero
    if mode == "seq-mean-token-mean":
        return sum((vm[idx].sum() / mask[idx].sum() for idx in nonempty), zero) / G
    total = sum((vm[idx].sum() for idx in nonempty), zero) / G
    if mode == "seq-mean-token-sum":
        return total
    return total / K if K > 0 else zero  # seq-mean-token-sum-norm; K = 0 only for an empty packed batch


def policy_loss(
    logprobs, advantages, response_mask, *, old_logprobs=None, rollout_logprobs=None, ref_logprobs=None,
    entropy=None, cu_seqlens=None, config,
):
    """The full SPEC loss on per-token tensors ([B, T] or [N]); differentiable w.r.t. logprobs/entropy."""
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
    rc = config.rollout_correction

    # SPEC §1: the three modes
    if old is not None:
        mode, l_old, l_train = "decoupled", old, old
    elif roll is not None:
        mode, l_old, l_train = "bypass", roll, lp.detach()
    else:
        mode, l_old, l_train = "on-policy", lp.detach(), None

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

    applied_w = None
    loss_type = config.loss_type
    delta_pg = (lp - l_old).clamp(-CLAMP, CLAMP)
    kl_metric = -delta_pg.detach()
    clipped = dual = torch.zeros_like(m)
    if loss_type == "reinforce":
        applied_w = w.detach() if w is not None else torch.ones_like(lp)
        L = -A * applied_w * lp
    elif loss_type == "gpg":  # verl core_algos.compute_policy_loss_gpg
        L = -lp * A
    elif loss_type == "sapo":  # verl compute_policy_loss_sapo: gates sigmoid(tau (r - 1)) 4 / tau
        r = torch.exp(delta_pg)
        tau = torch.where(A > 0, torch.full_like(r, config.tau_pos), torch.full_like(r, config.tau_neg))
        L = -torch.sigmoid(tau * (r - 1.0)) * (4.0 / tau) * A
    elif loss_type == "gspo":  # verl compute_policy_loss_gspo, token form, over the final mask
        raw = lp - l_old
        seq_mean = torch.zeros_like(lp)
        for idx in seqs:
            keep = new_mask[idx]
            n = max(int(keep.sum()), 1)
            seq_mean[idx] = torch.where(keep, raw[idx], torch.zeros_like(raw[idx])).sum().detach() / n
        log_s = (lp - lp.detach() + seq_mean).clamp(max=10.0)
        s_ratio = torch.exp(log_s)
        L1 = -A * s_ratio
        L2 = -A * s_ratio.clamp(1 - config.clip_ratio_low, 1 + config.clip_ratio_high)
        clipped = L2 > L1
        L = torch.maximum(L1, L2)
        kl_metric = -raw.detach()
    elif loss_type == "geo_mean":  # verl compute_policy_loss_geo_mean (GMPO), over the final mask
        raw = lp - l_old
        sign = torch.sign(A)
        d_clip = raw.clamp(-config.clip_ratio_low, config.clip_ratio_high)
        d_min = sign * torch.minimum(sign * raw, sign * d_clip)
        outside = raw != d_clip
        clipped, dual = outside & (A > 0), outside & (A < 0)
        kl_metric = -raw.detach()
        total = (lp * 0.0).sum()  # stays a function of lp when no sequence has a token
        if mode == "decoupled" and w is not None:
            applied_w = torch.zeros_like(lp)
        for idx in seqs:
            keep = new_mask[idx]
            if not keep.any():
                continue
            n = keep.sum()
            ratio = torch.exp(d_min[idx][keep].sum() / n)
            seq_w = 1.0
            if mode == "decoupled" and w is not None:
                seq_w = torch.exp(torch.log(w[idx][keep].detach()).sum() / n)
                applied_w[idx] = torch.where(keep, seq_w, torch.zeros_like(seq_w))
            total = total + (-A[idx][keep].sum() / n * ratio * seq_w)
        geo_loss = total / max(len(seqs), 1)
        L = torch.zeros_like(lp)
    elif loss_type in ("dppo_tv", "dppo_kl"):  # verl compute_policy_loss_dppo_tv / _kl
        r = torch.exp(delta_pg)
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
    elif loss_type == "cispo":  # verl compute_policy_loss_cispo
        r = torch.exp(delta_pg)
        r_clip = r.clamp(1 - config.clip_ratio_low, 1 + config.clip_ratio_high)
        clipped = r != r_clip
        L = -r_clip.detach() * A * lp
    elif loss_type == "dro":  # verl compute_policy_loss_dro
        raw = lp - l_old
        L = -(lp * A - 0.5 * config.dro_beta * raw.square())
        kl_metric = -raw.detach()
    else:  # vanilla / ppo_clip
        r = torch.exp(delta_pg)
        L1 = -A * r
        L2 = -A * r.clamp(1 - config.clip_ratio_low, 1 + config.clip_ratio_high)
        clipped = L2 > L1
        Lc = torch.where(clipped, L2, L1)
        if config.clip_ratio_c is not None:
            dual = (A < 0) & (-A * config.clip_ratio_c < Lc)
            L = torch.where(dual, -A * config.clip_ratio_c, Lc)
        else:
            L = Lc
    if loss_type not in ("reinforce", "geo_mean") and mode == "decoupled" and w is not None:
        applied_w = w.detach()
        L = L * applied_w
    L = torch.where(new_mask, L, torch.zeros_like(L))

    agg = lambda x: aggregate(  # noqa: E731
        x, new_mask, seqs, config.loss_agg_mode, config.loss_scale_factor or width,
        config.global_num_tokens, config.global_num_seqs,
    )
    pg_loss = geo_loss if loss_type == "geo_mean" else agg(L)
    loss = pg_loss
    metrics["actor/pg_loss"] = pg_loss.detach()
    metrics["actor/pg_clipfrac"] = masked_mean(clipped.double(), new_mask)
    metrics["actor/pg_clipfrac_lower"] = masked_mean(dual.double(), new_mask)
    metrics["actor/ppo_kl"] = masked_mean(kl_metric, new_mask)
    if ref is not None:
        kl = agg(per_token_kl(lp, ref, config.kl_type))
        metrics["actor/kl_loss"] = kl.detach()
        if config.kl_coef:
            loss = loss + config.kl_coef * kl
    if H is not None:
        ent = agg(H)
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
    cu_seqlens=None, config, ignore_index=-100,
):
    """Logits -> SPEC §2 stats -> `policy_loss`. `loss` is differentiable w.r.t. `logits`."""
    lp, H, _ = token_stats(logits, labels, temperature=config.temperature, ignore_index=ignore_index)
    V = logits.shape[-1]
    mask = response_mask.bool() & (labels != ignore_index) & (labels >= 0) & (labels < V)
    out = policy_loss(
        lp, advantages, mask, old_logprobs=_d(old_logprobs), rollout_logprobs=_d(rollout_logprobs),
        ref_logprobs=_d(ref_logprobs), entropy=H if config.needs_entropy else None, cu_seqlens=cu_seqlens,
        config=config,
    )
    return out
