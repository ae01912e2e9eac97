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
from .segments import Segments, hyper, masked_mean


class StageOutput(NamedTuple):
    loss: torch.Tensor  # 0-d
    coef_logprob: torch.Tensor  # [N] c_t
    coef_entropy: Optional[torch.Tensor]  # [N] e_t, None when the loss does not use the entropy
    is_weights: Optional[torch.Tensor]  # [N] weights multiplying the policy term, None if none do
    mask: torch.Tensor  # [N] bool, the final mask m'
    metrics: Dict[str, torch.Tensor]


def aggregation_weights(mask: torch.Tensor, seg: Segments, config: PolicyLossConfig, dtype) -> torch.Tensor:
    """a_t of SPEC §7, so that agg(X) = sum_t a_t * X_t. Empty batches give a = 0 (loss 0, never NaN)."""
    m = mask.to(dtype)
    mode = config.loss_agg_mode
    if mode == "token-sum":
        return m
    if mode == "token-mean":
        n = m.sum().clamp_min(1) if config.global_num_tokens is None else config.global_num_tokens
        return m / n
    lengths = seg.sum(m)
    G = (lengths > 0).to(dtype).sum().clamp_min(1) if config.global_num_seqs is None else config.global_num_seqs
    if mode == "seq-mean-token-mean":
        return m / (seg.expand(lengths.clamp_min(1)) * G)
    if mode == "seq-mean-token-sum":
        return m / G
    K = config.loss_scale_factor if config.loss_scale_factor is not None else seg.width
    if isinstance(K, torch.Tensor):
        K = K.to(dtype).clamp_min(1)  # a packed batch of empty sequences has width 0 and a = 0 anyway
    return m / (G * K)


def kl_and_grad(lp: torch.Tensor, ref: torch.Tensor, kl_type: str):
    """Per-token KL penalty of SPEC §6 and its derivative w.r.t. lp."""
    if kl_type == "k1":
        return lp - ref, torch.ones_like(lp)
    if kl_type == "k2":
        return 0.5 * (lp - ref) ** 2, lp - ref
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
    seg: Segments, config: PolicyLossConfig,
) -> StageOutput:
    """lp, entropy: [N] detached statistics of the current policy; mask: [N] bool (m); the others [N]."""
    dt = lp.dtype
    zero = torch.zeros((), dtype=dt, device=lp.device)

    def valid(x):  # off the mask values may be NaN/inf; they must not reach a sum or a gradient
        return None if x is None else torch.where(mask, x.to(dt), zero)

    lp, H, A = valid(lp), valid(entropy), valid(advantages)
    old, roll, ref = valid(old), valid(rollout), valid(ref)
    rc = config.rollout_correction
    decoupled = old is not None
    l_old = old if decoupled else (roll if roll is not None else lp)  # SPEC §1 modes

    metrics: Dict[str, torch.Tensor] = {}
    w = None
    final_mask = mask
    if roll is not None:
        l_train = old if decoupled else lp
        delta = l_train - roll
        if rc is not None and rc.is_level is not None:
            w = correction.is_weights(delta, mask, seg, rc)
        if rc is not None and rc.rs:
            rej = correction.rejection(delta, mask, seg, rc)
            final_mask = rej.mask
            metrics.update(rej.metrics)
        metrics.update(correction.offpolicy_metrics(l_train, roll, mask, seg, rc, w))

    delta_pg_raw = lp - l_old
    delta_pg = delta_pg_raw.clamp(-CLAMP, CLAMP)
    applied_w = None
    if config.loss_type == "reinforce":
        applied_w = w.weights if w is not None else None
        wv = applied_w if applied_w is not None else torch.ones_like(lp)
        L = -A * wv * lp
        dL = -A * wv
        clipped = dual = torch.zeros_like(mask)
    else:
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
            dual = torch.zeros_like(mask)
            L = Lc
        # c_t = -A * r where the unclipped branch is active (and the ±20 clamp passes it), else 0
        live = ~clipped & ~dual & (delta_pg_raw >= -CLAMP) & (delta_pg_raw <= CLAMP)
        dL = torch.where(live, -A * r, zero)
        if decoupled and w is not None:
            applied_w = w.weights
            L = L * applied_w
            dL = dL * applied_w

    a = aggregation_weights(final_mask, seg, config, dt)
    L = torch.where(final_mask, L, zero)
    pg_loss = (a * L).sum()
    loss = pg_loss
    coef = a * dL
    metrics["actor/pg_loss"] = pg_loss
    metrics["actor/pg_clipfrac"] = masked_mean(clipped.to(dt), final_mask)
    metrics["actor/pg_clipfrac_lower"] = masked_mean(dual.to(dt), final_mask)
    metrics["actor/ppo_kl"] = masked_mean(-delta_pg, final_mask)
    if ref is not None:
        kl, dkl = kl_and_grad(lp, ref, config.kl_type)
        kl_loss = (a * torch.where(final_mask, kl, zero)).sum()
        metrics["actor/kl_loss"] = kl_loss
        if config.kl_coef:
            loss = loss + config.kl_coef * kl_loss
            coef = coef + config.kl_coef * a * dkl
    coef_entropy = None
    if H is not None:
        ent = (a * H).sum()
        metrics["actor/entropy"] = ent
        if config.entropy_coeff:
            loss = loss - config.entropy_coeff * ent
            coef_entropy = -config.entropy_coeff * a
    return StageOutput(loss, coef, coef_entropy, applied_w, final_mask, metrics)
