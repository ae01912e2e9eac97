"""The public functions. Each is the same two or three lines: its arguments to one `inputs.prepare_*` (every
check, before any kernel runs), then one function of `step` (the route through the vocabulary passes and the
per-sequence stage) or of the stage, which returns the output (rlkernels.outputs).

Only `ops` reads `backend=`. Inputs are never modified (unless `inplace_backward=True`, which writes
dlogits into the logits' storage and bumps their version counter).
"""

from typing import Dict, Optional, Sequence, Union

import torch

from . import notices, ops, step
from .config import PolicyLossConfig, RolloutCorrection
from .inputs import (
    DEFAULT_BUCKET_EDGES,
    Arguments,
    DistillationOptions,
    check_baseline_options,
    check_metrics,
    check_wanted,
    prepare_baseline_rows,
    prepare_correction,
    prepare_distillation,
    prepare_divergences,
    prepare_hidden_loss,
    prepare_linear_stats,
    prepare_logits_loss,
    prepare_parity,
    prepare_policy,
    prepare_stats,
    prepare_variance_rows,
)
from .outputs import (
    CorrectionOutput,
    DistillationOutput,
    LogprobParity,
    PolicyLossOutput,
    TokenBaseline,
    TokenDivergences,
    TokenStats,
    floats_of,
    shaped_stats,
)
from .stage import baseline, parity

__all__ = ["decoupled_ppo_loss", "linear_decoupled_ppo_loss", "linear_token_logprobs", "logprob_parity",
           "metrics_to_floats",
           "optimal_token_baseline", "policy_loss", "rollout_correction", "token_divergences", "token_logprobs",
           "topk_distillation_loss", "variance_proxy_metrics"]


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
        gradient is formed ("logits", or "logits_one_pass" where dlogits are formed in the forward, SPEC §2.4;
        the fused-linear path's "linear_one_pass" / "linear_two_pass", SPEC §2.1).

    Raises:
        TypeError: an argument of the wrong type, named, before any kernel runs (SPEC §11).
        ValueError: an argument of the wrong shape, device or value, named, before any kernel runs.
    """
    args = Arguments.of(locals())
    config, batch = prepare_logits_loss(logits, args, config, overrides)
    out = step.logits_loss(logits, batch, config)
    notices.watch(out.metrics, config.validate)
    return out


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
    args = Arguments.of(locals())
    config, batch = prepare_hidden_loss(hidden, weight, bias, args, config, overrides)
    out = step.hidden_loss(hidden, weight, bias, batch, config)
    notices.watch(out.metrics, config.validate)
    return out


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
    args = Arguments.of(locals())
    config, batch = prepare_policy(logprobs, args, config, overrides)
    stats = ops.Statistics(logprobs.reshape(-1), None if entropy is None else entropy.reshape(-1), None)
    out = step.policy_output(stats, batch, config)
    notices.watch(out.metrics, config.validate)
    return out


def token_logprobs(
    logits: torch.Tensor, labels: torch.Tensor, *, temperature: Union[float, torch.Tensor] = 1.0,
    compute_entropy: bool = False, compute_sum_pi_squared: bool = False, ignore_index: int = -100,
    backend: str = "auto", validate: bool = True, inplace_backward: bool = False, tp_group=None, dp_group=None,
    cp_group=None, sampling_support: Optional[torch.Tensor] = None, numerics: str = "default",
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
        validate: run the value checks (label range, temperatures, kept ids): one host sync before the pass, and
            one after it that refuses a row holding a NaN or +inf logit (read from the [N] log-probs, SPEC §11).
        inplace_backward: let the backward write dlogits into the logits' storage.
        tp_group: vocabulary parallelism, as in `decoupled_ppo_loss`.
        dp_group: accepted so that one set of group arguments fits every entry point; per-token
            statistics need nothing from other data-parallel ranks (no collective).
        cp_group: the same, for context parallelism.
        sampling_support: [..., K] integer ids the sampler kept at each position (top-k / top-p / min-p;
            -1 pads): the statistics are those of the softmax renormalised over them, at O(K) per row.
        numerics: "default" (each backend's fastest exact form) or "vllm": the log-probs in vLLM's own operations,
            bit for bit what it returns on the same device: its V2 sampler's Triton kernels' order on the Triton
            backend (vLLM's default runner on a GPU), its V1 sampler's ATen log_softmax of the float32 logits / T
            on the others ("vllm_raw": vLLM's raw log-probs, before the temperature, its default logprobs_mode).
            Entropy, sum p^2 and the gradient are unchanged. "batch_invariant": every row's outputs
            and gradient the same bits whatever the batch, its layout, the chunking and the thread count (the
            default already is on the logits path; from hidden states the mode runs the head GEMMs in fixed
            64-row blocks). docs/numerics.md.

    Returns:
        TokenStats(logprobs, entropy, sum_pi_squared), float32, shaped like labels; autograd flows
        to logits from logprobs and entropy.
    """
    args = Arguments.of(locals())
    batch = prepare_stats(logits, args, backend, validate, inplace_backward, numerics)
    options = ops.PassOptions(compute_entropy, compute_sum_pi_squared, backend, inplace_backward=inplace_backward,
                              numerics=numerics)
    stats = ops.token_stats(logits, batch, options)
    step.checked_rows("logits", stats.logprobs, batch, validate)
    return shaped_stats(stats, batch.token_shape)


def linear_token_logprobs(
    hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, *, bias: Optional[torch.Tensor] = None,
    temperature: Union[float, torch.Tensor] = 1.0, compute_entropy: bool = False,
    compute_sum_pi_squared: bool = False, ignore_index: int = -100, backend: str = "auto", validate: bool = True,
    memory_budget_bytes: Optional[int] = None, tp_group=None, dp_group=None, cp_group=None,
    sampling_support: Optional[torch.Tensor] = None, head_dtype: Optional[str] = None, numerics: str = "default",
    select_loss_rows: Optional[bool] = None,
) -> TokenStats:
    """`token_logprobs` of logits = hidden @ weight.T + bias (SPEC §2), never forming [N, V] logits.

    The arguments not listed here are those of `token_logprobs` (with a `sampling_support` only the K kept
    rows of the head are read for each row: no V-wide product).

    Args:
        hidden: [..., H] float.
        weight: [V, H] the LM head's weight, in hidden's dtype.
        labels: [...] integer; `ignore_index` rows give 0, never touch the head, and get no gradient.
        bias: [V] or None.
        memory_budget_bytes: the largest chunk of logits formed at once (None: on CUDA a quarter of the free memory,
            512 MiB to 4 GiB; 32 MiB on CPU).
        head_dtype: None (the head GEMM in the inputs' dtype), "float32" or torch.float32 (float32 GEMMs on
            bf16/fp16 operands, as vLLM's `head_dtype=float32` and SGLang's `--enable-fp32-lm-head`) or "tf32"
            (NeMo-RL's choice: TF32 matrix units on CUDA, float32 on a CPU). Forward and backward alike; the weight
            is upcast a block of vocabulary rows at a time, never whole (at most one chunk of float32 logits' bytes
            more). Not yet with tp_group or a small kept set (`sampling_support`).
        numerics: as in `token_logprobs`, on each chunk's logits.
        select_loss_rows: only the rows with a label go through the head, their count read on the host (one sync);
            False: every row, no host read (the others give 0). None: as `validate`.

    Returns:
        TokenStats(logprobs, entropy, sum_pi_squared), float32, shaped like labels; autograd flows
        from logprobs and entropy to hidden, weight and bias. Under torch.no_grad() this is the lean
        pass trainers run for old and reference log-probs.
    """
    options = ops.PassOptions(compute_entropy, compute_sum_pi_squared, backend, memory_budget_bytes=memory_budget_bytes,
                              head_dtype=head_dtype, numerics=numerics,
                              select_rows=validate if select_loss_rows is None else select_loss_rows)
    batch, options = prepare_linear_stats(hidden, weight, bias, Arguments.of(locals()), validate, options)
    stats = ops.linear_token_stats(hidden.reshape(-1, hidden.shape[-1]), weight, bias, batch, options)
    step.checked_rows("hidden", stats.logprobs, batch, validate)
    return shaped_stats(stats, batch.token_shape)


def token_divergences(
    logits: torch.Tensor, labels: Optional[torch.Tensor] = None, *, reference_logits: Optional[torch.Tensor] = None,
    reference_topk_ids: Optional[torch.Tensor] = None, reference_topk_logprobs: Optional[torch.Tensor] = None,
    temperature: Union[float, torch.Tensor] = 1.0, reference_temperature: Union[float, torch.Tensor, None] = None,
    mode: str = "selected", ignore_index: int = -100, backend: str = "auto", validate: bool = True,
    divergences: Sequence[str] = ("kl", "reverse_kl", "chi2", "tv"),
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
        divergences: which to report, a selection of ("kl", "reverse_kl", "chi2", "tv"); the others come back None.
            The full form reads both tensors once for KL both ways and χ², and a second time for TV (whose terms
            need both normalisers first): leave "tv" out to halve what it reads on a GPU.

    Returns:
        TokenDivergences; `form` and `lower_bounds` say which values are exact.
    """
    wanted = check_wanted(divergences)
    given = prepare_divergences(logits, labels, (reference_topk_ids, reference_topk_logprobs, reference_logits),
                                (temperature, reference_temperature), mode, ignore_index, backend, validate)
    return step.token_divergences(logits, given._replace(wanted=wanted), backend)


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
    options = DistillationOptions(kind=kind, log_prob_min_clamp=log_prob_min_clamp, loss_max_clamp=loss_max_clamp,
                                  loss_agg_mode=loss_agg_mode, backend=backend, validate=validate)
    given = prepare_distillation(logits, (teacher_topk_ids, teacher_topk_logprobs), response_mask, temperature,
                                 options)
    return step.distillation_loss(logits, given)


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
    args = Arguments.of(locals())
    given = prepare_correction(train_logprobs, args, config, validate, divergences)
    out = step.rollout_correction(train_logprobs, given.batch, config, given.divergences, given.form)
    notices.watch(out.metrics, validate)
    return out


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
    options = check_baseline_options(multi_turn, handle_zero_tail, eps)
    with torch.no_grad():
        rows = prepare_baseline_rows(token_rewards, response_mask, group_index, old_logprobs, sum_pi_squared,
                                     is_weights, cu_seqlens, validate)
        out = baseline.optimal_token_baseline(rows, options.multi_turn, options.handle_zero_tail, options.eps)
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
    rows, grad_norm = prepare_variance_rows(advantages, response_mask, old_logprobs, sum_pi_squared, is_weights,
                                            cu_seqlens, grad_norm)
    with torch.no_grad():
        return baseline.variance_proxy_metrics(rows, grad_norm)


def logprob_parity(
    trainer_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, response_mask: torch.Tensor, *,
    cu_seqlens: Optional[torch.Tensor] = None, bucket_edges: Sequence[float] = DEFAULT_BUCKET_EDGES,
    validate: bool = True,
) -> LogprobParity:
    """How far the trainer's log-probs are from the rollout engine's, on the response tokens: the certificate of an
    engine-exact stack (NeMo-RL RFC #4039), and where a stack that is not departs.

    Over the response tokens: the fraction whose two log-probs have the same bits; each sequence's first position
    where they differ; per bucket of the rollout probability exp(rollout_logprobs), the token count and the mean
    and max |trainer - rollout|. No host synchronisation beyond the value checks (`validate=True`: one):
    `metrics_to_floats(report.metrics)` reads every value back with one. With no response token to compare,
    `tokens` is 0 and `match_rate` NaN ("none compared", never 0, which would read as "none matched"); so is every
    statistic of nothing: the mean and max |difference| of no token (overall, or in an empty bucket), and
    `diverged_sequence_fraction` with no sequence holding a response token.

    Args:
        trainer_logprobs: [B, T] (padded) or [N] (packed) float, the trainer's log-probs of the sampled tokens.
        rollout_logprobs: like trainer_logprobs and of its dtype, the engine's (vLLM `logprobs`, SGLang
            `output_token_logprobs`).
        response_mask: like trainer_logprobs, bool or 0/1: the tokens compared.
        cu_seqlens: [S + 1] offsets of the packed layout (None: a padded batch, or one packed sequence).
        bucket_edges: increasing probabilities from 0.0 to 1.0; the last bucket includes 1.0.
        validate: the value checks, as the loss makes them (one host sync): no NaN log-prob on a response token,
            a mask of 0/1 or bool, cu_seqlens' offsets covering the tokens.

    Returns:
        LogprobParity (rlkernels.outputs), with its values also as `metrics` (`logprob_parity/match_rate`,
        `logprob_parity/p[0.1,0.5)/max_abs_diff`, ...).
    """
    rows = prepare_parity(trainer_logprobs, rollout_logprobs, response_mask, cu_seqlens, bucket_edges, validate)
    with torch.no_grad():
        return LogprobParity(*parity.logprob_parity(rows))


def metrics_to_floats(metrics: Dict[str, torch.Tensor]) -> Dict[str, float]:
    """Device metrics -> Python floats for loggers, with one host synchronisation for all of them.

    Args:
        metrics: a dict of names to 0-d (one-element) tensors, as the outputs' `.metrics`; Python numbers pass
            through as floats. Tensors on several devices cost one synchronisation per device.

    Returns:
        {name: float}, in the dict's order. Reading a step whose rollout correction rejected every response token
        (`rollout_corr/rollout_rs_all_rejected` = 1) also warns, once per process.
    """
    values = floats_of(check_metrics(metrics))
    notices.read(values)
    return values
