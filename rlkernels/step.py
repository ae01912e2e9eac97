"""One call's computation, from its checked inputs (an `inputs.PreparedBatch`) to its output: the route
through the vocabulary passes (ops), the per-sequence stage, and what one hands the other.

The policy losses take one of these routes (SPEC §2, §2.1, §9):

    logits   no sampler distribution   ops.token_stats
             the sampler's top-k       ops.head_stats (the same pass, with the log-probs at its ids)
             the sampler's logits      ops.token_stats, then ops.full_divergences (one more read of both; a
                                       second one for TV, with the metrics)
    hidden   per-token coefficients    ops.linear_forward_gradient (the one-pass form; stage per chunk)
             otherwise                 as for logits: ops.linear_token_stats / linear_head_stats /
                                       linear_full_divergences (the two-pass form)

then the stage (`stage.choose`: the fused kernels, or `stage.run` eager or compiled) on the detached statistics,
with the sampler's evidence as a typed record (`stage.SamplerEvidence`), and `ops.CoefficientLossFunction` to carry
its closed-form coefficients back into autograd. api.py calls one function here per public function.
"""

from typing import Optional

import torch

from . import backends, ops, stage
from .backends import statistics_dtype
from .config import SAMPLER_HEAD_LOSSES, PolicyLossConfig, RolloutCorrection
from .inputs import DistillationInputs, DivergenceInputs, PreparedBatch
from .inputs.checks import refuse_non_finite_rows
from .outputs import (
    CorrectionOutput,
    DistillationOutput,
    PolicyLossOutput,
    TokenDivergences,
    TokenStats,
    shaped,
)
from .stage import SamplerEvidence, correction, distillation
from .stage.divergences import DIVERGENCES, Divergences, partition
from .stage.metrics import Metrics


# ---------------------------------------------------------------- the policy losses
def pass_options(config: PolicyLossConfig) -> ops.PassOptions:
    """What a loss's vocabulary pass computes and how, from its config."""
    return ops.PassOptions(entropy=config.needs_entropy, backend=config.backend, chunk_rows=config.chunk_rows,
                           memory_budget_bytes=config.memory_budget_bytes,
                           inplace_backward=config.inplace_backward, head_dtype=config.head_dtype,
                           numerics=config.numerics, select_rows=config.selects_loss_rows)


def checked_rows(source: str, logprobs: torch.Tensor, batch: PreparedBatch, validate: bool) -> None:
    """validate=True: refuse a row of the pass whose logits (from `source`, "logits" or "hidden") hold a NaN or
    +inf, read from its [N] log-probs (one host sync, SPEC §11)."""
    if validate:
        refuse_non_finite_rows(source, logprobs, batch.mask, batch.token_shape)


def logits_loss(logits: torch.Tensor, batch: PreparedBatch, config: PolicyLossConfig) -> PolicyLossOutput:
    """decoupled_ppo_loss: the current policy's statistics from the logits, then the stage."""
    options = pass_options(config)
    head = batch.sampler_head
    if head is None and _logits_one_pass_blocker(logits, batch, config, options) is None:
        return _logits_one_pass_output(logits, batch, config, options)
    if head is None:
        stats = ops.token_stats(logits, batch, options)
        checked_rows("logits", stats.logprobs, batch, config.validate)
        return policy_output(stats, batch, config)
    if head.ids is not None:
        stats = ops.head_stats(logits, batch, options, head.ids)
        checked_rows("logits", stats.logprobs, batch, config.validate)
        return policy_output(ops.Statistics(*stats[:3]), batch, config, "logits",
                             _topk_evidence(stats.head_logprobs, batch, config))
    stats = ops.token_stats(logits, batch, options)
    checked_rows("logits", stats.logprobs, batch, config.validate)
    with torch.no_grad():
        # TV only for its metrics (its own read of both tensors on the GPU); TRM's mask reads KL(μ||π)
        values = ops.full_divergences(logits.detach(), head.logits, batch.mask, batch.temperature,
                                      batch.temperature, backend=options.backend, with_tv=config.metrics == "all")
    return policy_output(stats, batch, config, "logits", SamplerEvidence(_record("full", Divergences(*values),
                                                                                 batch.mask)))


def _logits_one_pass_blocker(logits: torch.Tensor, batch: PreparedBatch, config: PolicyLossConfig,
                             options: ops.PassOptions) -> Optional[str]:
    """Why this logits call keeps the two-pass form (SPEC §2.4), or None: the option, the pass (ops), then the
    stage: the fused stage's kernels of the pass's backend must cover the call, and every token's coefficients must
    be its own."""
    if config.logits_one_pass is False:
        return "logits_one_pass=False"
    reason = ops.logits_one_pass_blocker(logits, batch, options, config.validate)
    if reason is not None:
        return reason
    name = backends.resolve(options.backend, logits)
    if name == "cpu" and config.logits_one_pass is None:
        return "the CPU kernels with logits_one_pass=None (no faster there: logits_one_pass=True takes it)"
    if stage.fused.implementation(config, logits.device) != name:
        return "the fused stage's kernels are not the pass's backend's (fused_stage=False, or another backend)"
    return stage.fused.blocker(batch, config, statistics_dtype(logits.dtype)) or \
        stage.forward_gradient_blocker(batch, config) or stage.fused.factors_blocker(config)


def _logits_one_pass_output(logits: torch.Tensor, batch: PreparedBatch, config: PolicyLossConfig,
                            options: ops.PassOptions) -> PolicyLossOutput:
    """The logits path with its gradient formed in the forward (SPEC §2.4): the stage's factors, one launch for
    the statistics and dlogits, then the fused stage on the statistics for the loss and the metrics, as the
    two-pass form computes them; the backward hands back g * dlogits."""
    factors, codes, hyper = stage.fused.forward_factors(batch, config, options.entropy)
    stats, d_logits = ops.logits_forward_gradient(logits, batch, options, factors, codes, hyper)
    checked_rows("logits", stats.logprobs, batch, config.validate)
    detached = TokenStats(stats.logprobs, stats.entropy, None)
    out = stage.choose(stats.logprobs, batch, config)(detached, batch, config, metrics=config.metrics == "all")
    loss = ops.ForwardGradientFunction.apply(out.loss, logits, None, None, d_logits, None, None, config.validate)
    return _output(loss, detached, out, batch, "logits_one_pass")


def hidden_loss(hidden: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], batch: PreparedBatch,
                config: PolicyLossConfig) -> PolicyLossOutput:
    """linear_decoupled_ppo_loss: the one-pass form where every token's coefficients allow (SPEC §2.1), else the
    two-pass form's statistics, then the stage."""
    options = pass_options(config)
    if config.linear_one_pass and ops.one_pass_blocker(hidden, weight, bias, batch) is None \
            and stage.forward_gradient_blocker(batch, config) is None:
        return _one_pass_output(hidden, weight, bias, batch, config, options)
    rows = hidden.reshape(-1, hidden.shape[-1])
    head = batch.sampler_head
    if head is None:
        stats = ops.linear_token_stats(rows, weight, bias, batch, options)
        checked_rows("hidden", stats.logprobs, batch, config.validate)
        return policy_output(stats, batch, config, "linear_two_pass")
    if head.ids is not None:
        # the head's log-probs from k + 1 gathered rows of the head and the pass's log p_y, with autograd only
        # for a loss that reads them
        stats = ops.linear_head_stats(rows, weight, bias, batch, options, head.ids,
                                      head_grad=config.loss_type in SAMPLER_HEAD_LOSSES)
        checked_rows("hidden", stats.logprobs, batch, config.validate)
        return policy_output(ops.Statistics(*stats[:3]), batch, config, "linear_two_pass",
                             _topk_evidence(stats.head_logprobs, batch, config))
    stats = ops.linear_token_stats(rows, weight, bias, batch, options)
    checked_rows("hidden", stats.logprobs, batch, config.validate)
    values = ops.linear_full_divergences(rows, weight, bias, head.logits, batch, options,
                                         with_tv=config.metrics == "all")
    return policy_output(stats, batch, config, "linear_two_pass",
                         SamplerEvidence(_record("full", Divergences(*values), batch.mask)))


def policy_output(stats: ops.Statistics, batch: PreparedBatch, config: PolicyLossConfig, path: str = "logits",
                  evidence: Optional[SamplerEvidence] = None) -> PolicyLossOutput:
    """The current policy's statistics (carrying autograd) -> the per-sequence stage -> PolicyLossOutput. A loss
    that reads the sampler's top-k gets `evidence.head_logprobs` (with autograd) as the stage's head."""
    lp, entropy = stats.logprobs, stats.entropy
    dt = statistics_dtype(lp.dtype)
    detached = TokenStats(lp.detach().to(dt), None if entropy is None else entropy.detach().to(dt), None)
    head_logprobs = None if evidence is None else evidence.head_logprobs
    if head_logprobs is not None:
        evidence = evidence._replace(head_logprobs=head_logprobs.detach().to(dt))
    out = stage.choose(detached.logprobs, batch, config)(detached, batch, config, metrics=config.metrics == "all",
                                                         evidence=evidence)
    loss = ops.CoefficientLossFunction.apply(out.loss, lp, entropy, out.coef_logprob, out.coef_entropy,
                                             head_logprobs, out.coef_head)
    return _output(loss, detached, out, batch, path)


def _output(loss: torch.Tensor, detached: TokenStats, out: stage.StageOutput, batch: PreparedBatch,
            path: str) -> PolicyLossOutput:
    shape = batch.token_shape
    return PolicyLossOutput(loss, shaped(out.logprobs, shape), shaped(detached.entropy, shape),
                            shaped(out.is_weights, shape), shaped(out.mask, shape), out.metrics, path)


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
    # the fused kernels where they cover the call (they decide the correction again: two launches per chunk)
    run = stage.choose(lp, batch, config, fallback=stage.run)

    def coefficients(idx, lp_rows, entropy_rows):
        lp.index_copy_(0, idx, lp_rows)
        if entropy is not None:
            entropy.index_copy_(0, idx, entropy_rows)
        out = run(TokenStats(lp, entropy, None), batch, config, corrected=corrected, metrics=False)
        e = None if out.coef_entropy is None else out.coef_entropy.index_select(0, idx)
        return out.coef_logprob.index_select(0, idx), e

    grads = ops.linear_forward_gradient(rows, weight, bias, batch, options, coefficients, stage.kept_mask(corrected))
    checked_rows("hidden", grads.logprobs, batch, config.validate)
    detached = TokenStats(grads.logprobs, grads.entropy, None)
    # the correction is reused unless it reads the current policy (bypass mode's mismatch metrics): then the split
    # is combined a second time. Eager either way: a compiled stage takes no precomputed correction
    reuse = None if stage.correction_reads_current_policy(batch) else corrected
    out = stage.choose(lp, batch, config, fallback=stage.run)(detached, batch, config, corrected=reuse,
                                                              metrics=config.metrics == "all")
    d_hidden = None if grads.d_hidden is None else grads.d_hidden.view(hidden.shape)
    loss = ops.ForwardGradientFunction.apply(out.loss, hidden, weight, bias, d_hidden, grads.d_weight, grads.d_bias,
                                             config.validate)
    return _output(loss, detached, out, batch, "linear_one_pass")


# ---------------------------------------------------------------- the sampler's evidence (SPEC §9)
def _record(form: str, div: Divergences, mask: torch.Tensor) -> correction.DivergenceRecord:
    """The divergences on the mask (0 elsewhere), detached, under the names the stage's metrics use."""
    zero = lambda t: torch.where(mask, t.detach(), torch.zeros_like(t.detach()))  # noqa: E731
    values = {name: zero(t) for name, t in div._asdict().items() if t is not None and name != "sampled_in_head"}
    if div.sampled_in_head is not None:
        values["sampled_in_head"] = div.sampled_in_head & mask
    return correction.DivergenceRecord(form, values)


def _topk_evidence(head_logprobs: torch.Tensor, batch: PreparedBatch, config: PolicyLossConfig) -> SamplerEvidence:
    """The top-k divergences over {the ids, the tail} and whether each sampled token is among the ids (no
    autograd), and the head's log-probs for a loss that reads them."""
    head = batch.sampler_head
    with torch.no_grad():
        div = partition(head_logprobs.detach(), head.logprobs, head.slots, head.mode)
        member = (head.slots & (head.ids == batch.row_labels[:, None])).any(1)
    record = _record("topk", div._replace(sampled_in_head=member), batch.mask)
    return SamplerEvidence(record, head_logprobs if config.loss_type in SAMPLER_HEAD_LOSSES else None)


# ---------------------------------------------------------------- divergences, distillation, corrections
# which top-k divergences are exact, by mode (SPEC §9.2): the partition's values bound the full ones from below
# (data processing); with μ living on H, KL(μ||π) and TV lose nothing to the tail bucket
_LOWER_BOUNDS = {"full": (), "topk_selected": ("kl", "reverse_kl", "chi2", "tv"), "topk_support": ()}


def token_divergences(logits: torch.Tensor, given: DivergenceInputs, backend: str) -> TokenDivergences:
    """token_divergences: the full form from both logits tensors, or the top-k form from the head pass."""
    head, rows = given.head, given.rows
    if head.logits is not None:
        form = "full"
        div = Divergences(*ops.full_divergences(logits, head.logits, rows.rows, rows.temperature,
                                                rows.reference_temperature, backend=backend,
                                                with_tv="tv" in given.wanted))
    else:
        form = f"topk_{head.mode}"
        stats = ops.head_stats(logits, rows.prepared, ops.PassOptions(backend=backend), head.ids)
        div = partition(stats.head_logprobs, head.logprobs, head.slots, head.mode)
        member = None if not given.labelled else \
            (head.slots & (head.ids == rows.row_labels[:, None])).any(1) & rows.rows
        div = div._replace(trainer_head_mass=div.trainer_head_mass.detach(),
                           sampler_head_mass=div.sampler_head_mass.detach(), sampled_in_head=member)
    # the divergences not asked for are not reported (the full form skips TV's second read without it)
    div = div._replace(**{name: None for name in DIVERGENCES if name not in given.wanted})
    token_shape = rows.prepared.token_shape
    values = [shaped(None if t is None else torch.where(rows.rows, t, torch.zeros_like(t)), token_shape)
              for t in div[:6]]
    return TokenDivergences(*values, shaped(div.sampled_in_head, token_shape), form, _LOWER_BOUNDS[form])


def distillation_loss(logits: torch.Tensor, given: DistillationInputs) -> DistillationOutput:
    """topk_distillation_loss: the student's log-probs at the teacher's ids from one head pass, then the per-token
    losses and their aggregation."""
    head, rows, options = given
    stats = ops.head_stats(logits, rows.prepared, ops.PassOptions(backend=options.backend), head.ids)
    losses, parts = distillation.token_losses(stats.head_logprobs, head.logprobs, head.slots, options.kind,
                                              options.log_prob_min_clamp, options.loss_max_clamp)
    loss, metrics = distillation.aggregate(losses, parts, rows.rows, options.loss_agg_mode)
    zero = torch.zeros((), dtype=losses.dtype, device=losses.device)
    token_shape = rows.prepared.token_shape
    on_rows = lambda t: shaped(torch.where(rows.rows, t, zero), token_shape)  # noqa: E731
    return DistillationOutput(loss, on_rows(losses), on_rows(parts["student_mass"]), on_rows(parts["teacher_mass"]),
                              metrics)


def rollout_correction(train_logprobs: torch.Tensor, batch: PreparedBatch, config: RolloutCorrection,
                       divergences: Optional[Divergences], form: str) -> CorrectionOutput:
    """rollout_correction: IS weights, rejection and rollout_corr/* metrics of the given log-probs (and the
    given divergences, `form` "full" or "topk"), without a loss."""
    dt = statistics_dtype(train_logprobs.dtype)
    zero = torch.zeros((), dtype=dt, device=train_logprobs.device)
    train = torch.where(batch.mask, train_logprobs.reshape(-1).detach().to(dt), zero)
    rollout = torch.where(batch.mask, batch.rollout_logprobs.detach().to(dt), zero)
    record = None if divergences is None else _record(form, divergences, batch.mask)
    terms, table, decisions, norms, weights = correction.correct(train, rollout, batch.mask, batch.segments, config,
                                                                 batch.split, divergences=record)
    metrics = Metrics()
    correction.record_metrics(metrics, terms, batch.mask, table, decisions, norms, config, weights)
    if record is not None:
        correction.record_divergence_metrics(metrics, record, batch.mask, table, norms)
    correction.record_length_metrics(metrics, table, norms, batch.split)
    shape = batch.token_shape
    return CorrectionOutput(None if weights is None else shaped(weights.weights, shape),
                            shaped(decisions.mask, shape), metrics.finish(batch.split))
