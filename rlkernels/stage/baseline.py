"""The optimal token baseline (OTB) and the variance proxies (SPEC §10), as segmented tensor code.

No Python loop over groups or rows and no host synchronisation: groups, positions and the zero-tail rule
are sorts, prefix sums and segmented reductions, so the cost is the same for 8 groups or 8,000 and the
function compiles with torch.compile(fullgraph=True, dynamic=True).

The tokens arrive flat ([N], one row after another: a padded [B, T] batch flattened, or packed sequences),
with each token's row and its position in the row. A padded batch (verl's layout) stays a [B, T] matrix:
its rows are sorted by group (a stable sort of B ids) and one `segment_reduce` along the rows gives every
group's per-position sums, at the cost of a few passes over the batch. Packed sequences have no common
width to align them without a host sync, so their tokens are sorted by (group, position) and reduced as one
segmented sum over the token axis. Both sum in a fixed order (bitwise reproducible). The padded path sums in
the inputs' precision (float32 at least), as verl does; the packed path sums along rows in float64, as its
prefix sums run over the whole token axis, whose totals float32 could not resolve to a row's few tokens.
"""

from typing import NamedTuple, Optional, Union

import torch
from torch import Tensor


class TokenRows(NamedTuple):
    """A batch's tokens, flat and in row order, with the structure OTB reads."""
    rewards: Tensor  # [N] token-level rewards
    mask: Tensor  # [N] bool, the response mask
    old_logprobs: Tensor  # [N] log-probs of the sampled tokens under pi_old
    sum_pi_squared: Tensor  # [N] sum_v pi_old(v)^2 at each position (temperature-scaled, as the sampler drew)
    is_weights: Optional[Tensor]  # [N] the applied IS weights, or None
    row: Optional[Tensor]  # [N] int64 row (sequence) of each packed token, non-decreasing; None when padded
    position: Optional[Tensor]  # [N] int64 position of each packed token in its row; None when padded
    row_group: Tensor  # [R] int64 prompt group of each row (any integers)
    padded_width: Optional[int]  # T when the rows are a flattened [R, T] batch, None when packed


class BaselineOutput(NamedTuple):
    advantages: Tensor  # [N] (G - B) * m
    returns: Tensor  # [N] G, the masked reward-to-go


def _row_starts(row: Tensor, num_rows: int) -> Tensor:
    """[R + 1] the first token of each row (rows are non-decreasing along the token axis)."""
    return torch.searchsorted(row, torch.arange(num_rows + 1, device=row.device))


def _row_cumsum(x: Tensor, rows: TokenRows, starts: Tensor) -> Tensor:
    """Inclusive cumulative sum of [N] x (float64) within each (packed) row."""
    total = x.cumsum(0)
    before = torch.cat([total.new_zeros(1), total])[starts[:-1]]  # the prefix before each row's first token
    return total - before.index_select(0, rows.row)


def _segment_sum(x: Tensor, offsets: Tensor) -> Tensor:
    """Sums of x's consecutive slices along dim 0 between `offsets` (empty ones 0), in a fixed order. No
    `initial=`: the sum's own identity fills the empty segments, and the CPU kernel runs ~3x faster without it."""
    return torch.segment_reduce(x, "sum", offsets=offsets, axis=0, unsafe=True)


def _row_sum(x: Tensor, rows: TokenRows, starts: Tensor) -> Tensor:
    """[R] sum of [N] x (float64) over each packed row (fixed order)."""
    return _segment_sum(x, starts)


def _dense_groups(row_group: Tensor, member: Tensor) -> Tensor:
    """[R] a dense id per group (0, 1, ... in order of the sorted group values), R for rows that are not members
    of any group (multi-turn: empty rows)."""
    R = row_group.numel()
    sentinel = torch.iinfo(torch.int64).max
    keyed = torch.where(member, row_group.long(), torch.full_like(row_group, sentinel, dtype=torch.long))
    ordered, order = torch.sort(keyed, stable=True)
    new = torch.ones_like(ordered, dtype=torch.long)
    new[1:] = (ordered[1:] != ordered[:-1]).long()
    dense_sorted = torch.cumsum(new, 0) - 1
    dense = torch.empty_like(dense_sorted).scatter_(0, order, dense_sorted)
    return torch.where(member, dense, torch.full_like(dense, R))


def _segment_mean_by_key(key: Tensor, numerator: Tensor, denominator: Tensor, eps: float) -> Tensor:
    """Per token, sum(numerator) / (sum(denominator) + eps) over the tokens that share its key."""
    ordered, order = torch.sort(key, stable=True)
    new = torch.ones_like(ordered)
    new[1:] = (ordered[1:] != ordered[:-1]).long()
    segment = torch.cumsum(new, 0) - 1  # dense segment id of each sorted token
    offsets = torch.searchsorted(segment, torch.arange(key.numel() + 1, device=key.device))
    num, den = (_segment_sum(x.index_select(0, order), offsets) for x in (numerator, denominator))
    per_sorted = (num / (den + eps)).index_select(0, segment)
    return torch.empty_like(per_sorted).scatter_(0, order, per_sorted)


class _Groups(NamedTuple):
    dense: Tensor  # [R] group id of each row (R: none)
    size: Tensor  # [R + 1] member rows of each group id
    zero_tail_from: Tensor  # [R] position from which the row's baseline is zeroed (a large value: never)


def _groups(row_group: Tensor, lengths: Tensor, member: Tensor, handle_zero_tail: bool) -> _Groups:
    """Group ids and sizes, and verl's zero-tail rule: when exactly one member has its group's longest length
    L1 and L1 > L2 (the second longest), that row's baseline is 0 from position L2 on."""
    R = row_group.numel()
    dense = _dense_groups(row_group, member)
    ones = member.long()
    size = torch.zeros(R + 1, dtype=torch.long, device=dense.device).index_add_(0, dense, ones)
    never = torch.full((R,), torch.iinfo(torch.int64).max, dtype=torch.long, device=dense.device)
    if not handle_zero_tail:
        return _Groups(dense, size, never)
    lengths = torch.where(member, lengths, torch.full_like(lengths, -1))
    longest = torch.full((R + 1,), -1, dtype=torch.long, device=dense.device).scatter_reduce_(
        0, dense, lengths, "amax", include_self=True)
    at_longest = member & (lengths == longest.index_select(0, dense))
    n_longest = torch.zeros(R + 1, dtype=torch.long, device=dense.device).index_add_(0, dense, at_longest.long())
    others = torch.where(at_longest, torch.full_like(lengths, -1), lengths)
    second = torch.full((R + 1,), -1, dtype=torch.long, device=dense.device).scatter_reduce_(
        0, dense, others, "amax", include_self=True)
    group_longest, group_second = longest.index_select(0, dense), second.index_select(0, dense)
    tail = (at_longest & (n_longest.index_select(0, dense) == 1) & (size.index_select(0, dense) >= 2)
            & (group_longest > group_second))
    return _Groups(dense, size, torch.where(tail, group_second, never))


def _group_sums(x: Tensor, dense: Tensor) -> Tensor:
    """[R + 1, T] sums of [R, T] x's rows by dense group id, each in row order (bitwise reproducible)."""
    R, T = x.shape
    if x.device.type == "cpu" and not torch.compiler.is_compiling():
        # eager on the CPU, index_add_ is a sequential loop over the rows (no atomics: that is CUDA's) and 3-5x
        # faster than segment_reduce, whose CPU kernel strides across the rows; the same sums in the same order
        return x.new_zeros(R + 1, T).index_add_(0, dense, x)
    order = torch.sort(dense, stable=True).indices  # rows sorted by group id (the non-members, id R, last)
    per_id = torch.zeros(R + 1, dtype=torch.long, device=x.device).index_add_(0, dense, torch.ones_like(dense))
    return _segment_sum(x.index_select(0, order), torch.cat([per_id.new_zeros(1), per_id.cumsum(0)]))


def _baseline_weights(rows: TokenRows, dtype: torch.dtype):
    """w_t = 1 - 2 pi_old(y_t) + sum pi^2 (times the squared IS weight), in `dtype`."""
    w = 1 - 2 * torch.exp(rows.old_logprobs.to(dtype)) + rows.sum_pi_squared.to(dtype)
    if rows.is_weights is not None:
        w = w * rows.is_weights.to(dtype) ** 2
    return w


def optimal_token_baseline(rows: TokenRows, multi_turn: bool, handle_zero_tail: bool, eps: float) -> BaselineOutput:
    """OTB advantages and returns (SPEC §10), exactly as verl 0.9.1 computes them.

    multi_turn: verl's TIR-OTB: each row's masked tokens are aligned by their rank among the row's masked
    tokens (the row "compacted"), empty rows belong to no group; else positions are the padded columns."""
    if rows.padded_width is not None:
        return _padded_baseline(rows, multi_turn, handle_zero_tail, eps)
    return _packed_baseline(rows, multi_turn, handle_zero_tail, eps)


def _padded_baseline(rows: TokenRows, multi_turn: bool, handle_zero_tail: bool, eps: float) -> BaselineOutput:
    """[R, T]: per-row prefix sums along T; the groups' per-position sums as one segment_reduce over the rows
    sorted by group."""
    R, T = rows.row_group.numel(), rows.padded_width
    dt = torch.promote_types(rows.rewards.dtype, torch.float32)
    m = rows.mask.view(R, T).to(dt)
    G = (rows.rewards.view(R, T).to(dt) * m).flip(1).cumsum(1).flip(1)  # verl's reverse cumsum, the same rounding
    W = (_baseline_weights(rows, dt).view(R, T) * m).cumsum(1)
    lengths = m.sum(1).long()
    member = lengths > 0 if multi_turn else torch.ones_like(lengths, dtype=torch.bool)
    groups = _groups(rows.row_group, lengths, member, handle_zero_tail)
    den = W * m
    num = G * den
    if multi_turn:  # compact each row: its k-th masked token to column k (off-mask tokens to a spare column T)
        rank = torch.where(m > 0, m.cumsum(1).long() - 1, torch.full_like(lengths, T)[:, None])
        compact = lambda x: x.new_zeros(R, T + 1).scatter_(1, rank, x)[:, :T]  # noqa: E731
        num, den = compact(num), compact(den)
    num, den = _group_sums(num, groups.dense), _group_sums(den, groups.dense)  # [R + 1, T]: id R, the non-members
    baseline = (num / (den + eps)).index_select(0, groups.dense)
    position = torch.arange(T, device=m.device)
    keep = ((groups.size.index_select(0, groups.dense) >= 2)[:, None]
            & (position[None] < groups.zero_tail_from[:, None]))
    baseline = torch.where(keep, baseline, torch.zeros_like(baseline))
    if multi_turn:  # back to each masked token's column
        baseline = baseline.gather(1, rank.clamp_max(T - 1))
    dtype = rows.rewards.dtype
    return BaselineOutput(((G - baseline) * m).reshape(-1).to(dtype), G.reshape(-1).to(dtype))


def _packed_baseline(rows: TokenRows, multi_turn: bool, handle_zero_tail: bool, eps: float) -> BaselineOutput:
    """[N] packed: row sums and prefix sums in float64, the per-(group, position) sums over the tokens sorted by
    that key."""
    R = rows.row_group.numel()
    starts = _row_starts(rows.row, R)
    m = rows.mask.to(torch.float64)
    rm = rows.rewards.double() * m
    G = _row_sum(rm, rows, starts).index_select(0, rows.row) - _row_cumsum(rm, rows, starts) + rm
    W = _row_cumsum(_baseline_weights(rows, torch.float64) * m, rows, starts)
    lengths = torch.round(_row_sum(m, rows, starts)).long()
    member = lengths > 0 if multi_turn else torch.ones_like(lengths, dtype=torch.bool)
    groups = _groups(rows.row_group, lengths, member, handle_zero_tail)
    # multi-turn: the rank of each masked token among its row's (tokens off the mask add zeros wherever they land)
    position = (torch.round(_row_cumsum(m, rows, starts)).long() - 1).clamp_min(0) if multi_turn else rows.position
    # (group, position) of each token; positions are < N, group ids <= R
    key = groups.dense.index_select(0, rows.row) * rows.row.numel() + position
    baseline = _segment_mean_by_key(key, G * W * m, W * m, eps)
    size = groups.size.index_select(0, groups.dense).index_select(0, rows.row)
    keep = (size >= 2) & (position < groups.zero_tail_from.index_select(0, rows.row))
    baseline = torch.where(keep, baseline, torch.zeros_like(baseline))
    dtype = rows.rewards.dtype
    return BaselineOutput(((G - baseline) * m).to(dtype), G.to(dtype))


class VarianceInputs(NamedTuple):
    advantages: Tensor  # [N]
    mask: Tensor  # [N] bool
    old_logprobs: Tensor  # [N]
    sum_pi_squared: Tensor  # [N]
    is_weights: Optional[Tensor]  # [N] or None
    row: Optional[Tensor]  # [N] row of each packed token (non-decreasing); None when padded
    num_rows: int
    padded_width: Optional[int]  # T of a padded [R, T] batch, None when packed


def variance_proxy_metrics(x: VarianceInputs, grad_norm: Union[float, Tensor, None]) -> dict:
    """verl's `compute_variance_proxy_metrics` (its names, its IS convention and clamps) as 0-d tensors.
    `grad_norm`: a float or a 0-d tensor (clip_grad_norm_'s, read without a host sync), or None."""
    dt = torch.float64
    m = x.mask.to(dt)
    starts = None if x.row is None else _row_starts(x.row, x.num_rows)

    def row_sum(v):  # masked, in float64; a padded batch's rows are its [R, T] view's
        v = torch.where(x.mask, v.to(dt), torch.zeros((), dtype=dt, device=m.device)) * m
        return v.view(x.num_rows, x.padded_width).sum(1) if starts is None else _segment_sum(v, starts)

    def row_mean(v):  # verl's masked_mean: / (count + 1e-8)
        return row_sum(v) / (row_sum(torch.ones_like(m)) + 1e-8)

    w = 1 - 2 * torch.exp(x.old_logprobs.to(dt)) + x.sum_pi_squared.to(dt)
    if x.is_weights is not None:
        w = w * x.is_weights.to(dt) ** 2
    a_row = row_mean(x.advantages)
    w_row = row_sum(w)
    if x.is_weights is not None:  # verl's IS convention: the squared mean weight times the unscaled W
        w_original = row_sum(w / torch.clamp(x.is_weights.to(dt) ** 2, min=1e-10)).clamp_min(0.0)
        proxy2 = (row_mean(x.is_weights) ** 2 * a_row ** 2 * w_original).mean()
    else:
        proxy2 = (a_row ** 2 * w_row.clamp_min(0.0)).mean()
    zero = torch.zeros((), dtype=dt, device=m.device)
    if isinstance(grad_norm, Tensor):
        # squared in its own dtype, as verl squares the tensor it is given (clip_grad_norm_'s is float32)
        proxy1 = zero + (grad_norm ** 2).to(device=m.device, dtype=dt)
    else:
        proxy1 = zero if grad_norm is None else zero + grad_norm ** 2
    proxy3 = zero
    if grad_norm is not None and x.num_rows > 1:
        proxy3 = ((proxy2 - proxy1) / (x.num_rows - 1)).clamp_min(0.0)
    out_dtype = x.advantages.dtype if x.advantages.dtype.is_floating_point else torch.float32
    values = {"proxy1_signal_strength": proxy1, "proxy2_total_power": proxy2, "proxy3_pure_noise": proxy3,
              "expected_a_squared": (a_row ** 2).mean(), "expected_w": w_row.mean()}
    if x.num_rows == 0:  # verl's means of nothing are NaN; here 0, as every empty metric (SPEC §8)
        values = {k: zero for k in values}
    return {f"variance_proxy/{k}": v.to(out_dtype) for k, v in values.items()}
