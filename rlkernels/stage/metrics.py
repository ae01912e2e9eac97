"""The stage's metrics (SPEC §8) as partial values that combine across ranks, reduced a kind at a time.

A metric is recorded as a partial value of one of a few kinds, each with a combine rule that makes
the result on a split batch equal to the result on the whole batch:

    sum      (per token or per sequence)  a mean written as sum_t x_t / n with the *global* count n
                                          (known before the metrics: see correction.Normalisers), or a
                                          loss term; combined by summation
    max, min                              extremes over a masked set; combined by max / min, then 0
                                          when the global set is empty
    lse      (per sequence)               log sum exp of a set, for means of exp (perplexities);
                                          combined by logsumexp, then exp(lse - log n)
    moments  (per token or per sequence)  (count, mean, M2) of one rank's values; combined with Chan's
                                          pairwise formula, so a variance is never E[x^2] - E[x]^2

Recording a metric computes nothing: it keeps its inputs. `finish` reduces every record of a kind, scope (tokens
or sequences) and dtype at once, on an [M, L] stack (one masked mean, max or logsumexp of M rows instead of M of
each: the stage's metrics were most of its ~600 launches), and finishes each kind elementwise on its [M] values.
Each row is the reduction that record alone would run, in its own dtype; where one thread reduces it, the same
bits (tests/stage/test_metrics.py), and past that a row's sum is split across a CPU's threads or a GPU's blocks
by the stack's shape, so a metric may differ from its value alone in the last bits (never run to run).

Without a split nothing is combined or packed: every metric is finished from its own value (which
is then the whole batch's). With one, the records are packed by kind into one vector and combined
with one collective per group (`split.BatchSplit.combine_metrics`). Per-sequence records are
already whole on every rank of a context-parallel group (sequences were combined before the stage),
so across that group they are taken once, not summed.
"""

import collections
import copy
import threading
from collections.abc import Iterable, Mapping, MutableMapping
from typing import Callable, Dict, Iterator, List, NamedTuple, Optional, Tuple, Union

import torch
import torch.utils._pytree
from torch import Tensor

# kinds, in packing order; each occupies one slot per record except MOMENTS (three)
SUM_TOKEN, SUM_SEQ, MAX, MIN, LSE_SEQ, MOMENTS, MOMENTS_SEQ = range(7)
KINDS = (SUM_TOKEN, SUM_SEQ, MAX, MIN, LSE_SEQ, MOMENTS, MOMENTS_SEQ)
SLOTS = {kind: 3 if kind in (MOMENTS, MOMENTS_SEQ) else 1 for kind in KINDS}


class _Masked(NamedTuple):
    """A reduction still to run: x over `valid` (n: the global size of `valid`, None for moments), of tokens or
    of sequences."""
    x: Tensor
    valid: Tensor
    n: Optional[Tensor]
    per_sequence: bool


class _Spread(NamedTuple):
    name: str
    moments: str  # the record whose (count, mean, M2) it is taken of
    bessel: bool  # the sample standard deviation (torch.std's default), 0 for fewer than two values


class Metrics:
    """The records of one stage run. `enabled=False` (a run for the loss alone) keeps nothing and finishes empty."""

    def __init__(self, enabled: bool = True):
        self.enabled = enabled
        self._records: Dict[int, List[Tuple[str, Union[Tensor, _Masked]]]] = {kind: [] for kind in KINDS}
        self._spreads: List[_Spread] = []
        self._derived: List[Tuple[str, Callable, Tuple[str, ...]]] = []
        self._order: List[str] = []  # public names in the order they were recorded

    def _add(self, name: str, kind: int, value: Union[Tensor, _Masked]) -> None:
        if not self.enabled:
            return
        self._records[kind].append((name, value))
        if not name.startswith("_"):
            self._order.append(name)

    def total(self, name: str, value: Tensor) -> None:
        """A per-token sum (a loss term with global normalisers already in its weights)."""
        self._add(name, SUM_TOKEN, value)

    def mean(self, name: str, x: Tensor, valid: Tensor, n: Tensor, per_sequence: bool = False) -> None:
        """Mean of x (float, or bool for a fraction) over `valid` (0 when empty), n = the global size of `valid`.
        Each term is divided before the sum, so that a mean of values near the dtype's maximum (exp of a large
        log-ratio in float32) does not overflow in the running sum. Values off `valid` may be NaN."""
        self._add(name, SUM_SEQ if per_sequence else SUM_TOKEN, _Masked(x, valid, n, per_sequence))

    def extreme(self, name: str, x: Tensor, valid: Tensor, n: Tensor, largest: bool, per_sequence: bool = False
                ) -> None:
        """Max (or min) of x over `valid`; 0 when the global set is empty."""
        self._add(name, MAX if largest else MIN, _Masked(x, valid, n, per_sequence))

    def mean_exp(self, name: str, a: Tensor, valid: Tensor, n: Tensor) -> None:
        """mean(exp(a)) over per-sequence `valid`, as exp(logsumexp(a) - log n): finite whenever the
        mean is, even when single terms overflow the dtype (perplexities of float32 log-probs); 0 when
        empty."""
        self._add(name, LSE_SEQ, _Masked(a, valid, n, True))

    def moments(self, name: str, x: Tensor, valid: Tensor, per_sequence: bool = False) -> None:
        """(count, mean, M2) of x over this rank's `valid` tokens (or sequences), for a variance."""
        self._add(name, MOMENTS_SEQ if per_sequence else MOMENTS, _Masked(x, valid, None, per_sequence))

    def std(self, name: str, x: Tensor, valid: Tensor, per_sequence: bool = False, bessel: bool = False,
            moments: Optional[str] = None) -> None:
        """The standard deviation of x over `valid` (with Bessel's correction if `bessel`), from moments that
        combine across a split, recorded as `moments` (default `_{name}`: another metric may derive from them)."""
        if not self.enabled:
            return
        moments = moments or f"_{name}"
        self.moments(moments, x, valid, per_sequence)
        self._spreads.append(_Spread(name, moments, bessel))
        self._order.append(name)

    def sequence_statistic(self, name: str, value: Tensor) -> None:
        """A statistic of the whole sequences that does not combine by sum, max or moments (a quantile): the same
        on every rank of a context-parallel group (taken once there); not to be recorded on a data-parallel
        split, which no combine rule here makes whole."""
        self._add(name, SUM_SEQ, value)

    def derive(self, name: str, fn: Callable, *inputs: str) -> None:
        """A metric computed from combined records (by name) after the combine."""
        if not self.enabled:
            return
        self._derived.append((name, fn, inputs))
        self._order.append(name)

    def finish(self, split) -> Dict[str, Tensor]:
        kinds = [kind for kind in KINDS if self._records[kind]]
        if not kinds:
            return {}
        zero = torch.zeros((), device=_device(self._records[kinds[0]][0][1]))  # the where()s' 0 (promotes to x's dtype)
        # kind -> its chunks, one per dtype of its values: (the records in the order of their values, the values)
        reduced = _reduce({kind: self._records[kind] for kind in kinds}, zero)
        if split.combines_metrics:  # packed by kind, one collective per group (a mixed-dtype pack promotes, as ever)
            slots = {kind: len(self._records[kind]) * SLOTS[kind] for kind in KINDS}
            chunks = [chunk for kind in kinds for chunk in reduced[kind]]
            packed = split.combine_metrics(torch.cat([values.reshape(-1) for _, values in chunks]), slots)
            parts = iter(packed.split([values.numel() for _, values in chunks]))
            reduced = {kind: [(records, next(parts).reshape(values.shape)) for records, values in reduced[kind]]
                       for kind in kinds}
        out: Dict[str, Tensor] = {}
        names: List[str] = []
        finished: List[Tensor] = []
        for kind in kinds:
            for records, values in reduced[kind]:
                if kind in (MOMENTS, MOMENTS_SEQ):  # rows for the spreads and the derived metrics
                    out.update(zip((name for name, _ in records), values.unbind(0)))
                else:
                    names += [name for name, _ in records]
                    finished.append(_finished(kind, values, records, zero))
        spreads: Dict[torch.dtype, List[_Spread]] = {}  # one stack per dtype of the moments, as above
        for spread in self._spreads:
            spreads.setdefault(out[spread.moments].dtype, []).append(spread)
        for group in spreads.values():
            moments = torch.stack([out[s.moments] for s in group])
            names += [s.name for s in group]
            finished.append(_spread(moments, [s.bessel for s in group], zero))
        out.update(_unbound(names, finished))
        for name, fn, inputs in self._derived:
            out[name] = fn(*(out[i] for i in inputs))
        return {name: out[name] for name in self._order}


def _device(value: Union[Tensor, _Masked]) -> torch.device:
    return (value.x if isinstance(value, _Masked) else value).device


def _unbound(names: List[str], finished: List[Tensor]) -> Dict[str, Tensor]:
    """name -> 0-d tensor from [M] vectors in `names`' order: one cat and one unbind per dtype."""
    by_dtype: Dict[torch.dtype, Tuple[List[str], List[Tensor]]] = {}
    position = 0
    for values in finished:
        count = values.shape[0]
        group = by_dtype.setdefault(values.dtype, ([], []))
        group[0].extend(names[position:position + count])
        group[1].append(values)
        position += count
    out: Dict[str, Tensor] = {}
    for group_names, parts in by_dtype.values():
        out.update(zip(group_names, (parts[0] if len(parts) == 1 else torch.cat(parts)).unbind(0)))
    return out


def _reduce(records: Dict[int, List[Tuple[str, Union[Tensor, _Masked]]]], zero: Tensor
            ) -> Dict[int, List[Tuple[List[Tuple[str, Union[Tensor, _Masked]]], Tensor]]]:
    """kind -> its chunks, one per dtype: (the records in the order of their values, the [M] (moments: [M, 3])
    partial values). The masked records of every kind over one axis (tokens or sequences) and dtype are reduced
    together (_reduce_axis: one stack, ~20 ops for all of them); values recorded as such are stacked. Each kind's
    order is the same on every rank (it follows the recording), as the split's combine needs."""
    axes: Dict[tuple, Dict[int, List[_Masked]]] = {}  # (scope, dtype) -> kind -> its masked inputs
    for kind, kind_records in records.items():
        for _, value in kind_records:
            key = _group_key(value)
            if key is not None:
                axes.setdefault(key, {}).setdefault(kind, []).append(value)
    parts = {key: _reduce_axis(members, zero) for key, members in axes.items()}  # key -> kind -> [M] values
    out = {}
    for kind, kind_records in records.items():
        groups: Dict[Optional[tuple], list] = {}
        for record in kind_records:
            groups.setdefault(_group_key(record[1]), []).append(record)
        chunks: Dict[torch.dtype, Tuple[list, List[Tensor]]] = {}  # a cat of two dtypes would promote one of them
        for key, members in groups.items():
            part = torch.stack([value for _, value in members]) if key is None else parts[key][kind]
            ordered, kind_parts = chunks.setdefault(part.dtype, ([], []))
            ordered += members
            kind_parts.append(part)
        out[kind] = [(ordered, ps[0] if len(ps) == 1 else torch.cat(ps)) for ordered, ps in chunks.values()]
    return out


def _group_key(value: Union[Tensor, _Masked]) -> Optional[tuple]:
    """Records reduced together: of tokens or of sequences, and of one float dtype (a fraction's bool joins the
    dtype of its n). Never the shape: on a split batch a rank whose token count equals the sequence count would
    group differently from its peers, and the packed records would no longer line up across ranks."""
    if not isinstance(value, _Masked):
        return None
    dtype = value.x.dtype if value.x.is_floating_point() or value.n is None else value.n.dtype
    return value.per_sequence, dtype


def _rows(tensors: List[Tensor]) -> Tensor:
    """One tensor for M records' inputs: the one they share (it broadcasts), or their [M, ...] stack."""
    first = tensors[0]
    return first if all(t is first for t in tensors) else torch.stack(tensors)


# the row order of one axis's stack: the means first, then the moments (whose means join theirs), the extremes
_ROW_ORDER = (SUM_TOKEN, SUM_SEQ, MOMENTS, MOMENTS_SEQ, MAX, MIN, LSE_SEQ)


def _reduce_axis(members: Dict[int, List[_Masked]], zero: Tensor) -> Dict[int, Tensor]:
    """The records of every kind over one axis and dtype, reduced on one [M, L] stack: a row is the reduction its
    record alone would run (a bool fraction in its n's dtype). The moments' means are means with n = their count,
    taken in the means' where-and-sum; a min is minus the max of minus its values (exact), taken in the maxima's."""
    kinds = [kind for kind in _ROW_ORDER if kind in members]
    masked = [m for kind in kinds for m in members[kind]]
    bounds, start = {}, 0
    for kind in kinds:
        bounds[kind] = slice(start, start + len(members[kind]))
        start += len(members[kind])
    x = torch.stack([m.x for m in masked])  # [M, L]: bool rows promote to the float rows' dtype
    valid = _rows([m.valid for m in masked])
    valid = valid if valid.dim() == 2 else valid.expand(x.shape)
    means = [kind for kind in kinds if kind in (SUM_TOKEN, SUM_SEQ, MOMENTS, MOMENTS_SEQ)]
    extremes = [kind for kind in kinds if kind in (MAX, MIN, LSE_SEQ)]
    out: Dict[int, Tensor] = {}
    if means:
        rows = slice(bounds[means[0]].start, bounds[means[-1]].stop)
        out.update(_means(x[rows], valid[rows], [(kind, bounds[kind], members[kind]) for kind in means], zero))
    if extremes:
        out.update(_extremes(x, valid, [(kind, bounds[kind]) for kind in extremes]))
    return out


def _means(x: Tensor, valid: Tensor, kinds: list, zero: Tensor) -> Dict[int, Tensor]:
    """The SUM rows' masked means (x / n over valid: n their global count) and the MOMENTS rows' (count, mean, M2),
    with one where-and-sum for every mean. `kinds`: (kind, its rows in the stack, its records); the sums first."""
    start = kinds[0][1].start
    divisors, moments = [], None
    dt = x.dtype if x.is_floating_point() else kinds[0][2][0].n.dtype  # a stack of fractions alone: n's dtype
    for kind, rows, records in kinds:
        if kind in (SUM_TOKEN, SUM_SEQ):
            divisors.append(_rows([m.n for m in records]).clamp_min(1).to(dt).expand(len(records)))
        else:
            moments = slice(rows.start - start, rows.stop - start)
            count = valid[moments].sum(1).to(dt)
            divisors.append(count.clamp_min(1))
    n = divisors[0] if len(divisors) == 1 else torch.cat(divisors)
    sums = torch.where(valid, x.to(dt) / n[:, None], zero).sum(1)
    out = {kind: sums[rows.start - start:rows.stop - start] for kind, rows, _ in kinds if kind in (SUM_TOKEN, SUM_SEQ)}
    if moments is not None:
        mean = sums[moments]
        m2 = torch.where(valid[moments], (x[moments] - mean[:, None]) ** 2, zero).sum(1)
        out[kinds[-1][0]] = torch.stack([count, mean, m2], 1)
    return out


def _extremes(x: Tensor, valid: Tensor, kinds: list) -> Dict[int, Tensor]:
    """The MAX, MIN and LSE rows' reductions over valid, the unmasked values filled with -inf once for all (a MIN
    row negated first, in this fresh stack). `kinds`: (kind, its rows), in the stack's order."""
    rows = {kind: span for kind, span in kinds}
    if x.shape[1] == 0:  # the identities of the combine (max or logsumexp of nothing)
        return {kind: x.new_full((span.stop - span.start,), float("inf") if kind == MIN else float("-inf"))
                for kind, span in rows.items()}
    if MIN in rows:
        x[rows[MIN]].neg_()
    first = kinds[0][1].start
    filled = torch.where(valid[first:], x[first:], float("-inf"))
    out = {}
    ordered = [kind for kind in (MAX, MIN) if kind in rows]
    if ordered:
        span = slice(rows[ordered[0]].start - first, rows[ordered[-1]].stop - first)
        largest = filled[span].amax(1)
        if MIN in rows:
            lowest = slice(rows[MIN].start - first - span.start, rows[MIN].stop - first - span.start)
            largest[lowest].neg_()
            out[MIN] = largest[lowest]
        if MAX in rows:
            out[MAX] = largest[:rows[MAX].stop - rows[MAX].start]
    if LSE_SEQ in rows:
        out[LSE_SEQ] = torch.logsumexp(filled[rows[LSE_SEQ].start - first:rows[LSE_SEQ].stop - first], dim=1)
    return out


def _finished(kind: int, values: Tensor, records: List[Tuple[str, Union[Tensor, _Masked]]], zero: Tensor) -> Tensor:
    """A kind's combined values -> its metrics, elementwise: an extreme of nothing is 0, a mean of exp is
    exp(lse - log n)."""
    if kind not in (MAX, MIN, LSE_SEQ):
        return values
    n = _rows([value.n for _, value in records])
    if kind == LSE_SEQ:
        return torch.exp(values - torch.log(n.clamp_min(1).to(values.dtype)))
    return torch.where(n > 0, values, zero)


def _spread(moments: Tensor, bessel: List[bool], zero: Tensor) -> Tensor:
    """[K, 3] (count, mean, M2) -> [K] standard deviations; with Bessel's correction (torch.std's default) where
    `bessel` says, 0 for fewer than two values there."""
    count, _, m2 = moments.unbind(1)
    population = torch.sqrt(m2 / count.clamp_min(1))
    if not any(bessel):
        return population
    sample = torch.where(count > 1, torch.sqrt(m2 / (count - 1).clamp_min(1)), zero)
    if all(bessel):
        return sample
    return torch.stack([s if b else p for s, p, b in zip(sample.unbind(0), population.unbind(0), bessel)])


def combine_moments(parts: Tensor) -> Tensor:
    """parts: [ranks, records, 3] (count, mean, M2) -> [records, 3] of the union (Chan et al.)."""
    count, mean, m2 = parts.unbind(-1)
    total = count.sum(0)
    mu = (count * mean).sum(0) / total.clamp_min(1)
    return torch.stack([total, mu, m2.sum(0) + (count * (mean - mu) ** 2).sum(0)], -1)


class DeferredMetrics(MutableMapping):
    """A loss's metrics computed when first read: the fused stage's (SPEC §18). The loss and its gradient's
    coefficients take two kernel launches; the ~55 metrics are the torch stage's run on the same inputs, a few
    hundred small ops, queued when a logger reads them (after `loss.backward()` has queued the backward's kernels,
    whose GPU time then hides that host time) instead of before the loss returns. The values are the torch stage's,
    bit for bit.

    A mapping, not a dict, on purpose: C code that reads a dict's storage directly (json's encoder, orjson, an
    OrderedDict's ==, torch.compile's guards) would find a dict subclass empty before its first read and answer
    `{}` silently; a Mapping makes such code go through its methods or refuse it loudly. Everything else goes where a
    dict goes: read, update, `copy()`, `|`, `copy.copy` and `dict(m)` give dicts; a pickle gives a
    `collections.OrderedDict` (the one dict type `torch.load(weights_only=True)` rebuilds); `torch.utils._pytree`
    flattens it as a dict, with keys; a library that rebuilds a mapping as `type(m)(items)` or `type(m)(**items)`
    gets one computed already. Its inputs are the call's: modifying them in place (the advantages, the returned
    entropy) before the metrics are read changes the metrics.

    The computation runs as the call would have run it, whatever the reader's thread or mode: under no_grad, in the
    call's inference mode, once (a lock holds a second reader back), and on the CUDA stream current at the call
    (`stream`), the reader's stream then waiting for it. Autocast is not restored: the metrics run no
    autocast-eligible op (no matmul) and their inputs are float32 or float64, which autocast leaves as they are
    (tests/stage/test_fused_stage.py reads them inside it). `known`: values the call computed anyway (the
    all-rejected flag the notices read), readable without computing the rest."""

    def __init__(self, compute: Union[Callable[[], Dict[str, torch.Tensor]], Mapping, Iterable] = (),
                 known: Optional[Dict[str, torch.Tensor]] = None, stream=None, /, **values: torch.Tensor):
        given = isinstance(compute, Mapping) or not callable(compute)  # type(m)({...}): values, not a computation
        self._compute: Optional[Callable[[], Dict[str, torch.Tensor]]] = None if given else compute
        self._values: Optional[Dict[str, torch.Tensor]] = {**dict(compute), **values} if given else None
        self._stream = None if given else stream
        self._inference = torch.is_inference_mode_enabled()
        self._lock = threading.Lock()
        self.known: Dict[str, torch.Tensor] = dict(known or {})

    @property
    def ready(self) -> bool:
        """Whether the metrics have been computed (any read computes them)."""
        return self._values is not None

    def _computed(self) -> Dict[str, torch.Tensor]:
        if self._values is None:
            with self._lock:
                if self._values is None:
                    with torch.inference_mode(self._inference):
                        self._values = dict(_on_stream(self._stream, self._compute))
                    self._compute = self._stream = None  # lets go of the call's inputs
        return self._values

    def __getitem__(self, name: str) -> torch.Tensor:
        return self._computed()[name]

    def __setitem__(self, name: str, value: torch.Tensor) -> None:
        self._computed()[name] = value

    def __delitem__(self, name: str) -> None:
        del self._computed()[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._computed())

    def __reversed__(self) -> Iterator[str]:
        return reversed(self._computed())

    def __len__(self) -> int:
        return len(self._computed())

    def __contains__(self, name: object) -> bool:
        return name in self._computed()

    def __repr__(self) -> str:
        return f"DeferredMetrics({self._computed()!r})"

    def clear(self) -> None:
        with self._lock:  # a reader computing meanwhile must not refill it
            self._values, self._compute, self._stream = {}, None, None

    def copy(self) -> Dict[str, torch.Tensor]:
        return dict(self._computed())

    def __copy__(self) -> Dict[str, torch.Tensor]:
        return self.copy()

    def __deepcopy__(self, memo) -> Dict[str, torch.Tensor]:
        return copy.deepcopy(self.copy(), memo)

    def __or__(self, other):
        return {**self._computed(), **other} if isinstance(other, Mapping) else NotImplemented

    def __ror__(self, other):
        return {**other, **self._computed()} if isinstance(other, Mapping) else NotImplemented

    def __ior__(self, other):
        self.update(other)
        return self

    def __reduce__(self):
        return collections.OrderedDict, (list(self._computed().items()),)


def _on_stream(stream, compute: Callable[[], Dict[str, torch.Tensor]]) -> Dict[str, torch.Tensor]:
    """compute() on the CUDA stream the call ran on (None: the current one), then the reader's stream waits for
    it, and each value is marked used there (the caching allocator must not hand its memory to the call's stream
    while the reader's work on it is queued)."""
    if stream is None:
        return compute()
    reader = torch.cuda.current_stream(stream.device)
    with torch.cuda.stream(stream):
        values = compute()
    if reader != stream:
        reader.wait_stream(stream)
        for value in values.values():
            if isinstance(value, Tensor) and value.is_cuda:
                value.record_stream(reader)
    return values


def _flatten_deferred(metrics: DeferredMetrics):
    return list(metrics.values()), list(metrics.keys())


def _flatten_deferred_with_keys(metrics: DeferredMetrics):
    return [(torch.utils._pytree.MappingKey(name), value) for name, value in metrics.items()], list(metrics.keys())


def _unflatten_deferred(values, names) -> Dict[str, torch.Tensor]:
    return dict(zip(names, values))


# tree_map(f, metrics) maps the values and gives a dict, as for the dict the torch stage returns; paths are the
# dict's (registered with the Python pytree; its type is rlkernels' own, so no other library's behaviour changes)
torch.utils._pytree.register_pytree_node(
    DeferredMetrics, _flatten_deferred, _unflatten_deferred,
    serialized_type_name="rlkernels.stage.metrics.DeferredMetrics", flatten_with_keys_fn=_flatten_deferred_with_keys)
