"""Sequences of a batch as plain lists of token indices (SPEC §3), for the loop-based oracle."""

from typing import List, Optional, Tuple

import torch


def sequence_indices(
    token_shape: Tuple[int, ...], cu_seqlens: Optional[torch.Tensor], device
) -> Tuple[List[torch.Tensor], int]:
    """Index tensors into the flattened per-token arrays, one per sequence, and the padded width K.

    Padded [B, T]: sequence b is row b and K = T. Packed [N]: sequence i is
    cu_seqlens[i]:cu_seqlens[i+1] and K is the longest sequence (0 if there is none).
    """
    if len(token_shape) == 2:
        B, T = token_shape
        return [torch.arange(b * T, (b + 1) * T, device=device) for b in range(B)], T
    (N,) = token_shape
    bounds = [0, N] if cu_seqlens is None else [int(x) for x in cu_seqlens.tolist()]
    seqs = [torch.arange(s, e, device=device) for s, e in zip(bounds[:-1], bounds[1:])]
    return seqs, max((e - s for s, e in zip(bounds[:-1], bounds[1:])), default=0)


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of x over mask; 0 over an empty set (SPEC §8)."""
    n = mask.sum()
    if n == 0:
        return torch.zeros((), dtype=torch.float64, device=x.device)
    return torch.where(mask, x, torch.zeros_like(x)).sum() / n


def mean_or_zero(values: List[torch.Tensor], device) -> torch.Tensor:
    if not values:
        return torch.zeros((), dtype=torch.float64, device=device)
    return torch.stack(values).mean()
