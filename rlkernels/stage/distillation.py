"""SPEC §9.3: on-policy distillation to a teacher's top-k, per token, from the student's log-probs at the teacher's
ids (ops.head: autograd to the logits) and the teacher's log-probs there. Plain torch on [N, k] tensors.

    forward_kl       Σ_H t (log t - log s), both log-probs clamped below at log_prob_min_clamp (verl's
                     forward_kl_topk: the teacher's probabilities are those of its clamped log-probs)
    forward_kl_tail  KL(teacher || student) over {the ids, the tail} (verl PR #7855's tail-aware form)
    reverse_kl       KL(student || teacher) over {the ids, the tail}

then, with loss_max_clamp c, each token's loss clamped to [-c, c] (verl clamps both sides, for its k1 loss).
"""

from typing import Dict, Optional, Tuple

import torch
from torch import Tensor

from .divergences import partition


def token_losses(student: Tensor, teacher: Tensor, slots: Tensor, kind: str, log_prob_min_clamp: Optional[float],
                 loss_max_clamp: Optional[float]) -> Tuple[Tensor, Dict[str, Tensor]]:
    """([N] losses with autograd through `student`, the masses and the clamp's verdicts). student: [N, k] the
    student's log-probs at the ids (-inf at pads); teacher: [N, k] the teacher's; slots: [N, k] bool."""
    zero = torch.zeros((), dtype=student.dtype, device=student.device)
    t = torch.where(slots, teacher.to(student.dtype), zero)
    if kind == "forward_kl":
        s = student
        if log_prob_min_clamp is not None:
            s, t = s.clamp_min(log_prob_min_clamp), t.clamp_min(log_prob_min_clamp)
        # a pad's -inf must not reach a product (0 * -inf = NaN, forward or backward)
        s = torch.where(slots, s, zero)
        losses = torch.where(slots, t.exp() * (t - s), zero).sum(1)
    else:
        div = partition(student, teacher, slots)
        losses = div.kl if kind == "forward_kl_tail" else div.reverse_kl
    clamped = torch.zeros_like(losses, dtype=torch.bool)
    if loss_max_clamp is not None:
        clamped = losses.detach().abs() > loss_max_clamp
        losses = losses.clamp(-loss_max_clamp, loss_max_clamp)
    parts = {
        "student_mass": torch.where(slots, student.detach().exp(), zero).sum(1),
        "teacher_mass": torch.where(slots, teacher.to(student.dtype).exp(), zero).sum(1),
        "clamped": clamped,
    }
    return losses, parts


def aggregate(losses: Tensor, parts: Dict[str, Tensor], rows: Tensor, agg: str) -> Tuple[Tensor, Dict[str, Tensor]]:
    """(the loss over `rows` by token-mean or token-sum, the distillation/* metrics); every value is 0 where no
    row takes part."""
    zero = torch.zeros((), dtype=losses.dtype, device=losses.device)
    losses = torch.where(rows, losses, zero)
    n = rows.sum()
    total = losses.sum()
    loss = total / n.clamp_min(1) if agg == "token-mean" else total
    metrics = {"distillation/loss": loss.detach()}
    for name in ("student_mass", "teacher_mass"):
        x = parts[name]
        metrics[f"distillation/{name}"] = torch.where(rows, x, zero).sum() / n.clamp_min(1)
        big = torch.where(rows, x, x.new_full((), -float("inf")))
        small = torch.where(rows, x, x.new_full((), float("inf")))
        any_row = n > 0
        metrics[f"distillation/{name}_max"] = torch.where(any_row, big.max() if x.numel() else zero, zero)
        metrics[f"distillation/{name}_min"] = torch.where(any_row, small.min() if x.numel() else zero, zero)
    metrics["distillation/clamped_fraction"] = (parts["clamped"] & rows).sum().to(losses.dtype) / n.clamp_min(1)
    return loss, metrics
