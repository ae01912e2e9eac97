"""What a backend implements: the only two passes that touch the [N, V] logits (SPEC §2).

Conventions shared by every backend (and checked by tests/backends against the reference):
- `logits` is [N, V] with unit stride along V and any row stride; any float dtype.
- `labels` is [N] int64 with -1 on rows that take no part in the loss. Such rows (and rows whose
  label is outside [0, V)) are skipped: their statistics are 0 and their gradient row is 0, and
  their logits are never read.
- Statistics are float32 (float64 for float64 logits, which only the torch backend accepts).
"""

from typing import NamedTuple, Optional, Protocol

import torch


class RowStats(NamedTuple):
    lse: torch.Tensor  # [N] log-sum-exp of logits / T (saved for backward)
    logprobs: torch.Tensor  # [N]
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
        self, logits: torch.Tensor, labels: torch.Tensor, lse: torch.Tensor, entropy: Optional[torch.Tensor],
        coef_logprob: torch.Tensor, coef_entropy: Optional[torch.Tensor], temperature: float, inplace: bool,
    ) -> torch.Tensor:
        """dlogits = (c*(onehot - p) + e*(-p*(log p + H))) / T in the logits dtype; one read, one write.

        With `inplace` the result may be written into the logits' storage (the caller bumps the
        version counter)."""
