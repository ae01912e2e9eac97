"""SPEC §2, unfused: per-token log-prob, entropy and sum of squared probabilities, in float64."""

import torch


def token_stats(logits: torch.Tensor, labels: torch.Tensor, *, temperature: float = 1.0, ignore_index: int = -100):
    """Returns (logprobs, entropy, sum_pi_squared), each shaped like `labels`, float64.

    Rows whose label is `ignore_index` or outside [0, V) are not part of any loss: all three values
    are 0 there (the fast backends skip such rows without reading them).
    Autograd flows to `logits` through logprobs and entropy.
    """
    V = logits.shape[-1]
    zs = logits.double() / temperature
    lse = torch.logsumexp(zs, dim=-1)
    valid = (labels != ignore_index) & (labels >= 0) & (labels < V)
    y = torch.where(valid, labels, torch.zeros_like(labels)).long()
    logprobs = zs.gather(-1, y.unsqueeze(-1)).squeeze(-1) - lse
    p = torch.softmax(zs, dim=-1)
    # p_v * zs_v with p_v = 0 contributes 0 (SPEC §2); zs is replaced *before* the product so that
    # the unselected branch cannot send 0 * -inf = NaN into the gradient.
    zs_finite = torch.where(p > 0, zs, torch.zeros_like(zs))
    entropy = lse - (p * zs_finite).sum(-1)
    sum_pi_squared = (p * p).sum(-1)
    zero = torch.zeros((), dtype=torch.float64, device=logits.device)
    return (
        torch.where(valid, logprobs, zero),
        torch.where(valid, entropy, zero),
        torch.where(valid, sum_pi_squared, zero).detach(),
    )
