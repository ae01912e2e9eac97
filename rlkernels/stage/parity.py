"""The log-prob parity report (`rlkernels.logprob_parity`): trainer against rollout log-probs, bit for bit, on the
response tokens. Every value stays on the device; nothing here reads one back."""

import math
from typing import Dict, NamedTuple, Optional, Tuple

import torch


class ParityRows(NamedTuple):
    """What inputs/parity.py hands over: the flat tokens and their layout."""
    trainer: torch.Tensor  # [N], as given (the bits are what is compared)
    rollout: torch.Tensor  # [N]
    mask: torch.Tensor  # [N] bool: response tokens
    row: Optional[torch.Tensor]  # [N] sequence of each token (packed), None for a padded batch
    position: Optional[torch.Tensor]  # [N] position in its sequence (packed)
    num_rows: int
    width: Optional[int]  # T of a padded batch
    edges: Tuple[float, ...]  # K + 1 probabilities from 0 to 1 (host floats: they name the buckets' metrics)

_BITS = {torch.float64: torch.int64, torch.float32: torch.int32, torch.bfloat16: torch.int16,
         torch.float16: torch.int16}


def _label(edges, k: int) -> str:
    close = "]" if k == len(edges) - 2 else ")"
    return f"p[{edges[k]:g},{edges[k + 1]:g}{close}"


def logprob_parity(rows: ParityRows) -> Tuple:
    """The fields of outputs.LogprobParity, in its order."""
    mask = rows.mask
    bits = _BITS[rows.trainer.dtype]
    # the bit patterns: -0.0 and 0.0 differ, and a NaN matches only the same NaN
    differs = (rows.trainer.view(bits) != rows.rollout.view(bits)) & mask
    tokens = mask.sum()
    matched = tokens - differs.sum()
    # |difference| where the bits differ, 0 where they match (two -inf log-probs agree; their difference is NaN)
    gap = torch.where(differs, (rows.trainer.double() - rows.rollout.double()).abs(), 0.0)

    # the first differing position of each sequence, -1 where none differs
    if rows.row is None:  # a padded [B, T] batch: positions are its columns
        per_row = differs.view(rows.num_rows, rows.width)
        first = torch.where(per_row.any(1), per_row.int().argmax(1), -1).long() if rows.width else \
            torch.full((rows.num_rows,), -1, dtype=torch.long, device=mask.device)
        responding = mask.view(rows.num_rows, rows.width).any(1)
    else:
        never = torch.iinfo(torch.int64).max
        first = torch.full((rows.num_rows,), never, dtype=torch.long, device=mask.device)
        first = first.scatter_reduce(0, rows.row, rows.position.masked_fill(~differs, never), "amin")
        first = first.masked_fill(first == never, -1)
        responding = torch.zeros(rows.num_rows, dtype=torch.bool, device=mask.device).index_put_(
            (rows.row,), mask, accumulate=True)

    # buckets of the rollout probability; p = 1 falls in the last one
    K = len(rows.edges) - 1
    edges = torch.tensor(rows.edges, dtype=torch.float64, device=mask.device)
    p = rows.rollout.double().exp()
    bucket = (torch.searchsorted(edges, p, right=True) - 1).clamp(0, K - 1)
    bucket = bucket.masked_fill(~mask, K)  # off the response: a spare bucket, dropped
    count = torch.zeros(K + 1, dtype=torch.long, device=mask.device).index_add_(0, bucket, torch.ones_like(bucket))
    total = torch.zeros(K + 1, dtype=torch.float64, device=mask.device).index_add_(0, bucket, gap)
    worst = torch.zeros(K + 1, dtype=torch.float64, device=mask.device).scatter_reduce(0, bucket, gap, "amax")
    count, total, worst = count[:K], total[:K], worst[:K]
    # a statistic of nothing is NaN ("none compared"), never a 0 that reads as "no gap"
    mean = torch.where(count > 0, total / count.clamp(min=1), math.nan)
    worst = torch.where(count > 0, worst, math.nan)

    # a fraction of nothing is NaN, not 0: "none compared" must not read as "none matched"
    match_rate = torch.where(tokens > 0, matched.double() / tokens.clamp(min=1), math.nan)
    sequences = responding.sum()
    metrics: Dict[str, torch.Tensor] = {
        "logprob_parity/tokens": tokens.double(),
        "logprob_parity/match_rate": match_rate,
        "logprob_parity/mean_abs_diff": torch.where(tokens > 0, gap.sum() / tokens.clamp(min=1), math.nan),
        "logprob_parity/max_abs_diff": torch.where(tokens > 0, gap.max(), math.nan) if gap.numel() else
        gap.new_full((), math.nan),
        # of the sequences with a response token (the same whatever the layout)
        "logprob_parity/diverged_sequence_fraction": torch.where(
            sequences > 0, (first >= 0).sum().double() / sequences.clamp(min=1), math.nan),
    }
    for k in range(K):
        name = f"logprob_parity/{_label(rows.edges, k)}"
        metrics[f"{name}/tokens"] = count[k].double()
        metrics[f"{name}/mean_abs_diff"] = mean[k]
        metrics[f"{name}/max_abs_diff"] = worst[k]
    return match_rate, matched, tokens, first, edges, count, mean, worst, metrics
