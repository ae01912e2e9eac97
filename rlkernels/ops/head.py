"""Head-id statistics: the trainer's log-probs at a second set of ids per row (the sampler's top-k, a teacher's
top-k), from the same vocabulary pass that gives the sampled token's log-prob, entropy and sum p^2 (SPEC §9.1).

    log p_j = (z_j - row_max) / T - log_norm          for each id j of the row's head H (k ids, -1 pads)

The forward is the backend's head_stats_fwd (its token_stats pass plus a gather of k logits per row): the head's
log-probs come from the pass's two-part normaliser (backends.base.RowStats), never from a second reduction over
V. The backward takes an [N, k] coefficient matrix C = dLoss/dlog p_H beside the pass's (c, e): its gradient is

    dz_v = ( c 1[v = y] + sum_j C_j 1[v = h_j] - (c + sum_j C_j) p_v - e p_v (log p_v + H) ) / T,

the backend's `head_grad_bwd` (the custom op `head_grad`). The CPU kernels form it in their backward loop: the
p term with c + sum_j C_j, then + c at y and + C_j at each id, in float32 before the one rounding (one pass, no
torch op around it). The others run their own backward for c + sum_j C_j (every column's -c p term, one pass) and
overwrite the k + 1 columns {y} u H with their exact values, formed in float32 by torch and rounded once (the
target column's 1 - p is never formed from a rounded -c p plus c; backends/torch_backend.py). Duplicate ids in a
row are refused by the input checks: two slots with one id would each carry only their own coefficient.

The fused-linear route (`linear_head_logprobs`) forms only the k + 1 logits it needs, from gathered rows of the
head: log p_j = (z_j - z_y) / T + log p_y, with log p_y from the fused-linear pass (autograd through both).
"""

from typing import NamedTuple, Optional, Tuple

import torch
from torch import Tensor

from .. import backends
from ..backends.base import FOREIGN_TARGET, statistics_dtype
from ..backends.temperature import Temperature
from .kept_set import linear_logits_kept
from .linear import carrying_rows, loss_rows
from .vocab import refuse_double_backward


class HeadStatistics(NamedTuple):
    logprobs: Tensor  # [N] log p_y (0 on rows without a label), with autograd
    entropy: Optional[Tensor]  # [N] with autograd, or None
    sum_pi_squared: Optional[Tensor]  # [N] no autograd, or None
    head_logprobs: Tensor  # [N, k] log p at the head ids, with autograd; -inf at pads and at ids p gives no mass


@torch.library.custom_op("rlkernels::head_stats", mutates_args=())
def head_stats(
    logits: Tensor, labels: Tensor, head_ids: Tensor, temperature: Tensor, compute_entropy: bool,
    compute_sum_pi_squared: bool, backend: str, chunk_rows: int,
) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    # logits: (N, V) or (B, T, V) row-strided; labels: (N,) int64 (-1: outside, FOREIGN_TARGET: no label);
    # head_ids: (N, k) int64, -1 pads
    stats, head = backends.select(backend, logits, chunk_rows or None).head_stats_fwd(
        logits, labels, head_ids, Temperature(temperature), compute_entropy, compute_sum_pi_squared)
    absent = lambda x: stats.logprobs.new_empty(0) if x is None else x  # noqa: E731 (outputs may not alias)
    return stats.row_max, stats.log_norm, stats.logprobs, absent(stats.entropy), absent(stats.sum_pi_squared), head


@head_stats.register_fake
def _(logits, labels, head_ids, temperature, compute_entropy, compute_sum_pi_squared, backend, chunk_rows):
    N = labels.shape[0]
    new = lambda *n: logits.new_empty(*n, dtype=statistics_dtype(logits.dtype))  # noqa: E731
    return (new(N), new(N), new(N), new(N if compute_entropy else 0), new(N if compute_sum_pi_squared else 0),
            new(N, head_ids.shape[1]))


def _setup_context(ctx, inputs, output):
    logits, labels, head_ids, temperature, _, _, backend, chunk_rows = inputs
    row_max, log_norm, logprobs, entropy, s2, head = output
    ctx.save_for_backward(logits, labels, head_ids, row_max, log_norm, logprobs, entropy, head, temperature)
    ctx.options = (backend, chunk_rows)
    ctx.mark_non_differentiable(row_max, log_norm, s2)
    # the outputs nobody differentiates (the normaliser, sum p^2, an entropy without a coefficient) arrive as None,
    # not as [N] zeros autograd would fill for them: four launches per backward saved, and the backward skips them
    ctx.set_materialize_grads(False)


def _backward(ctx, _g_row_max, _g_log_norm, grad_logprobs, grad_entropy, _g_sum_pi_squared, grad_head):
    refuse_double_backward()
    logits, labels, head_ids, row_max, log_norm, logprobs, entropy, head, temperature = ctx.saved_tensors
    backend, chunk_rows = ctx.options
    V = logits.shape[-1]
    acc = row_max.dtype
    labelled = (labels >= 0) & (labels < V)  # log p_y of a row without a label is the constant 0
    active = labelled | (labels == FOREIGN_TARGET)
    zero = torch.zeros((), dtype=acc, device=row_max.device)
    c = torch.zeros_like(row_max) if grad_logprobs is None else torch.where(labelled, grad_logprobs.to(acc), zero)
    # a pad, a row outside, or an id without mass (log p = -inf: p = 0, no derivative to pass on) carries none
    C = zero.expand(head.shape) if grad_head is None else torch.where(
        (head_ids >= 0) & active[:, None] & (head > float("-inf")), grad_head.to(acc), zero)
    use_entropy = grad_entropy is not None and entropy.numel() > 0
    e = torch.where(active, grad_entropy.to(acc), zero) if use_entropy else row_max.new_empty(0)
    dlogits = head_grad(logits, labels, head_ids, row_max, log_norm, entropy, logprobs, head, c, C.contiguous(), e,
                        temperature, backend, chunk_rows)
    return dlogits, None, None, None, None, None, None, None


@torch.library.custom_op("rlkernels::head_grad", mutates_args=())
def head_grad(
    logits: Tensor, labels: Tensor, head_ids: Tensor, row_max: Tensor, log_norm: Tensor, entropy: Tensor,
    logprobs: Tensor, head: Tensor, coef_logprob: Tensor, coef_head: Tensor, coef_entropy: Tensor,
    temperature: Tensor, backend: str, chunk_rows: int,
) -> Tensor:
    """dlogits of the pass with head ids for the coefficients (c [N], C [N, k], e [N] or empty: none), the backend's
    head_grad_bwd (its kernel's epilogue where it has one, else the plain backward and the k + 1 columns written
    by torch: backends/torch_backend.py)."""
    has_entropy = coef_entropy.numel() > 0
    return backends.select(backend, logits, chunk_rows or None).head_grad_bwd(
        logits, labels, head_ids, row_max, log_norm, entropy if has_entropy else None, logprobs, head, coef_logprob,
        coef_head, coef_entropy if has_entropy else None, Temperature(temperature))


@head_grad.register_fake
def _(logits, labels, head_ids, row_max, log_norm, entropy, logprobs, head, coef_logprob, coef_head, coef_entropy,
      temperature, backend, chunk_rows):
    return torch.empty_like(logits, memory_format=torch.contiguous_format)


head_stats.register_autograd(_backward, setup_context=_setup_context)


def head_token_stats(logits: Tensor, labels: Tensor, head_ids: Tensor, temperature: Temperature, entropy: bool,
                     sum_pi_squared: bool, backend: str, chunk_rows: int = 0) -> HeadStatistics:
    """The vocabulary pass with head ids: logits [N, V] or [B, T, V] (logit_rows), labels [N] (-1 outside the
    loss; FOREIGN_TARGET for rows with statistics but no label), head_ids [N, k] (-1 pads),
    a Temperature. `backend` is resolved."""
    out = head_stats(logits, labels, head_ids, temperature.tensor, entropy, sum_pi_squared, backend, chunk_rows)
    _, _, lp, ent, s2, head = out
    return HeadStatistics(lp, ent if entropy else None, s2 if sum_pi_squared else None, head)


class HeadRows(NamedTuple):
    """The rows a fused-linear head pass reads: their labels (-1 outside the loss), head ids and log p_y."""
    labels: Tensor  # [N] int64
    head_ids: Tensor  # [N, k] int64, -1 pads
    logprobs: Tensor  # [N] log p_y from the fused-linear pass (autograd through it)


def linear_head_logprobs(hidden: Tensor, weight: Tensor, bias: Optional[Tensor], rows_in: HeadRows,
                         temperature: Temperature, budget_bytes: int, select_rows: bool = True) -> Tensor:
    """[N, k] log p at the head ids of logits = hidden @ weight.T + bias, for rows with a label (labels >= 0;
    the others 0): (z_j - z_y) / T + log p_y, with log p_y ([N], autograd) from the fused-linear pass and the
    k + 1 logits from gathered rows of the head (kept_set.linear_logits_kept: no V-wide product). The rows with a
    label cost one host synchronisation, as the fused-linear pass's own row selection (select_rows=False: every
    row, no sync; linear.loss_rows)."""
    labels, head_ids, logprobs = rows_in
    N, k = head_ids.shape
    acc = statistics_dtype(hidden.dtype)
    labelled = labels >= 0
    rows = loss_rows(labelled, select_rows)
    if not select_rows:  # every row: those without a label carry nothing, NaN hidden states included
        hidden = carrying_rows(hidden, labelled)
    ids = torch.cat([head_ids.index_select(0, rows), labels.index_select(0, rows)[:, None]], 1)
    z = linear_logits_kept(hidden.index_select(0, rows), weight, bias, ids.clamp_min(0), budget_bytes).to(acc)
    inv_t = temperature.rows(rows).inverse(acc)
    lp = (z[:, :k] - z[:, k:]) * inv_t + logprobs.index_select(0, rows)[:, None].to(acc)
    minus_inf = torch.full((), float("-inf"), dtype=acc, device=hidden.device)
    lp = torch.where((ids[:, :k] >= 0) & (z[:, :k] > float("-inf")), lp, minus_inf)
    if not select_rows:  # every row: the rows without a label are 0, as when skipped
        return torch.where(labelled[:, None], lp, torch.zeros((), dtype=acc, device=hidden.device))
    return torch.zeros(N, k, dtype=acc, device=hidden.device).index_copy(0, rows, lp)
