"""The oracle's policy losses, one function per loss type (SPEC §6), to be read side by side with
rlkernels/stage/policy_terms.py: the same terms written with autograd (sequences as Python loops) instead of
closed-form derivatives. Imports nothing of the fast paths."""

import math
from typing import Callable, Dict, List, NamedTuple, Optional, Tuple

import torch

from .sequences import masked_mean, mean_or_zero

CLAMP = 20.0


class ReferenceContext(NamedTuple):
    lp: torch.Tensor  # [N] float64 current log-probs, with autograd (0 off the mask)
    advantages: torch.Tensor
    log_ratio: torch.Tensor  # lp - l_old (raw)
    ratio: torch.Tensor  # r, token or sequence level, clamped as config.log_ratio_clamp says
    l_old: torch.Tensor
    behaviour: torch.Tensor  # the sampler's log-probs where given, else l_old
    mask: torch.Tensor  # [N] bool, the final mask after rejection
    seqs: List[torch.Tensor]  # index tensors of the sequences
    config: object
    weights: Optional[torch.Tensor]  # the IS weights (computed or given), or None
    weighted: bool  # they multiply the policy term (decoupled mode, or given weights)
    token_weights: Optional[torch.Tensor]  # per-token weights (is_level="token", or given), for VESPO
    metrics: Dict[str, torch.Tensor]
    head: Optional[Tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = None  # (log p [N, k] with autograd, log q, ids)


class ReferenceTerm(NamedTuple):
    value: torch.Tensor  # [N] L_t, with autograd
    clipped: torch.Tensor
    dual: torch.Tensor
    kl_metric: Optional[torch.Tensor] = None  # None: -log r, clamped as r is
    weights_applied: bool = False  # the term carries the IS weights itself
    applied_weights: Optional[torch.Tensor] = None  # the weights reported (when weights_applied)
    own_loss: Optional[torch.Tensor] = None  # a loss with its own mean over sequences (GMPO)
    aggregation: Optional[Tuple[str, bool]] = None  # (loss_agg_mode, over every sequence) the loss defines


REFERENCE_TERMS: Dict[str, Callable[[ReferenceContext], ReferenceTerm]] = {}


def term(*names: str):
    def register(fn):
        for name in names:
            REFERENCE_TERMS[name] = fn
        return fn
    return register


def _none(ctx):
    return torch.zeros_like(ctx.mask)


def per_sequence_mean(values, mask, seqs):
    """Each token gets the mean of `values` over its sequence's tokens in `mask` (0 for an empty one);
    differentiable (without any sequence too: zeros that still hang off `values`, so a loss of no tokens has the
    zero gradient instead of none)."""
    out = torch.where(torch.zeros_like(mask, dtype=torch.bool), values, torch.zeros_like(values))
    for idx in seqs:
        keep = mask[idx]
        n = max(int(keep.sum()), 1)
        out = out.index_put((idx,), torch.where(keep, values[idx], torch.zeros_like(values[idx])).sum().expand(
            idx.numel()) / n)
    return out


def _ppo_clip(ctx, ratio=None, dual_clip=True):
    r, A, config = ctx.ratio if ratio is None else ratio, ctx.advantages, ctx.config
    L1 = -A * r
    L2 = -A * r.clamp(1 - config.clip_ratio_low, 1 + config.clip_ratio_high)
    clipped = L2 > L1
    Lc = torch.where(clipped, L2, L1)
    dual = _none(ctx)
    if dual_clip and config.clip_ratio_c is not None:
        dual = (A < 0) & (-A * config.clip_ratio_c < Lc)
        Lc = torch.where(dual, -A * config.clip_ratio_c, Lc)
    return Lc, clipped, dual


@term("vanilla", "ppo_clip")
def ppo_clip(ctx):  # verl compute_policy_loss_vanilla
    return ReferenceTerm(*_ppo_clip(ctx))


@term("reinforce")
def reinforce(ctx):  # verl bypass mode, loss_type="reinforce"
    w = ctx.weights.detach() if ctx.weights is not None else torch.ones_like(ctx.lp)
    return ReferenceTerm(-ctx.advantages * w * ctx.lp, _none(ctx), _none(ctx), weights_applied=True, applied_weights=w)


@term("gpg")
def gpg(ctx):  # verl core_algos.compute_policy_loss_gpg
    return ReferenceTerm(-ctx.lp * ctx.advantages, _none(ctx), _none(ctx))


@term("sapo")
def sapo(ctx):  # verl compute_policy_loss_sapo: gates sigmoid(tau (r - 1)) 4 / tau
    r, A, config = ctx.ratio, ctx.advantages, ctx.config
    tau = torch.where(A > 0, torch.full_like(r, config.tau_pos), torch.full_like(r, config.tau_neg))
    return ReferenceTerm(-torch.sigmoid(tau * (r - 1.0)) * (4.0 / tau) * A, _none(ctx), _none(ctx))


@term("gspo")
def gspo(ctx):  # verl compute_policy_loss_gspo, token form, over the final mask
    lp, A, config = ctx.lp, ctx.advantages, ctx.config
    log_s = (lp - lp.detach() + per_sequence_mean(ctx.log_ratio, ctx.mask, ctx.seqs).detach()).clamp(max=10.0)
    s_ratio = torch.exp(log_s)
    L1 = -A * s_ratio
    L2 = -A * s_ratio.clamp(1 - config.clip_ratio_low, 1 + config.clip_ratio_high)
    return ReferenceTerm(torch.maximum(L1, L2), L2 > L1, _none(ctx), kl_metric=-ctx.log_ratio.detach())


@term("geo_mean")
def geo_mean(ctx):  # verl compute_policy_loss_geo_mean (GMPO), over the final mask
    raw, A, config, lp = ctx.log_ratio, ctx.advantages, ctx.config, ctx.lp
    sign = torch.sign(A)
    d_clip = raw.clamp(-config.clip_ratio_low, config.clip_ratio_high)
    d_min = sign * torch.minimum(sign * raw, sign * d_clip)
    outside = raw != d_clip
    total = (lp * 0.0).sum()  # stays a function of lp when no sequence has a token
    applied = torch.zeros_like(lp) if ctx.weighted else None
    for idx in ctx.seqs:
        keep = ctx.mask[idx]
        if not keep.any():
            continue
        n = keep.sum()
        ratio = torch.exp(d_min[idx][keep].sum() / n)
        seq_w = 1.0
        if ctx.weighted:
            seq_w = torch.exp(torch.log(ctx.weights[idx][keep].detach()).sum() / n)
            applied[idx] = torch.where(keep, seq_w, torch.zeros_like(seq_w))
        total = total + (-A[idx][keep].sum() / n * ratio * seq_w)
    return ReferenceTerm(torch.zeros_like(lp), outside & (A > 0), outside & (A < 0), kl_metric=-raw.detach(),
                         weights_applied=True, applied_weights=applied, own_loss=total / max(len(ctx.seqs), 1))


@term("cispo")
def cispo(ctx):  # verl compute_policy_loss_cispo; TRL's absolute cap with cispo_cap
    r, config = ctx.ratio, ctx.config
    if config.cispo_cap is None:
        c = r.clamp(1 - config.clip_ratio_low, 1 + config.clip_ratio_high)
        clipped = r != c
    else:
        c = r.clamp(max=config.cispo_cap)
        clipped = (r > c) & (ctx.advantages > 0)
    return ReferenceTerm(-c.detach() * ctx.advantages * ctx.lp, clipped, _none(ctx))


@term("dro")
def dro(ctx):  # verl compute_policy_loss_dro
    raw = ctx.log_ratio
    return ReferenceTerm(-(ctx.lp * ctx.advantages - 0.5 * ctx.config.dro_beta * raw.square()), _none(ctx),
                         _none(ctx), kl_metric=-raw.detach())


def _dppo(ctx, kind):  # verl compute_policy_loss_dppo_tv / _kl
    r, A, config, lp, l_old = ctx.ratio, ctx.advantages, ctx.config, ctx.lp, ctx.l_old
    cap = 20.0 if config.clip_ratio_c is None else config.clip_ratio_c
    truncated = r.clamp(max=cap).detach()
    p, p_old = torch.exp(lp.detach()), torch.exp(l_old.detach())
    if kind == "tv":
        inside = torch.where(A > 0, p - p_old <= config.clip_ratio_high, p - p_old >= -config.clip_ratio_low)
    else:
        bkl = (p_old * (l_old.detach() - lp.detach())
               + (1 - p_old) * torch.log((1.0 - p_old + 1e-8) / (1.0 - p + 1e-8)))
        inside = torch.where(A > 0, (bkl <= config.clip_ratio_high) | (p <= p_old),
                             (bkl <= config.clip_ratio_low) | (p >= p_old))
    return ReferenceTerm(-A * truncated * lp * inside.double(), ~inside, (r > cap) & inside)


@term("dppo_tv")
def dppo_tv(ctx):
    return _dppo(ctx, "tv")


@term("dppo_kl")
def dppo_kl(ctx):
    return _dppo(ctx, "kl")


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


@term("clip_cov")
def clip_cov(ctx):  # verl compute_policy_loss_clip_cov, on the unclamped ratio
    A, config, raw = ctx.advantages, ctx.config, ctx.log_ratio
    ratio = torch.exp(raw)
    L1, L2 = -A * ratio, -A * ratio.clamp(1 - config.clip_ratio_low, 1 + config.clip_ratio_high)
    chosen = _covariance_selection("clip_cov", ctx.lp.detach(), A, ctx.mask, ~(L2 > L1), config)
    return ReferenceTerm(torch.maximum(L1, L2) * (~chosen).double(), chosen, _none(ctx), kl_metric=-raw.detach())


@term("kl_cov")
def kl_cov(ctx):  # verl compute_policy_loss_kl_cov
    A, config, raw = ctx.advantages, ctx.config, ctx.log_ratio
    ratio = torch.exp(raw)
    chosen = _covariance_selection("kl_cov", ctx.lp.detach(), A, ctx.mask, ctx.mask, config)
    L = torch.where(chosen, -A * ratio + config.ppo_kl_coef * raw.abs(), -A * ratio)
    return ReferenceTerm(L, chosen, _none(ctx), kl_metric=raw.abs().detach())


@term("topr")
def topr(ctx):  # verl PR #6986 compute_policy_loss_topr
    lp, A, config, raw = ctx.lp, ctx.advantages, ctx.config, ctx.log_ratio
    taper = torch.ones_like(lp)
    negative, tapers = [], []
    for idx in ctx.seqs:
        keep = ctx.mask[idx]
        n = max(int(keep.sum()), 1)
        neg = bool(A[idx][keep].sum() / n < 0)
        t = torch.ones((), dtype=torch.float64, device=lp.device)
        if neg:
            s_mean = raw[idx][keep].sum().detach() / n
            t = torch.exp(s_mean.clamp(max=10.0)).clamp(config.topr_negative_ratio_lower,
                                                          config.topr_negative_ratio_upper)
        taper[idx] = t
        negative.append(torch.tensor(float(neg), dtype=torch.float64, device=lp.device))
        tapers.append(t)
    ctx.metrics["actor/topr_negative_seq_frac"] = mean_or_zero(negative, lp.device)
    ctx.metrics["actor/topr_taper_weight_mean"] = mean_or_zero(tapers, lp.device)
    return ReferenceTerm(-A * lp * taper, _none(ctx), _none(ctx), kl_metric=-raw.detach())


@term("luspo")
def luspo(ctx):  # TRL's LUSPO: PPO clip under its own aggregation
    return ReferenceTerm(*_ppo_clip(ctx), aggregation=("seq-mean-token-sum", True))


@term("vespo")
def vespo(ctx):  # TRL get_gamma_weights: w from the sequence's summed log-ratios
    lp, A, config, raw = ctx.lp, ctx.advantages, ctx.config, ctx.log_ratio
    floor = math.log(1e-8)
    log_w = torch.zeros_like(lp)
    for idx in ctx.seqs:
        keep = ctx.mask[idx]
        total = raw[idx][keep].clamp(-CLAMP, CLAMP).sum()
        if ctx.token_weights is not None:  # token IS weights fold into the ratio (TRL)
            total = total + torch.log(ctx.token_weights[idx][keep]).clamp(floor, CLAMP).sum()
        log_w[idx] = total.clamp(floor, CLAMP).detach()
    nonneg = A >= 0
    k = torch.where(nonneg, torch.full_like(lp, config.vespo_k_pos), torch.full_like(lp, config.vespo_k_neg))
    lam = torch.where(nonneg, torch.full_like(lp, config.vespo_lambda_pos),
                      torch.full_like(lp, config.vespo_lambda_neg)).clamp(min=1e-4)
    phi = torch.exp(lam + k * log_w - lam * torch.exp(log_w)).nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)
    ctx.metrics["actor/vespo_phi_seq_mean"] = masked_mean(phi, ctx.mask)
    return ReferenceTerm(-phi * A * lp, _none(ctx), _none(ctx), kl_metric=-raw.detach(), weights_applied=True)


def _rollout_trust_region(ctx, keep):  # prime-rl's IPO loss (src/prime_rl/trainer/rl/loss.py), its ratio p / q
    d = ctx.lp - ctx.behaviour
    bound = ctx.config.log_ratio_clamp
    r = torch.exp(d if bound is None else d.clamp(-bound, bound))
    value = torch.where(keep, -ctx.advantages * r + ctx.config.ipo_kl_tau * d * d, torch.zeros_like(d))
    if ctx.weighted:  # a trainer's own weights (computed ones are refused for these losses)
        value = value * ctx.weights
    return ReferenceTerm(value, ~keep, _none(ctx), kl_metric=-d.detach(), weights_applied=True,
                         applied_weights=ctx.weights if ctx.weighted else None)


@term("ipo")
def ipo(ctx):  # prime-rl IPO: keep iff |p - q| <= eps
    p, q = torch.exp(ctx.lp.detach()), torch.exp(ctx.behaviour)
    return _rollout_trust_region(ctx, (p - q).abs() <= ctx.config.ipo_eps)


@term("kpop")
def kpop(ctx):  # prime-rl PR #3283 KPop: both binary KLs of the clamped probabilities within phi
    p = torch.exp(ctx.lp.detach()).clamp(1e-6, 1 - 1e-6)
    q = torch.exp(ctx.behaviour).clamp(1e-6, 1 - 1e-6)

    def binary_kl(a, b):
        return a * torch.log(a / b) + (1 - a) * torch.log((1 - a) / (1 - b))

    phi = ctx.config.kpop_phi
    return _rollout_trust_region(ctx, (binary_kl(p, q) <= phi) & (binary_kl(q, p) <= phi))


@term("dppo_binary_tv")
def dppo_binary_tv(ctx):  # prime-rl PR #2434: keep iff p - q in [-low, high], whatever the advantage
    gap = torch.exp(ctx.lp.detach()) - torch.exp(ctx.behaviour)
    return _rollout_trust_region(ctx, (gap >= -ctx.config.binary_tv_low) & (gap <= ctx.config.binary_tv_high))


@term("dppo_binary_tv_signed")
def dppo_binary_tv_signed(ctx):  # prime-rl 559b4477 default_loss_fn: drop a token moving further off the sampler
    gap = torch.exp(ctx.lp.detach()) - torch.exp(ctx.behaviour)
    high, low = gap > ctx.config.binary_tv_high, gap < -ctx.config.binary_tv_low
    return _rollout_trust_region(ctx, ~torch.where(ctx.advantages > 0, high, low))


@term("score_centering")
def score_centering(ctx):  # arXiv 2609.20807: -A (f(r_y) lp_y - sum_H sg[q f(r) - alpha p] log p)
    rc = ctx.config.rollout_correction
    if rc is None or rc.is_level is None:
        def f(r):
            return torch.ones_like(r)
    else:
        lo, hi = rc.is_range
        if rc.is_icepop:
            def f(r):
                return r * ((r >= lo) & (r <= hi)).double()
        else:
            def f(r):
                return r.clamp(lo, hi)
    log_p, log_q, ids = ctx.head
    slots = ids >= 0
    lp_y = ctx.lp
    r_y = torch.exp((lp_y.detach() - ctx.behaviour).clamp(-CLAMP, CLAMP))
    p = torch.where(slots, log_p.detach().exp(), torch.zeros_like(log_q))
    q = torch.where(slots, log_q.exp(), torch.zeros_like(log_q))
    r = torch.where(p > 0, torch.exp((log_p.detach() - log_q).clamp(-CLAMP, CLAMP)), torch.zeros_like(p))
    rho = (1 - q.sum(-1)).clamp_min(1e-6) / (1 - p.sum(-1)).clamp_min(1e-6)
    alpha = rho * f(1 / rho)
    w = torch.where(slots, q * f(r) - alpha[:, None] * p, torch.zeros_like(q))
    live = slots & (p > 0)
    centre = torch.where(live, w * torch.where(live, log_p, torch.zeros_like(log_p)), torch.zeros_like(w)).sum(-1)
    L = -ctx.advantages * (f(r_y) * lp_y - centre)
    clipped = f(r_y) != r_y if rc is not None and rc.is_level is not None else _none(ctx)
    return ReferenceTerm(L, clipped, _none(ctx), kl_metric=-(lp_y - ctx.behaviour).detach(), weights_applied=True,
                         applied_weights=f(r_y))
