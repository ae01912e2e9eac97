"""The sequence structure of a flat [N] token axis (SPEC §3), with segmented reductions.

Both layouts become one: padded [B, T] is B segments of T tokens, packed [N] is the segments of
`cu_seqlens`. Every reduction runs in a fixed order, so two runs on the same input are bitwise
identical on a GPU too: the padded layout reduces rows of a [B, T] view, the packed layout uses
`torch.segment_reduce` over the offsets (one ordered reduction per segment). Neither uses
`index_add_` / `scatter_reduce_`, whose CUDA kernels accumulate with floating-point atomics. Nothing
depends on data in shapes, so the per-sequence stage never synchronises the device.
"""

from typing import Optional, Union

import torch


class Segments:
    def __init__(
        self, seq_id: torch.Tensor, num_seqs: int, width: Union[int, torch.Tensor], padded_T: Optional[int],
        cu_seqlens: Optional[torch.Tensor] = None,
    ):
        self.seq_id = seq_id  # [N] int64, the sequence of each token
        self.num_seqs = num_seqs  # S, known from shapes alone
        self.width = width  # K default of seq-mean-token-sum-norm: T, or the longest packed sequence
        self.padded_T = padded_T  # T of the padded layout, None when packed
        self.cu_seqlens = cu_seqlens  # [S + 1] int64 offsets of the packed layout, None when padded

    @classmethod
    def padded(cls, B: int, T: int, device) -> "Segments":
        seq_id = torch.arange(B, device=device).repeat_interleave(T)
        return cls(seq_id, B, T, T)

    @classmethod
    def packed(cls, cu_seqlens: Optional[torch.Tensor], N: int, device) -> "Segments":
        if cu_seqlens is None:  # [N, V] without cu_seqlens: one sequence
            cu = torch.tensor([0, N], dtype=torch.long, device=device)
            return cls(torch.zeros(N, dtype=torch.long, device=device), 1, N, None, cu)
        cu = cu_seqlens.to(device=device, dtype=torch.long)
        S = cu.numel() - 1
        seq_id = torch.searchsorted(cu[1:], torch.arange(N, device=device), right=True)
        width = (cu[1:] - cu[:-1]).max() if S > 0 else torch.zeros((), dtype=torch.long, device=device)
        return cls(seq_id, S, width, None, cu)

    def _reduce(self, x: torch.Tensor, how: str, empty: float) -> torch.Tensor:
        if self.padded_T is not None:  # padded: a row reduction of the [B, T] view
            if self.padded_T == 0:
                return x.new_full((self.num_seqs,), empty)
            rows = x.view(self.num_seqs, self.padded_T)
            return rows.sum(1) if how == "sum" else rows.amax(1)
        # `unsafe`: the offsets were checked by validation (or are trusted with validate=False); the
        # safe path would read them on the host
        return torch.segment_reduce(x, how, offsets=self.cu_seqlens, unsafe=True, initial=empty)

    def sum(self, x: torch.Tensor) -> torch.Tensor:
        """[N] -> [S] sums (callers zero the masked tokens first); 0 for an empty sequence."""
        return self._reduce(x, "sum", 0.0)

    def max(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """[N] -> [S] max over masked-in tokens; an empty sequence has max 0 (SPEC §5)."""
        out = self._reduce(torch.where(mask, x, torch.full_like(x, float("-inf"))), "max", float("-inf"))
        return torch.where(self.sum(mask.to(x.dtype)) > 0, out, torch.zeros_like(out))

    def expand(self, per_seq: torch.Tensor) -> torch.Tensor:
        """[S] -> [N]: each token gets its sequence's value (a gather: no accumulation)."""
        return per_seq.index_select(0, self.seq_id)


def hyper(like: torch.Tensor, value) -> torch.Tensor:
    """A hyperparameter (Python float, or a symbolic float under torch.compile) as a 0-d tensor of
    `like`'s dtype and device.

    It is built by arithmetic on purpose: torch.compile keeps a float that only enters tensor
    arithmetic a run-time input of the graph, whereas passing it to clamp / where / full / a custom
    op specialises the graph on its value -- a recompilation for every new clip ratio or threshold."""
    return like.new_zeros(()) + value


def log_hyper(like: torch.Tensor, value) -> torch.Tensor:
    """log(value) as a 0-d tensor of `like`'s dtype: taken in float64 and rounded once, as math.log
    followed by the comparison's cast would (see `hyper` for why it is a tensor)."""
    return torch.log(torch.zeros((), dtype=torch.float64, device=like.device) + value).to(like.dtype)


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of x where mask is set; 0 over an empty set (SPEC §8). Values off the mask may be NaN.

    Each term is divided before the sum, so that a mean of values near the dtype's maximum (exp of
    a large log-ratio in float32) does not overflow in the running sum."""
    n = mask.sum().clamp_min(1).to(x.dtype)
    return torch.where(mask, x / n, torch.zeros_like(x)).sum()


def masked_mean_exp(a: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """mean(exp(a)) where mask is set, as exp(logsumexp(a) - log n): finite whenever the mean is,
    even when single terms overflow the dtype (perplexities of float32 log-probs); 0 when empty."""
    n = mask.sum().clamp_min(1).to(a.dtype)
    lse = torch.logsumexp(torch.where(mask, a, torch.full_like(a, float("-inf"))), dim=0)
    return torch.exp(lse - torch.log(n))


def masked_extreme(x: torch.Tensor, mask: torch.Tensor, largest: bool) -> torch.Tensor:
    """Max (or min) of x where mask is set; 0 over an empty set."""
    fill = float("-inf") if largest else float("inf")
    filled = torch.where(mask, x, torch.full_like(x, fill))
    if filled.numel() == 0:
        return x.new_zeros(())
    out = filled.max() if largest else filled.min()
    return torch.where(mask.any(), out, torch.zeros_like(out))
