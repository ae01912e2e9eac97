"""Public functions: validate -> pick a backend -> run the fused passes -> return named outputs.

Only this module reads `backend=`. Inputs are never modified (unless `inplace_backward=True`, which
writes dlogits into the logits' storage and bumps their version counter).
"""

from typing import Dict, NamedTuple, Optional, Union

import torch
import torch.distributed as dist

from . import backends, correction, custom_ops, distributed, linear, sampler
from .autograd import CoefficientLossFunction
from .backends.base import rows_form_one_sequence
from .config import (
    BACKENDS,
    PolicyLossConfig,
    RolloutCorrection,
    _check_finite_positive,
    check_memory_budget,
    resolve_config,
)
from .loss import check_split_options
from .metrics import Metrics
from .segments import Segments
from .split import BatchSplit, context_layout
from .validation import check_cu_seqlens, check_head, check_logits, check_tensor, value_checks


class PolicyLossOutput(NamedTuple):
    loss: torch.Tensor  # () differentiable w.r.t. logits (or logprobs / entropy for policy_loss)
    logprobs: torch.Tensor  # [B, T] or [N] float32, detached; 0 off the mask
    entropy: Optional[torch.Tensor]  # like logprobs, or None
    is_weights: Optional[torch.Tensor]  # weights multiplying the policy term, or None
    mask: torch.Tensor  # bool, the final mask after rejection
    metrics: Dict[str, torch.Tensor]  # 0-d device tensors named as in SPEC §8


class TokenStats(NamedTuple):
    logprobs: torch.Tensor
    entropy: Optional[torch.Tensor]
    sum_pi_squared: Optional[torch.Tensor]


class CorrectionOutput(NamedTuple):
    weights: Optional[torch.Tensor]  # IS weights (0 off the mask), or None when is_level is None
    mask: torch.Tensor  # bool mask after rejection
    metrics: Dict[str, torch.Tensor]


def _segments(token_shape, cu_seqlens, device) -> Segments:
    if len(token_shape) == 2:
        return Segments.padded(token_shape[0], token_shape[1], device)
    return Segments.packed(cu_seqlens, token_shape[0], device)


def _check_group(name: str, group) -> None:
    if group is not None and not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"{name}: expected a torch.distributed ProcessGroup or None, got {type(group).__name__}")


class _BatchLayout(NamedTuple):
    split: BatchSplit
    segments: Segments
    num_tokens: Union[int, torch.Tensor, None]  # what cu_seqlens[-1] must be (None: unchecked)
    positions: Union[int, torch.Tensor, None]  # token_index values lie in [0, positions)


def _batch_layout(token_shape, cu_seqlens, device, dp_group, cp_group, token_index):
    """The data/context-parallel split of the batch, this rank's sequence segments, and what the value
    checks compare cu_seqlens[-1] with (None: nothing) and token_index's positions with."""
    _check_group("dp_group", dp_group)
    _check_group("cp_group", cp_group)
    split = BatchSplit(dp_group, cp_group)
    if cp_group is None:
        if token_index is not None:
            raise ValueError("token_index: only used with cp_group (the global positions of this rank's tokens); "
                             "pass cp_group or token_index=None")
        return _BatchLayout(split, _segments(token_shape, cu_seqlens, device), token_shape[0], None)
    if token_index is not None:
        check_tensor("token_index", token_index, kind="int", shape=(token_shape[-1],), device=device)
    layout = context_layout(token_shape, cu_seqlens, token_index, cp_group, device)
    end = layout.total if (len(token_shape) == 2 or cu_seqlens is None) else cu_seqlens[-1]
    return _BatchLayout(split, layout.segments, layout.total, end)


def _layout_and_advantages(token_shape, cu_seqlens, device, advantages, dp_group, cp_group, token_index):
    """The batch layout, and the advantages per token (broadcast to the sequences' tokens when given
    one per sequence: the sequences are known only once the layout is)."""
    per_sequence = _sequence_advantages(advantages, token_shape, cu_seqlens, device, cp_group)
    layout = _batch_layout(token_shape, cu_seqlens, device, dp_group, cp_group, token_index)
    if per_sequence:
        advantages = layout.segments.expand(advantages.reshape(-1)).reshape(token_shape)
    return layout, advantages


def _sequence_advantages(advantages, token_shape, cu_seqlens, device, cp_group=None) -> bool:
    """True when `advantages` holds one value per sequence ([S] or [S, 1]: GRPO-style outcome
    advantages), to be broadcast to the tokens once the sequences are known; False when per token.
    Raises naming the argument when the shape is neither."""
    check_tensor("advantages", advantages, kind="float", device=device)
    if tuple(advantages.shape) == tuple(token_shape):
        return False
    S = token_shape[0] if len(token_shape) == 2 else (1 if cu_seqlens is None else cu_seqlens.numel() - 1)
    if tuple(advantages.shape) == (S,) and cp_group is not None:
        # a rank whose slice holds S tokens would read the same tensor per token
        raise ValueError(f"advantages: with cp_group pass one value per sequence as [{S}, 1], not [{S}]")
    if tuple(advantages.shape) in ((S,), (S, 1)):
        return True
    raise ValueError(f"advantages: expected shape {tuple(token_shape)} (per token) or ({S},) / ({S}, 1) (one per "
                     f"sequence), got {tuple(advantages.shape)}")


def _check_per_token(shape, device, **tensors) -> None:
    for name, x in tensors.items():
        if x is not None:
            check_tensor(name, x, kind="mask" if name == "response_mask" else "float", shape=shape, device=device)


def _temperature_override(config, overrides):
    """(temperature, config): a tensor `temperature=` (per token) is taken out of the overrides and
    stands for the config's float, which must then be left at 1."""
    temperature = overrides.get("temperature")
    if isinstance(temperature, torch.Tensor):
        overrides = {k: v for k, v in overrides.items() if k != "temperature"}
        config = resolve_config(config, overrides)
        if config.temperature != 1.0:
            raise ValueError(f"temperature: given as a tensor while config.temperature={config.temperature}; pass "
                             "one or the other")
        return temperature, config
    config = resolve_config(config, overrides)
    return config.temperature, config


def _check_call(config: PolicyLossConfig, old_logprobs, rollout_logprobs, ref_logprobs, is_weights=None,
                dp_group=None, cp_group=None) -> None:
    check_split_options(config, dp_group, cp_group)
    if config.loss_type == "reinforce" and old_logprobs is not None:
        raise ValueError(
            "old_logprobs: expected None with loss_type='reinforce' (the bypass-mode loss of SPEC §6); "
            "pass rollout_logprobs only, or use loss_type='ppo_clip'"
        )
    if config.kl_coef > 0 and ref_logprobs is None:
        raise ValueError(f"ref_logprobs: expected a tensor since kl_coef={config.kl_coef} > 0, got None")
    rc = config.rollout_correction
    if is_weights is not None and rc is not None and rc.is_level is not None:
        raise ValueError(f"is_weights: given while rollout_correction computes IS weights too (is_level="
                         f"{rc.is_level!r}); pass one or the other")
    if rc is not None and rc.enabled and rollout_logprobs is None:
        raise ValueError("rollout_logprobs: expected a tensor since rollout_correction is set, got None")


def _flat(t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    return None if t is None else t.reshape(-1)


def _row_labels(flat_labels: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """Labels for the vocabulary passes: -1 on every row that takes no part (such rows are never read)."""
    return torch.where(keep, flat_labels, torch.full_like(flat_labels, -1))


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


def _logit_rows(logits: torch.Tensor, inplace_backward: bool) -> torch.Tensor:
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


def _policy_output(
    lp, entropy, advantages, mask, old, rollout, ref, layout, token_shape, config, is_weights=None
) -> PolicyLossOutput:
    """Flat statistics carrying autograd -> the per-sequence stage -> PolicyLossOutput (both entry points)."""
    dt = backends.statistics_dtype(lp.dtype)
    stat_lp = lp.detach().to(dt)
    stat_ent = None if entropy is None else entropy.detach().to(dt)
    stage = backends.select_stage(lp, config.compile_stage)(
        stat_lp, stat_ent, _flat(advantages), mask, _flat(old), _flat(rollout), _flat(ref), layout.segments, config,
        layout.split, None if is_weights is None else _flat(is_weights).detach(),
    )
    loss = CoefficientLossFunction.apply(stage.loss, lp, entropy, stage.coef_logprob, stage.coef_entropy)
    shape = lambda t: None if t is None else t.reshape(token_shape)  # noqa: E731
    return PolicyLossOutput(
        loss, shape(torch.where(mask, stat_lp, torch.zeros_like(stat_lp))), shape(stat_ent), shape(stage.is_weights),
        shape(stage.mask), stage.metrics,
    )


def _vocab_size(local_vocab: int, device, tp_group, inplace: bool = False) -> int:
    """The vocabulary the labels index: this rank's V, or the whole of a vocabulary-parallel group's."""
    _check_group("tp_group", tp_group)
    if tp_group is None:
        return local_vocab
    if inplace:
        raise ValueError("inplace_backward: not supported with tp_group (pass inplace_backward=False)")
    return distributed.shard_offset(tp_group, local_vocab, device)[1]


def _token_stats(logits, row_labels, temperature, entropy, sum_pi_squared, inplace, backend, chunk_rows,
                 tp_group=None, support=None):
    """The fused forward as a custom op (or, with tp_group, the vocabulary-parallel function). The
    backend is chosen here, once per call (the one place that reads backend=), and the forward and
    its backward run that choice by name. With a sampling support: the kept set's statistics from
    the gathered kept logits (sampler.py), no pass over the vocabulary."""
    if support is not None:
        rows = _logit_rows(logits, False)
        if sampler.gathers(support.shape[1], rows.shape[-1]):
            return sampler.kept_set_stats(sampler.logits_kept(rows, support), support >= 0,
                                          sampler.label_slots(support, row_labels), temperature, entropy,
                                          sum_pi_squared)
        # a large kept set: the vocabulary pass over logits masked to -inf outside it (a temporary of
        # ours, so its gradient may overwrite it in place)
        logits = rows.masked_fill(~sampler.kept_mask(support, rows.shape[-1]).reshape(rows.shape), float("-inf"))
        inplace = True
    rows = _logit_rows(logits, inplace)
    per_row = isinstance(temperature, torch.Tensor)
    name = backends.resolve(backend, rows)
    if tp_group is not None:
        return distributed.vocab_parallel_token_stats(
            rows, row_labels, float(temperature), entropy, sum_pi_squared, name, chunk_rows, tp_group
        )
    _, _, lp, ent, s2 = custom_ops.token_stats(
        rows, row_labels, temperature if per_row else custom_ops.temperature_tensor(temperature), entropy,
        sum_pi_squared, inplace, name, chunk_rows or 0,
    )
    return lp, ent if entropy else None, s2 if sum_pi_squared else None


def _loss_tokens(
    source: str, token_shape, V: int, device, labels, advantages, response_mask, old_logprobs, rollout_logprobs,
    ref_logprobs, cu_seqlens, config: PolicyLossConfig, ignore_index: int, dp_group, cp_group, token_index,
    is_weights=None,
):
    """The checks every loss entry point makes on its per-token inputs, then the flat int64 labels,
    the mask m -- the response mask minus ignored tokens and (with validate=False) out-of-range labels,
    which are treated as masked so that nothing is ever read out of bounds -- and the batch layout."""
    check_tensor("labels", labels, kind="int", shape=token_shape, device=device)
    _check_per_token(
        token_shape, device, response_mask=response_mask, old_logprobs=old_logprobs,
        rollout_logprobs=rollout_logprobs, ref_logprobs=ref_logprobs, is_weights=is_weights,
    )
    if cu_seqlens is not None and len(token_shape) == 2:
        raise ValueError(f"cu_seqlens: must be None with padded [B, T, ...] {source}; pass [N, ...] {source} to pack "
                         "sequences")
    check_cu_seqlens(cu_seqlens, token_shape, device)
    _check_call(config, old_logprobs, rollout_logprobs, ref_logprobs, is_weights, dp_group, cp_group)
    layout, advantages = _layout_and_advantages(token_shape, cu_seqlens, device, advantages, dp_group, cp_group,
                                                token_index)
    flat_labels = labels.reshape(-1).long()  # compared in int64: -100 must not wrap in uint8/int8
    in_mask = response_mask.reshape(-1).bool()
    if config.validate:
        value_checks(
            valid=in_mask, labels=flat_labels, vocab=V, ignore_index=ignore_index, cu_seqlens=cu_seqlens,
            num_tokens=layout.num_tokens, token_index=token_index, positions=layout.positions,
            finite=[("advantages", advantages.reshape(-1)), ("is_weights", _flat(is_weights))],
            not_nan=[("old_logprobs", _flat(old_logprobs)), ("rollout_logprobs", _flat(rollout_logprobs)),
                     ("ref_logprobs", _flat(ref_logprobs))],
        )
    mask = in_mask & (flat_labels >= 0) & (flat_labels < V) & (flat_labels != ignore_index)
    return flat_labels, mask, layout, advantages


def decoupled_ppo_loss(
    logits: torch.Tensor, labels: torch.Tensor, advantages: torch.Tensor, response_mask: torch.Tensor, *,
    old_logprobs: Optional[torch.Tensor] = None, rollout_logprobs: Optional[torch.Tensor] = None,
    ref_logprobs: Optional[torch.Tensor] = None, cu_seqlens: Optional[torch.Tensor] = None,
    config: Optional[PolicyLossConfig] = None, ignore_index: int = -100, tp_group=None, dp_group=None,
    cp_group=None, token_index: Optional[torch.Tensor] = None, is_weights: Optional[torch.Tensor] = None,
    sampling_support: Optional[torch.Tensor] = None, **overrides,
) -> PolicyLossOutput:
    """The policy loss of `config.loss_type` (PPO clip by default) with rollout correction, from logits
    (SPEC §1-§8).

    Args:
        logits: [B, T, V] (padded) or [N, V] (packed), float16/bfloat16/float32 (float64 on torch).
        labels: [B, T] / [N] integer sampled tokens; `ignore_index` marks tokens outside the loss.
        advantages: [B, T] / [N] float per token, or one per sequence ([B] / [B, 1] padded, [S] / [S, 1]
            packed; S global under cp_group, which needs [S, 1]), broadcast to the sequence's tokens;
            a tensor of the token shape is always per token.
        response_mask: [B, T] / [N] bool or 0/1; 1 = generated token that enters the loss.
        old_logprobs: proximal policy log-probs (decoupled mode) or None.
        rollout_logprobs: behaviour (inference engine) log-probs; alone they select bypass mode.
        ref_logprobs: reference policy log-probs for the KL penalty.
        cu_seqlens: [S + 1] int32/int64 sequence offsets of the packed layout (None: one sequence).
        config: a PolicyLossConfig; keyword `overrides` replace its fields.
        tp_group: a process group over which the logits are split along the vocabulary (each rank
            passes its contiguous shard, in rank order; labels are global ids): one all_gather per
            call, identical loss and metrics on every rank, each rank's gradient its own slice.
        dp_group: a process group over which the batch is split (data parallelism): normalisers and
            metrics are those of the whole batch, and the loss is scaled so that the mean of the
            ranks' gradients (DDP / FSDP) is the whole batch's gradient.
        cp_group: a process group over which the sequences are split (context parallelism): this
            rank holds the r-th contiguous slice of the packed token axis (or of the padded time
            axis), or the global positions `token_index`; cu_seqlens is the global one. Each rank's
            loss is its tokens' share (the ranks' losses sum to the whole batch's).
        token_index: [N_r] (packed) or [T_r] (padded) global positions of this rank's tokens along
            the split axis, for interleaved (zigzag) context-parallel layouts.
        is_weights: per-token IS weights a trainer computed itself (verl's `rollout_is_weights`),
            detached; they multiply the policy term in every mode, in place of computed ones (the
            config's rollout correction must then have no IS level; its rejection still applies).
        sampling_support: [..., K] the ids the sampler kept at each position (-1 pads): log-probs and
            entropy of the softmax renormalised over them (as `token_logprobs`).
        temperature=: a tensor here (per token, or [B, 1] per sequence) stands for the config's float.
    Returns:
        PolicyLossOutput(loss, logprobs, entropy, is_weights, mask, metrics).
    Raises:
        TypeError / ValueError naming the argument, before any kernel runs (SPEC §11).
    """
    temperature, config = _temperature_override(config, overrides)
    check_logits(logits)
    token_shape = tuple(logits.shape[:-1])
    V = _vocab_size(logits.shape[-1], logits.device, tp_group, config.inplace_backward)
    flat_labels, mask, layout, advantages = _loss_tokens(
        "logits", token_shape, V, logits.device, labels, advantages, response_mask, old_logprobs,
        rollout_logprobs, ref_logprobs, cu_seqlens, config, ignore_index, dp_group, cp_group, token_index, is_weights,
    )
    temperature, support = _sampler_inputs(temperature, sampling_support, token_shape, V, logits.device, flat_labels,
                                           mask, config.validate, tp_group)
    lp, entropy, _ = _token_stats(
        logits, _row_labels(flat_labels, mask), temperature, config.needs_entropy, False,
        config.inplace_backward, config.backend, config.chunk_rows, tp_group, support,
    )
    return _policy_output(
        lp, entropy, advantages, mask, old_logprobs, rollout_logprobs, ref_logprobs, layout, token_shape, config,
        is_weights,
    )


def policy_loss(
    logprobs: torch.Tensor, advantages: torch.Tensor, response_mask: torch.Tensor, *,
    old_logprobs: Optional[torch.Tensor] = None, rollout_logprobs: Optional[torch.Tensor] = None,
    ref_logprobs: Optional[torch.Tensor] = None, entropy: Optional[torch.Tensor] = None,
    cu_seqlens: Optional[torch.Tensor] = None, config: Optional[PolicyLossConfig] = None, dp_group=None,
    cp_group=None, token_index: Optional[torch.Tensor] = None, is_weights: Optional[torch.Tensor] = None,
    **overrides,
) -> PolicyLossOutput:
    """The same loss as `decoupled_ppo_loss` when log-probs (and entropy) come from elsewhere.

    Args:
        logprobs: [B, T] or [N] float current-policy log-probs of the sampled tokens (with autograd).
        entropy: like logprobs, needed when entropy_coeff != 0 (with autograd).
        The other arguments (dp_group, cp_group, token_index, is_weights included) are those of
        `decoupled_ppo_loss`.
    Returns:
        PolicyLossOutput; `loss` is differentiable w.r.t. logprobs and entropy.
    """
    config = resolve_config(config, overrides)
    check_tensor("logprobs", logprobs, kind="float")
    if logprobs.dim() not in (1, 2):
        raise ValueError(f"logprobs: expected [B, T] (padded) or [N] (packed), got shape {tuple(logprobs.shape)}")
    device, token_shape = logprobs.device, tuple(logprobs.shape)
    _check_per_token(
        token_shape, device, response_mask=response_mask, old_logprobs=old_logprobs,
        rollout_logprobs=rollout_logprobs, ref_logprobs=ref_logprobs, entropy=entropy, is_weights=is_weights,
    )
    check_cu_seqlens(cu_seqlens, token_shape, device)
    _check_call(config, old_logprobs, rollout_logprobs, ref_logprobs, is_weights, dp_group, cp_group)
    if config.entropy_coeff != 0 and entropy is None:
        raise ValueError(f"entropy: expected a tensor since entropy_coeff={config.entropy_coeff} != 0, got None")
    layout, advantages = _layout_and_advantages(token_shape, cu_seqlens, device, advantages, dp_group, cp_group,
                                                token_index)
    mask = response_mask.reshape(-1).bool()
    if config.validate:
        value_checks(
            valid=mask, cu_seqlens=cu_seqlens, num_tokens=layout.num_tokens, token_index=token_index,
            positions=layout.positions, finite=[("advantages", _flat(advantages)), ("is_weights", _flat(is_weights))],
            not_nan=[("logprobs", _flat(logprobs)), ("old_logprobs", _flat(old_logprobs)),
                     ("rollout_logprobs", _flat(rollout_logprobs)), ("ref_logprobs", _flat(ref_logprobs))],
        )
    return _policy_output(
        _flat(logprobs), _flat(entropy), advantages, mask, old_logprobs, rollout_logprobs, ref_logprobs, layout,
        token_shape, config, is_weights,
    )


def token_logprobs(
    logits: torch.Tensor, labels: torch.Tensor, *, temperature: Union[float, torch.Tensor] = 1.0,
    compute_entropy: bool = False, compute_sum_pi_squared: bool = False, ignore_index: int = -100,
    backend: str = "auto", validate: bool = True, inplace_backward: bool = False, tp_group=None, dp_group=None,
    cp_group=None, sampling_support: Optional[torch.Tensor] = None,
) -> TokenStats:
    """Per-token log-prob of `labels` under softmax(logits / T), with entropy and sum p^2 (SPEC §2).

    Args:
        logits: [..., V] float; labels: [...] integer (`ignore_index` rows give 0 and no gradient).
        temperature: a float, or a tensor broadcastable to the labels' shape (per token; [B, 1] per
            sequence): the sampler's own temperatures.
        sampling_support: [..., K] integer ids the sampler kept at each position (top-k / top-p / min-p;
            -1 pads): the statistics are those of the softmax renormalised over them, at O(K) per row.
        tp_group: vocabulary parallelism, as in `decoupled_ppo_loss`.
        dp_group, cp_group: accepted so that one set of group arguments fits every entry point; per-token
            statistics need nothing from other data- or context-parallel ranks (no collective).
    Returns:
        TokenStats(logprobs, entropy, sum_pi_squared), float32, shaped like labels; autograd flows
        to logits from logprobs and entropy.
    """
    check_logits(logits, allow_any_rank=True)
    token_shape = tuple(logits.shape[:-1])
    temperature, row_labels = _stats_tokens(
        token_shape, logits.shape[-1], logits.device, labels, temperature, backend, validate, ignore_index, tp_group,
        dp_group, cp_group, inplace_backward,
    )
    temperature, support = _sampler_inputs(temperature, sampling_support, token_shape, logits.shape[-1],
                                           logits.device, labels.reshape(-1).long(), row_labels >= 0, validate,
                                           tp_group)
    stats = _token_stats(logits, row_labels, temperature, compute_entropy, compute_sum_pi_squared, inplace_backward,
                         backend, None, tp_group, support)
    return _shaped_stats(stats, token_shape)


def _stats_tokens(token_shape, local_vocab, device, labels, temperature, backend, validate, ignore_index, tp_group,
                  dp_group, cp_group, inplace=False):
    """The checks of the two token-statistics entry points, then the checked temperature and the row
    labels (-1 on ignored rows and, with validate=False, out-of-range labels)."""
    check_tensor("labels", labels, kind="int", shape=token_shape, device=device)
    _check_group("dp_group", dp_group)  # accepted and unused: per-token statistics combine nothing
    _check_group("cp_group", cp_group)
    if not isinstance(temperature, torch.Tensor):
        temperature = _check_finite_positive("temperature", temperature)  # the checks PolicyLossConfig makes
    if backend not in BACKENDS:
        raise ValueError(f"backend: expected one of {BACKENDS}, got {backend!r}")
    V = _vocab_size(local_vocab, device, tp_group, inplace)
    flat_labels = labels.reshape(-1).long()  # compared in int64: -100 must not wrap in uint8/int8
    if validate:
        value_checks(valid=flat_labels != ignore_index, labels=flat_labels, vocab=V, ignore_index=ignore_index,
                     where="tokens whose label is not ignore_index")
    keep = (flat_labels >= 0) & (flat_labels < V) & (flat_labels != ignore_index)
    return temperature, _row_labels(flat_labels, keep)


def _sampler_inputs(temperature, sampling_support, token_shape, V, device, flat_labels, keep, validate, tp_group):
    """The temperature (a float, or a per-token [N] tensor) and the sampler's kept ids ([N, K] int64, or
    None), checked: types, shapes and devices always; with validate, in one sync, positive finite
    temperatures, ids in [-1, V), no id twice in a row, and every label in the loss among its row's ids."""
    per_token = isinstance(temperature, torch.Tensor)
    if per_token:
        check_tensor("temperature", temperature, kind="float", device=device)
        if temperature.dim() not in (0, len(token_shape)):  # a [B] tensor would broadcast along T, not B
            raise ValueError(f"temperature: expected a tensor with the labels' {len(token_shape)} dimensions "
                             f"(per token {token_shape}" + (", or [B, 1] per sequence" if len(token_shape) == 2
                                                            else "") + f"), got shape {tuple(temperature.shape)}")
        try:
            temperature = torch.broadcast_to(temperature, token_shape).reshape(-1).detach()
        except RuntimeError:
            raise ValueError(f"temperature: expected a float or a tensor broadcastable to the labels' shape "
                             f"{token_shape} (per token, or [B, 1] per sequence), got shape "
                             f"{tuple(temperature.shape)}") from None
    # a float was checked already (PolicyLossConfig, or _stats_tokens)
    support = None
    if sampling_support is not None:
        check_tensor("sampling_support", sampling_support, kind="int", device=device)
        if (sampling_support.dim() != len(token_shape) + 1 or tuple(sampling_support.shape[:-1]) != token_shape
                or sampling_support.shape[-1] == 0):
            raise ValueError(f"sampling_support: expected shape {token_shape + ('K',)} (the labels' shape and K >= 1 "
                             f"kept ids, -1 padding), got {tuple(sampling_support.shape)}")
        support = sampling_support.reshape(-1, sampling_support.shape[-1]).long()
    if tp_group is not None and (per_token or support is not None):
        raise ValueError("temperature / sampling_support: a per-token temperature or a kept set is not supported with "
                         "tp_group yet")
    if validate and (per_token or support is not None):
        zero = torch.zeros((), dtype=torch.bool, device=device)
        bad_t = (~torch.isfinite(temperature) | (temperature <= 0)).any() if per_token else zero
        bad_id = missing = twice = zero
        if support is not None and support.numel():
            bad_id = ((support < -1) | (support >= V)).any()
            ordered = support.sort(1).values
            twice = ((ordered[:, 1:] == ordered[:, :-1]) & (ordered[:, 1:] >= 0)).any()
            missing = (keep & ~(support == flat_labels[:, None]).any(1)).any()
        elif support is not None:
            missing = keep.any()
        flags = torch.stack([bad_t, bad_id, twice, missing]).tolist()  # the one sync of these checks
        for flag, message in zip(flags, (
                "temperature: expected finite values > 0",
                f"sampling_support: expected token ids in [0, {V}) or -1 (padding)",
                "sampling_support: an id appears twice in a row (the kept set is a set)",
                "sampling_support: a label in the loss is not among its row's kept ids (the sampler cannot have "
                "drawn it)")):
            if flag:
                raise ValueError(message)
    return temperature, support


def _shaped_stats(stats, token_shape) -> TokenStats:
    return TokenStats(*(None if t is None else t.reshape(token_shape) for t in stats))


def _linear_stats(hidden2d, weight, bias, row_labels, temperature, entropy, sum_pi_squared, backend, budget,
                  tp_group=None, support=None):
    """The fused-linear forward as a custom op (or, with tp_group, its vocabulary-parallel form); the
    backend is chosen here, once per call. With a sampling support: only the kept ids' logits, from
    the K gathered rows of the head (sampler.py), for the rows in the loss."""
    if support is not None and sampler.gathers(support.shape[1], weight.shape[0]):
        return _linear_kept_set_stats(hidden2d, weight, bias, row_labels, temperature, entropy, sum_pi_squared,
                                      budget, support)
    per_row = isinstance(temperature, torch.Tensor)
    name = backends.resolve(backend, hidden2d)
    chunk_rows = linear.chunk_rows_for(weight.shape[0], hidden2d.dtype, hidden2d.device, budget)
    if tp_group is not None:
        return distributed.vocab_parallel_linear_token_stats(
            hidden2d, weight, bias, row_labels, float(temperature), entropy, sum_pi_squared, name,
            chunk_rows, tp_group,
        )
    _, _, lp, ent, s2 = linear.linear_token_stats(
        hidden2d, weight, bias, row_labels, temperature if per_row else custom_ops.temperature_tensor(temperature),
        entropy, sum_pi_squared, name, chunk_rows, False, support,  # a large kept set: masked chunks of logits
    )
    return lp, ent if entropy else None, s2 if sum_pi_squared else None


def _linear_kept_set_stats(hidden2d, weight, bias, row_labels, temperature, entropy, sum_pi_squared, budget, support):
    """The kept-set statistics of the rows in the loss (the others stay 0 and never touch the head)."""
    N = hidden2d.shape[0]
    rows = torch.nonzero(row_labels >= 0).squeeze(1)  # a sync, as the fused-linear path's own row selection
    budget = budget or linear.DEFAULT_MEMORY_BUDGET_BYTES["cuda" if hidden2d.is_cuda else "cpu"]
    kept = sampler.linear_logits_kept(hidden2d.index_select(0, rows), weight, bias, support.index_select(0, rows),
                                      budget)
    t_rows = temperature.index_select(0, rows) if isinstance(temperature, torch.Tensor) else temperature
    sub = support.index_select(0, rows)
    stats = sampler.kept_set_stats(kept, sub >= 0, sampler.label_slots(sub, row_labels.index_select(0, rows)),
                                   t_rows, entropy, sum_pi_squared)
    acc = backends.statistics_dtype(hidden2d.dtype)
    full = lambda t: None if t is None else torch.zeros(N, dtype=acc, device=hidden2d.device).index_copy(  # noqa: E731
        0, rows, t)
    return tuple(full(t) for t in stats)


def linear_decoupled_ppo_loss(
    hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, advantages: torch.Tensor,
    response_mask: torch.Tensor, *, bias: Optional[torch.Tensor] = None, old_logprobs: Optional[torch.Tensor] = None,
    rollout_logprobs: Optional[torch.Tensor] = None, ref_logprobs: Optional[torch.Tensor] = None,
    cu_seqlens: Optional[torch.Tensor] = None, config: Optional[PolicyLossConfig] = None, ignore_index: int = -100,
    tp_group=None, dp_group=None, cp_group=None, token_index: Optional[torch.Tensor] = None,
    is_weights: Optional[torch.Tensor] = None, sampling_support: Optional[torch.Tensor] = None, **overrides,
) -> PolicyLossOutput:
    """`decoupled_ppo_loss` on logits = hidden @ weight.T + bias, without ever forming [N, V] logits.

    Rows outside the loss never touch the head; the logits of the others are formed a chunk at a time
    (`config.memory_budget_bytes`) in forward and backward. Same outputs, metrics and config as
    `decoupled_ppo_loss`; row t of `hidden` predicts `labels[t]` (no shift inside).

    Args:
        hidden: [B, T, H] (padded) or [N, H] (packed) float16/bfloat16/float32 (float64 on torch).
        weight: [V, H] LM-head weight (the nn.Linear layout; tied embeddings are that tensor), same dtype.
        bias: [V] or None.
        tp_group: the head split over the vocabulary: this rank's weight rows (and bias) [V_r, H] of
            the contiguous shard [o_r, o_r + V_r); one all_gather forward, one all_reduce (d_hidden)
            backward.
        The other arguments (dp_group, cp_group, token_index, is_weights included) are those of
        `decoupled_ppo_loss`.
    Returns:
        PolicyLossOutput; `loss` is differentiable w.r.t. hidden, weight and bias.
    Raises:
        TypeError / ValueError naming the argument, before any kernel runs (SPEC §11).
    """
    temperature, config = _temperature_override(config, overrides)
    check_head(hidden, weight, bias)
    token_shape = tuple(hidden.shape[:-1])
    V = _vocab_size(weight.shape[0], hidden.device, tp_group)
    flat_labels, mask, layout, advantages = _loss_tokens(
        "hidden", token_shape, V, hidden.device, labels,
        advantages, response_mask, old_logprobs, rollout_logprobs, ref_logprobs, cu_seqlens, config, ignore_index,
        dp_group, cp_group, token_index, is_weights,
    )
    temperature, support = _sampler_inputs(temperature, sampling_support, token_shape, V, hidden.device, flat_labels,
                                           mask, config.validate, tp_group)
    lp, entropy, _ = _linear_stats(
        hidden.reshape(-1, hidden.shape[-1]), weight, bias, _row_labels(flat_labels, mask), temperature,
        config.needs_entropy, False, config.backend, config.memory_budget_bytes, tp_group, support,
    )
    return _policy_output(
        lp, entropy, advantages, mask, old_logprobs, rollout_logprobs, ref_logprobs, layout, token_shape, config,
        is_weights,
    )


def linear_token_logprobs(
    hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, *, bias: Optional[torch.Tensor] = None,
    temperature: Union[float, torch.Tensor] = 1.0, compute_entropy: bool = False,
    compute_sum_pi_squared: bool = False, ignore_index: int = -100, backend: str = "auto", validate: bool = True,
    memory_budget_bytes: Optional[int] = None, tp_group=None, dp_group=None, cp_group=None,
    sampling_support: Optional[torch.Tensor] = None,
) -> TokenStats:
    """`token_logprobs` of logits = hidden @ weight.T + bias (SPEC §2), never forming [N, V] logits.

    Args:
        hidden: [..., H] float; weight: [V, H]; bias: [V] or None; labels: [...] integer
            (`ignore_index` rows give 0, never touch the head, and get no gradient).
        tp_group, dp_group, cp_group, temperature, sampling_support: as in `token_logprobs` (with a
            support only the K kept rows of the head are read for each row: no V-wide product).
    Returns:
        TokenStats(logprobs, entropy, sum_pi_squared), float32, shaped like labels; autograd flows
        from logprobs and entropy to hidden, weight and bias. Under torch.no_grad() this is the lean
        pass trainers run for old and reference log-probs.
    """
    check_head(hidden, weight, bias, allow_any_rank=True)
    check_memory_budget(memory_budget_bytes)
    token_shape = tuple(hidden.shape[:-1])
    temperature, row_labels = _stats_tokens(
        token_shape, weight.shape[0], hidden.device, labels, temperature, backend, validate, ignore_index, tp_group,
        dp_group, cp_group,
    )
    temperature, support = _sampler_inputs(temperature, sampling_support, token_shape, weight.shape[0],
                                           hidden.device, labels.reshape(-1).long(), row_labels >= 0, validate,
                                           tp_group)
    stats = _linear_stats(hidden.reshape(-1, hidden.shape[-1]), weight, bias, row_labels, temperature,
                          compute_entropy, compute_sum_pi_squared, backend, memory_budget_bytes, tp_group, support)
    return _shaped_stats(stats, token_shape)


def rollout_correction(
    train_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, response_mask: torch.Tensor, *,
    cu_seqlens: Optional[torch.Tensor] = None, config: RolloutCorrection, validate: bool = True, dp_group=None,
    cp_group=None, token_index: Optional[torch.Tensor] = None,
) -> CorrectionOutput:
    """IS weights (SPEC §4), rejection mask (§5) and rollout_corr/* metrics (§8), without a loss.

    Args:
        train_logprobs: [B, T] / [N] log-probs of the training policy (ℓold in decoupled mode).
        rollout_logprobs: same shape, from the inference engine.
        response_mask: same shape, bool or 0/1.
        config: a RolloutCorrection.
        dp_group, cp_group, token_index: a split batch, as in `decoupled_ppo_loss` (metrics, sequence
            decisions and batch normalisation are those of the whole batch).
    Returns:
        CorrectionOutput(weights or None, mask, metrics); nothing carries autograd.
    """
    if not isinstance(config, RolloutCorrection):
        raise TypeError(f"config: expected a RolloutCorrection, got {type(config).__name__}")
    check_tensor("train_logprobs", train_logprobs, kind="float")
    if train_logprobs.dim() not in (1, 2):
        raise ValueError(f"train_logprobs: expected [B, T] or [N], got shape {tuple(train_logprobs.shape)}")
    device, token_shape = train_logprobs.device, tuple(train_logprobs.shape)
    _check_per_token(token_shape, device, rollout_logprobs=rollout_logprobs, response_mask=response_mask)
    check_cu_seqlens(cu_seqlens, token_shape, device)
    layout = _batch_layout(token_shape, cu_seqlens, device, dp_group, cp_group, token_index)
    mask = response_mask.reshape(-1).bool()
    tr, ro = train_logprobs.reshape(-1), rollout_logprobs.reshape(-1)
    if validate:
        value_checks(valid=mask, cu_seqlens=cu_seqlens, num_tokens=layout.num_tokens, token_index=token_index,
                     positions=layout.positions, not_nan=[("train_logprobs", tr), ("rollout_logprobs", ro)])
    dt = backends.statistics_dtype(train_logprobs.dtype)
    zero = torch.zeros((), dtype=dt, device=device)
    tr = torch.where(mask, tr.detach().to(dt), zero)
    ro = torch.where(mask, ro.detach().to(dt), zero)
    terms, table, decisions, norms, weights = correction.correct(tr, ro, mask, layout.segments, config, layout.split)
    metrics = Metrics()
    correction.record_metrics(metrics, terms, mask, table, decisions, norms, config, weights)
    final_mask, metrics = decisions.mask, metrics.finish(layout.split)
    return CorrectionOutput(
        None if weights is None else weights.weights.reshape(token_shape), final_mask.reshape(token_shape), metrics
    )


def metrics_to_floats(metrics: Dict[str, torch.Tensor]) -> Dict[str, float]:
    """Device metrics -> Python floats for loggers, with one host synchronisation for all of them."""
    if not metrics:
        return {}
    names = list(metrics)
    values = torch.stack([metrics[n].detach().reshape(()).to(torch.float64) for n in names]).cpu().tolist()
    return dict(zip(names, values))
