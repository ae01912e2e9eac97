"""Vocabulary-parallel token statistics (`tp_group=`): logits split over the vocabulary across ranks.

Rank r holds logits [..., V_r] for the vocabulary ids [o_r, o_r + V_r), contiguous in rank order (the
Megatron layout; shard sizes may differ). Labels are global ids. Every rank gets identical per-token
statistics, so the per-sequence stage, the loss and the metrics are identical on every rank; each
rank's gradient is its own slice of dlogits.

Forward, one collective: every rank computes its shard's statistics with the backend (a row whose
target is elsewhere carries the FOREIGN_TARGET label: statistics without a logprob), then one
all_gather of six numbers per row -- (row max, log-normaliser, the owner's logprob, owner flag,
entropy, sum p^2) -- and every rank merges them in rank order, in float64, so the results are
bitwise identical on every rank and every run:

    M = max_r m_r,  a_r = (m_r - M) / T + ln_r,  LN = logsumexp_r a_r    (lse = M / T + LN, two parts)
    logprob = lp_owner + ln_owner + (m_owner - M) / T - LN
    w_r = exp(a_r - LN),  H = sum_r w_r (H_r - (a_r - LN)),  sum p^2 = sum_r w_r^2 s2_r

Backward, no collective: each rank runs the backend's backward on its shard with the global
normaliser, written for its own shift: log p = (z - m_r) / T - ((M - m_r) / T + LN).

The shard offsets are found with one all_gather the first time a (group, V_r) pair is seen, and
cached. Mapping of vocabulary ids and the statistics are in SPEC §2.2.
"""

from typing import Dict, Optional, Tuple

import torch
import torch.distributed as dist

from .. import backends
from ..backends.base import FOREIGN_TARGET, RowStats
from ..backends.temperature import Temperature
from . import linear
from .vocab import refuse_double_backward

_SHARDS: Dict[Tuple[int, int, str], Tuple[int, int]] = {}


def shard_offset(group, local_vocab: int, device: torch.device) -> Tuple[int, int]:
    """(offset of this rank's shard, total vocabulary) of `group`; one all_gather the first time."""
    key = (id(group), local_vocab, device.type)
    if key not in _SHARDS:
        world = dist.get_world_size(group)
        mine = torch.tensor([local_vocab], dtype=torch.int64, device=device)
        sizes = [torch.empty_like(mine) for _ in range(world)]
        dist.all_gather(sizes, mine, group=group)
        sizes = [int(s) for s in sizes]
        rank = dist.get_rank(group)
        _SHARDS[key] = (sum(sizes[:rank]), sum(sizes))
    return _SHARDS[key]


def shard_labels(labels: torch.Tensor, offset: int, local_vocab: int) -> torch.Tensor:
    """Global row labels (-1 = skipped) -> this shard's: the local id, or FOREIGN_TARGET."""
    local = labels - offset
    mine = (labels >= 0) & (local >= 0) & (local < local_vocab)
    return torch.where(labels < 0, labels, torch.where(mine, local, torch.full_like(labels, FOREIGN_TARGET)))


def _local_labels(row_labels: torch.Tensor, local_vocab: int, group, device) -> torch.Tensor:
    """This rank's row labels: its shard's ids, FOREIGN_TARGET, or -1 (skipped)."""
    offset, _ = shard_offset(group, local_vocab, device)
    return shard_labels(row_labels, offset, local_vocab)


def _coefficients(row_max, grad_logprobs, grad_entropy, compute_entropy: bool):
    """The backward's per-row (c, e) in the statistics' dtype; e is None without an entropy gradient."""
    c = torch.zeros_like(row_max) if grad_logprobs is None else grad_logprobs.to(row_max.dtype)
    e = grad_entropy.to(row_max.dtype) if (compute_entropy and grad_entropy is not None) else None
    return c, e


def _merge(parts: torch.Tensor, temperature: float):
    """parts: [world, 6, N] float64 in rank order -> the global statistics and, per rank, the
    normaliser its backward uses (relative to its own row max)."""
    m, ln, lp, owner, ent, s2 = parts.unbind(1)  # each [world, N]
    has_mass = torch.isfinite(ln) & (ln > float("-inf"))
    m = torch.where(has_mass, m, torch.full_like(m, float("-inf")))
    M = m.amax(0)
    M_safe = torch.where(torch.isfinite(M), M, torch.zeros_like(M))
    a = torch.where(has_mass, (m - M_safe) / temperature + ln, torch.full_like(ln, float("-inf")))
    LN = torch.logsumexp(a, 0)
    finite = torch.isfinite(LN)
    LN_safe = torch.where(finite, LN, torch.zeros_like(LN))
    w = torch.where(has_mass, torch.exp(a - LN_safe), torch.zeros_like(a))
    owned = owner > 0
    # the owner's logprob relative to the global normaliser; an owner shard without a finite logit
    # means the target's logit is -inf
    own = torch.where(has_mass, lp + ln + (m - M_safe) / temperature, torch.full_like(lp, float("-inf")))
    lp_owner = torch.where(owned, own, torch.zeros_like(lp)).sum(0)
    logprob = torch.where(finite, lp_owner - LN_safe, torch.full_like(LN, float("-inf")))
    entropy = torch.where(w > 0, w * (ent - (a - LN_safe)), torch.zeros_like(w)).sum(0)
    sum_pi_squared = (w * w * s2).sum(0)
    # a shard holding a NaN or +inf logit has a NaN normaliser: the row's statistics are NaN, as on one rank
    # (has_mass above would drop that shard's mass without a trace)
    poisoned = torch.isnan(ln).any(0)
    nan = torch.full_like(logprob, float("nan"))
    logprob, entropy, sum_pi_squared = (torch.where(poisoned, nan, t) for t in (logprob, entropy, sum_pi_squared))
    # rank r's backward normaliser for its own shift m_r (the kernel's row_max, 0 without mass)
    backward_log_norm = torch.where(finite, (M_safe - torch.where(has_mass, m, torch.zeros_like(m))) / temperature
                                    + LN_safe, torch.full_like(m, float("-inf")))
    return logprob, entropy, sum_pi_squared, backward_log_norm


def _gather_and_merge(stats, local: torch.Tensor, temperature: float, group):
    """This shard's statistics -> the global ones (one all_gather) and this rank's backward normaliser."""
    dt = stats.logprobs.dtype
    zeros = torch.zeros_like(stats.logprobs)
    active = local != -1
    ln = torch.where(active, stats.log_norm, torch.full_like(zeros, float("-inf")))
    part = torch.stack([stats.row_max, ln, stats.logprobs, (local >= 0).to(dt),
                        zeros if stats.entropy is None else stats.entropy,
                        zeros if stats.sum_pi_squared is None else stats.sum_pi_squared]).double()
    gathered = [torch.empty_like(part) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, part.contiguous(), group=group)  # the forward's one collective
    logprob, entropy, sum_pi_squared, bw_log_norm = _merge(torch.stack(gathered), temperature)
    skip = lambda t: torch.where(active, t, torch.zeros_like(t)).to(dt)  # noqa: E731
    return skip(logprob), skip(entropy), skip(sum_pi_squared), skip(bw_log_norm[dist.get_rank(group)])


class VocabParallelTokenStats(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, row_labels, temperature: Temperature, compute_entropy: bool,
                compute_sum_pi_squared: bool, backend_name: str, chunk_rows: Optional[int], group):
        # logits: (N, V_r) or (B, T, V_r) this rank's shard; row_labels: (N,) global ids, -1 skipped
        backend = backends.select(backend_name, logits, chunk_rows, vocab_shard=True)
        local = _local_labels(row_labels, logits.shape[-1], group, logits.device)
        # the entropy is needed to merge it, and the backward needs the merged one
        stats = backend.token_stats_fwd(logits, local, temperature, compute_entropy, compute_sum_pi_squared)
        logprob, entropy, sum_pi_squared, bw_log_norm = _gather_and_merge(stats, local, temperature.value(), group)
        ctx.save_for_backward(logits, local, stats.row_max, bw_log_norm, entropy)
        ctx.options = (temperature, backend_name, chunk_rows, compute_entropy)
        ctx.mark_non_differentiable(sum_pi_squared)
        return logprob, entropy if compute_entropy else None, sum_pi_squared if compute_sum_pi_squared else None

    @staticmethod
    def backward(ctx, grad_logprobs, grad_entropy, _grad_sum_pi_squared):
        refuse_double_backward()
        logits, local, row_max, log_norm, entropy = ctx.saved_tensors
        temperature, backend_name, chunk_rows, compute_entropy = ctx.options
        backend = backends.select(backend_name, logits, chunk_rows, vocab_shard=True)
        c, e = _coefficients(row_max, grad_logprobs, grad_entropy, compute_entropy)
        dlogits = backend.token_grad_bwd(logits, local, row_max, log_norm, None if e is None else entropy, c, e,
                                         temperature, False)
        return dlogits, None, None, None, None, None, None, None


class VocabParallelLinearTokenStats(torch.autograd.Function):
    """The fused-linear form: this rank holds weight rows [o_r, o_r + V_r) (and that slice of the bias).
    Forward as above; the backward's partial d_hidden (each shard's G_r @ W_r) is summed over the group
    with one all_reduce; d_weight and d_bias are this rank's slices."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, row_labels, temperature: Temperature, compute_entropy: bool,
                compute_sum_pi_squared: bool, backend_name: str, chunk_rows: int, group, select_rows: bool = True):
        local = _local_labels(row_labels, weight.shape[0], group, hidden.device)
        T = temperature.tensor
        head = linear.HeadOptions(backend_name, chunk_rows, vocab_shard=True, select_rows=select_rows)
        stats = RowStats(*linear.linear_token_stats(hidden, weight, bias, local, T, compute_entropy,
                                                    compute_sum_pi_squared, **head.op_kwargs()))
        stats = stats._replace(entropy=stats.entropy if compute_entropy else None,
                               sum_pi_squared=stats.sum_pi_squared if compute_sum_pi_squared else None)
        logprob, entropy, sum_pi_squared, bw_log_norm = _gather_and_merge(stats, local, temperature.value(), group)
        ctx.save_for_backward(hidden, weight, bias, local, stats.row_max, bw_log_norm, entropy, T)
        ctx.options = (head, compute_entropy, group)
        ctx.mark_non_differentiable(sum_pi_squared)
        return logprob, entropy if compute_entropy else None, sum_pi_squared if compute_sum_pi_squared else None

    @staticmethod
    def backward(ctx, grad_logprobs, grad_entropy, _grad_sum_pi_squared):
        refuse_double_backward()
        hidden, weight, bias, local, row_max, log_norm, entropy, T = ctx.saved_tensors
        head, compute_entropy, group = ctx.options
        c, e = _coefficients(row_max, grad_logprobs, grad_entropy, compute_entropy)
        use_entropy = e is not None
        e = e if use_entropy else row_max.new_empty(0)  # the op takes an empty tensor for "none"
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        d_hidden, d_weight, d_bias = linear.linear_token_grad(
            hidden, weight, bias, local, row_max, log_norm, entropy if use_entropy else row_max.new_empty(0), c, e,
            T, need_hidden=True, need_weight=need_w, need_bias=need_b and bias is not None, **head.op_kwargs())
        dist.all_reduce(d_hidden, group=group)  # the backward's one collective: sum of the shards' G_r @ W_r
        return (d_hidden if need_h else None, d_weight if need_w else None,
                d_bias if (need_b and bias is not None) else None, None, None, None, None, None, None, None, None)


# Collectives inside: a graph break under torch.compile, and under fullgraph=True an error that says so.
_REASON = "rlkernels: tp_group runs torch.distributed collectives outside the compiled graph"
vocab_parallel_token_stats = torch.compiler.disable(VocabParallelTokenStats.apply, reason=_REASON)
vocab_parallel_linear_token_stats = torch.compiler.disable(VocabParallelLinearTokenStats.apply, reason=_REASON)
