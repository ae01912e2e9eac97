"""The stage's metrics (SPEC §8) as partial values that combine across ranks.

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

Without a split nothing is combined or packed: every metric is finished from its own value (which
is then the whole batch's). With one, the records are packed by kind into one vector and combined
with one collective per group (`split.BatchSplit.combine_metrics`). Per-sequence records are
already whole on every rank of a context-parallel group (sequences were combined before the stage),
so across that group they are taken once, not summed.
"""

from typing import Callable, Dict, List, Optional, Tuple

import torch

# kinds, in packing order; each occupies one slot per record except MOMENTS (three)
SUM_TOKEN, SUM_SEQ, MAX, MIN, LSE_SEQ, MOMENTS, MOMENTS_SEQ = range(7)
KINDS = (SUM_TOKEN, SUM_SEQ, MAX, MIN, LSE_SEQ, MOMENTS, MOMENTS_SEQ)
SLOTS = {kind: 3 if kind in (MOMENTS, MOMENTS_SEQ) else 1 for kind in KINDS}


class Metrics:
    def __init__(self):
        self._records: Dict[int, List[Tuple[str, torch.Tensor]]] = {kind: [] for kind in KINDS}
        self._finish: Dict[str, Callable] = {}  # name -> finishing function of the combined value
        self._derived: List[Tuple[str, Callable, Tuple[str, ...]]] = []
        self._order: List[str] = []  # public names in the order they were recorded

    def _add(self, name: str, kind: int, value: torch.Tensor, finish: Optional[Callable] = None) -> None:
        self._records[kind].append((name, value))
        if finish is not None:
            self._finish[name] = finish
        if not name.startswith("_"):
            self._order.append(name)

    def total(self, name: str, value: torch.Tensor) -> None:
        """A per-token sum (a loss term with global normalisers already in its weights)."""
        self._add(name, SUM_TOKEN, value)

    def mean(self, name: str, x: torch.Tensor, valid: torch.Tensor, n: torch.Tensor,
             per_sequence: bool = False) -> None:
        """Mean of x over `valid` (0 when empty), n = the global size of `valid`. Each term is divided
        before the sum, so that a mean of values near the dtype's maximum (exp of a large log-ratio in
        float32) does not overflow in the running sum. Values off `valid` may be NaN."""
        value = torch.where(valid, x / n.clamp_min(1).to(x.dtype), torch.zeros_like(x)).sum()
        self._add(name, SUM_SEQ if per_sequence else SUM_TOKEN, value)

    def extreme(self, name: str, x: torch.Tensor, valid: torch.Tensor, n: torch.Tensor, largest: bool) -> None:
        """Max (or min) of x over `valid`; 0 when the global set is empty."""
        filled = torch.where(valid, x, torch.full_like(x, float("-inf") if largest else float("inf")))
        if filled.numel() == 0:  # the identity of the combine (max of nothing)
            value = x.new_full((), float("-inf") if largest else float("inf"))
        else:
            value = filled.max() if largest else filled.min()
        self._add(name, MAX if largest else MIN, value, lambda v: torch.where(n > 0, v, torch.zeros_like(v)))

    def mean_exp(self, name: str, a: torch.Tensor, valid: torch.Tensor, n: torch.Tensor) -> None:
        """mean(exp(a)) over per-sequence `valid`, as exp(logsumexp(a) - log n): finite whenever the
        mean is, even when single terms overflow the dtype (perplexities of float32 log-probs); 0 when
        empty."""
        lse = torch.logsumexp(torch.where(valid, a, torch.full_like(a, float("-inf"))), dim=0)
        self._add(name, LSE_SEQ, lse, lambda v: torch.exp(v - torch.log(n.clamp_min(1).to(v.dtype))))

    def moments(self, name: str, x: torch.Tensor, valid: torch.Tensor, per_sequence: bool = False) -> None:
        """(count, mean, M2) of x over this rank's `valid` tokens (or sequences), for a variance (`std`)."""
        count = valid.sum().to(x.dtype)
        mean = torch.where(valid, x / count.clamp_min(1), torch.zeros_like(x)).sum()
        m2 = torch.where(valid, (x - mean) ** 2, torch.zeros_like(x)).sum()
        self._add(name, MOMENTS_SEQ if per_sequence else MOMENTS, torch.stack([count, mean, m2]))

    def sequence_statistic(self, name: str, value: torch.Tensor) -> None:
        """A statistic of the whole sequences that does not combine by sum, max or moments (a quantile): the same
        on every rank of a context-parallel group (taken once there); not to be recorded on a data-parallel
        split, which no combine rule here makes whole."""
        self._add(name, SUM_SEQ, value)

    def derive(self, name: str, fn: Callable, *inputs: str) -> None:
        """A metric computed from combined records (by name) after the combine."""
        self._derived.append((name, fn, inputs))
        self._order.append(name)

    def finish(self, split) -> Dict[str, torch.Tensor]:
        records = [(name, kind, value) for kind in KINDS for name, value in self._records[kind]]
        if split.combines_metrics and records:  # packed by kind, one collective per group
            slots = {kind: len(self._records[kind]) * SLOTS[kind] for kind in KINDS}
            packed = split.combine_metrics(torch.cat([value.reshape(-1) for _, _, value in records]), slots)
            sizes = [SLOTS[kind] for _, kind, _ in records]
            values = [v if SLOTS[kind] > 1 else v.reshape(())
                      for v, (_, kind, _) in zip(packed.split(sizes), records)]
            records = [(name, kind, v) for (name, kind, _), v in zip(records, values)]
        out: Dict[str, torch.Tensor] = {}
        for name, _, value in records:
            out[name] = self._finish[name](value) if name in self._finish else value
        for name, fn, inputs in self._derived:
            out[name] = fn(*(out[i] for i in inputs))
        return {name: out[name] for name in self._order}


def std(moments: torch.Tensor) -> torch.Tensor:
    count, _, m2 = moments.unbind()
    return torch.sqrt(m2 / count.clamp_min(1))


def sample_std(moments: torch.Tensor) -> torch.Tensor:
    """With Bessel's correction (torch.std's default); 0 for fewer than two values."""
    count, _, m2 = moments.unbind()
    return torch.where(count > 1, torch.sqrt(m2 / (count - 1).clamp_min(1)), torch.zeros_like(m2))


def combine_moments(parts: torch.Tensor) -> torch.Tensor:
    """parts: [ranks, records, 3] (count, mean, M2) -> [records, 3] of the union (Chan et al.)."""
    count, mean, m2 = parts.unbind(-1)
    total = count.sum(0)
    mu = (count * mean).sum(0) / total.clamp_min(1)
    return torch.stack([total, mu, m2.sum(0) + (count * (mean - mu) ** 2).sum(0)], -1)
