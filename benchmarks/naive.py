"""The baseline: the loss as a user writes it today in plain PyTorch eager.

Full fp32 log-softmax over [N, V], gather of the sampled token, then the rollout-correction
weights, rejection mask, PPO clip and a masked mean, each as its own torch op. Nothing here is
clever on purpose: it is the thing the fused kernels are measured against (SPEC §2, §4-§7).
Only token-mean aggregation and the IS / rejection options the benchmark cases use are written.
"""

import math
from typing import Optional, Sequence, Tuple

import torch


def naive_token_logprobs(logits: torch.Tensor, labels: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """logits: (N, V) any float dtype; labels: (N,) int. Returns (N,) float32 log-probs."""
    x = logits.float()
    if temperature != 1.0:
        x = x / temperature
    logp = torch.log_softmax(x, dim=-1)  # (N, V) float32, kept for backward
    return logp.gather(-1, labels.clamp_min(0).unsqueeze(-1)).squeeze(-1)


def sequence_ids(cu_seqlens: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """(S + 1,) offsets -> (N,) index of the sequence of every token."""
    positions = torch.arange(num_tokens, device=cu_seqlens.device)
    return torch.searchsorted(cu_seqlens[1:].long(), positions, right=True)


def naive_decoupled_ppo_loss(
    logits: torch.Tensor,  # (N, V)
    labels: torch.Tensor,  # (N,)
    advantages: torch.Tensor,  # (N,)
    response_mask: torch.Tensor,  # (N,) bool
    old_logprobs: torch.Tensor,  # (N,)
    rollout_logprobs: torch.Tensor,  # (N,)
    cu_seqlens: torch.Tensor,  # (S + 1,)
    *,
    is_level: Optional[str] = "sequence",
    is_threshold: float = 2.0,
    rs: Sequence[Tuple[str, object]] = (),
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.2,
    clip_ratio_c: Optional[float] = 3.0,
    temperature: float = 1.0,
) -> torch.Tensor:
    """Decoupled PPO with truncated IS weights and rejection masks, token-mean aggregation."""
    logprobs = naive_token_logprobs(logits, labels, temperature)

    mask = response_mask.float()
    num_seqs = cu_seqlens.numel() - 1
    seq_id = sequence_ids(cu_seqlens, labels.numel())

    def seq_sum(x):
        return torch.zeros(num_seqs, dtype=x.dtype, device=x.device).index_add(0, seq_id, x)

    # rollout correction: constants (no gradient), on delta = log(pi_old / mu)
    delta = (old_logprobs.float() - rollout_logprobs.float()) * mask
    delta_hat = delta.clamp(-20.0, 20.0)
    if is_level == "token":
        weights = torch.exp(delta_hat).clamp(max=is_threshold) * mask
    elif is_level == "sequence":
        weights = torch.exp(seq_sum(delta).clamp(-20.0, 20.0))[seq_id].clamp(max=is_threshold) * mask
    else:
        weights = mask

    keep = response_mask.bool()
    lengths = seq_sum(mask).clamp(min=1.0)
    for option, bound in rs:
        kind = option.rsplit("_", 1)[1]
        if kind == "k1":
            stat = -delta_hat
        elif kind == "k2":
            stat = 0.5 * delta_hat**2
        elif kind == "k3":
            stat = torch.exp(delta_hat) - 1.0 - delta_hat
        else:
            raise NotImplementedError(f"naive baseline: rejection statistic {kind!r} is not written here")
        stat = stat * mask
        if option.startswith("seq_sum_"):
            stat = seq_sum(stat)[seq_id]
        elif option.startswith("seq_mean_"):
            stat = (seq_sum(stat) / lengths)[seq_id]
        elif not option.startswith("token_"):
            raise NotImplementedError(f"naive baseline: rejection option {option!r} is not written here")
        if kind == "k1":  # keep lo <= rho <= hi with rho = exp(-stat)
            lo, hi = bound
            keep = keep & (-stat >= math.log(lo)) & (-stat <= math.log(hi))
        else:
            keep = keep & (stat <= bound)

    # PPO clip (+ dual clip) against the proximal policy
    ratio = torch.exp((logprobs - old_logprobs.float()).clamp(-20.0, 20.0))
    loss1 = -advantages.float() * ratio
    loss2 = -advantages.float() * ratio.clamp(1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
    per_token = torch.maximum(loss1, loss2)
    if clip_ratio_c is not None:
        loss3 = -advantages.float() * clip_ratio_c
        per_token = torch.where(advantages < 0, torch.minimum(per_token, loss3), per_token)
    per_token = per_token * weights

    final_mask = keep.float()
    return (per_token * final_mask).sum() / final_mask.sum().clamp(min=1.0)
