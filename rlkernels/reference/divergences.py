"""SPEC §9, unfused: divergences between the trainer's distribution π and the sampler's μ per token, in float64.

Both forms are written as one generic formula applied to two probability vectors: the full softmaxes (full
form), or the coarse distributions over the partition {h_1, ..., h_k, tail} (top-k form). Conventions: a term
with no mass on its left contributes 0 (0 log 0 = 0, 0^2 / 0 = 0); mass against none is +inf.
"""

from typing import Dict, Optional

import torch


def _kl(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """KL(a || b) along the last axis."""
    # the empty branch's operands are replaced before the division, so no 0 / 0 reaches the gradient
    live = a > 0
    ratio = torch.where(live, a / torch.where(live, b, torch.ones_like(b)), torch.ones_like(a))  # b = 0: +inf
    return torch.where(live, a * torch.log(ratio), torch.zeros_like(a)).sum(-1)


def _chi2(pi: torch.Tensor, mu: torch.Tensor) -> torch.Tensor:
    """chi^2(pi || mu) = sum pi^2 / mu - 1."""
    live = pi > 0
    return torch.where(live, pi * pi / torch.where(live, mu, torch.ones_like(mu)), torch.zeros_like(pi)).sum(-1) - 1


def _divergences(pi: torch.Tensor, mu: torch.Tensor) -> Dict[str, torch.Tensor]:
    return {"kl": _kl(mu, pi), "reverse_kl": _kl(pi, mu), "chi2": _chi2(pi, mu),
            "tv": 0.5 * (pi - mu).abs().sum(-1)}


def head_logprobs(logits: torch.Tensor, head_ids: torch.Tensor, temperature=1.0) -> torch.Tensor:
    """[..., k] log softmax(logits / T) at the ids, -inf at pads (-1); autograd to the logits."""
    log_p = torch.log_softmax(_shifted(logits, temperature), -1)
    ids = head_ids.long()
    picked = log_p.gather(-1, ids.clamp_min(0))
    return torch.where(ids >= 0, picked, torch.full_like(picked, float("-inf")))


def token_divergences(
    logits: torch.Tensor, *, labels: Optional[torch.Tensor] = None, reference_logits: Optional[torch.Tensor] = None,
    reference_topk_ids: Optional[torch.Tensor] = None, reference_topk_logprobs: Optional[torch.Tensor] = None,
    temperature=1.0, reference_temperature=None, mode: str = "selected",
) -> Dict[str, torch.Tensor]:
    """Per-token kl = KL(μ||π), reverse_kl = KL(π||μ), chi2 = χ²(π||μ), tv; with a top-k also the head masses
    Σ_H π and Σ_H μ, and with labels the sampled token's membership of the head. Autograd to `logits`.

    Full form: μ = softmax(reference_logits / reference_temperature). Top-k form: μ at the head ids from
    reference_topk_logprobs (full-vocabulary log-probs; in "support" mode renormalised over the head, μ's
    support), coarse distributions over {each head id, tail}, tail = 1 - head mass."""
    if reference_logits is not None:
        pi = torch.softmax(_shifted(logits, temperature), -1)
        rt = temperature if reference_temperature is None else reference_temperature
        mu = torch.softmax(_shifted(reference_logits.detach(), rt), -1)
        return _divergences(pi, mu)
    ids = reference_topk_ids.long()
    pi_head = head_logprobs(logits, ids, temperature).exp()
    lq = torch.where(ids >= 0, reference_topk_logprobs.double(), torch.full_like(pi_head, float("-inf")))
    Q = lq.exp().sum(-1)  # the sampler's head mass as given
    P = pi_head.sum(-1)
    # each tail's rounding error (SPEC §9.2): k ulps of the sum's dtype (the fast path's float32), and for μ the
    # rounding of every given log-prob to its dtype, Σ_H μ |log μ| eps / 2
    k = ids.shape[-1]
    eps_sum = torch.finfo(torch.float64 if logits.dtype == torch.float64 else torch.float32).eps
    mu_given = lq.exp()
    spread = torch.where(mu_given > 0, mu_given * lq.abs(), torch.zeros_like(mu_given)).sum(-1)
    bound_p = k * eps_sum
    bound_q = bound_p + 0.5 * torch.finfo(reference_topk_logprobs.dtype).eps * spread
    if mode == "support":  # μ lives on the ids; π's tail is real or noise (empty)
        lq = lq - torch.logsumexp(lq, -1, keepdim=True)
        pi = torch.cat([pi_head, torch.where(1 - P > bound_p, 1 - P, torch.zeros_like(P))[..., None]], -1)
        mu = torch.cat([lq.exp(), torch.zeros_like(P)[..., None]], -1)
    else:
        # a noise tail is empty when the other is too, else it stands at its bound
        noise_p, noise_q = 1 - P <= bound_p, 1 - Q <= bound_q
        both = noise_p & noise_q
        tail_p = torch.where(both, torch.zeros_like(P), torch.where(noise_p, bound_p * torch.ones_like(P), 1 - P))
        tail_q = torch.where(both, torch.zeros_like(Q), torch.where(noise_q, bound_q, 1 - Q))
        pi = torch.cat([pi_head, tail_p[..., None]], -1)
        mu = torch.cat([mu_given, tail_q[..., None]], -1)
    out = _divergences(pi, mu)
    out.update(trainer_head_mass=P, sampler_head_mass=Q)
    if labels is not None:
        out["sampled_in_head"] = ((ids == labels.long()[..., None]) & (ids >= 0)).any(-1)
    return out


def _shifted(logits, temperature):
    if isinstance(temperature, torch.Tensor):
        temperature = torch.broadcast_to(temperature.double(), logits.shape[:-1])[..., None]
    z = logits.double()
    top = z.detach().amax(-1, keepdim=True)
    return (z - torch.where(torch.isfinite(top), top, torch.zeros_like(top))) / temperature
