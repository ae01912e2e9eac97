"""What the public functions return: named tuples of tensors, shaped like the caller's tokens."""

from typing import Dict, NamedTuple, Optional

import torch


class PolicyLossOutput(NamedTuple):
    loss: torch.Tensor  # () differentiable w.r.t. logits (or logprobs / entropy for policy_loss)
    logprobs: torch.Tensor  # [B, T] or [N] float32, detached; 0 off the mask
    entropy: Optional[torch.Tensor]  # like logprobs, or None
    is_weights: Optional[torch.Tensor]  # weights multiplying the policy term, or None
    mask: torch.Tensor  # bool, the final mask after rejection
    metrics: Dict[str, torch.Tensor]  # 0-d device tensors named as in SPEC §8 (a dict, or a DeferredMetrics)
    # how the gradient is formed (SPEC §2.1, §2.4): "logits" (the logits' backward pass), "logits_one_pass" (dlogits
    # formed in the forward, scaled after), "linear_two_pass" (the fused-linear backward recomputes the logits) or
    # "linear_one_pass" (formed in the forward, scaled after)
    path: str = "logits"


class LogprobParity(NamedTuple):
    """The trainer's log-probs against the rollout engine's on the response tokens (`logprob_parity`); device
    tensors, read back with one host sync through `metrics_to_floats(report.metrics)`."""
    match_rate: torch.Tensor  # () the fraction of response tokens whose two log-probs have the same bits; NaN: none
    matched: torch.Tensor  # () int64, how many
    tokens: torch.Tensor  # () int64, response tokens
    first_divergence: torch.Tensor  # [S] int64: each sequence's first response position that differs; -1: none
    bucket_edges: torch.Tensor  # [K + 1] float64 edges of the rollout probability exp(rollout_logprobs)
    bucket_tokens: torch.Tensor  # [K] int64 response tokens per bucket
    bucket_mean_abs_diff: torch.Tensor  # [K] float64 mean |trainer - rollout| (NaN in an empty bucket)
    bucket_max_abs_diff: torch.Tensor  # [K] float64 max |trainer - rollout| (NaN in an empty bucket)
    metrics: Dict[str, torch.Tensor]  # the same as 0-d tensors: logprob_parity/<name>, logprob_parity/p[a,b)/<name>


class TokenStats(NamedTuple):
    logprobs: torch.Tensor
    entropy: Optional[torch.Tensor]
    sum_pi_squared: Optional[torch.Tensor]


class CorrectionOutput(NamedTuple):
    weights: Optional[torch.Tensor]  # IS weights (0 off the mask), or None when is_level is None
    mask: torch.Tensor  # bool mask after rejection
    metrics: Dict[str, torch.Tensor]


class TokenDivergences(NamedTuple):
    """Per-token divergences between the trainer's π and a second distribution μ (SPEC §9), shaped like the
    labels (logits.shape[:-1]); float32 (float64 for float64 logits), 0 on rows outside (ignore_index)."""
    # each None where `divergences=` left it out
    kl: Optional[torch.Tensor]  # KL(μ || π), the direction of TRM's criterion; autograd to the logits
    reverse_kl: Optional[torch.Tensor]  # KL(π || μ); None in "support" mode (+inf wherever π leaves μ's support)
    chi2: Optional[torch.Tensor]  # χ²(π || μ) = Σ π²/μ - 1; None in "support" mode
    tv: Optional[torch.Tensor]  # ½ Σ |π - μ|
    trainer_head_mass: Optional[torch.Tensor]  # Σ_H π (top-k form), no autograd
    sampler_head_mass: Optional[torch.Tensor]  # Σ_H μ as given (top-k form)
    sampled_in_head: Optional[torch.Tensor]  # bool, the label is one of the row's ids (top-k form with labels)
    form: str  # "full", "topk_selected" or "topk_support"
    lower_bounds: tuple  # the names above that are lower bounds on the exact divergence (the rest are exact)


class DistillationOutput(NamedTuple):
    loss: torch.Tensor  # () the aggregated loss, differentiable w.r.t. the student's logits
    losses: torch.Tensor  # [...] per-token losses after the clamps (0 off the mask), differentiable
    student_mass: torch.Tensor  # [...] Σ_H p_student, detached
    teacher_mass: torch.Tensor  # [...] Σ_H p_teacher as given
    metrics: Dict[str, torch.Tensor]  # distillation/* 0-d device tensors


class TokenBaseline(NamedTuple):
    advantages: torch.Tensor  # like token_rewards: (G - B) * m, no gradient
    returns: torch.Tensor  # like token_rewards: G, the masked reward-to-go


def shaped(t: Optional[torch.Tensor], token_shape) -> Optional[torch.Tensor]:
    """A flat [N] result in the caller's token shape (None stays None; one of that shape is returned as it is)."""
    return t if t is None or t.shape == tuple(token_shape) else t.reshape(token_shape)


def shaped_stats(stats, token_shape) -> TokenStats:
    """Flat [N] statistics (log-probs, entropy, Σπ²) as TokenStats in the caller's token shape."""
    return TokenStats(*(shaped(t, token_shape) for t in stats))


def floats_of(items) -> Dict[str, float]:
    """(name, 0-d tensor or number) pairs -> Python floats, with one host synchronisation per device the tensors
    are on (one in a training step: its metrics live where its loss does)."""
    values: Dict[str, float] = {}
    by_device: Dict[torch.device, list] = {}
    for name, value in items:
        if isinstance(value, torch.Tensor):
            by_device.setdefault(value.device, []).append(name)
        else:
            values[name] = float(value)
    tensors = dict(items)
    for names in by_device.values():
        read = torch.stack([tensors[n].detach().reshape(()).to(torch.float64) for n in names]).cpu().tolist()
        values.update(zip(names, read))
    return {name: values[name] for name, _ in items}
