"""What a backend implements: the only two passes that touch the [N, V] logits (SPEC §2).

Conventions shared by every backend (and checked by tests/backends against the reference):
- `logits` is [N, V], or [B, T, V] standing for N = B*T rows, with unit stride along V and any other
  strides: the causal-shift view `model_out[:, :-1, :]` is read where it lies, never copied.
- `labels` is [N] int64 with -1 on rows that take no part in the loss. Such rows (and rows whose
  label is outside [0, V)) are skipped: their statistics are 0 and their gradient row is 0. The
  Triton and CUDA kernels never read their logits; the torch backend computes whole chunks and
  selects those rows away.
- `FOREIGN_TARGET` (-2) marks a row whose target lies in another vocabulary shard (tensor
  parallelism, rlkernels.distributed): its row_max, log_norm, entropy and sum p^2 are computed, its
  logprob is 0, and its gradient is that of a row without the target column. Every backend
  supports it.
- Statistics are float32 (float64 for float64 logits, which only the torch backend accepts).
"""

from typing import List, NamedTuple, Optional, Protocol, Tuple

import torch

FOREIGN_TARGET = -2


def statistics_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype of every per-token statistic for inputs of `dtype`: float32, or float64 for float64
    inputs (only the torch backend and the oracle see those)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def inverse_temperature(temperature, acc: torch.dtype):
    """1/T for the torch code paths: a float for one temperature, an [N, 1] tensor in `acc` for a per-row
    ([N]) one."""
    if isinstance(temperature, torch.Tensor):
        return (1.0 / temperature.to(acc)).reshape(-1, 1)
    return 1.0 / temperature


def rows_form_one_sequence(logits: torch.Tensor) -> bool:
    """Whether the rows of [N, V] or [B, T, V] logits are one strided sequence, i.e. view(-1, V)
    works without a copy. Decided from the strides: a view() tried inside try/except does not trace
    under torch.compile."""
    if logits.dim() == 2:
        return True
    B, T, _ = logits.shape
    return B <= 1 or T <= 1 or logits.stride(0) == T * logits.stride(1)


def row_groups(logits: torch.Tensor) -> List[Tuple[int, torch.Tensor]]:
    """(first flat row, 2-D row-strided view) pieces that cover [N, V] or [B, T, V] logits without a
    copy: one piece when the rows form a single strided sequence, else one per batch row."""
    if rows_form_one_sequence(logits):
        return [(0, logits.view(-1, logits.shape[-1]))]
    T = logits.shape[1]
    return [(b * T, logits[b]) for b in range(logits.shape[0])]


def paired_row_groups(
    logits: torch.Tensor, out: torch.Tensor
) -> List[Tuple[int, torch.Tensor, torch.Tensor]]:
    """row_groups(logits), each piece with the rows of `out` (shaped like logits: the gradient, or
    the logits themselves for an in-place backward) that it writes."""
    out_groups = row_groups(out)
    pieces = []
    for i, (start, rows) in enumerate(row_groups(logits)):
        out_start, out_rows = out_groups[0] if len(out_groups) == 1 else out_groups[i]
        pieces.append((start, rows, out_rows[start - out_start:start - out_start + rows.shape[0]]))
    return pieces


def num_rows(logits: torch.Tensor) -> int:
    return logits.numel() // logits.shape[-1] if logits.shape[-1] else 0


class RowStats(NamedTuple):
    # The log-normaliser is kept as two parts, lse = row_max / T + log_norm, and never summed into
    # one float32: at logits ~1e4 a float32 lse carries an absolute error of 2^-24 * 1e4 ~ 6e-4,
    # which would become a 6e-4 relative error in every p of the backward. In two parts,
    # z - row_max is exact for the entries that matter (Sterbenz) and is scaled by 1/T only after
    # the subtraction, and log_norm lies in [0, log V].
    row_max: torch.Tensor  # [N] max_v z_v, unscaled (0 for skipped rows and rows without a finite entry)
    log_norm: torch.Tensor  # [N] log sum_v exp((z_v - row_max) / T)
    logprobs: torch.Tensor  # [N] (z_y - row_max) / T - log_norm
    entropy: Optional[torch.Tensor]  # [N] or None
    sum_pi_squared: Optional[torch.Tensor]  # [N] or None


class Backend(Protocol):
    name: str

    def supports(self, logits: torch.Tensor) -> bool:
        """Whether this backend can run on these logits (device, dtype)."""

    def token_stats_fwd(
        self, logits: torch.Tensor, labels: torch.Tensor, temperature: float, compute_entropy: bool,
        compute_sum_pi_squared: bool,
    ) -> RowStats:
        """One read of the logits: lse, logprob, and on request entropy and sum p^2 per row."""

    def token_grad_bwd(
        self, logits: torch.Tensor, labels: torch.Tensor, row_max: torch.Tensor, log_norm: torch.Tensor,
        entropy: Optional[torch.Tensor],
        coef_logprob: torch.Tensor, coef_entropy: Optional[torch.Tensor], temperature: float, inplace: bool,
    ) -> torch.Tensor:
        """dlogits = (c*(onehot - p) + e*(-p*(log p + H))) / T in the logits dtype; one read, one write.

        log p = (z - row_max) / T - log_norm, formed in that order (see RowStats).

        With `inplace` the result may be written into the logits' storage (the caller bumps the
        version counter)."""
