"""The inputs of the functions that read a second distribution beside the trainer's logits (SPEC §9):
`token_divergences` (a reference given as logits or as top-k ids with log-probs) and `topk_distillation_loss`
(a teacher's top-k), checked: the second distribution, the rows that take part, the temperatures."""

import math
from typing import NamedTuple, Optional, Tuple

import torch

from ..backends.base import DIVERGENCES, FOREIGN_TARGET
from ..backends.temperature import Temperature
from ..config import BACKENDS, check_finite_positive
from .batch import PreparedBatch, _row_labels
from .checks import ValueChecks, check_logits, check_tensor
from .sampler import SamplerHead, check_head_values, per_token_temperature, prepare_head

REFERENCE_NAMES = ("reference_topk_ids", "reference_topk_logprobs", "reference_logits")
TEACHER_NAMES = ("teacher_topk_ids", "teacher_topk_logprobs", "teacher_logits")
DISTILLATION_KINDS = ("forward_kl", "forward_kl_tail", "reverse_kl")


class DivergenceRows(NamedTuple):
    """token_divergences' rows: which take part, their labels for the pass, the temperatures, the value checks."""
    rows: torch.Tensor  # [N] bool
    row_labels: torch.Tensor  # [N] int64: the label, -1 outside, FOREIGN_TARGET on rows without a label
    temperature: Temperature
    reference_temperature: Temperature
    checks: ValueChecks
    prepared: PreparedBatch  # what ops.head_stats reads


def _divergence_rows(token_shape, vocab: int, device, labels, temperatures: Tuple, backend: str,
                     ignore_index: int, mask=None) -> DivergenceRows:
    """The checks of token_divergences' rows, labels and temperatures (the trainer's, the reference's or None),
    the label range among the value checks. `mask`: [...] bool or 0/1, the rows that take part (without labels;
    None: every row)."""
    temperature, reference_temperature = temperatures
    if backend not in BACKENDS:
        raise ValueError(f"backend: expected one of {BACKENDS}, got {backend!r}")
    checks = ValueChecks()
    N = math.prod(token_shape)
    if labels is None:
        rows = torch.ones(N, dtype=torch.bool, device=device)
        if mask is not None:
            check_tensor("response_mask", mask, kind="mask", shape=token_shape, device=device)
            checks.mask_values("response_mask", mask)
            rows = mask.reshape(-1).bool()
        row_labels = torch.where(rows, FOREIGN_TARGET, -1).to(torch.int64)
    else:
        check_tensor("labels", labels, kind="int", shape=token_shape, device=device)
        flat = labels.reshape(-1).long()
        checks.labels(flat != ignore_index, flat, vocab, ignore_index, "tokens whose label is not ignore_index")
        rows = (flat >= 0) & (flat < vocab) & (flat != ignore_index)
        row_labels = _row_labels(flat, rows)

    def one(name, t) -> Temperature:
        if isinstance(t, torch.Tensor):
            per_token = per_token_temperature(t, token_shape, device)
            checks.add((~torch.isfinite(per_token) | (per_token <= 0)).any(), f"{name}: expected finite values > 0")
            return Temperature(per_token)
        check_finite_positive(name, t)
        return Temperature.of(t)

    t = one("temperature", temperature)
    t_ref = t if reference_temperature is None else one("reference_temperature", reference_temperature)
    prepared = PreparedBatch(token_shape=token_shape, mask=rows, row_labels=row_labels, vocab_size=vocab,
                             temperature=t)
    return DivergenceRows(rows, row_labels, t, t_ref, checks, prepared)


class DivergenceInputs(NamedTuple):
    head: SamplerHead  # the second distribution: top-k ids and log-probs, or logits
    rows: DivergenceRows
    labelled: bool  # labels were given (the top-k form then reports whether each is among the ids)
    wanted: Tuple[str, ...] = DIVERGENCES  # the divergences asked for (the others come back None)


def check_wanted(divergences) -> Tuple[str, ...]:
    """token_divergences' `divergences`: a non-empty selection of DIVERGENCES, as a tuple."""
    wanted = (divergences,) if isinstance(divergences, str) else tuple(divergences)
    unknown = [d for d in wanted if d not in DIVERGENCES]
    if unknown or not wanted:
        raise ValueError(f"divergences: expected a non-empty selection of {DIVERGENCES}, got {divergences!r}")
    return wanted


def prepare_divergences(logits, labels, reference: Tuple, temperatures: Tuple, mode: str, ignore_index: int,
                        backend: str, validate: bool) -> DivergenceInputs:
    """token_divergences: `reference` is (reference_topk_ids, reference_topk_logprobs, reference_logits),
    `temperatures` (temperature, reference_temperature). Every divergence is wanted (the caller narrows `wanted`)."""
    check_logits(logits, allow_any_rank=True)
    token_shape, V = tuple(logits.shape[:-1]), logits.shape[-1]
    head = prepare_head(REFERENCE_NAMES, reference, token_shape, V, logits.device, mode, trainer_shape=logits.shape)
    if head is None:
        raise ValueError("reference_logits / reference_topk_ids: expected the second distribution, as logits (full "
                         "form) or as top-k ids with their log-probs, got neither")
    if head.logits is None and temperatures[1] is not None:
        raise ValueError("reference_temperature: only the full form takes it (top-k log-probs are the sampler's own, "
                         "at its temperature); pass reference_logits or leave it None")
    rows = _divergence_rows(token_shape, V, logits.device, labels, temperatures, backend, ignore_index)
    if validate:
        check_head_values(rows.checks, head, REFERENCE_NAMES[:2], V, rows.rows,
                          None if labels is None else rows.row_labels)
        rows.checks.run()
    return DivergenceInputs(head, rows, labels is not None)


class DistillationOptions(NamedTuple):
    """topk_distillation_loss's options, as the caller passed them (checked by prepare_distillation)."""
    kind: str = "forward_kl"
    log_prob_min_clamp: Optional[float] = None
    loss_max_clamp: Optional[float] = None
    loss_agg_mode: str = "token-mean"
    backend: str = "auto"
    validate: bool = True


class DistillationInputs(NamedTuple):
    head: SamplerHead  # the teacher's top-k
    rows: DivergenceRows
    options: DistillationOptions


def _check_distillation_options(options: DistillationOptions) -> None:
    if options.kind not in DISTILLATION_KINDS:
        raise ValueError(f"kind: expected one of {DISTILLATION_KINDS}, got {options.kind!r}")
    if options.loss_agg_mode not in ("token-mean", "token-sum"):
        raise ValueError(f"loss_agg_mode: expected 'token-mean' or 'token-sum' (the per-token losses are returned for "
                         f"any other aggregation), got {options.loss_agg_mode!r}")
    for name in ("log_prob_min_clamp", "loss_max_clamp"):
        value = getattr(options, name)
        if value is not None and not (isinstance(value, (int, float)) and math.isfinite(value)):
            raise ValueError(f"{name}: expected a finite number or None, got {value!r}")
    if options.loss_max_clamp is not None and options.loss_max_clamp <= 0:
        raise ValueError(f"loss_max_clamp: expected a value > 0, got {options.loss_max_clamp!r}")


def prepare_distillation(logits, teacher: Tuple, response_mask, temperature,
                         options: DistillationOptions) -> DistillationInputs:
    """topk_distillation_loss: `teacher` is (teacher_topk_ids, teacher_topk_logprobs)."""
    _check_distillation_options(options)
    check_logits(logits, allow_any_rank=True)
    token_shape, V = tuple(logits.shape[:-1]), logits.shape[-1]
    head = prepare_head(TEACHER_NAMES, (*teacher, None), token_shape, V, logits.device, "selected")
    if head is None:
        raise ValueError("teacher_topk_ids / teacher_topk_logprobs: expected the teacher's top-k ids and their "
                         "log-probs, got None")
    rows = _divergence_rows(token_shape, V, logits.device, None, (temperature, None), options.backend, -100,
                            mask=response_mask)
    if options.validate:
        check_head_values(rows.checks, head, TEACHER_NAMES[:2], V, rows.rows, None)
        rows.checks.run()
    return DistillationInputs(head, rows, options)
