"""SPEC §9.2, the top-k form: divergences between the trainer's π and the sampler's μ over the partition
{h_1, ..., h_k, tail} of each row, from the [N, k] log-probs of both at the head ids. Plain torch on [N, k]
tensors, differentiable w.r.t. the trainer's head log-probs (their autograd reaches the logits through
ops.head); nothing here touches the vocabulary.

With P = sum_H π, Q = sum_H μ and the tail bins 1 - P, 1 - Q, each divergence is the exact divergence of the
two coarse distributions; by the data-processing inequality it is a lower bound on the divergence of the full
distributions. In "support" mode μ lives on H (the sampler's kept set, its log-probs renormalised over it):
kl = KL(μ||π) = sum_H μ log(μ/π) and tv = (sum_H |π - μ| + 1 - P) / 2 are then exact, while KL(π||μ) and χ²(π||μ)
are +inf whenever π has mass outside H, so they are not reported (None).
"""

from typing import NamedTuple, Optional, Tuple

import torch
from torch import Tensor

DIVERGENCES = ("kl", "reverse_kl", "chi2", "tv")  # kl = KL(μ||π), reverse_kl = KL(π||μ), chi2 = χ²(π||μ)
MODES = ("selected", "support")


class Divergences(NamedTuple):
    """Per-token divergences [N] (float32, float64 for float64 logits); None where not computed."""
    kl: Optional[Tensor]  # KL(μ || π): the sampler to the trainer (TRM's direction)
    reverse_kl: Optional[Tensor]  # KL(π || μ)
    chi2: Optional[Tensor]  # χ²(π || μ) = sum π² / μ - 1
    tv: Optional[Tensor]  # ½ sum |π - μ|
    trainer_head_mass: Optional[Tensor] = None  # sum_H π (top-k form)
    sampler_head_mass: Optional[Tensor] = None  # sum_H μ as given (top-k form; before any renormalisation)
    sampled_in_head: Optional[Tensor] = None  # [N] bool, the sampled token is one of the head ids (with labels)


def _kl_terms(a: Tensor, log_a: Tensor, log_b: Tensor) -> Tensor:
    """a (log a - log b) where a > 0, else 0; the log values of the empty branch are replaced before the
    product so that 0 * -inf never reaches a value or a gradient."""
    live = a > 0
    zero = torch.zeros((), dtype=a.dtype, device=a.device)
    return torch.where(live, a * (torch.where(live, log_a, zero) - torch.where(live, log_b, zero)), zero)


def tail_bounds(lq: Tensor, k: int, eps_sum: float, eps_logprobs: float) -> Tuple[float, Tensor]:
    """The rounding error of each tail bucket 1 - Σ_H: k ulps of 1 for a sum in the statistics' dtype (`eps_sum`),
    and for the sampler's side also the rounding of each reported log-prob to its dtype (`eps_logprobs`: a log-prob
    rounded by |log μ| eps / 2 moves μ by that relative amount; bf16 log-probs carry percents)."""
    zero = torch.zeros((), dtype=lq.dtype, device=lq.device)
    mu = lq.exp()
    spread = torch.where(mu > 0, mu * torch.where(mu > 0, lq, zero).abs(), zero).sum(1)
    return k * eps_sum, k * eps_sum + 0.5 * eps_logprobs * spread


def tail_masses(P: Tensor, Q: Tensor, bound_p, bound_q) -> Tuple[Tensor, Tensor]:
    """(1 - P, 1 - Q) where they are real. A tail within its rounding error is noise: when both are, both buckets
    are empty (a head covering the vocabulary); when only one is, that one stands at its bound, so that noise
    against a real tail never makes a divergence infinite (the value stays a lower bound up to that rounding)."""
    tail_p, tail_q = 1 - P, 1 - Q
    noise_p, noise_q = tail_p <= bound_p, tail_q <= bound_q
    both = noise_p & noise_q
    zero = torch.zeros_like(tail_p)
    tail_p = torch.where(both, zero, torch.where(noise_p, torch.full_like(tail_p, 1.0) * bound_p, tail_p))
    tail_q = torch.where(both, zero, torch.where(noise_q, bound_q * torch.ones_like(tail_q), tail_q))
    return tail_p, tail_q


def _safe_log(x: Tensor) -> Tensor:
    return torch.log(torch.where(x > 0, x, torch.ones_like(x))).masked_fill(x <= 0, float("-inf"))


def partition(head_logprobs: Tensor, sampler_logprobs: Tensor, slots: Tensor, mode: str = "selected") -> Divergences:
    """head_logprobs: [N, k] log π at the head ids (-inf at pads), with autograd; sampler_logprobs: [N, k] log μ
    there as the sampler reports them; slots: [N, k] bool, the slots holding an id (elsewhere μ is read as 0)."""
    lq = torch.where(slots, sampler_logprobs.to(head_logprobs.dtype), head_logprobs.new_full((), float("-inf")))
    bounds = tail_bounds(lq.detach(), lq.shape[1], torch.finfo(head_logprobs.dtype).eps,
                         torch.finfo(sampler_logprobs.dtype).eps)
    return _partition(head_logprobs, lq, mode, bounds)


def _partition(lp: Tensor, lq: Tensor, mode: str, bounds) -> Divergences:
    pi, mu = lp.exp(), lq.exp()
    P, Q = pi.sum(1), mu.sum(1)
    if mode == "support":  # μ has no tail: π's is real or noise (empty)
        pi_tail = torch.where(1 - P > bounds[0], 1 - P, torch.zeros_like(P))
        norm = torch.logsumexp(lq, 1, keepdim=True)
        lq = lq - torch.where(torch.isfinite(norm), norm, torch.zeros_like(norm))  # a row without ids stays empty
        mu = lq.exp()
        kl = _kl_terms(mu, lq, lp).sum(1)
        tv = 0.5 * ((pi - mu).abs().sum(1) + pi_tail)
        return Divergences(kl, None, None, tv, P, Q)
    pi_tail, mu_tail = tail_masses(P, Q, *bounds)
    log_pi_tail, log_mu_tail = _safe_log(pi_tail), _safe_log(mu_tail)
    kl = _kl_terms(mu, lq, lp).sum(1) + _kl_terms(mu_tail, log_mu_tail, log_pi_tail)
    reverse_kl = _kl_terms(pi, lp, lq).sum(1) + _kl_terms(pi_tail, log_pi_tail, log_mu_tail)
    zero = torch.zeros((), dtype=lp.dtype, device=lp.device)
    live, live_tail = pi > 0, pi_tail > 0
    # π² / μ as exp(2 log π - log μ): no square of a small π underflows before the division
    chi2 = torch.where(live, torch.exp(2 * torch.where(live, lp, zero) - torch.where(live, lq, zero)), zero).sum(1) \
        + torch.where(live_tail, pi_tail * pi_tail / torch.where(live_tail, mu_tail, torch.ones_like(mu_tail)), zero) \
        - 1
    tv = 0.5 * ((pi - mu).abs().sum(1) + (pi_tail - mu_tail).abs())
    return Divergences(kl, reverse_kl, chi2, tv, P, Q)
