"""Autograd around the vocabulary passes: the one place that resolves `backend=` and picks the route.

A call's statistics of the current policy (log-prob, entropy, sum p^2 per row, SPEC §2) come from one of
these routes, chosen here from the prepared batch:

    logits                        vocab.token_stats          the custom op (its backward: token_grad)
    logits, tp_group              vocab_parallel             one all_gather forward (SPEC §2.2)
    logits, a small kept set      kept_set                   the K kept logits gathered (SPEC §2.3)
    logits, a large kept set      vocab.token_stats          on logits masked to -inf outside the set
    hidden + head                 linear.linear_token_stats  logits a chunk of rows at a time (SPEC §2.1)
    hidden + head, tp_group       vocab_parallel             its fused-linear form
    hidden + head, small kept set kept_set                   the K kept rows of the head

`coefficients.CoefficientLossFunction` carries the stage's closed-form (c_t, e_t) back to whichever
produced the statistics. Where the coefficients are per-token functions of each row's own statistics, the
fused-linear route has a one-pass form instead (`linear_forward_gradient`: the gradient formed in the forward,
carried by `coefficients.ForwardGradientFunction`), and so has the logits route where the fused stage's Triton
kernels cover the call (`logits_forward_gradient`: one launch, SPEC §2.4). A second set of ids per row (the
sampler's or a teacher's top-k, SPEC §9) rides on the same pass: `head_stats` (logits: the custom op of head.py,
whose backward takes [N, k] coefficients) and `linear_head_stats` (hidden + head: k + 1 gathered rows of the head);
a second distribution given as logits goes through `full_divergences` (divergences.py). Modules: vocab.py (the
custom ops over logits), linear.py (the fused-linear custom ops and the one-pass form), kept_set.py (sampler
replay), vocab_parallel.py (tensor parallelism), head.py (head ids), divergences.py (the full form),
coefficients.py (the autograd functions).
"""

from typing import NamedTuple, Optional, Tuple

import torch

from .. import backends
from ..backends.base import rows_form_one_sequence
from ..backends.temperature import Temperature
from . import kept_set, linear, vocab, vocab_parallel
from .coefficients import CoefficientLossFunction, ForwardGradientFunction
from .divergences import divergence_columns, full_divergence_stats, linear_full_divergence_values
from .head import HeadRows, HeadStatistics, head_token_stats, linear_head_logprobs

__all__ = ["CoefficientLossFunction", "ForwardGradientFunction", "HeadStatistics", "PassOptions", "Statistics",
           "full_divergences", "head_stats", "linear_forward_gradient", "linear_full_divergences", "linear_head_stats",
           "linear_token_stats", "logits_forward_gradient", "logits_one_pass_blocker", "one_pass_blocker",
           "token_stats"]


class PassOptions(NamedTuple):
    """What a vocabulary pass computes and how (the call's options, not the data)."""
    entropy: bool = False
    sum_pi_squared: bool = False
    backend: str = "auto"
    chunk_rows: Optional[int] = None  # the torch backend's rows per chunk (logits)
    memory_budget_bytes: Optional[int] = None  # the fused-linear path's chunk of logits (hidden + head)
    inplace_backward: bool = False  # the gradient may overwrite the logits' storage
    head_dtype: Optional[str] = None  # the fused-linear head GEMM: None (the inputs' dtype), "float32" or "tf32"
    numerics: str = "default"  # the sampled token's log-prob: the pass's own, or an engine's order (config.NUMERICS)
    # the fused-linear path runs only the rows in the loss through the head, which costs one host sync (their count
    # sets the GEMM chunks); False (validate=False): every row, no sync (linear.loss_rows)
    select_rows: bool = True


class Statistics(NamedTuple):
    logprobs: torch.Tensor  # [N] float32 (float64 for float64 inputs); autograd to the logits (hidden, head)
    entropy: Optional[torch.Tensor]  # [N], with autograd, or None
    sum_pi_squared: Optional[torch.Tensor]  # [N], no autograd, or None


def _elements_may_share_memory(t: torch.Tensor) -> bool:
    """False when no two elements of `t` can share memory: with its dimensions sorted by stride, each
    stride reaches past everything the smaller ones span. (torch's own internal-overlap check answers
    "too hard" for the causal-shift view and for partly overlapping views alike.)"""
    extent = 1
    for stride, size in sorted((s, n) for s, n in zip(t.stride(), t.shape) if n > 1):
        if stride < extent:
            return True
        extent = stride * size
    return False


def logit_rows(logits: torch.Tensor, inplace_backward: bool) -> torch.Tensor:
    """The logits as the vocabulary passes take them: [N, V], or [B, T, V] when the rows do not form
    one strided sequence (the causal shift `model_out[:, :-1]`): read where they lie, never copied.

    Only a non-unit stride along V is copied (the kernels stream rows), and only rank > 3 is
    flattened with a possible copy."""
    if inplace_backward and _elements_may_share_memory(logits):
        raise ValueError(
            f"logits: inplace_backward=True needs logits whose elements do not share memory, got strides "
            f"{logits.stride()} for shape {tuple(logits.shape)} (an expand()ed or overlapping view); pass "
            "inplace_backward=False"
        )
    if logits.stride(-1) != 1:
        if inplace_backward:
            raise ValueError(f"logits: inplace_backward=True needs unit stride along V, got strides {logits.stride()}")
        logits = logits.contiguous()
    V = logits.shape[-1]
    if logits.dim() == 2:
        return logits
    if logits.dim() == 3:
        return logits.view(-1, V) if rows_form_one_sequence(logits) else logits
    if inplace_backward:
        raise ValueError(
            f"logits: inplace_backward=True needs [N, V] or [B, T, V] rows, got shape {tuple(logits.shape)}"
        )
    return logits.reshape(-1, V)


def _present(stats, options: PassOptions) -> Statistics:
    lp, ent, s2 = stats[-3:]
    return Statistics(lp, ent if options.entropy else None, s2 if options.sum_pi_squared else None)


def token_stats(logits: torch.Tensor, batch, options: PassOptions) -> Statistics:
    """The current policy's statistics from logits [..., V] for `batch` (an inputs.PreparedBatch). The
    backend is chosen here, once per call, and the forward and its backward run that choice by name."""
    inplace = options.inplace_backward
    if batch.support is not None:
        rows = logit_rows(logits, False)
        if kept_set.gathers(batch.support.shape[1], rows.shape[-1]):
            _refuse_numerics(options, "a small kept set (sampling_support)")
            return Statistics(*kept_set.kept_set_stats(
                kept_set.logits_kept(rows, batch.support), batch.support >= 0,
                kept_set.label_slots(batch.support, batch.row_labels), batch.temperature,
                options.entropy, options.sum_pi_squared))
        # a large kept set: the vocabulary pass over logits masked to -inf outside it (a temporary of
        # ours, so its gradient may overwrite it in place)
        logits = rows.masked_fill(~kept_set.kept_mask(batch.support, rows.shape[-1]).reshape(rows.shape),
                                  float("-inf"))
        inplace = True
    rows = logit_rows(logits, inplace)
    name = backends.resolve(options.backend, rows)
    _refuse_unverified_invariance(options, name, rows)
    if batch.tp_group is not None:
        _refuse_numerics(options, "tp_group")
        return Statistics(*vocab_parallel.vocab_parallel_token_stats(
            rows, batch.row_labels, batch.temperature, options.entropy, options.sum_pi_squared,
            name, options.chunk_rows, batch.tp_group))
    return _present(vocab.token_stats(rows, batch.row_labels, batch.temperature.tensor, options.entropy,
                                      options.sum_pi_squared, inplace, name, options.chunk_rows or 0,
                                      options.numerics), options)


def linear_token_stats(hidden: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], batch,
                       options: PassOptions) -> Statistics:
    """The statistics of logits = hidden @ weight.T + bias ([N, H] hidden), never forming [N, V]; the backend
    is chosen here, once per call. With a small kept set only the kept ids' logits, from the K gathered rows
    of the head, for the rows in the loss."""
    if batch.support is not None and kept_set.gathers(batch.support.shape[1], weight.shape[0]):
        _refuse_head_dtype(options, "a small kept set (sampling_support)")
        _refuse_numerics(options, "a small kept set (sampling_support)")
        return _linear_kept_set_stats(hidden, weight, bias, batch, options)
    name = backends.resolve(options.backend, hidden)
    _refuse_unverified_invariance(options, name, hidden)
    chunk_rows = _linear_chunk_rows(hidden, weight, options)
    if batch.tp_group is not None:
        _refuse_head_dtype(options, "tp_group")
        _refuse_numerics(options, "tp_group")
        return Statistics(*vocab_parallel.vocab_parallel_linear_token_stats(
            hidden, weight, bias, batch.row_labels, batch.temperature, options.entropy,
            options.sum_pi_squared, name, chunk_rows, batch.tp_group, options.select_rows))
    head = linear.HeadOptions(name, chunk_rows, support=batch.support,  # a large kept set: masked chunks of logits
                              head_dtype=options.head_dtype or "", numerics=options.numerics,
                              select_rows=options.select_rows)
    return _present(linear.linear_token_stats(hidden, weight, bias, batch.row_labels, batch.temperature.tensor,
                                              options.entropy, options.sum_pi_squared, **head.op_kwargs()), options)


def _linear_chunk_rows(hidden: torch.Tensor, weight: torch.Tensor, options: PassOptions) -> int:
    dtype = linear.logits_dtype(hidden.dtype, options.head_dtype)
    return linear.chunk_rows_for(weight.shape[0], dtype, hidden.device, options.memory_budget_bytes)


def _refuse_unverified_invariance(options: PassOptions, name: str, tensor: torch.Tensor) -> None:
    if options.numerics == "batch_invariant" and name == "torch" and tensor.device.type != "cpu":
        raise ValueError("numerics: 'batch_invariant' with the torch backend is verified on the CPU only (ATen's "
                         "device reductions choose their split by shape); use backend='triton' or 'cuda' there")


def _refuse_variant_head(options: PassOptions) -> None:
    if options.numerics == "batch_invariant":
        raise ValueError("numerics: 'batch_invariant' is not supported with sampler_logits from hidden states yet "
                         "(its divergence pass does not run the head in fixed row blocks)")


def _refuse_numerics(options: PassOptions, what: str) -> None:
    if options.numerics != "default":
        raise ValueError(f"numerics: {options.numerics!r} is not supported with {what} yet; pass numerics='default'")


def _refuse_head_dtype(options: PassOptions, what: str) -> None:
    if options.head_dtype is not None:
        raise ValueError(f"head_dtype: {options.head_dtype!r} is not supported with {what} yet (its head GEMMs run "
                         "in the inputs' dtype); pass head_dtype=None")


def _linear_kept_set_stats(hidden, weight, bias, batch, options: PassOptions) -> Statistics:
    """The kept-set statistics of the rows in the loss (the others stay 0 and never touch the head)."""
    N = hidden.shape[0]
    row_labels, support = batch.row_labels, batch.support
    rows = linear.loss_rows(row_labels >= 0, options.select_rows)  # as the fused-linear path's own selection
    budget = options.memory_budget_bytes or linear.default_memory_budget(hidden.device)
    if not options.select_rows:  # every row: those without a label carry nothing and read no kept id (pads)
        labelled = row_labels >= 0
        hidden = linear.carrying_rows(hidden, labelled)
        support = torch.where(labelled[:, None], support, torch.full((), -1, dtype=support.dtype,
                                                                     device=support.device))
    sub = support.index_select(0, rows)
    kept = kept_set.linear_logits_kept(hidden.index_select(0, rows), weight, bias, sub, budget)
    stats = kept_set.kept_set_stats(kept, sub >= 0, kept_set.label_slots(sub, row_labels.index_select(0, rows)),
                                    batch.temperature.rows(rows), options.entropy, options.sum_pi_squared)
    acc = backends.statistics_dtype(hidden.dtype)

    def full(t):
        if t is None:
            return None
        if not options.select_rows:  # every row was computed; those without a label are 0 (kept_set_stats)
            return t.to(acc)
        return torch.zeros(N, dtype=acc, device=hidden.device).index_copy(0, rows, t)

    return Statistics(*(full(t) for t in stats))


def one_pass_blocker(hidden: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], batch) -> Optional[str]:
    """Why this fused-linear call cannot form its gradient in the forward pass (whatever its coefficients), or
    None. Nothing to differentiate: no gradient work at all. A compiled region: the two-pass custom ops, which
    Dynamo traces (the one-pass loop calls back into Python). float16: the gradients are formed for a unit
    incoming gradient, so a loss scaler's factor (2^16) would come too late to keep small dlogits from
    underflowing (bfloat16 has float32's range). tp_group: each row's statistics need the other ranks' shards
    before its coefficients exist. A small kept set: the K gathered rows of the head."""
    if not torch.is_grad_enabled() or not any(t is not None and t.requires_grad for t in (hidden, weight, bias)):
        return "no gradient is needed"
    if torch.compiler.is_compiling():
        return "inside torch.compile"
    if hidden.dtype == torch.float16:
        return "float16 (a loss scaler's factor must reach the dlogits before they are rounded to float16)"
    if batch.tp_group is not None:
        return "tp_group"
    if batch.support is not None and kept_set.gathers(batch.support.shape[1], weight.shape[0]):
        return "a small kept set (sampling_support)"
    return None


def logits_one_pass_blocker(logits: torch.Tensor, batch, options: PassOptions, validate: bool) -> Optional[str]:
    """Why this logits call cannot form its gradient in the forward pass (SPEC §2.4), as far as the pass goes, or
    None (the stage decides the rest). It runs on the Triton backend (a program per row) or the CPU kernels (a row at
    a time). validate=False on CUDA: its
    backward reads the incoming gradient on the host, to hand back the dlogits it formed for g = 1 as they are; the
    two-pass form reads nothing. Otherwise as `one_pass_blocker`, and the kept set and the numerics modes, whose
    passes are their own."""
    if not torch.is_grad_enabled() or not logits.requires_grad:
        return "no gradient is needed"
    if torch.compiler.is_compiling():
        return "inside torch.compile"
    if logits.dtype == torch.float16:
        return "float16 (a loss scaler's factor must reach the dlogits before they are rounded to float16)"
    if batch.tp_group is not None or batch.support is not None or options.numerics != "default":
        return "tp_group, sampling_support or a numerics mode"
    name = backends.resolve(options.backend, logits)
    if name not in ("triton", "cpu"):
        return f"the {name} backend (the Triton backend and the CPU kernels have it)"
    if not backends.instance(name).forward_gradient_covers(logits.shape[-1]):
        return f"V = {logits.shape[-1]} (its kernel tiers stack rows; from V = 1025 a program streams one)"
    if logits.is_cuda and not validate:
        return "validate=False on CUDA (the backward would read its incoming gradient on the host)"
    if options.inplace_backward:  # the caller asked for no logits-sized buffer: the one-pass form allocates one
        return "inplace_backward=True (the two-pass backward writes dlogits into the logits' storage)"
    return None


def logits_forward_gradient(logits: torch.Tensor, batch, options: PassOptions, factors, codes: dict,
                            hyper: dict) -> Tuple[Statistics, torch.Tensor]:
    """The statistics of every row and dlogits for a unit incoming gradient, in one launch of the Triton backend
    (kernels/triton/forward_grad.py) or one op of the CPU kernels: each row's coefficients are formed from its
    log-prob and the stage's `factors` (stage.fused.forward_factors). dlogits are shaped like `logits`, in their
    dtype, contiguous."""
    rows = logit_rows(logits, False)
    out = torch.empty(rows.shape, dtype=rows.dtype, device=rows.device)
    with torch.no_grad():
        lp, entropy = backends.instance(backends.resolve(options.backend, rows)).forward_gradient(
            rows, batch.row_labels, batch.temperature, out, factors, codes, hyper, options.entropy)
    return Statistics(lp, entropy, None), out.view(logits.shape)


def linear_forward_gradient(hidden: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], batch,
                            options: PassOptions, coefficients: linear.RowCoefficients,
                            kept: Optional[torch.Tensor] = None) -> linear.ForwardGradient:
    """The one-pass fused-linear route ([N, H] hidden): the statistics and dLoss/d(hidden, weight, bias) for a
    unit incoming gradient, with each chunk's coefficients from `coefficients` (see linear.linear_forward_gradient).
    `kept`: [N] bool, the rows whose coefficients may be nonzero (the others get statistics only). The caller
    has checked one_pass_blocker and that the coefficients are per-token."""
    name = backends.resolve(options.backend, hidden)
    _refuse_unverified_invariance(options, name, hidden)
    chunk_rows = _linear_chunk_rows(hidden, weight, options)
    need = (hidden.requires_grad, weight.requires_grad, bias is not None and bias.requires_grad)
    plan = linear.OnePassPlan(row_labels=batch.row_labels, temperature=batch.temperature, support=batch.support,
                              compute_entropy=options.entropy, compute_sum_pi_squared=options.sum_pi_squared,
                              backend=name, chunk_rows=chunk_rows, need=need, kept=kept,
                              head_dtype=options.head_dtype, numerics=options.numerics,
                              select_rows=options.select_rows)
    return linear.linear_forward_gradient(hidden, weight, bias, plan, coefficients)


def _refuse_with_head(batch, what: str) -> None:
    if batch.tp_group is not None or batch.support is not None:
        raise ValueError(f"{what}: not supported with tp_group or sampling_support yet (SPEC §9)")


def head_stats(logits: torch.Tensor, batch, options: PassOptions, head_ids: torch.Tensor) -> HeadStatistics:
    """token_stats with the log-probs at `head_ids` ([N, k], -1 pads) from the same pass (SPEC §9.1): autograd
    reaches the logits from log p_y, the entropy and the head's log-probs. A row whose batch.row_labels is
    FOREIGN_TARGET has no label: its statistics and head only."""
    _refuse_with_head(batch, "sampler_topk_ids / reference_topk_ids")
    _refuse_numerics(options, "sampler_topk_ids")
    rows = logit_rows(logits, False)
    name = backends.resolve(options.backend, rows)
    return head_token_stats(rows, batch.row_labels, head_ids, batch.temperature, options.entropy,
                            options.sum_pi_squared, name, options.chunk_rows or 0)


def linear_head_stats(hidden: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], batch,
                      options: PassOptions, head_ids: torch.Tensor, head_grad: bool = True) -> HeadStatistics:
    """linear_token_stats with the log-probs at `head_ids` (SPEC §9.1): the fused-linear pass for log p_y, then
    the k + 1 logits of each row in the loss from gathered rows of the head. head_grad=False: the head's log-probs
    without autograd (metrics only: nothing of the gathered rows is kept for a backward)."""
    _refuse_with_head(batch, "sampler_topk_ids")
    _refuse_head_dtype(options, "sampler_topk_ids")
    _refuse_numerics(options, "sampler_topk_ids")
    stats = linear_token_stats(hidden, weight, bias, batch, options)
    budget = options.memory_budget_bytes or linear.default_memory_budget(hidden.device)
    with torch.set_grad_enabled(head_grad and torch.is_grad_enabled()):
        rows = HeadRows(batch.row_labels, head_ids, stats.logprobs if head_grad else stats.logprobs.detach())
        head = linear_head_logprobs(hidden, weight, bias, rows, batch.temperature, budget, options.select_rows)
    return HeadStatistics(stats.logprobs, stats.entropy, stats.sum_pi_squared, head)


def full_divergences(logits: torch.Tensor, reference: torch.Tensor, active: torch.Tensor, temperature: Temperature,
                     reference_temperature: Temperature, chunk_rows: Optional[int] = None, backend: str = "auto",
                     with_tv: bool = True):
    """(kl, reverse_kl, chi2, tv), each [N], of softmax(logits / T) against softmax(reference / T_r) (SPEC §9.2,
    the full form); autograd to `logits`. `active`: [N] bool rows. The backend is resolved here and runs both
    passes (its kernels where it has them for these inputs; backends.base.Backend). with_tv=False: tv is None (on
    the GPU one read of both tensors instead of two)."""
    rows = logit_rows(logits, False)
    name = backends.resolve(backend, rows)
    return full_divergence_stats(rows, reference, active, temperature, reference_temperature, name, chunk_rows,
                                 with_tv)


def linear_full_divergences(hidden: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], reference,
                            batch, options: PassOptions, with_tv: bool = True):
    """full_divergences of logits = hidden @ weight.T + bias ([N, H] hidden) against `reference` logits, at the
    batch's temperature, on the rows in the loss; no autograd (the loss's metrics and TRM's mask)."""
    _refuse_head_dtype(options, "sampler_logits")
    _refuse_variant_head(options)
    name = backends.resolve(options.backend, hidden)
    chunk_rows = linear.chunk_rows_for(weight.shape[0], hidden.dtype, hidden.device, options.memory_budget_bytes)
    head = linear.HeadOptions(name, chunk_rows, select_rows=options.select_rows)
    values = linear_full_divergence_values(hidden, weight, bias, reference, batch.mask, batch.temperature, head,
                                           with_tv)
    return divergence_columns(values, with_tv)
