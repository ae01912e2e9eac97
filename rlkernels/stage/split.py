"""A batch split over data-parallel (`dp_group`) and context-parallel (`cp_group`) ranks.

The per-sequence stage reads three kinds of batch-wide values, and each is made whole at one point,
with one collective per group that needs it:

    per-sequence sums and maxima   (log-ratio sums, lengths, k-statistics)   across cp_group
    batch normalisers              (|m|, |m'|, non-empty sequences, K, IS-weight means)   across dp_group
    metrics                        (packed partial values, see metrics.py)   across cp_group, then dp_group

A context-parallel rank's sequences are whole after the first combine, so its normalisers need no
collective; a data-parallel rank's sequences are whole from the start, so it needs no first combine.
Every combine is an `all_gather` of a small float64 vector, merged by every rank in rank order: the
results are bitwise identical on every rank and in every run (an all_reduce would leave the order of
the sum to the communication library). Nothing is read on the host: no synchronisation.

The loss of a data-parallel rank is scaled by the group's size, so that the *mean* of the ranks'
gradients (what DDP and FSDP compute) is the gradient of the loss on the whole batch.
"""

from typing import Dict, NamedTuple, Optional, Tuple

import torch
import torch.distributed as dist

from .metrics import LSE_SEQ, MAX, MIN, MOMENTS, MOMENTS_SEQ, SUM_SEQ, SUM_TOKEN, combine_moments
from .segments import Segments, longest

_REASON = "rlkernels: dp_group / cp_group run torch.distributed collectives outside the compiled graph"


@torch.compiler.disable(reason=_REASON)  # a graph break under torch.compile (an error under fullgraph=True)
def _all_gather(vector: torch.Tensor, group) -> torch.Tensor:
    """[F] on every rank -> [world, F] float64, in rank order."""
    part = vector.detach().to(torch.float64).contiguous()
    parts = [torch.empty_like(part) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, part, group=group)
    return torch.stack(parts)


def _combine_metrics(gathered: torch.Tensor, slots: Dict[int, int], within_context: bool) -> torch.Tensor:
    """gathered: [world, F] packed records (metrics.Metrics.finish's layout) -> [F]. Across a
    context-parallel group the per-sequence records are the same on every rank: taken once."""
    out, start = [], 0
    for kind, width in slots.items():
        part = gathered[:, start:start + width]
        start += width
        if kind == SUM_TOKEN or (kind == SUM_SEQ and not within_context):
            out.append(part.sum(0))
        elif kind in (SUM_SEQ, LSE_SEQ) and within_context:
            out.append(part[0])
        elif kind == LSE_SEQ:
            out.append(torch.logsumexp(part, 0))
        elif kind == MAX:
            out.append(part.amax(0))
        elif kind == MIN:
            out.append(part.amin(0))
        elif kind == MOMENTS_SEQ and within_context:
            out.append(part[0])
        elif kind in (MOMENTS, MOMENTS_SEQ):
            out.append(combine_moments(part.reshape(part.shape[0], -1, 3)).reshape(-1))
    return torch.cat(out)


class BatchSplit:
    def __init__(self, dp_group=None, cp_group=None):
        self.dp_group = dp_group
        self.cp_group = cp_group

    @property
    def combines_metrics(self) -> bool:
        return self.dp_group is not None or self.cp_group is not None

    @property
    def loss_scale(self) -> int:
        return 1 if self.dp_group is None else dist.get_world_size(self.dp_group)

    def combine_sequences(self, sums: torch.Tensor, maxes: Optional[torch.Tensor]
                          ) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        """[S, F] partial sums and [S, G] partial maxima of this rank's tokens -> whole sequences."""
        if self.cp_group is None:
            return sums, maxes
        n_sum = sums.numel()
        flat = sums.reshape(-1) if maxes is None else torch.cat([sums.reshape(-1), maxes.reshape(-1)])
        gathered = _all_gather(flat, self.cp_group)
        whole_sums = gathered[:, :n_sum].sum(0).to(sums.dtype).reshape(sums.shape)
        if maxes is None:
            return whole_sums, None
        return whole_sums, gathered[:, n_sum:].amax(0).to(maxes.dtype).reshape(maxes.shape)

    def combine_normalisers(self, sums: torch.Tensor, maxes: Optional[torch.Tensor]
                            ) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        """Batch counts ([k], summed) and widths ([j], maxed, given with a dp_group) of this rank -> the whole
        batch's."""
        if self.dp_group is None:
            return sums, maxes
        gathered = _all_gather(torch.cat([sums, maxes]), self.dp_group)
        k = sums.numel()
        return gathered[:, :k].sum(0).to(sums.dtype), gathered[:, k:].amax(0).to(maxes.dtype)

    def combine_metrics(self, packed: torch.Tensor, slots: Dict[int, int]) -> torch.Tensor:
        """Packed metric records of this rank -> the whole batch's (see metrics.py)."""
        out = packed
        if self.cp_group is not None:
            out = _combine_metrics(_all_gather(out, self.cp_group), slots, within_context=True)
        if self.dp_group is not None:
            out = _combine_metrics(_all_gather(out, self.dp_group), slots, within_context=False)
        return out.to(packed.dtype)


LOCAL = BatchSplit()


class ContextLayout(NamedTuple):
    segments: Segments  # this rank's tokens as parts of the global sequences
    total: Optional[torch.Tensor]  # 0-d int64: tokens along the split axis on all ranks (None if not needed)


def context_layout(token_shape: Tuple[int, ...], cu_seqlens: Optional[torch.Tensor],
                   token_index: Optional[torch.Tensor], group, device) -> ContextLayout:
    """Where this context-parallel rank's tokens sit in the global sequences.

    The split axis is the packed token axis ([N] tokens, global `cu_seqlens`) or the padded time axis
    ([B, T] tokens: every row split alike). Rank r holds the r-th contiguous slice of it (sizes may
    differ), or the positions `token_index` ([N_r] / [T_r], global, in any order: zigzag layouts).
    The slice offsets and the global length come from one all_gather of each rank's size, done only
    when needed (no token_index, a padded layout, or no cu_seqlens); on the device, no sync."""
    padded = len(token_shape) == 2
    local = token_shape[-1] if padded else token_shape[0]
    total = None
    if token_index is None or padded or cu_seqlens is None:
        sizes = _all_gather(torch.tensor([local], dtype=torch.float64, device=device), group)[:, 0].long()
        total = sizes.sum()
    if token_index is None:
        along = sizes[:dist.get_rank(group)].sum() + torch.arange(local, device=device)
    else:
        along = token_index.to(device=device, dtype=torch.long)
    if padded:
        B = token_shape[0]
        positions = (torch.arange(B, device=device)[:, None] * total + along[None, :]).reshape(-1)
        cu = torch.arange(B + 1, device=device) * total
        return ContextLayout(Segments.at_positions(positions, cu, total, token_index is None), total)
    cu = torch.stack([total.new_zeros(()), total]) if cu_seqlens is None else cu_seqlens.long()
    return ContextLayout(Segments.at_positions(along, cu, longest(cu), token_index is None), total)
