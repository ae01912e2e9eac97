"""The public functions, each the same four steps: inputs.prepare_*() -> ops.* -> stage.run() -> output.

Only `ops` reads `backend=`. Inputs are never modified (unless `inplace_backward=True`, which writes
dlogits into the logits' storage and bumps their version counter).
"""

import math
from dataclasses import replace
from typing import Dict, NamedTuple, Optional, Union

import torch

from . import ops, stage
from .backends import statistics_dtype
from .config import (
    SAMPLER_HEAD_LOSSES,
    PolicyLossConfig,
    RolloutCorrection,
    check_finite_positive,
    check_memory_budget,
)
from .inputs import (
    Arguments,
    PreparedBatch,
    check_head,
    check_head_values,
    check_logits,
    prepare_baseline_rows,
    prepare_correction,
    prepare_divergence_rows,
    prepare_head,
    prepare_loss,
    prepare_policy,
    prepare_stats,
    prepare_variance_rows,
    resolve_config,
)
from .stage import baseline, correction, distillation
from .stage.divergences import Divergences, partition
from .stage.metrics import Metrics
from .stage.policy_terms import HeadContext


class PolicyLossOutput(NamedTuple):
    loss: torch.Tensor  # () differentiable w.r.t. logits (or logprobs / entropy for policy_loss)
    logprobs: torch.Tensor  # [B, T] or [N] float32, detached; 0 off the mask
    entropy: Optional[torch.Tensor]  # like logprobs, or None
    is_weights: Optional[torch.Tensor]  # weights multiplying the policy term, or None
    mask: torch.Tensor  # bool, the final mask after rejection
    metrics: Dict[str, torch.Tensor]  # 0-d device tensors named as in SPEC §8
    # how the gradient is formed (SPEC §2.1): "logits" (the logits' backward pass), "linear_two_pass" (the
    # fused-linear backward recomputes the logits) or "linear_one_pass" (formed in the forward, scaled after)
    path: str = "logits"


class TokenStats(NamedTuple):
    logprobs: torch.Tensor
    entropy: Optional[torch.Tensor]
    sum_pi_squared: Optional[torch.Tensor]


class CorrectionOutput(NamedTuple):
    weights: Optional[torch.Tensor]  # IS weights (0 off the mask), or None when is_level is None
    mask: torch.Tensor  # bool mask after rejection
    metrics: Dict[str, torch.Tensor]


def _policy_output(stats: ops.Statistics, batch: PreparedBatch, config: PolicyLossConfig,
                   path: str = "logits", head_logprobs: Optional[torch.Tensor] = None) -> PolicyLossOutput:
    """The current policy's statistics (carrying autograd) -> the per-sequence stage -> PolicyLossOutput.
    `head_logprobs`: [N, k] at the sampler's head ids, with autograd, for a loss that reads them (SPEC §9)."""
    lp, entropy = stats.logprobs, stats.entropy
    dt = statistics_dtype(lp.dtype)
    detached = TokenStats(lp.detach().to(dt), None if entropy is None else entropy.detach().to(dt), None)
    if head_logprobs is not None and config.loss_type in SAMPLER_HEAD_LOSSES:
        head = batch.sampler_head
        batch = replace(batch, head_terms=HeadContext(head_logprobs.detach().to(dt), head.logprobs, head.slots))
    else:
        head_logprobs = None
    out = stage.select(lp, config.compile_stage)(detached, batch, config)
    loss = ops.CoefficientLossFunction.apply(out.loss, lp, entropy, out.coef_logprob, out.coef_entropy,
                                             head_logprobs, out.coef_head)
    return _output(loss, detached, out, batch, path)


def _output(loss, detached: TokenStats, out: stage.StageOutput, batch: PreparedBatch, path: str) -> PolicyLossOutput:
    shape = lambda t: None if t is None else t.reshape(batch.token_shape)  # noqa: E731
    logprobs = torch.where(batch.mask, detached.logprobs, torch.zeros_like(detached.logprobs))
    return PolicyLossOutput(loss, shape(logprobs), shape(detached.entropy), shape(out.is_weights), shape(out.mask),
                            out.metrics, path)


def _one_pass_output(hidden: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], batch: PreparedBatch,
                     config: PolicyLossConfig, options: ops.PassOptions) -> PolicyLossOutput:
    """The fused-linear loss with its gradient formed in the forward (SPEC §2.1): the rollout correction once,
    then, for each chunk of rows, the stage's coefficients of those rows from their fresh statistics (exact: no
    row's coefficients depend on another row's statistics here), then the whole stage on every row for the
    loss and the metrics, as the two-pass route computes them."""
    rows = hidden.reshape(-1, hidden.shape[-1])
    dt = statistics_dtype(hidden.dtype)
    # rows whose statistics are not in yet hold the proximal policy's log-probs (a ratio of 1: every value of
    # the stage stays finite there; nothing of them reaches the chunk's coefficients)
    proximal = batch.old_logprobs if batch.old_logprobs is not None else batch.rollout_logprobs
    zero = torch.zeros((), dtype=dt, device=hidden.device)
    lp = torch.zeros(rows.shape[0], dtype=dt, device=hidden.device) if proximal is None else \
        torch.where(batch.mask, proximal.to(dt), zero)
    entropy = torch.zeros_like(lp) if options.entropy else None
    corrected = stage.correct(TokenStats(lp, entropy, None), batch, config)  # once: its collectives too

    def coefficients(idx, lp_rows, entropy_rows):
        lp.index_copy_(0, idx, lp_rows)
        if entropy is not None:
            entropy.index_copy_(0, idx, entropy_rows)
        out = stage.run(TokenStats(lp, entropy, None), batch, config, corrected=corrected, metrics=False)
        e = None if out.coef_entropy is None else out.coef_entropy.index_select(0, idx)
        return out.coef_logprob.index_select(0, idx), e

    grads = ops.linear_forward_gradient(rows, weight, bias, batch, options, coefficients, stage.kept_mask(corrected))
    detached = TokenStats(grads.logprobs, grads.entropy, None)
    # the correction is reused unless it reads the current policy (bypass mode's mismatch metrics): then the split
    # is combined a second time. Eager either way: a compiled stage takes no precomputed correction
    reuse = None if stage.correction_reads_current_policy(batch) else corrected
    out = stage.run(detached, batch, config, corrected=reuse)
    d_hidden = None if grads.d_hidden is None else grads.d_hidden.view(hidden.shape)
    loss = ops.ForwardGradientFunction.apply(out.loss, hidden, weight, bias, d_hidden, grads.d_weight, grads.d_bias)
    return _output(loss, detached, out, batch, "linear_one_pass")


def _shaped(stats: ops.Statistics, token_shape) -> TokenStats:
    return TokenStats(*(None if t is None else t.reshape(token_shape) for t in stats))


def decoupled_ppo_loss(
    logits: torch.Tensor, labels: torch.Tensor, advantages: torch.Tensor, response_mask: torch.Tensor, *,
    old_logprobs: Optional[torch.Tensor] = None, rollout_logprobs: Optional[torch.Tensor] = None,
    ref_logprobs: Optional[torch.Tensor] = None, cu_seqlens: Optional[torch.Tensor] = None,
    config: Optional[PolicyLossConfig] = None, ignore_index: int = -100, tp_group=None, dp_group=None,
    cp_group=None, token_index: Optional[torch.Tensor] = None, is_weights: Optional[torch.Tensor] = None,
    sampling_support: Optional[torch.Tensor] = None, sampler_topk_ids: Optional[torch.Tensor] = None,
    sampler_topk_logprobs: Optional[torch.Tensor] = None, sampler_logits: Optional[torch.Tensor] = None,
    sampler_topk_mode: str = "selected", **overrides,
) -> PolicyLossOutput:
    """The policy loss of `config.loss_type` (PPO clip by default) with rollout correction, from logits
    (SPEC §1-§9).

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
        ignore_index: the label of tokens outside the loss.
        sampling_support: [..., K] the ids the sampler kept at each position (-1 pads): log-probs and
            entropy of the softmax renormalised over them (as `token_logprobs`).
        sampler_topk_ids: [..., k] the sampler's top-k ids at each position (-1 pads; vLLM `logprobs=k`, SGLang
            `top_logprobs_num`, slime `rollout_topk_token_ids`), with
        sampler_topk_logprobs: [..., k] their full-vocabulary log-probs under the sampler. The divergences
            between the trainer and the sampler over {the ids, the tail} (SPEC §9) come from the same pass:
            rollout_corr/topk_* metrics, and the seq_max_kl / seq_mean_kl rejection options (TRM).
        sampler_logits: [..., V] the sampler's logits instead (recomputed rollout logits): exact divergences,
            rollout_corr/full_* metrics, one more read of both tensors. Detached.
        sampler_topk_mode: "selected" (candidates before filtering) or "support" (the kept set after top-k /
            top-p; each sampled token must be among the ids), as token_divergences' `mode`.
        **overrides: fields of `config` to replace; `temperature=` may be a tensor here (per token, or
            [B, 1] per sequence), standing for the config's float.

    Returns:
        PolicyLossOutput(loss, logprobs, entropy, is_weights, mask, metrics, path): path says how the
        gradient is formed ("logits"; the fused-linear path's "linear_one_pass" / "linear_two_pass", SPEC §2.1).

    Raises:
        TypeError: an argument of the wrong type, named, before any kernel runs (SPEC §11).
        ValueError: an argument of the wrong shape, device or value, named, before any kernel runs.
    """
    config, temperature = resolve_config(config, overrides)
    check_logits(logits)
    args = Arguments(labels, advantages, response_mask, old_logprobs, rollout_logprobs, ref_logprobs, is_weights,
                     None, cu_seqlens, token_index, tp_group, dp_group, cp_group, temperature, sampling_support,
                     ignore_index, (sampler_topk_ids, sampler_topk_logprobs, sampler_logits), sampler_topk_mode)
    batch = prepare_loss("logits", tuple(logits.shape[:-1]), logits.shape[-1], logits.device, args, config)
    options = ops.PassOptions(entropy=config.needs_entropy, backend=config.backend, chunk_rows=config.chunk_rows,
                              inplace_backward=config.inplace_backward)
    if batch.sampler_head is None:
        return _policy_output(ops.token_stats(logits, batch, options), batch, config)
    stats, batch, head_logprobs = _with_sampler_divergences(logits, batch, options)
    return _policy_output(stats, batch, config, head_logprobs=head_logprobs)


def _record(form: str, div: Divergences, batch: PreparedBatch) -> correction.DivergenceRecord:
    """The divergences on the mask (0 elsewhere), detached, under the names the stage's metrics use."""
    zero = lambda t: torch.where(batch.mask, t.detach(), torch.zeros_like(t.detach()))  # noqa: E731
    values = {name: zero(t) for name, t in div._asdict().items() if t is not None and name != "sampled_in_head"}
    if div.sampled_in_head is not None:
        values["sampled_in_head"] = div.sampled_in_head & batch.mask
    return correction.DivergenceRecord(form, values)


def _topk_record(head_logprobs: torch.Tensor, batch: PreparedBatch) -> correction.DivergenceRecord:
    head = batch.sampler_head
    with torch.no_grad():
        div = partition(head_logprobs.detach(), head.logprobs, head.slots, head.mode)
        member = (head.slots & (head.ids == batch.row_labels[:, None])).any(1)
    return _record("topk", div._replace(sampled_in_head=member), batch)


def _with_sampler_divergences(logits: torch.Tensor, batch: PreparedBatch, options: ops.PassOptions):
    """(the current policy's statistics, the batch with its trainer-vs-sampler divergences (SPEC §9), the head's
    log-probs with autograd or None): the top-k form from the same pass, the full form from one more read of
    both logits tensors. The divergences carry no autograd (metrics and rejection masks)."""
    head = batch.sampler_head
    if head.ids is not None:
        stats = ops.head_stats(logits, batch, options, head.ids)
        record = _topk_record(stats.head_logprobs, batch)
        return (ops.Statistics(stats.logprobs, stats.entropy, None), replace(batch, divergences=record),
                stats.head_logprobs)
    stats = ops.token_stats(logits, batch, options)
    t = batch.temperature
    with torch.no_grad():
        div = Divergences(*ops.full_divergences(logits.detach(), head.logits, batch.mask, t, t,
                                                backend=options.backend))
    return stats, replace(batch, divergences=_record("full", div, batch)), None


def policy_loss(
    logprobs: torch.Tensor, advantages: torch.Tensor, response_mask: torch.Tensor, *,
    old_logprobs: Optional[torch.Tensor] = None, rollout_logprobs: Optional[torch.Tensor] = None,
    ref_logprobs: Optional[torch.Tensor] = None, entropy: Optional[torch.Tensor] = None,
    cu_seqlens: Optional[torch.Tensor] = None, config: Optional[PolicyLossConfig] = None, dp_group=None,
    cp_group=None, token_index: Optional[torch.Tensor] = None, is_weights: Optional[torch.Tensor] = None,
    **overrides,
) -> PolicyLossOutput:
    """The same loss as `decoupled_ppo_loss` when log-probs (and entropy) come from elsewhere.

    The arguments not listed here (`advantages`, `response_mask`, the log-probs, `cu_seqlens`, `config`,
    the groups, `token_index`, `is_weights`, overrides) are those of `decoupled_ppo_loss`.

    Args:
        logprobs: [B, T] or [N] float current-policy log-probs of the sampled tokens (with autograd).
        advantages: as in `decoupled_ppo_loss`.
        response_mask: as in `decoupled_ppo_loss`.
        entropy: like logprobs, needed when entropy_coeff != 0 (with autograd).

    Returns:
        PolicyLossOutput; `loss` is differentiable w.r.t. logprobs and entropy.
    """
    config, _ = resolve_config(config, overrides)
    args = Arguments(None, advantages, response_mask, old_logprobs, rollout_logprobs, ref_logprobs, is_weights,
                     entropy, cu_seqlens, token_index, None, dp_group, cp_group)
    batch = prepare_policy(logprobs, args, config)
    return _policy_output(ops.Statistics(logprobs.reshape(-1), None if entropy is None else entropy.reshape(-1),
                                         None), batch, config)


def token_logprobs(
    logits: torch.Tensor, labels: torch.Tensor, *, temperature: Union[float, torch.Tensor] = 1.0,
    compute_entropy: bool = False, compute_sum_pi_squared: bool = False, ignore_index: int = -100,
    backend: str = "auto", validate: bool = True, inplace_backward: bool = False, tp_group=None, dp_group=None,
    cp_group=None, sampling_support: Optional[torch.Tensor] = None,
) -> TokenStats:
    """Per-token log-prob of `labels` under softmax(logits / T), with entropy and sum p^2 (SPEC §2).

    Args:
        logits: [..., V] float.
        labels: [...] integer; `ignore_index` rows give 0 and no gradient.
        temperature: a float, or a tensor broadcastable to the labels' shape (per token; [B, 1] per
            sequence): the sampler's own temperatures.
        compute_entropy: also return the entropy of each row's distribution (with autograd).
        compute_sum_pi_squared: also return sum_v p_v^2 of each row (no autograd).
        ignore_index: the label of rows outside any loss.
        backend: "auto", "torch", "cpu", "triton" or "cuda".
        validate: run the value checks (label range, temperatures, kept ids): one host sync.
        inplace_backward: let the backward write dlogits into the logits' storage.
        tp_group: vocabulary parallelism, as in `decoupled_ppo_loss`.
        dp_group: accepted so that one set of group arguments fits every entry point; per-token
            statistics need nothing from other data-parallel ranks (no collective).
        cp_group: the same, for context parallelism.
        sampling_support: [..., K] integer ids the sampler kept at each position (top-k / top-p / min-p;
            -1 pads): the statistics are those of the softmax renormalised over them, at O(K) per row.

    Returns:
        TokenStats(logprobs, entropy, sum_pi_squared), float32, shaped like labels; autograd flows
        to logits from logprobs and entropy.
    """
    check_logits(logits, allow_any_rank=True)
    args = Arguments(labels, cu_seqlens=None, tp_group=tp_group, dp_group=dp_group, cp_group=cp_group,
                     temperature=temperature, sampling_support=sampling_support, ignore_index=ignore_index)
    token_shape = tuple(logits.shape[:-1])
    batch = prepare_stats(token_shape, logits.shape[-1], logits.device, args, backend, validate, inplace_backward)
    options = ops.PassOptions(compute_entropy, compute_sum_pi_squared, backend, inplace_backward=inplace_backward)
    return _shaped(ops.token_stats(logits, batch, options), token_shape)


class TokenDivergences(NamedTuple):
    """Per-token divergences between the trainer's π and a second distribution μ (SPEC §9), shaped like the
    labels (logits.shape[:-1]); float32 (float64 for float64 logits), 0 on rows outside (ignore_index)."""
    kl: torch.Tensor  # KL(μ || π), the direction of TRM's criterion; autograd to the logits
    reverse_kl: Optional[torch.Tensor]  # KL(π || μ); None in "support" mode (+inf wherever π leaves μ's support)
    chi2: Optional[torch.Tensor]  # χ²(π || μ) = Σ π²/μ - 1; None in "support" mode
    tv: torch.Tensor  # ½ Σ |π - μ|
    trainer_head_mass: Optional[torch.Tensor]  # Σ_H π (top-k form), no autograd
    sampler_head_mass: Optional[torch.Tensor]  # Σ_H μ as given (top-k form)
    sampled_in_head: Optional[torch.Tensor]  # bool, the label is one of the row's ids (top-k form with labels)
    form: str  # "full", "topk_selected" or "topk_support"
    lower_bounds: tuple  # the names above that are lower bounds on the exact divergence (the rest are exact)


# which top-k divergences are exact, by mode (SPEC §9.2): the partition's values bound the full ones from below
# (data processing); with μ living on H, KL(μ||π) and TV lose nothing to the tail bucket
_LOWER_BOUNDS = {"full": (), "topk_selected": ("kl", "reverse_kl", "chi2", "tv"), "topk_support": ()}


def token_divergences(
    logits: torch.Tensor, labels: Optional[torch.Tensor] = None, *, reference_logits: Optional[torch.Tensor] = None,
    reference_topk_ids: Optional[torch.Tensor] = None, reference_topk_logprobs: Optional[torch.Tensor] = None,
    temperature: Union[float, torch.Tensor] = 1.0, reference_temperature: Union[float, torch.Tensor, None] = None,
    mode: str = "selected", ignore_index: int = -100, backend: str = "auto", validate: bool = True,
) -> TokenDivergences:
    """Divergences between the trainer's π = softmax(logits / T) and a second distribution μ, per token, read in
    one pass (SPEC §9): KL both ways, χ² and TV, with autograd to `logits`, so any of them can be a loss term.

    Args:
        logits: [..., V] the trainer's logits.
        labels: [...] the sampled tokens, or None (every row). `ignore_index` rows give 0 and no gradient.
        reference_logits: the full form: μ = softmax(reference_logits / reference_temperature), [..., V]
            (recomputed rollout logits, a reference model); exact divergences. Detached.
        reference_topk_ids: the top-k form: [..., k] ids (-1 pads; vLLM `logprobs=k`, SGLang
            `top_logprobs_num`, slime `rollout_topk_token_ids`), with
        reference_topk_logprobs: [..., k] their full-vocabulary log-probs under μ. The divergences are those of
            the partition {each id, the tail}: lower bounds in "selected" mode; in "support" mode μ lives on the
            ids (renormalised over them), kl and tv are exact and reverse_kl / chi2 are not reported.
        temperature: the trainer's temperature (the sampler's), a float or a tensor broadcastable to the labels.
        reference_temperature: the full form's temperature for μ (None: `temperature`).
        mode: "selected" (the sampler's candidates before filtering) or "support" (its kept set after top-k /
            top-p: the sampled token must be among the ids).
        backend: "auto", "torch", "cpu", "triton" or "cuda" (the top-k form's vocabulary pass).
        validate: the value checks (id range, duplicate ids, log-probs <= 0 and not NaN, head mass <= 1, the label
            in a support): one host sync.

    Returns:
        TokenDivergences; `form` and `lower_bounds` say which values are exact.
    """
    check_logits(logits, allow_any_rank=True)
    token_shape, V = tuple(logits.shape[:-1]), logits.shape[-1]
    names = ("reference_topk_ids", "reference_topk_logprobs", "reference_logits")
    head = prepare_head(names, (reference_topk_ids, reference_topk_logprobs, reference_logits), token_shape, V,
                        logits.device, mode, trainer_shape=logits.shape)
    if head is None:
        raise ValueError("reference_logits / reference_topk_ids: expected the second distribution, as logits (full "
                         "form) or as top-k ids with their log-probs, got neither")
    if head.logits is None and reference_temperature is not None:
        raise ValueError("reference_temperature: only the full form takes it (top-k log-probs are the sampler's own, "
                         "at its temperature); pass reference_logits or leave it None")
    batch = prepare_divergence_rows(token_shape, V, logits.device, labels, (temperature, reference_temperature),
                                    backend, ignore_index)
    if validate:
        checks = batch.checks
        check_head_values(checks, head, names[:2], V, batch.rows, None if labels is None else batch.row_labels)
        checks.run()
    form = "full" if head.logits is not None else f"topk_{mode}"
    zero = lambda t: None if t is None else torch.where(batch.rows, t, torch.zeros_like(t))  # noqa: E731
    shaped = lambda t: None if t is None else t.reshape(token_shape)  # noqa: E731
    if head.logits is not None:
        div = Divergences(*ops.full_divergences(logits, head.logits, batch.rows, batch.temperature,
                                                batch.reference_temperature, backend=backend))
    else:
        options = ops.PassOptions(backend=backend)
        stats = ops.head_stats(logits, batch.prepared, options, head.ids)
        div = partition(stats.head_logprobs, head.logprobs, head.slots, mode)
        member = None if labels is None else (head.slots & (head.ids == batch.row_labels[:, None])).any(1) & batch.rows
        div = div._replace(trainer_head_mass=div.trainer_head_mass.detach(),
                           sampler_head_mass=div.sampler_head_mass.detach(), sampled_in_head=member)
    out = [shaped(zero(t)) for t in div[:6]]
    member = None if div.sampled_in_head is None else shaped(div.sampled_in_head)
    return TokenDivergences(*out, member, form, _LOWER_BOUNDS[form])


class DistillationOutput(NamedTuple):
    loss: torch.Tensor  # () the aggregated loss, differentiable w.r.t. the student's logits
    losses: torch.Tensor  # [...] per-token losses after the clamps (0 off the mask), differentiable
    student_mass: torch.Tensor  # [...] Σ_H p_student, detached
    teacher_mass: torch.Tensor  # [...] Σ_H p_teacher as given
    metrics: Dict[str, torch.Tensor]  # distillation/* 0-d device tensors


DISTILLATION_KINDS = ("forward_kl", "forward_kl_tail", "reverse_kl")


def topk_distillation_loss(
    logits: torch.Tensor, teacher_topk_ids: torch.Tensor, teacher_topk_logprobs: torch.Tensor,
    response_mask: Optional[torch.Tensor] = None, *, kind: str = "forward_kl",
    log_prob_min_clamp: Optional[float] = None, loss_max_clamp: Optional[float] = None,
    temperature: Union[float, torch.Tensor] = 1.0, loss_agg_mode: str = "token-mean", backend: str = "auto",
    validate: bool = True,
) -> DistillationOutput:
    """On-policy distillation to a teacher's top-k (SPEC §9.3), from the student's logits in one vocabulary pass
    (the head primitive of §9.1: the student's log-probs at the teacher's ids and their gradient, never a
    [N, V] log-softmax).

    Args:
        logits: [..., V] the student's logits.
        teacher_topk_ids: [..., k] the teacher's top-k ids (-1 pads; vLLM `prompt_logprobs=k`, SGLang
            `top_logprobs_num`).
        teacher_topk_logprobs: [..., k] their full-vocabulary log-probs under the teacher.
        response_mask: [...] bool or 0/1, the tokens in the loss (None: every token).
        kind: "forward_kl": verl's `forward_kl_topk`, Σ_H t (log t - log s) over the teacher's head, t and s the
            teacher's and student's probabilities there, with both log-probs clamped at `log_prob_min_clamp`;
            "forward_kl_tail": the tail-aware form (verl PR #7855), KL(teacher || student) over {the ids, the
            tail}, the tail bucket's mass 1 - Σ_H; "reverse_kl": KL(student || teacher) over {the ids, the tail}.
        log_prob_min_clamp: forward_kl's floor on both log-probs (verl's default -10; None: none).
        loss_max_clamp: clamp of each token's loss to [-c, c] (verl's default 10; None: none); the gradient is 0
            where it binds.
        temperature: the student's temperature (a float or a per-token tensor).
        loss_agg_mode: "token-mean" (over the mask) or "token-sum".
        backend: the vocabulary pass's backend. validate: the value checks of SPEC §9.2 (one host sync).

    Returns:
        DistillationOutput(loss, losses, student_mass, teacher_mass, metrics).
    """
    if kind not in DISTILLATION_KINDS:
        raise ValueError(f"kind: expected one of {DISTILLATION_KINDS}, got {kind!r}")
    if loss_agg_mode not in ("token-mean", "token-sum"):
        raise ValueError(f"loss_agg_mode: expected 'token-mean' or 'token-sum' (the per-token losses are returned for "
                         f"any other aggregation), got {loss_agg_mode!r}")
    for name, value in (("log_prob_min_clamp", log_prob_min_clamp), ("loss_max_clamp", loss_max_clamp)):
        if value is not None and not (isinstance(value, (int, float)) and math.isfinite(value)):
            raise ValueError(f"{name}: expected a finite number or None, got {value!r}")
    if loss_max_clamp is not None and loss_max_clamp <= 0:
        raise ValueError(f"loss_max_clamp: expected a value > 0, got {loss_max_clamp!r}")
    check_logits(logits, allow_any_rank=True)
    token_shape, V = tuple(logits.shape[:-1]), logits.shape[-1]
    names = ("teacher_topk_ids", "teacher_topk_logprobs", "teacher_logits")
    head = prepare_head(names, (teacher_topk_ids, teacher_topk_logprobs, None), token_shape, V, logits.device,
                        "selected")
    batch = prepare_divergence_rows(token_shape, V, logits.device, None, (temperature, None), backend, -100,
                                    mask=response_mask)
    if validate:
        check_head_values(batch.checks, head, names[:2], V, batch.rows, None)
        batch.checks.run()
    stats = ops.head_stats(logits, batch.prepared, ops.PassOptions(backend=backend), head.ids)
    losses, parts = distillation.token_losses(stats.head_logprobs, head.logprobs, head.slots, kind,
                                              log_prob_min_clamp, loss_max_clamp)
    loss, metrics = distillation.aggregate(losses, parts, batch.rows, loss_agg_mode)
    zero = torch.zeros((), dtype=losses.dtype, device=losses.device)
    shaped = lambda t: torch.where(batch.rows, t, zero).reshape(token_shape)  # noqa: E731
    return DistillationOutput(loss, shaped(losses), shaped(parts["student_mass"]), shaped(parts["teacher_mass"]),
                              metrics)


def linear_decoupled_ppo_loss(
    hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, advantages: torch.Tensor,
    response_mask: torch.Tensor, *, bias: Optional[torch.Tensor] = None, old_logprobs: Optional[torch.Tensor] = None,
    rollout_logprobs: Optional[torch.Tensor] = None, ref_logprobs: Optional[torch.Tensor] = None,
    cu_seqlens: Optional[torch.Tensor] = None, config: Optional[PolicyLossConfig] = None, ignore_index: int = -100,
    tp_group=None, dp_group=None, cp_group=None, token_index: Optional[torch.Tensor] = None,
    is_weights: Optional[torch.Tensor] = None, sampling_support: Optional[torch.Tensor] = None,
    sampler_topk_ids: Optional[torch.Tensor] = None, sampler_topk_logprobs: Optional[torch.Tensor] = None,
    sampler_logits: Optional[torch.Tensor] = None, sampler_topk_mode: str = "selected", **overrides,
) -> PolicyLossOutput:
    """`decoupled_ppo_loss` on logits = hidden @ weight.T + bias, without ever forming [N, V] logits.

    Rows outside the loss never touch the head; the logits of the others are formed a chunk at a time
    (`config.memory_budget_bytes`) in forward and backward. Same outputs, metrics and config as
    `decoupled_ppo_loss`; row t of `hidden` predicts `labels[t]` (no shift inside).

    The arguments not listed here are those of `decoupled_ppo_loss`.

    Args:
        hidden: [B, T, H] (padded) or [N, H] (packed) float16/bfloat16/float32 (float64 on torch).
        weight: [V, H] LM-head weight (the nn.Linear layout; tied embeddings are that tensor), same dtype.
        labels: [B, T] / [N] integer; row t of `hidden` predicts `labels[t]`.
        advantages: as in `decoupled_ppo_loss`.
        response_mask: as in `decoupled_ppo_loss`.
        bias: [V] or None.
        sampler_topk_ids: as in `decoupled_ppo_loss`; the trainer's log-probs at the ids come from k + 1
            gathered rows of the head per row (no V-wide product beyond the pass). `sampler_logits` ([..., V])
            are read a chunk of rows at a time beside the chunks of the trainer's logits.
        tp_group: the head split over the vocabulary: this rank's weight rows (and bias) [V_r, H] of
            the contiguous shard [o_r, o_r + V_r); one all_gather forward, one all_reduce (d_hidden)
            backward.

    Returns:
        PolicyLossOutput; `loss` is differentiable w.r.t. hidden, weight and bias.

    Raises:
        TypeError: an argument of the wrong type, named, before any kernel runs (SPEC §11).
        ValueError: an argument of the wrong shape, device or value, named, before any kernel runs.
    """
    config, temperature = resolve_config(config, overrides)
    check_head(hidden, weight, bias)
    args = Arguments(labels, advantages, response_mask, old_logprobs, rollout_logprobs, ref_logprobs, is_weights,
                     None, cu_seqlens, token_index, tp_group, dp_group, cp_group, temperature, sampling_support,
                     ignore_index, (sampler_topk_ids, sampler_topk_logprobs, sampler_logits), sampler_topk_mode)
    batch = prepare_loss("hidden", tuple(hidden.shape[:-1]), weight.shape[0], hidden.device, args, config)
    options = ops.PassOptions(entropy=config.needs_entropy, backend=config.backend,
                              memory_budget_bytes=config.memory_budget_bytes)
    if config.linear_one_pass and ops.one_pass_blocker(hidden, weight, bias, batch) is None \
            and stage.forward_gradient_blocker(batch, config) is None:
        return _one_pass_output(hidden, weight, bias, batch, config, options)
    rows = hidden.reshape(-1, hidden.shape[-1])
    if batch.sampler_head is None:
        return _policy_output(ops.linear_token_stats(rows, weight, bias, batch, options), batch, config,
                              "linear_two_pass")
    if batch.sampler_head.ids is not None:
        # the head's log-probs from k + 1 gathered rows of the head and the pass's log p_y, with autograd
        stats = ops.linear_head_stats(rows, weight, bias, batch, options, batch.sampler_head.ids,
                                      head_grad=config.loss_type in SAMPLER_HEAD_LOSSES)
        batch = replace(batch, divergences=_topk_record(stats.head_logprobs, batch))
        return _policy_output(ops.Statistics(*stats[:3]), batch, config, "linear_two_pass", stats.head_logprobs)
    stats = ops.linear_token_stats(rows, weight, bias, batch, options)
    div = Divergences(*ops.linear_full_divergences(rows, weight, bias, batch.sampler_head.logits, batch, options))
    return _policy_output(stats, replace(batch, divergences=_record("full", div, batch)), config, "linear_two_pass")


def linear_token_logprobs(
    hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, *, bias: Optional[torch.Tensor] = None,
    temperature: Union[float, torch.Tensor] = 1.0, compute_entropy: bool = False,
    compute_sum_pi_squared: bool = False, ignore_index: int = -100, backend: str = "auto", validate: bool = True,
    memory_budget_bytes: Optional[int] = None, tp_group=None, dp_group=None, cp_group=None,
    sampling_support: Optional[torch.Tensor] = None,
) -> TokenStats:
    """`token_logprobs` of logits = hidden @ weight.T + bias (SPEC §2), never forming [N, V] logits.

    The arguments not listed here are those of `token_logprobs` (with a `sampling_support` only the K kept
    rows of the head are read for each row: no V-wide product).

    Args:
        hidden: [..., H] float.
        weight: [V, H] the LM head's weight, in hidden's dtype.
        labels: [...] integer; `ignore_index` rows give 0, never touch the head, and get no gradient.
        bias: [V] or None.
        memory_budget_bytes: the largest chunk of logits formed at once (None: 512 MiB on CUDA, 32 MiB on
            CPU).

    Returns:
        TokenStats(logprobs, entropy, sum_pi_squared), float32, shaped like labels; autograd flows
        from logprobs and entropy to hidden, weight and bias. Under torch.no_grad() this is the lean
        pass trainers run for old and reference log-probs.
    """
    check_head(hidden, weight, bias, allow_any_rank=True)
    check_memory_budget(memory_budget_bytes)
    args = Arguments(labels, tp_group=tp_group, dp_group=dp_group, cp_group=cp_group, temperature=temperature,
                     sampling_support=sampling_support, ignore_index=ignore_index)
    token_shape = tuple(hidden.shape[:-1])
    batch = prepare_stats(token_shape, weight.shape[0], hidden.device, args, backend, validate)
    options = ops.PassOptions(compute_entropy, compute_sum_pi_squared, backend,
                              memory_budget_bytes=memory_budget_bytes)
    stats = ops.linear_token_stats(hidden.reshape(-1, hidden.shape[-1]), weight, bias, batch, options)
    return _shaped(stats, token_shape)


def rollout_correction(
    train_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, response_mask: torch.Tensor, *,
    cu_seqlens: Optional[torch.Tensor] = None, config: RolloutCorrection, validate: bool = True, dp_group=None,
    cp_group=None, token_index: Optional[torch.Tensor] = None, divergences: Optional[TokenDivergences] = None,
) -> CorrectionOutput:
    """IS weights (SPEC §4), rejection mask (§5) and rollout_corr/* metrics (§8), without a loss.

    Args:
        train_logprobs: [B, T] / [N] log-probs of the training policy (ℓold in decoupled mode).
        rollout_logprobs: same shape, from the inference engine.
        response_mask: same shape, bool or 0/1.
        cu_seqlens: [S + 1] sequence offsets of the packed layout (None: one sequence).
        config: a RolloutCorrection.
        validate: run the value checks (one host sync).
        dp_group: a data-parallel split, as in `decoupled_ppo_loss` (metrics, sequence decisions and
            batch normalisation are those of the whole batch).
        cp_group: a context-parallel split, as in `decoupled_ppo_loss`.
        token_index: this rank's global positions under cp_group, as in `decoupled_ppo_loss`.
        divergences: `token_divergences(...)` of the trainer against the sampler on these tokens (SPEC §9): the
            seq_max_kl / seq_mean_kl options (Trust Region Masking) read its `kl`, and its values are reported
            as rollout_corr/{full,topk}_* metrics.

    Returns:
        CorrectionOutput(weights or None, mask, metrics); nothing carries autograd.
    """
    args = Arguments(rollout_logprobs=rollout_logprobs, response_mask=response_mask, cu_seqlens=cu_seqlens,
                     token_index=token_index, dp_group=dp_group, cp_group=cp_group)
    batch = prepare_correction(train_logprobs, args, config, validate)
    dt = statistics_dtype(train_logprobs.dtype)
    zero = torch.zeros((), dtype=dt, device=train_logprobs.device)
    train = torch.where(batch.mask, train_logprobs.reshape(-1).detach().to(dt), zero)
    rollout = torch.where(batch.mask, batch.rollout_logprobs.detach().to(dt), zero)
    record = _given_divergences(divergences, batch, config)
    terms, table, decisions, norms, weights = correction.correct(train, rollout, batch.mask, batch.segments, config,
                                                                 batch.split, divergences=record)
    metrics = Metrics()
    correction.record_metrics(metrics, terms, batch.mask, table, decisions, norms, config, weights)
    if record is not None:
        correction.record_divergence_metrics(metrics, record, batch.mask, table, norms)
    correction.record_length_metrics(metrics, table, norms, batch.split)
    shape = batch.token_shape
    return CorrectionOutput(None if weights is None else weights.weights.reshape(shape),
                            decisions.mask.reshape(shape), metrics.finish(batch.split))


def _given_divergences(divergences: Optional[TokenDivergences], batch: PreparedBatch,
                       config: RolloutCorrection) -> Optional[correction.DivergenceRecord]:
    if divergences is None:
        if config.needs_divergence:
            raise ValueError("divergences: expected token_divergences(...) since config.rs has a seq_max_kl / "
                             "seq_mean_kl option (Trust Region Masking's KL(μ_t || π_t)), got None")
        return None
    if not isinstance(divergences, TokenDivergences):
        raise TypeError(f"divergences: expected the TokenDivergences of token_divergences(...), got "
                        f"{type(divergences).__name__}")
    if tuple(divergences.kl.shape) != tuple(batch.token_shape):
        raise ValueError(f"divergences: expected values of the tokens' shape {tuple(batch.token_shape)}, got "
                         f"{tuple(divergences.kl.shape)}")
    div = Divergences(*(None if t is None else t.reshape(-1).to(statistics_dtype(t.dtype)) if t.is_floating_point()
                        else t.reshape(-1) for t in divergences[:7]))
    return _record("full" if divergences.form == "full" else "topk", div, batch)


class TokenBaseline(NamedTuple):
    advantages: torch.Tensor  # like token_rewards: (G - B) * m, no gradient
    returns: torch.Tensor  # like token_rewards: G, the masked reward-to-go


def optimal_token_baseline(
    token_rewards: torch.Tensor, response_mask: torch.Tensor, group_index: torch.Tensor,
    old_logprobs: torch.Tensor, sum_pi_squared: torch.Tensor, *, is_weights: Optional[torch.Tensor] = None,
    multi_turn: bool = False, handle_zero_tail: bool = True, eps: float = 1e-8,
    cu_seqlens: Optional[torch.Tensor] = None, validate: bool = True,
) -> TokenBaseline:
    """Advantages from the optimal token baseline (SPEC §10; Li, Xu et al., arXiv 2602.07078), as verl 0.9.1's
    `compute_optimal_token_baseline_advantage` (and, with `multi_turn`, its TIR form) computes them.

    Per prompt group and per position, B_t = sum_i G_t W_t m_t / (sum_i W_t m_t + eps), with G the masked
    reward-to-go and W the cumulative sum of w_t = 1 - 2 pi_old(y_t) + sum_v pi_old(v)^2 (times the squared
    IS weight when given): a baseline weighted by each trajectory's "realised energy". Segmented: no loop over
    groups or rows, no host synchronisation (with validate=False).

    Args:
        token_rewards: [B, T] (padded) or [N] (packed) float rewards per token.
        response_mask: like token_rewards, bool or 0/1.
        group_index: [B] (or [S] packed) integer prompt id of each sequence (any integers, in any order).
        old_logprobs: like token_rewards, log-probs of the sampled tokens under pi_old.
        sum_pi_squared: like token_rewards, sum_v pi_old(v)^2 (`token_logprobs(..., compute_sum_pi_squared=True)`).
        is_weights: like token_rewards, the applied IS weights (w_t is scaled by their square), or None.
        multi_turn: verl's TIR-OTB: each row's masked tokens aligned by their rank among the row's masked
            tokens; empty rows belong to no group.
        handle_zero_tail: the single longest trajectory of a group gets B = 0 beyond the second-longest length.
        eps: the denominator's epsilon.
        cu_seqlens: [S + 1] offsets of the packed layout (None: padded, or one sequence).
        validate: run the value checks (NaN / inf, cu_seqlens contents): one host sync.

    Returns:
        TokenBaseline(advantages, returns), shaped and typed like token_rewards; no gradient.
    """
    if not isinstance(multi_turn, bool) or not isinstance(handle_zero_tail, bool):
        raise TypeError(f"multi_turn / handle_zero_tail: expected bools, got {multi_turn!r} / {handle_zero_tail!r}")
    eps = check_finite_positive("eps", eps, allow_zero=True)
    with torch.no_grad():
        rows = prepare_baseline_rows(token_rewards, response_mask, group_index, old_logprobs, sum_pi_squared,
                                     is_weights, cu_seqlens, validate)
        out = baseline.optimal_token_baseline(rows, multi_turn, handle_zero_tail, eps)
    shape = token_rewards.shape
    return TokenBaseline(out.advantages.reshape(shape), out.returns.reshape(shape))


def variance_proxy_metrics(
    advantages: torch.Tensor, response_mask: torch.Tensor, old_logprobs: torch.Tensor,
    sum_pi_squared: torch.Tensor, *, is_weights: Optional[torch.Tensor] = None, grad_norm: Optional[float] = None,
    cu_seqlens: Optional[torch.Tensor] = None,
) -> Dict[str, torch.Tensor]:
    """verl's gradient-variance proxies (`compute_variance_proxy_metrics`) under its names, as 0-d tensors.

    With W_i = sum_t w_t m_t (w_t as in `optimal_token_baseline`) and A_i the masked mean advantage of row i:
    proxy2_total_power = mean_i(A_i^2 max(W_i, 0)) (with IS weights, verl's convention: the row's squared mean
    weight times the unscaled W), proxy1_signal_strength = grad_norm^2, proxy3_pure_noise =
    max(0, (proxy2 - proxy1) / (B - 1)) (0 without grad_norm), expected_a_squared, expected_w.

    Args:
        advantages: [B, T] (padded) or [N] (packed) float.
        response_mask: like advantages.
        old_logprobs: like advantages.
        sum_pi_squared: like advantages.
        is_weights: like advantages, the applied IS weights, or None.
        grad_norm: the step's gradient norm (a float), or None.
        cu_seqlens: [S + 1] offsets of the packed layout.

    Returns:
        {"variance_proxy/<name>": 0-d tensor}.
    """
    x = prepare_variance_rows(advantages, response_mask, old_logprobs, sum_pi_squared, is_weights, cu_seqlens,
                              grad_norm)
    with torch.no_grad():
        return baseline.variance_proxy_metrics(x, grad_norm)


def metrics_to_floats(metrics: Dict[str, torch.Tensor]) -> Dict[str, float]:
    """Device metrics -> Python floats for loggers, with one host synchronisation for all of them."""
    if not metrics:
        return {}
    names = list(metrics)
    values = torch.stack([metrics[n].detach().reshape(()).to(torch.float64) for n in names]).cpu().tolist()
    return dict(zip(names, values))
