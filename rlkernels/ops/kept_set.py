"""Sampler-faithful statistics: a per-token temperature and the rollout's kept token set.

The rollout engine samples token t from softmax(z_t / T_t) restricted to its kept set S_t (top-k,
top-p, min-p), at a temperature that may differ per request. Scoring the same tokens under the full
softmax at one temperature is a different distribution, not noise. Here (docs/spec.md §2, "Sampler
replay"):

    log p_t(y) = z_y / T_t - logsumexp_{k in S_t} z_k / T_t      (S_t = every id without a support)
    H_t = -sum_{k in S_t} p_k log p_k,   sum_{k in S_t} p_k^2

With a support of K << V ids the statistics need only the K kept logits of each row: they are
gathered ([N, K], O(N K) work, never a pass over V) and reduced with ordinary differentiable torch
ops; the gradient reaches the logits through the gather (zero outside S_t). A large kept set (K > V /
GATHER_RATIO) instead masks the other logits to -inf and runs the vocabulary pass (whose -inf
entries have p = 0 and a zero gradient). The fused-linear path computes just those
K logits, from K gathered rows of the head, in chunks of rows. A per-token temperature without a
support runs in the vocabulary passes of every backend, each row scaled by its own 1/T.
"""

from typing import Optional, Tuple

import torch
import torch.nn.functional as F

from ..backends.base import gather_columns, statistics_dtype
from ..backends.temperature import Temperature

PAD = -1  # a support slot without an id


def kept_set_stats(
    kept_logits: torch.Tensor, kept: torch.Tensor, label_slot: torch.Tensor, temperature: Temperature,
    compute_entropy: bool, compute_sum_pi_squared: bool,
) -> Tuple[torch.Tensor, Optional[torch.Tensor], Optional[torch.Tensor]]:
    """Statistics of softmax(z / T) over each row's kept ids.

    kept_logits: [N, K] the logits of the kept ids (any value in padded slots), with autograd;
    kept: [N, K] bool, the slots holding an id; label_slot: [N] int64, the slot of the row's label, or
    -1 for a row outside the loss (its statistics are 0).
    Returns (logprobs, entropy, sum_pi_squared), [N] in float32 (float64 for float64 logits)."""
    acc = statistics_dtype(kept_logits.dtype)
    active = label_slot >= 0
    # -inf is the identity of the log-sum-exp: padded slots carry no mass (and no gradient, below)
    z = torch.where(kept, kept_logits.to(acc), torch.full((), float("-inf"), dtype=acc, device=kept.device))
    # shifted by the row's largest kept logit before the scaling, as the vocabulary passes do
    # (backends.base.RowStats): z - max is exact where it matters, z / T of a logit of 1e4 is not
    shift = z.detach().amax(1, keepdim=True)
    shift = torch.where(torch.isfinite(shift), shift, torch.zeros_like(shift))
    z = (z - shift) * temperature.inverse(acc)
    log_p = torch.log_softmax(torch.where(active[:, None], z, torch.zeros_like(z)), dim=-1)
    zero = torch.zeros((), dtype=acc, device=z.device)
    logprobs = torch.where(active, log_p.gather(1, label_slot.clamp_min(0)[:, None]).squeeze(1), zero)
    entropy = sum_pi_squared = None
    if compute_entropy or compute_sum_pi_squared:
        # a padded slot has p = 0 and log p = -inf: its term is 0, and the -inf must not reach a product
        # (0 * -inf = NaN, forward or backward), so it is replaced before the multiplication
        live = kept & active[:, None] & (log_p > float("-inf"))  # a kept -inf logit has p = 0 too
        safe_log_p = torch.where(live, log_p, zero)
        p = torch.where(live, safe_log_p.exp(), zero)
        if compute_entropy:
            entropy = -(p * safe_log_p).sum(1)
        if compute_sum_pi_squared:
            sum_pi_squared = (p * p).sum(1).detach()
    return logprobs, entropy, sum_pi_squared


def label_slots(support: torch.Tensor, row_labels: torch.Tensor) -> torch.Tensor:
    """[N] the slot of each row's label in its support, -1 where the row is outside the loss (or,
    with validation off, where the label is not kept: such a row is treated as outside the loss)."""
    match = (support == row_labels[:, None]) & (row_labels >= 0)[:, None]
    slot = match.to(torch.int8).argmax(1)
    return torch.where(match.any(1), slot, torch.full_like(slot, -1))


# A kept set larger than V / GATHER_RATIO goes through the vocabulary pass on masked logits instead of
# the gather: past that, K gathered elements per row cost more than one dense pass (on 2 CPU cores at
# N = 2048, V = 32768 the gather path took 23x the full pass at K = V, the masked pass ~3x).
GATHER_RATIO = 16


def gathers(K: int, V: int) -> bool:
    """Whether a kept set of K ids out of V is reduced from its gathered logits (else: masked logits)."""
    return GATHER_RATIO * K <= V


def kept_mask(support: torch.Tensor, V: int) -> torch.Tensor:
    """[N, V] bool: True at the kept ids (padding goes to an extra column, dropped)."""
    ids = torch.where(support >= 0, support, torch.full_like(support, V))
    mask = torch.zeros(support.shape[0], V + 1, dtype=torch.bool, device=support.device)
    return mask.scatter_(1, ids, True)[:, :V]


def logits_kept(rows: torch.Tensor, support: torch.Tensor) -> torch.Tensor:
    """[N, K] the logits of the kept ids, gathered from [N, V] rows or a [B, T, V] causal-shift view (where they
    lie); autograd scatters into zeros of the logits' shape. Padded slots read column 0."""
    return gather_columns(rows, support.clamp_min(0))


def linear_logits_kept(hidden: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                       support: torch.Tensor, budget_bytes: int) -> torch.Tensor:
    """[N, K] logits of the kept ids from hidden states: per chunk of rows, the K rows of the head
    those ids select, gathered ([rows, K, H]: sized by `budget_bytes`) and contracted with the
    hidden states. A V-wide GEMM is never formed; autograd reaches hidden, weight and bias."""
    N, K = support.shape
    H = hidden.shape[1]
    ids = support.clamp_min(0)
    per_row = max(K * H * weight.element_size(), 1)
    step = max(1, budget_bytes // per_row)
    parts = []
    with torch.autocast(hidden.device.type, enabled=False):  # as the full head (linear._head): one function
        for s in range(0, N, step):
            rows_w = F.embedding(ids[s:s + step], weight)  # [rows, K, H]
            part = torch.einsum("nh,nkh->nk", hidden[s:s + step], rows_w)
            if bias is not None:
                part = part + F.embedding(ids[s:s + step], bias[:, None]).squeeze(-1)
            parts.append(part)
    if parts:
        return torch.cat(parts)
    # no row in the loss: an empty result that still hangs off the inputs, so that autograd gives them
    # zero gradients (as the vocabulary pass does) instead of refusing a graph without them
    anchor = hidden.sum() + weight.sum() + (bias.sum() if bias is not None else 0)
    return hidden.new_zeros(0, K) + 0 * anchor
