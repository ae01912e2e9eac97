"""What a backend implements: the passes that read the [N, V] logits (SPEC §2, §9), behind one protocol.

Every vocabulary pass of the package goes through `Backend`: the sampled token's statistics and their
gradient, the same with the log-probs at a second set of ids per row (the sampler's top-k, SPEC §9.1), and
the full-form divergences between two logits tensors (SPEC §9.2). The chunked PyTorch backend
(torch_backend.TorchBackend) implements all of them and is the base class of the others, which override the
passes they have kernels for; what a backend does not override runs in its chunked PyTorch form, stated by
the class (backends/__init__ answers which backend runs).

Conventions shared by every backend (and checked by tests/backends against the reference):
- `logits` is [N, V], or [B, T, V] standing for N = B*T rows, with unit stride along V and any other
  strides: the causal-shift view `model_out[:, :-1, :]` is read where it lies, never copied.
- `labels` is [N] int64 with -1 on rows that take no part in the loss. Such rows (and rows whose
  label is outside [0, V)) are skipped: their statistics are 0 and their gradient row is 0. The
  Triton and CUDA kernels never read their logits; the torch backend computes whole chunks and
  selects those rows away.
- `FOREIGN_TARGET` (-2) marks a row whose target lies in another vocabulary shard (tensor
  parallelism, ops/vocab_parallel.py), or a row with no label at all (divergences): its row_max,
  log_norm, entropy and sum p^2 are computed, its logprob is 0, and its gradient is that of a row
  without the target column. Every backend supports it.
- A row holding a NaN or +inf logit has no distribution either: its log_norm, logprob, entropy and sum p^2 are
  NaN in every backend (never the -inf of a row without a finite logit), so that `validate=True` can refuse it
  from the pass's [N] log-probs (inputs.checks.refuse_non_finite_rows) without another read of the logits.
- `temperature` is a `Temperature` (backends/temperature.py); a float or an [N] tensor given instead is
  read as one (`Temperature.of`).
- Statistics are float32 (float64 for float64 logits, which only the torch backend accepts).
"""

from typing import List, NamedTuple, Optional, Protocol, Tuple

import torch

FOREIGN_TARGET = -2


def statistics_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype of every per-token statistic for inputs of `dtype`: float32, or float64 for float64
    inputs (only the torch backend and the oracle see those)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


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


# The full form's statistics per row (SPEC §9.2): the four divergences first, then what a backend keeps for its
# backward (the Triton and C++ kernels: Σ π sign(π - μ) and the two rows' (row max, log-normaliser))
DIVERGENCES = ("kl", "reverse_kl", "chi2", "tv")
DIVERGENCE_STATS = 9


def gather_columns(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """[N, K] logits at the ids [N, K] (in [0, V)) of each row, from [N, V] or [B, T, V] rows, gathered where
    they lie along the vocabulary (autograd scatters into zeros of the logits' shape)."""
    if logits.dim() == 3:
        B, T, _ = logits.shape
        return logits.gather(2, ids.view(B, T, ids.shape[1])).reshape(-1, ids.shape[1])  # (-1: ambiguous at 0 rows)
    return logits.gather(1, ids)


def head_logprobs(logits: torch.Tensor, head_ids: torch.Tensor, stats: RowStats, labels: torch.Tensor,
                  temperature) -> torch.Tensor:
    """[N, k] log p at the head ids (-1 pads) from the pass's two-part normaliser (never a second reduction over
    V): (z_j - row_max) / T - log_norm; -inf at pads and at ids without mass, 0 on rows outside the pass.
    `temperature`: a backends.temperature.Temperature."""
    acc = stats.row_max.dtype
    z = gather_columns(logits, head_ids.clamp_min(0)).to(acc)
    lp = (z - stats.row_max[:, None]) * temperature.inverse(acc) - stats.log_norm[:, None]
    V = logits.shape[-1]
    active = ((labels >= 0) & (labels < V)) | (labels == FOREIGN_TARGET)
    # -inf: no finite logit (no distribution); a NaN normaliser (a NaN or +inf logit) stays NaN in every log-prob
    has_distribution = (stats.log_norm != float("-inf")) & active
    minus_inf = torch.full((), float("-inf"), dtype=acc, device=lp.device)
    lp = torch.where((head_ids >= 0) & has_distribution[:, None] & (z > float("-inf")), lp, minus_inf)
    return torch.where(active[:, None], lp, torch.zeros_like(lp))


class Backend(Protocol):
    """The vocabulary passes. `temperature` / `reference_temperature`: Temperature values."""

    name: str

    def supports(self, logits: torch.Tensor) -> bool:
        """Whether this backend can run on these logits (device, dtype)."""

    def token_stats_fwd(self, logits, labels, temperature, compute_entropy: bool,
                        compute_sum_pi_squared: bool) -> RowStats:
        """One read of the logits: lse, logprob, and on request entropy and sum p^2 per row."""

    def token_grad_bwd(self, logits, labels, row_max, log_norm, entropy: Optional[torch.Tensor], coef_logprob,
                       coef_entropy: Optional[torch.Tensor], temperature, inplace: bool) -> torch.Tensor:
        """dlogits = (c*(onehot - p) + e*(-p*(log p + H))) / T in the logits dtype; one read, one write.

        log p = (z - row_max) / T - log_norm, formed in that order (see RowStats).

        With `inplace` the result may be written into the logits' storage (the caller bumps the
        version counter)."""

    def vllm_logprobs(self, logits, labels, temperature) -> torch.Tensor:
        """[N] float32 log-probs of the labels in vLLM's own operations (numerics="vllm"): its V1 sampler's (ATen)
        by default, its V2 sampler's Triton kernels on the Triton backend; 0 where a label is outside [0, V)."""

    def head_stats_fwd(self, logits, labels, head_ids, temperature, compute_entropy: bool,
                       compute_sum_pi_squared: bool) -> Tuple[RowStats, torch.Tensor]:
        """token_stats_fwd and the [N, k] log-probs at `head_ids` (-1 pads) from the same pass (SPEC §9.1), with
        the row's normaliser on every active row (also where log p_y is -inf, and on FOREIGN_TARGET rows). The
        backward is token_grad_bwd's (ops/head.py adds the head's columns)."""

    def full_divergences_fwd(self, logits, reference, active, temperature, reference_temperature,
                             with_tv: bool = True) -> torch.Tensor:
        """[N, DIVERGENCE_STATS] float32 (float64 for float64 logits): the DIVERGENCES of softmax(logits / T)
        against softmax(reference / T_r) per row, then the backend's own columns; zeros on inactive rows.
        with_tv=False: TV may be left out (its column 0): it is the one divergence a single read cannot give."""

    def full_divergences_bwd(self, logits, reference, stats, coef, temperature,
                             reference_temperature) -> torch.Tensor:
        """dlogits (the logits' shape and dtype, contiguous) for coef = [N, 4] dLoss/d(DIVERGENCES)."""
