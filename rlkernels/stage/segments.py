"""The sequence structure of a flat [N] token axis (SPEC §3), with segmented reductions.

Both layouts become one: padded [B, T] is B segments of T tokens, packed [N] is the segments of
`cu_seqlens`. Every reduction runs in a fixed order, so two runs on the same input are bitwise
identical on a GPU too: the padded layout reduces rows of a [B, T] view, the packed layout uses
`torch.segment_reduce` over the offsets (one ordered reduction per segment). Neither uses
`index_add_` / `scatter_reduce_`, whose CUDA kernels accumulate with floating-point atomics. Nothing
depends on data in shapes, so the per-sequence stage never synchronises the device.

A context-parallel rank holds only some tokens of each sequence, at known global positions
(`Segments.at_positions`); its reductions give partial per-sequence values, which `SequenceTable`
combines across the group in one collective before anything reads them.
"""

import math
from typing import Dict, Optional, Union

import torch


class Segments:
    def __init__(
        self, seq_id: torch.Tensor, num_seqs: int, width: Union[int, torch.Tensor, None], padded_T: Optional[int],
        cu_seqlens: Optional[torch.Tensor] = None, order: Optional[torch.Tensor] = None,
    ):
        self.seq_id = seq_id  # [N] int64, the sequence of each token
        self.num_seqs = num_seqs  # S, known from shapes alone
        self._width = width  # K default of seq-mean-token-sum-norm: T, or the longest packed sequence (None: later)
        self.padded_T = padded_T  # T of the padded layout, None when packed
        self.cu_seqlens = cu_seqlens  # [S + 1] int64 offsets of the tokens (after `order`), None when padded
        self.order = order  # [N] permutation that groups the tokens by sequence, None when they already are

    @property
    def width(self) -> Union[int, torch.Tensor]:
        """The longest sequence's length: formed on first use (only seq-mean-token-sum-norm reads it)."""
        if self._width is None:
            self._width = longest(self.cu_seqlens)
        return self._width

    def width_like(self, like: torch.Tensor) -> torch.Tensor:
        """The width as a 0-d tensor of `like`'s dtype and device. The padded layout's is a host number: a fill on
        the device, never a tensor built on the host and copied there (a blocking copy: a host synchronisation)."""
        width = self.width
        if isinstance(width, torch.Tensor):
            return width.to(device=like.device, dtype=like.dtype)
        if torch.compiler.is_compiling():  # a symbolic T: arithmetic keeps it a graph input (see `hyper`)
            return like.new_zeros(()) + width
        return torch.full((), float(width), dtype=like.dtype, device=like.device)

    @classmethod
    def padded(cls, B: int, T: int, device) -> "Segments":
        seq_id = torch.arange(B, device=device).repeat_interleave(T)
        return cls(seq_id, B, T, T)

    @classmethod
    def packed(cls, cu_seqlens: Optional[torch.Tensor], N: int, device) -> "Segments":
        if cu_seqlens is None:  # [N, V] without cu_seqlens: one sequence
            cu = torch.tensor([0, N], dtype=torch.long, device=device)
            return cls(torch.zeros(N, dtype=torch.long, device=device), 1, N, None, cu)
        cu = cu_seqlens.to(device=device, dtype=torch.long).contiguous()  # kernels index it as contiguous
        S = cu.numel() - 1
        seq_id = torch.searchsorted(cu[1:], torch.arange(N, device=device), right=True)
        return cls(seq_id, S, None, None, cu)

    @classmethod
    def at_positions(cls, positions: torch.Tensor, cu_seqlens: torch.Tensor, width: Union[int, torch.Tensor],
                     grouped: bool) -> "Segments":
        """Tokens at global `positions` ([N] int64) of a packed axis split by `cu_seqlens` ([S + 1],
        global): one context-parallel rank's share. `grouped`: the positions are increasing (a
        contiguous slice), so the tokens of a sequence are already together; otherwise a stable sort
        groups them (a fixed order, hence deterministic)."""
        cu = cu_seqlens.to(device=positions.device, dtype=torch.long)
        S = cu.numel() - 1
        seq_id = torch.searchsorted(cu[1:], positions, right=True)
        order = None if grouped else torch.sort(seq_id, stable=True).indices
        sorted_id = seq_id if order is None else seq_id.index_select(0, order)
        local_cu = torch.searchsorted(sorted_id, torch.arange(S + 1, device=positions.device))
        return cls(seq_id, S, width, None, local_cu, order)

    def _reduce(self, x: torch.Tensor, how: str, empty: float) -> torch.Tensor:
        """[N, ...] -> [S, ...]."""
        if self.padded_T is not None:  # padded: a row reduction of the [B, T] view
            if self.padded_T == 0:
                return x.new_full((self.num_seqs, *x.shape[1:]), empty)
            rows = x.view(self.num_seqs, self.padded_T, *x.shape[1:])
            return rows.sum(1) if how == "sum" else rows.amax(1)
        if self.order is not None:
            x = x.index_select(0, self.order)
        # `unsafe`: the offsets were checked by validation (or are trusted with validate=False); the
        # safe path would read them on the host
        return torch.segment_reduce(x, how, offsets=self.cu_seqlens, axis=0, unsafe=True, initial=empty)

    def sum(self, x: torch.Tensor) -> torch.Tensor:
        """[N] -> [S] sums (callers zero the masked tokens first); 0 for an empty sequence."""
        return self._reduce(x, "sum", 0.0)

    def expand(self, per_seq: torch.Tensor) -> torch.Tensor:
        """[S] -> [N]: each token gets its sequence's value (a gather: no accumulation)."""
        return per_seq.index_select(0, self.seq_id)


def longest(cu: torch.Tensor) -> torch.Tensor:
    return (cu[1:] - cu[:-1]).max() if cu.numel() > 1 else torch.zeros((), dtype=torch.long, device=cu.device)


class SequenceTable:
    """Per-sequence sums and maxima of named per-token columns, each kind reduced in one segmented
    pass over a [N, columns] stack. `reduce(split)` runs the reductions and, when the batch is split
    over a context-parallel group, combines the partial values across it (one collective) -- so every
    per-sequence decision after it sees whole sequences. "len" (the masked-in token count) is always a
    column; a sequence's max is 0 when it has no masked-in token (SPEC §5)."""

    def __init__(self, seg: Segments, mask: torch.Tensor, dtype: torch.dtype):
        self.seg = seg
        self.mask = mask
        self.zero = torch.zeros((), dtype=dtype, device=mask.device)  # for every where() on the table's columns
        self._sum_columns: Dict[str, torch.Tensor] = {"len": mask.to(dtype)}
        self._max_columns: Dict[str, torch.Tensor] = {}
        self._sums: Dict[str, torch.Tensor] = {}
        self._maxes: Dict[str, torch.Tensor] = {}

    def add_sum(self, name: str, x: torch.Tensor) -> None:
        """x: [N], already 0 off the mask."""
        self._sum_columns[name] = x

    def add_max(self, name: str, x: torch.Tensor) -> None:
        """x: [N]; only masked-in tokens count."""
        self._max_columns[name] = torch.where(self.mask, x, torch.full_like(x, float("-inf")))

    def reduce(self, split) -> "SequenceTable":
        sums, maxes = list(self._sum_columns.values()), list(self._max_columns.values())
        S_sum = self.seg._reduce(torch.stack(sums, 1), "sum", 0.0)
        S_max = self.seg._reduce(torch.stack(maxes, 1), "max", float("-inf")) if maxes else None
        S_sum, S_max = split.combine_sequences(S_sum, S_max)
        self._sums = dict(zip(self._sum_columns, S_sum.unbind(1)))
        if S_max is not None:
            nonempty = self._sums["len"] > 0
            self._maxes = {name: torch.where(nonempty, col, torch.zeros_like(col))
                           for name, col in zip(self._max_columns, S_max.unbind(1))}
        return self

    def sum(self, name: str) -> torch.Tensor:
        return self._sums[name]

    def max(self, name: str) -> torch.Tensor:
        return self._maxes[name]


def hyper(like: torch.Tensor, value) -> torch.Tensor:
    """A hyperparameter (Python float, or a symbolic float under torch.compile) as a 0-d tensor of
    `like`'s dtype and device.

    Under torch.compile it is built by arithmetic on purpose: torch.compile keeps a float that only enters tensor
    arithmetic a run-time input of the graph, whereas passing it to clamp / where / full / a custom op
    specialises the graph on its value -- a recompilation for every new clip ratio or threshold. Eager, it is
    one fill (the same value: 0 + value rounds as the fill does)."""
    if torch.compiler.is_compiling():
        return like.new_zeros(()) + value
    return torch.full((), value, dtype=like.dtype, device=like.device)


def hyper_scalar(like: torch.Tensor, value):
    """A hyperparameter for a comparison or a clamp: eagerly the Python number itself, which the op rounds to
    `like`'s dtype exactly as `hyper`'s 0-d tensor holds it, without a launch; `hyper`'s tensor under
    torch.compile (or for a value that is not a plain number)."""
    if torch.compiler.is_compiling() or not isinstance(value, (int, float)):
        return hyper(like, value)
    return float(value)


def log_hyper_scalar(like: torch.Tensor, value):
    """log(value) for a comparison, as `hyper_scalar` (eagerly a Python float, `log_hyper` under torch.compile)."""
    if torch.compiler.is_compiling() or not isinstance(value, (int, float)):
        return log_hyper(like, value)
    return _log(value)


def log_hyper(like: torch.Tensor, value) -> torch.Tensor:
    """log(value) as a 0-d tensor of `like`'s dtype: taken in float64 and rounded once, as math.log
    followed by the comparison's cast would (see `hyper` for why it is a tensor)."""
    if torch.compiler.is_compiling():
        return torch.log(torch.zeros((), dtype=torch.float64, device=like.device) + value).to(like.dtype)
    return torch.full((), _log(value), dtype=like.dtype, device=like.device)


def _log(value: float) -> float:
    """torch.log's value of a float (math.log refuses 0 and negatives)."""
    return math.log(value) if value > 0 else (-math.inf if value == 0 else math.nan)
