"""SPEC §2, unfused: per-token log-prob, entropy and sum of squared probabilities, in float64."""

import torch


def token_stats(logits: torch.Tensor, labels: torch.Tensor, *, temperature=1.0, ignore_index: int = -100,
                sampling_support=None):
    """Returns (logprobs, entropy, sum_pi_squared), each shaped like `labels`, float64.

    Rows whose label is `ignore_index` or outside [0, V) are not part of any loss: all three values
    are 0 there (the fast backends skip such rows without reading them).
    Autograd flows to `logits` through logprobs and entropy.

    temperature: a float or a tensor broadcastable to `labels` (per token). sampling_support: [..., K]
    kept ids (-1 pads): the softmax is renormalised over them, i.e. every other logit is -inf.
    """
    V = logits.shape[-1]
    if isinstance(temperature, torch.Tensor):
        temperature = torch.broadcast_to(temperature.double(), labels.shape)[..., None]
    z = logits.double()
    # softmax is shift-invariant: shifting by the row max before dividing keeps logits of 1e4 at a low
    # temperature from losing the digits that matter (z / T of 1e4 at T = 0.3 has an ulp of 4e-12)
    top = z.detach().amax(-1, keepdim=True)
    zs = (z - torch.where(torch.isfinite(top), top, torch.zeros_like(top))) / temperature
    if sampling_support is not None:
        ids = sampling_support.long()
        ids = torch.where(ids >= 0, ids, torch.full_like(ids, V))  # padding -> an extra column, dropped below
        kept = torch.zeros(logits.shape[:-1] + (V + 1,), dtype=torch.bool, device=logits.device)
        kept = kept.scatter(-1, ids, True)[..., :V]
        zs = torch.where(kept, zs, torch.full_like(zs, float("-inf")))
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
