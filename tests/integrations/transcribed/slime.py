"""Transcription of slime's default policy loss (Megatron backend), non-distributed path.

Source: THUDM/slime, commit 624b824a898ab0ec1fcb4d373004c7f3852bf515
(2026-08-21, "[NFC] Add observability subfolder (#2298)"):

- ``slime/backends/megatron_utils/loss.py`` (response windows, log-probs, TIS, policy loss)
- ``slime/utils/ppo_utils.py`` (KL, PPO / CISPO / GSPO / OPSM, vocab-parallel log-prob)
- ``slime/backends/megatron_utils/cp_utils.py`` (``get_sum_of_sample_mean``)
- ``slime/utils/arguments.py`` (flag names and defaults)

Only the ``cp_size == 1``, ``tp_size == 1``, ``allgather_cp=False`` branches are
transcribed.  Deliberate differences, each marked ``# TRANSCRIPTION NOTE:``:

- slime asserts ``logits.dtype == torch.float32`` and casts to float32 inside the
  vocab-parallel log-prob (``.float()``) and ``compute_approx_kl`` (``.float()``);
  here computation stays in the input dtype so float64 parity is possible.
- ``torch.compile`` decorators are dropped.
- ``_VocabParallelLogProbEntropy`` (a custom autograd.Function whose backward is the
  analytic gradient) is replaced by the same forward arithmetic under plain autograd
  with TP all-reduces removed; entropy is detached when slime marks it
  non-differentiable (``entropy_coef == 0``).
- CP helpers (``all_gather_with_cp``) are the identity, as in slime at cp_size 1.
- ``load_function(path)`` is replaced by :func:`_load_function`, which accepts a
  callable or the dotted names of the TIS functions transcribed here.
- rollout top-p replay (``--rollout-top-p != 1.0``) and the train-debug log-prob
  capture are not transcribed.

Only ``torch`` and ``types`` are imported.
"""

from types import SimpleNamespace

import torch

__all__ = [
    "calculate_log_probs_and_entropy",
    "compute_approx_kl",
    "compute_cispo_loss",
    "compute_gspo_kl",
    "compute_opsm_mask",
    "compute_policy_loss",
    "default_args",
    "get_log_probs_and_entropy",
    "get_responses",
    "get_sum_of_sample_mean",
    "icepop_function",
    "loss_function",
    "policy_loss_function",
    "vanilla_tis_function",
]

_SRC = "THUDM/slime@624b824a898ab0ec1fcb4d373004c7f3852bf515"


def default_args(**over) -> SimpleNamespace:
    """slime's argument defaults for the options the policy loss reads, then overrides,
    then the two post-processing rules of ``slime_validate_args``.

    Transcribes THUDM/slime@624b824a898ab0ec1fcb4d373004c7f3852bf515
    ``slime/utils/arguments.py``: ``--rollout-temperature`` 1.0 (343-347),
    ``--rollout-top-p`` 1.0 (349), ``--log-probs-chunk-size`` -1 (244),
    ``--allgather-cp`` False (297-300), ``--calculate-per-token-loss`` False (879),
    ``--eps-clip`` 0.2 / ``--eps-clip-high`` None / ``--eps-clip-c`` None (899-906),
    ``--loss-type`` "policy_loss" (915-918), ``--kl-loss-type`` "k1" (934-939),
    ``--advantage-estimator`` "grpo" (941-951), ``--use-kl-loss`` False (981),
    ``--kl-loss-coef`` 0.0 (984-988), ``--use-unbiased-kl`` False (990-994),
    ``--entropy-coef`` 0.0 (1001), ``--get-mismatch-metrics`` False (1027-1031),
    ``--use-rollout-logprobs`` False (1051-1058), ``--use-tis`` False (1061-1065),
    ``--tis-clip`` 2.0 (1067-1071), ``--tis-clip-low`` 0 (1073-1077),
    ``--custom-tis-function-path`` None (1079-1083),
    ``--custom-pg-loss-reducer-function-path`` None (1085-1089), ``--use-opsm`` False
    (1104-1108), ``--opsm-delta`` 1e-4 (1110-1114); and ``slime_validate_args``
    lines 1854-1855 (use_rollout_logprobs excludes use_tis) and 1876-1877
    (``eps_clip_high`` defaults to ``eps_clip``).

    ICEPOP is selected as in slime with
    ``custom_tis_function_path="slime.backends.megatron_utils.loss.icepop_function"``
    (or the function object itself).
    """
    args = SimpleNamespace(
        rollout_temperature=1.0,
        rollout_top_p=1.0,
        log_probs_chunk_size=-1,
        allgather_cp=False,
        calculate_per_token_loss=False,
        loss_type="policy_loss",
        custom_loss_function_path=None,
        recompute_loss_function=False,
        advantage_estimator="grpo",
        eps_clip=0.2,
        eps_clip_high=None,
        eps_clip_c=None,
        use_kl_loss=False,
        kl_loss_coef=0.0,
        kl_loss_type="k1",
        use_unbiased_kl=False,
        entropy_coef=0.0,
        get_mismatch_metrics=False,
        use_rollout_logprobs=False,
        use_tis=False,
        tis_clip=2.0,
        tis_clip_low=0,
        custom_tis_function_path=None,
        custom_pg_loss_reducer_function_path=None,
        use_opsm=False,
        opsm_delta=1e-4,
    )
    for k, v in over.items():
        if not hasattr(args, k):
            raise TypeError(f"unknown slime arg {k!r}")
        setattr(args, k, v)
    # slime_validate_args (arguments.py:1854-1855, 1876-1877)
    if args.use_rollout_logprobs:
        assert not args.use_tis, "use_rollout_logprobs and use_tis cannot be set at the same time."
    if args.eps_clip_high is None:
        args.eps_clip_high = args.eps_clip
    return args


# ---------------------------------------------------------------------------
# response windows and log-probs (cp_size == 1, tp_size == 1)
# ---------------------------------------------------------------------------


def get_responses(
    logits: torch.Tensor,
    *,
    args,
    unconcat_tokens: list,
    total_lengths: list,
    response_lengths: list,
    apply_temperature: bool = True,
):
    """Yield response-aligned ``(logits_chunk [R, V], tokens_chunk [R])`` per sample
    from packed logits ``[1, T, V]``: rows ``[end - R - 1, end - 1)``, tokens
    ``tokens[-R:]``, after dividing by ``args.rollout_temperature`` (when != 1.0).

    Transcribes THUDM/slime@624b824a898ab0ec1fcb4d373004c7f3852bf515
    ``slime/backends/megatron_utils/loss.py`` lines 97-191 (the ``cp_size == 1`` branch,
    lines 139-144 and 189-191).
    """
    # TRANSCRIPTION NOTE: slime asserts logits.dtype == torch.float32; any float dtype accepted here.
    assert logits.is_floating_point(), f"{logits.dtype}"
    assert len(logits.shape) == 3, f"{logits.shape}"
    assert logits.size(0) == 1, f"{logits.shape}"
    logits = logits.squeeze(0)

    if apply_temperature and args.rollout_temperature != 1.0:
        logits = logits.div(args.rollout_temperature)

    # TRANSCRIPTION NOTE: cp_size == 1 assumed (mpu.get_context_parallel_world_size()).
    end = 0
    seq_start = 0
    for tokens, total_length, response_length in zip(unconcat_tokens, total_lengths, response_lengths, strict=False):
        end += total_length
        start = end - response_length
        logits_chunk = logits[start - 1 : end - 1]
        tokens_chunk = tokens[-response_length:]

        seq_start += total_length

        yield logits_chunk, tokens_chunk


def _build_shifted_tokens(
    T: int,
    device,
    unconcat_tokens: list,
    total_lengths: list,
    response_lengths: list,
    allgather_cp: bool,
) -> torch.Tensor:
    """Shifted target tokens for the packed logits: ``full[off:off+L-1] = tokens[1:L]``.

    Transcribes THUDM/slime@624b824a898ab0ec1fcb4d373004c7f3852bf515
    ``slime/backends/megatron_utils/loss.py`` lines 273-323 (cp1 path, lines 301-308, 323).
    """
    # TRANSCRIPTION NOTE: zigzag-CP and allgather-CP branches omitted (cp_size == 1).
    assert not allgather_cp, "allgather_cp is not transcribed"
    T_global = T
    full_tokens = torch.zeros(T_global, dtype=torch.long, device=device)

    offset = 0
    for tokens, total_length in zip(unconcat_tokens, total_lengths, strict=False):
        full_tokens[offset : offset + total_length - 1] = tokens[1:total_length]
        offset += total_length

    return full_tokens


def _extract_per_sample(
    log_prob_full: torch.Tensor,
    entropy_full,
    total_lengths: list,
    response_lengths: list,
    allgather_cp: bool,
):
    """Slice per-sample response rows ``[end - R - 1, end - 1)`` from full 1-D tensors.

    Transcribes THUDM/slime@624b824a898ab0ec1fcb4d373004c7f3852bf515
    ``slime/backends/megatron_utils/loss.py`` lines 432-510 (cp1 branch, lines 499-510).
    """
    # TRANSCRIPTION NOTE: zigzag-CP and allgather-CP branches omitted (cp_size == 1).
    assert not allgather_cp, "allgather_cp is not transcribed"
    log_probs_list: list = []
    entropy_list: list = []

    # cp1
    offset = 0
    for total_length, response_length in zip(total_lengths, response_lengths, strict=False):
        end = offset + total_length
        start = end - response_length
        log_probs_list.append(log_prob_full[start - 1 : end - 1])
        if entropy_full is not None:
            entropy_list.append(entropy_full[start - 1 : end - 1])
        offset += total_length

    return log_probs_list, entropy_list


def _vocab_parallel_log_prob_entropy(
    vocab_parallel_logits: torch.Tensor,
    target: torch.Tensor,
    with_entropy: bool,
    with_entropy_grad: bool,
):
    """Forward of ``_VocabParallelLogProbEntropy`` at tp_size 1 with no top-p keep mask:
    ``log_prob = (l_t - max) - log(sum exp(l - max))`` ([T, 1]) and
    ``entropy = max + log(sum exp(l - max)) - sum(softmax * l)`` ([T]).

    Transcribes THUDM/slime@624b824a898ab0ec1fcb4d373004c7f3852bf515
    ``slime/utils/ppo_utils.py`` lines 187-296 (forward; the backward, lines 298-336, is
    the analytic gradient ``(onehot - softmax) * g_logp + softmax * (sum(softmax*l) - l)
    * g_ent``, which plain autograd of this forward reproduces).
    """
    with_entropy_grad = with_entropy and with_entropy_grad
    # TRANSCRIPTION NOTE: slime casts ``vocab_parallel_logits.float()``; input dtype kept.
    seq_len, vocab_parallel_size = vocab_parallel_logits.shape
    rank = 0  # TRANSCRIPTION NOTE: tp_size == 1, no all-reduces.
    vocab_start_index = rank * vocab_parallel_size
    vocab_end_index = vocab_start_index + vocab_parallel_size

    target_mask = (target < vocab_start_index) | (target >= vocab_end_index)
    masked_target_1d = (target - vocab_start_index).clone()
    masked_target_1d[target_mask] = 0
    arange_1d = torch.arange(seq_len, device=vocab_parallel_logits.device)

    def vocab_parallel_softmax(logits: torch.Tensor):
        # TRANSCRIPTION NOTE: the max is detached (it cancels in the analytic gradient);
        # slime's in-place ``sub_`` / ``exp_`` / ``div_`` become out-of-place ops.
        logits_max = logits.max(dim=-1, keepdim=True).values.detach()
        normalized_logits = logits - logits_max
        predicted_logits = normalized_logits.view(-1, vocab_parallel_size)[arange_1d, masked_target_1d]
        exp_logits = normalized_logits.exp()
        sum_exp_logits = exp_logits.sum(dim=-1, keepdim=True)
        softmax = exp_logits.div(sum_exp_logits)
        return predicted_logits, sum_exp_logits, softmax, logits_max

    entropy = vocab_parallel_logits.new_zeros((0,))

    predicted_logits, log_prob_sum_exp_logits, log_prob_softmax, log_prob_logits_max = vocab_parallel_softmax(
        vocab_parallel_logits
    )
    if with_entropy:
        entropy_softmax = log_prob_softmax
        sum_softmax_times_logits = (entropy_softmax * vocab_parallel_logits).sum(dim=-1, keepdim=True)
        entropy = log_prob_logits_max + log_prob_sum_exp_logits.log() - sum_softmax_times_logits
        entropy = entropy.squeeze(dim=-1)

    predicted_logits = predicted_logits.masked_fill(target_mask, 0.0).unsqueeze(-1)
    log_prob = predicted_logits - log_prob_sum_exp_logits.log()

    if not with_entropy_grad:
        # TRANSCRIPTION NOTE: ``ctx.mark_non_differentiable(entropy)`` -> detach.
        entropy = entropy.detach()
    return log_prob, entropy


def _calculate_log_probs_and_entropy_chunk(logits, tokens, tp_group, *, with_entropy, with_entropy_grad=True,
                                           log_prob_keep_mask):
    """Transcribes THUDM/slime@624b824a898ab0ec1fcb4d373004c7f3852bf515
    ``slime/utils/ppo_utils.py`` lines 339-358."""
    # TRANSCRIPTION NOTE: rollout top-p keep mask not transcribed.
    assert log_prob_keep_mask is None, "rollout top-p replay is not transcribed"
    log_prob, entropy = _vocab_parallel_log_prob_entropy(logits, tokens, with_entropy, with_entropy_grad)
    if not with_entropy:
        entropy = None
    return log_prob, entropy


def calculate_log_probs_and_entropy(
    logits,
    tokens,
    tp_group,
    with_entropy: bool = False,
    chunk_size: int = -1,
    log_prob_keep_mask=None,
    with_entropy_grad: bool = True,
):
    """Per-row log-prob ``[T, 1]`` and entropy ``[T]`` of ``logits [T, V]`` at
    ``tokens [T]``, optionally in row chunks.

    Transcribes THUDM/slime@624b824a898ab0ec1fcb4d373004c7f3852bf515
    ``slime/utils/ppo_utils.py`` lines 718-769.
    """
    logits = logits.contiguous()
    entropy = None
    if logits.size(0) != 0:
        if chunk_size > 0:
            num_chunks = (logits.size(0) - 1) // chunk_size + 1
            logits_chunks = logits.chunk(num_chunks, dim=0)
            tokens_chunks = tokens.chunk(num_chunks, dim=0)
            mask_chunks = (
                log_prob_keep_mask.chunk(num_chunks, dim=0) if log_prob_keep_mask is not None else [None] * num_chunks
            )

            log_probs = []
            entropy_chunks = []
            for tokens_chunk, logits_chunk, mask_chunk in zip(tokens_chunks, logits_chunks, mask_chunks, strict=True):
                log_prob, entropy_chunk = _calculate_log_probs_and_entropy_chunk(
                    logits_chunk,
                    tokens_chunk,
                    tp_group,
                    with_entropy=with_entropy,
                    with_entropy_grad=with_entropy_grad,
                    log_prob_keep_mask=mask_chunk,
                )
                log_probs.append(log_prob)
                if entropy_chunk is not None:
                    entropy_chunks.append(entropy_chunk)
            log_prob = torch.cat(log_probs, dim=0)
            if entropy_chunks:
                entropy = torch.cat(entropy_chunks, dim=0)
        else:
            log_prob, entropy = _calculate_log_probs_and_entropy_chunk(
                logits,
                tokens,
                tp_group,
                with_entropy=with_entropy,
                with_entropy_grad=with_entropy_grad,
                log_prob_keep_mask=log_prob_keep_mask,
            )
    else:
        log_prob = logits.new_zeros((0,))
        if with_entropy:
            entropy = logits.new_zeros((0,))

    return log_prob, entropy


def get_log_probs_and_entropy(
    logits: torch.Tensor,
    *,
    args,
    unconcat_tokens: list,
    total_lengths: list,
    response_lengths: list,
    with_entropy: bool = False,
    non_loss_data: bool = True,
):
    """Per-sample response log-probs (and entropy) from packed logits ``[1, T, V]``:
    temperature division, one log-softmax over all ``T`` rows against the shifted
    tokens, then the response windows.  Returns ``(empty, {"log_probs": [...],
    "entropy": [...]})``.

    Transcribes THUDM/slime@624b824a898ab0ec1fcb4d373004c7f3852bf515
    ``slime/backends/megatron_utils/loss.py`` lines 513-604 (this, not
    ``get_responses``, is what ``policy_loss_function`` calls).
    """
    assert non_loss_data
    # TRANSCRIPTION NOTE: slime asserts logits.dtype == torch.float32; any float dtype accepted here.
    assert logits.is_floating_point(), f"{logits.dtype}"
    assert len(logits.shape) == 3, f"{logits.shape}"
    assert logits.size(0) == 1, f"{logits.shape}"
    logits = logits.squeeze(0)

    # Apply rollout temperature scaling to logits to match rollout-time log-probs.
    rollout_temperature = getattr(args, "rollout_temperature", 1.0)
    if rollout_temperature != 1.0:
        logits = logits / rollout_temperature
    logits = logits.contiguous()
    T = logits.size(0)
    device = logits.device
    tp_group = None  # TRANSCRIPTION NOTE: mpu.get_tensor_model_parallel_group() -> None (tp_size 1).
    chunk_size = args.log_probs_chunk_size
    with_entropy_grad = with_entropy and getattr(args, "entropy_coef", 0.0) != 0

    full_tokens = _build_shifted_tokens(T, device, unconcat_tokens, total_lengths, response_lengths, args.allgather_cp)

    # TRANSCRIPTION NOTE: top-p keep mask (lines 556-568) not transcribed.
    top_p_keep_mask = None

    log_prob_full, entropy_full = calculate_log_probs_and_entropy(
        logits,
        full_tokens,
        tp_group,
        with_entropy=with_entropy,
        with_entropy_grad=with_entropy_grad,
        chunk_size=chunk_size,
        log_prob_keep_mask=top_p_keep_mask,
    )
    log_prob_full = log_prob_full.squeeze(-1)  # [T, 1] -> [T]

    log_probs_list, entropy_list = _extract_per_sample(
        log_prob_full,
        entropy_full,
        total_lengths,
        response_lengths,
        args.allgather_cp,
    )

    res = {"log_probs": log_probs_list}
    if with_entropy:
        res["entropy"] = entropy_list

    return torch.empty((0,), device=device), res


# ---------------------------------------------------------------------------
# ppo_utils
# ---------------------------------------------------------------------------


def compute_approx_kl(
    log_probs: torch.Tensor,
    log_probs_base: torch.Tensor,
    kl_loss_type: str,
    importance_ratio=None,
) -> torch.Tensor:
    """k1 / k2 / k3 / low_var_kl estimate of KL(pi || pi_base), times an optional IS
    ratio (unbiased KL); low_var_kl clamped to [-10, 10] after the ratio.

    Transcribes THUDM/slime@624b824a898ab0ec1fcb4d373004c7f3852bf515
    ``slime/utils/ppo_utils.py`` lines 11-51.
    """
    # TRANSCRIPTION NOTE: slime computes ``log_probs.float() - log_probs_base.float()``
    # (float32 even for float64 inputs); input dtype kept here.
    log_ratio = log_probs - log_probs_base

    if kl_loss_type == "k1":
        kl = log_ratio
    elif kl_loss_type == "k2":
        kl = log_ratio**2 / 2.0
    elif kl_loss_type in ["k3", "low_var_kl"]:
        log_ratio = -log_ratio
        kl = log_ratio.exp() - 1 - log_ratio
    else:
        raise ValueError(f"Unknown kl_loss_type: {kl_loss_type}")

    if importance_ratio is not None:
        kl = importance_ratio * kl

    if kl_loss_type == "low_var_kl":
        kl = torch.clamp(kl, min=-10, max=10)

    return kl


def compute_opsm_mask(args, full_log_probs, full_old_log_probs, advantages, loss_masks):
    """Off-Policy Sequence Masking: per sample, mask tokens with ``A < 0`` when the
    masked-mean ``old - new`` log-ratio exceeds ``args.opsm_delta``.

    Transcribes THUDM/slime@624b824a898ab0ec1fcb4d373004c7f3852bf515
    ``slime/utils/ppo_utils.py`` lines 54-92.
    """
    opsm_mask_list = []
    device = advantages[0].device
    opsm_clipfrac = torch.tensor(0.0, device=device)

    for full_log_prob, full_old_log_prob, advantage, loss_mask in zip(
        full_log_probs, full_old_log_probs, advantages, loss_masks, strict=False
    ):
        seq_kl = ((full_old_log_prob - full_log_prob) * loss_mask).sum() / torch.clamp_min(loss_mask.sum(), 1)

        mask = ((advantage < 0) & (seq_kl > args.opsm_delta)).float()
        opsm_clipfrac += mask.sum() / torch.clamp_min(loss_mask.sum(), 1)

        opsm_mask_list.append(1 - mask)

    opsm_mask = torch.cat(opsm_mask_list, dim=0)
    return opsm_mask, opsm_clipfrac


def compute_gspo_kl(full_log_probs, full_old_log_probs, local_log_probs, loss_masks) -> torch.Tensor:
    """GSPO: per-sample masked-mean ``old - new`` log-ratio broadcast to every token.

    Transcribes THUDM/slime@624b824a898ab0ec1fcb4d373004c7f3852bf515
    ``slime/utils/ppo_utils.py`` lines 95-121.
    """
    ppo_kl = [
        ((old_logprob - log_prob) * loss_mask).sum() / torch.clamp_min(loss_mask.sum(), 1)
        for log_prob, old_logprob, loss_mask in zip(full_log_probs, full_old_log_probs, loss_masks, strict=False)
    ]
    ppo_kl = [kl.expand_as(log_prob) for kl, log_prob in zip(ppo_kl, local_log_probs, strict=False)]
    ppo_kl = torch.cat(ppo_kl, dim=0)

    return ppo_kl


def compute_policy_loss(
    ppo_kl: torch.Tensor,
    advantages: torch.Tensor,
    eps_clip: float,
    eps_clip_high: float,
    eps_clip_c=None,
):
    """PPO clipped surrogate with ``ratio = exp(-ppo_kl)`` and optional dual clip
    (``eps_clip_c > 1``, applied where A < 0).  Returns ``(pg_losses, clipfrac)`` per token.

    Transcribes THUDM/slime@624b824a898ab0ec1fcb4d373004c7f3852bf515
    ``slime/utils/ppo_utils.py`` lines 124-148.
    """
    # TRANSCRIPTION NOTE: @torch.compile(dynamic=True) dropped.
    ratio = (-ppo_kl).exp()
    pg_losses1 = -ratio * advantages
    pg_losses2 = -ratio.clamp(1 - eps_clip, 1 + eps_clip_high) * advantages
    clip_pg_losses1 = torch.maximum(pg_losses1, pg_losses2)
    clipfrac = torch.gt(pg_losses2, pg_losses1).float()

    if eps_clip_c is not None:
        assert (
            eps_clip_c > 1.0
        ), f"The lower bound of the clip_ratio_c for dual-clip PPO should be greater than 1.0, but get the value: {eps_clip_c}."  # noqa: E501
        pg_losses3 = -eps_clip_c * advantages
        clip_pg_losses2 = torch.min(pg_losses3, clip_pg_losses1)
        pg_losses = torch.where(advantages < 0, clip_pg_losses2, clip_pg_losses1)
    else:
        pg_losses = clip_pg_losses1

    return pg_losses, clipfrac


def compute_cispo_loss(ppo_kl, log_probs, advantages, eps_clip: float, eps_clip_high: float):
    """CISPO: ``-sg(clip(ratio, 1 - eps_clip, 1 + eps_clip_high)) * A * log_probs``.

    Transcribes THUDM/slime@624b824a898ab0ec1fcb4d373004c7f3852bf515
    ``slime/utils/ppo_utils.py`` lines 151-171.
    """
    # TRANSCRIPTION NOTE: @torch.compile(dynamic=True) dropped.
    ratio = (-ppo_kl).exp()
    ratio_truncated = torch.clamp(ratio, min=1.0 - eps_clip, max=1.0 + eps_clip_high)
    pg_losses = -ratio_truncated.detach() * advantages * log_probs
    clipfrac = (ratio_truncated != ratio).float()
    return pg_losses, clipfrac


# ---------------------------------------------------------------------------
# cp_utils
# ---------------------------------------------------------------------------


def get_sum_of_sample_mean(
    total_lengths: list,
    response_lengths: list,
    loss_masks: list,
    sample_denoms=None,
    calculate_per_token_loss: bool = False,
):
    """Reducer over a concatenated per-token tensor: ``sum_i (x_i * mask_i).sum() /
    clamp_min(denom_i, 1)`` (``denom_i`` = ``sample_denoms[i]``, default
    ``mask_i.sum()``), or ``sum_i (x_i * mask_i).sum()`` when
    ``calculate_per_token_loss``.

    Transcribes THUDM/slime@624b824a898ab0ec1fcb4d373004c7f3852bf515
    ``slime/backends/megatron_utils/cp_utils.py`` lines 47-124 (``cp_size == 1`` branch,
    lines 67-89 and 124).  In the trainer ``sample_denoms`` is
    ``batch["rollout_mask_sums"]``: for every sample, the sum of loss-mask totals of all
    samples of its rollout (``slime/ray/rollout.py`` lines 685-700), a float32 tensor.
    """
    if sample_denoms is None:
        sample_denoms = [m.sum() for m in loss_masks]

    # TRANSCRIPTION NOTE: cp_size == 1 assumed; the zigzag-CP branch is omitted.

    def sum_of_sample_mean(x: torch.Tensor) -> torch.Tensor:
        return sum(
            [
                (x_i * loss_mask_i).sum() / torch.clamp_min(denom, 1)
                for x_i, loss_mask_i, denom in zip(
                    x.split(response_lengths, dim=0), loss_masks, sample_denoms, strict=False
                )
            ]
        )

    def sum_of_token(x: torch.Tensor) -> torch.Tensor:
        return sum(
            [
                (x_i * loss_mask_i).sum()
                for x_i, loss_mask_i in zip(x.split(response_lengths, dim=0), loss_masks, strict=False)
            ]
        )

    return sum_of_sample_mean if not calculate_per_token_loss else sum_of_token


# ---------------------------------------------------------------------------
# TIS and the policy loss
# ---------------------------------------------------------------------------


def vanilla_tis_function(
    args,
    *,
    pg_loss: torch.Tensor,
    train_log_probs: list,
    rollout_log_probs: list,
    loss_masks: list,
    **kwargs,
):
    """Token TIS: ``pg_loss * clamp(exp(old - rollout), tis_clip_low, tis_clip)``;
    masks unchanged.

    Transcribes THUDM/slime@624b824a898ab0ec1fcb4d373004c7f3852bf515
    ``slime/backends/megatron_utils/loss.py`` lines 884-905.
    """
    rollout_log_probs = torch.cat(rollout_log_probs, dim=0)
    old_log_probs = torch.cat(train_log_probs, dim=0)
    tis = torch.exp(old_log_probs - rollout_log_probs)
    tis_abs = (torch.exp(old_log_probs - rollout_log_probs) - 1).abs()
    tis_weights = torch.clamp(tis, min=args.tis_clip_low, max=args.tis_clip)
    tis_clipfrac = (tis_weights != tis).float()
    metrics = {
        "tis": tis.clone().detach(),
        "tis_clipfrac": tis_clipfrac.clone().detach(),
        "tis_abs": tis_abs.clone().detach(),
    }
    pg_loss = pg_loss * tis_weights
    return pg_loss, loss_masks, metrics


def icepop_function(
    args,
    *,
    pg_loss: torch.Tensor,
    train_log_probs: list,
    rollout_log_probs: list,
    loss_masks: list,
    **kwargs,
):
    """ICEPOP: ``pg_loss * r`` where ``r = exp(old - rollout)`` lies in
    ``[tis_clip_low, tis_clip]``, else 0; masks unchanged.

    Transcribes THUDM/slime@624b824a898ab0ec1fcb4d373004c7f3852bf515
    ``slime/backends/megatron_utils/loss.py`` lines 908-931.
    """
    rollout_log_probs = torch.cat(rollout_log_probs, dim=0)
    old_log_probs = torch.cat(train_log_probs, dim=0)
    ice_ratio = torch.exp(old_log_probs - rollout_log_probs)
    ice_abs = (torch.exp(old_log_probs - rollout_log_probs) - 1).abs()
    ice_weight = torch.where(
        (ice_ratio >= args.tis_clip_low) & (ice_ratio <= args.tis_clip), ice_ratio, torch.zeros_like(ice_ratio)
    )
    ice_clipfrac = (ice_weight != ice_ratio).float()
    metrics = {
        "tis": ice_ratio.clone().detach(),
        "tis_clipfrac": ice_clipfrac.clone().detach(),
        "tis_abs": ice_abs.clone().detach(),
    }
    pg_loss = pg_loss * ice_weight
    return pg_loss, loss_masks, metrics


_KNOWN_FUNCTIONS = {
    "slime.backends.megatron_utils.loss.vanilla_tis_function": vanilla_tis_function,
    "slime.backends.megatron_utils.loss.icepop_function": icepop_function,
}


def _load_function(path):
    """Stand-in for ``slime.utils.misc.load_function`` (misc.py lines 39-47)."""
    # TRANSCRIPTION NOTE: no importlib; a callable or a known dotted path.
    if callable(path):
        return path
    if path in _KNOWN_FUNCTIONS:
        return _KNOWN_FUNCTIONS[path]
    raise NotImplementedError(f"cannot import {path!r} in the transcription; pass the function object")


def _all_gather_with_cp(tensor, total_length, response_length):
    """``all_gather_with_cp`` at cp_size 1: the identity.

    Transcribes THUDM/slime@624b824a898ab0ec1fcb4d373004c7f3852bf515
    ``slime/backends/megatron_utils/cp_utils.py`` lines 127-136.
    """
    return tensor


def policy_loss_function(args, batch: dict, logits: torch.Tensor, sum_of_sample_mean):
    """slime's default policy loss on packed logits ``[1, T, V]``, non-distributed.

    Transcribes THUDM/slime@624b824a898ab0ec1fcb4d373004c7f3852bf515
    ``slime/backends/megatron_utils/loss.py`` lines 934-1173.

    ``batch`` keys (per-sample lists, response-length tensors unless stated):
    ``unconcat_tokens`` (prompt+response ids), ``total_lengths`` / ``response_lengths``
    (ints), ``loss_masks``, ``advantages``, ``log_probs`` (pi_old; may be absent or
    empty, then the detached current log-probs are used), ``rollout_log_probs`` (needed
    by ``use_rollout_logprobs`` / ``use_tis``), ``ref_log_probs`` (``use_kl_loss``),
    ``rollout_mask_sums`` (per-sample denominators; needed by ``use_tis``).

    Returns ``(loss, reported_loss)``:
    ``loss = reduce(pg_loss) - entropy_coef * reduce(entropy) + kl_loss_coef *
    reduce(kl)``.
    """
    advantages = torch.cat(batch["advantages"], dim=0)
    old_log_probs = batch["rollout_log_probs"] if args.use_rollout_logprobs else batch.get("log_probs")

    response_lengths = batch["response_lengths"]
    total_lengths = batch["total_lengths"]

    # TRANSCRIPTION NOTE: get_rollout_top_p_logprob_kwargs (lines 83-94) not transcribed.
    if args.rollout_top_p != 1.0:
        raise NotImplementedError("rollout top-p replay is not transcribed")

    _, log_probs_and_entropy = get_log_probs_and_entropy(
        logits,
        args=args,
        unconcat_tokens=batch["unconcat_tokens"],
        total_lengths=total_lengths,
        response_lengths=response_lengths,
        with_entropy=True,
    )

    log_probs = log_probs_and_entropy["log_probs"]
    # TRANSCRIPTION NOTE: _maybe_capture_log_probs (train debug dump) omitted.
    if not args.use_rollout_logprobs and not old_log_probs:
        old_log_probs = [log_prob.detach() for log_prob in log_probs]
    train_log_probs_for_tis = batch.get("log_probs")
    if not train_log_probs_for_tis:
        train_log_probs_for_tis = [log_prob.detach() for log_prob in log_probs]

    need_full_log_probs = args.use_opsm or args.advantage_estimator == "gspo"

    full_log_probs = None
    full_old_log_probs = None
    if need_full_log_probs:
        full_log_probs = [
            _all_gather_with_cp(log_prob, total_length, response_length)
            for log_prob, total_length, response_length in zip(
                log_probs, total_lengths, response_lengths, strict=False
            )
        ]
        full_old_log_probs = [
            _all_gather_with_cp(old_log_prob, total_length, response_length)
            for old_log_prob, total_length, response_length in zip(
                old_log_probs, total_lengths, response_lengths, strict=False
            )
        ]

    if args.use_opsm:
        opsm_mask, opsm_clipfrac = compute_opsm_mask(
            args=args,
            full_log_probs=full_log_probs,
            full_old_log_probs=full_old_log_probs,
            advantages=batch["advantages"],
            loss_masks=batch["loss_masks"],
        )

    if args.advantage_estimator == "gspo":
        ppo_kl = compute_gspo_kl(
            full_log_probs=full_log_probs,
            full_old_log_probs=full_old_log_probs,
            local_log_probs=log_probs,
            loss_masks=batch["loss_masks"],
        )
        old_log_probs = torch.cat(old_log_probs, dim=0)
        log_probs = torch.cat(log_probs, dim=0)
    else:
        old_log_probs = torch.cat(old_log_probs, dim=0)
        log_probs = torch.cat(log_probs, dim=0)
        ppo_kl = old_log_probs - log_probs

    if args.advantage_estimator == "cispo":
        pg_loss, pg_clipfrac = compute_cispo_loss(ppo_kl, log_probs, advantages, args.eps_clip, args.eps_clip_high)
    else:
        pg_loss, pg_clipfrac = compute_policy_loss(
            ppo_kl,
            advantages,
            args.eps_clip,
            args.eps_clip_high,
            eps_clip_c=args.eps_clip_c,
        )

    if args.use_opsm:
        pg_loss = pg_loss * opsm_mask

    if args.get_mismatch_metrics or args.use_tis:
        sum_of_sample_mean_for_mismatch_metrics = sum_of_sample_mean

        assert "rollout_log_probs" in batch, "rollout_log_probs must be provided for TIS"

        ois = (-ppo_kl).exp()
        tis_kwargs = {
            "args": args,
            "pg_loss": pg_loss,
            "train_log_probs": train_log_probs_for_tis,
            "rollout_log_probs": batch["rollout_log_probs"],
            "loss_masks": batch["loss_masks"],
            "total_lengths": total_lengths,
            "response_lengths": response_lengths,
        }

        if args.custom_tis_function_path is not None:
            tis_func = _load_function(args.custom_tis_function_path)
        else:
            tis_func = vanilla_tis_function
        pg_loss, modified_response_masks, tis_metrics = tis_func(**tis_kwargs)

        sum_of_sample_mean = get_sum_of_sample_mean(
            total_lengths,
            response_lengths,
            modified_response_masks,
            batch["rollout_mask_sums"],
            args.calculate_per_token_loss,
        )

    if getattr(args, "custom_pg_loss_reducer_function_path", None) is not None:
        custom_pg_loss_reducer_func = _load_function(args.custom_pg_loss_reducer_function_path)
        pg_loss_masks = modified_response_masks if (args.get_mismatch_metrics or args.use_tis) else batch["loss_masks"]
        pg_loss_reducer = custom_pg_loss_reducer_func(
            total_lengths, response_lengths, pg_loss_masks, args.calculate_per_token_loss
        )
    else:
        pg_loss_reducer = sum_of_sample_mean

    pg_loss = pg_loss_reducer(pg_loss)
    pg_clipfrac = sum_of_sample_mean(pg_clipfrac)
    ppo_kl = sum_of_sample_mean(ppo_kl)

    entropy = log_probs_and_entropy["entropy"]
    entropy = torch.cat(entropy, dim=0)
    entropy_loss = sum_of_sample_mean(entropy)

    loss = pg_loss - args.entropy_coef * entropy_loss

    if args.use_kl_loss:
        ref_log_probs = batch["ref_log_probs"]
        ref_log_probs = torch.cat(ref_log_probs, dim=0)
        importance_ratio = None
        if args.use_unbiased_kl:
            importance_ratio = torch.exp(log_probs - old_log_probs)
        kl = compute_approx_kl(
            log_probs,
            ref_log_probs,
            kl_loss_type=args.kl_loss_type,
            importance_ratio=importance_ratio,
        )
        kl_loss = sum_of_sample_mean(kl)

        loss = loss + args.kl_loss_coef * kl_loss

    if log_probs.numel() == 0:
        loss += 0 * logits.sum()

    train_rollout_logprob_abs_diff = None
    if "rollout_log_probs" in batch and batch["rollout_log_probs"]:
        rollout_log_probs = torch.cat(batch["rollout_log_probs"], dim=0)
        log_probs_to_compare = log_probs if args.use_rollout_logprobs else old_log_probs
        train_rollout_logprob_abs_diff = sum_of_sample_mean((log_probs_to_compare - rollout_log_probs).abs())

    reported_loss = {
        "loss": loss.clone().detach(),
        "pg_loss": pg_loss.clone().detach(),
        "entropy_loss": entropy_loss.clone().detach(),
        "pg_clipfrac": pg_clipfrac.clone().detach(),
        "ppo_kl": ppo_kl.clone().detach(),
    }

    if train_rollout_logprob_abs_diff is not None:
        reported_loss["train_rollout_logprob_abs_diff"] = train_rollout_logprob_abs_diff.clone().detach()

    if args.use_kl_loss:
        reported_loss["kl_loss"] = kl_loss.clone().detach()

    if args.get_mismatch_metrics or args.use_tis:
        reported_loss["ois"] = sum_of_sample_mean_for_mismatch_metrics(ois).clone().detach()
        for metric_key, metric_value in tis_metrics.items():
            key_name = f"{metric_key}"
            reported_loss[key_name] = sum_of_sample_mean_for_mismatch_metrics(metric_value)

    if args.use_opsm:
        reported_loss["opsm_clipfrac"] = opsm_clipfrac

    if batch.get("opd_reverse_kl"):
        opd_reverse_kl = torch.cat(batch["opd_reverse_kl"], dim=0)
        reported_loss["opd_reverse_kl"] = sum_of_sample_mean(opd_reverse_kl).clone().detach()

    return loss, reported_loss


def loss_function(
    args,
    batch: dict,
    num_microbatches: int,
    step_global_batch_size: int,
    logits: torch.Tensor,
    *,
    dp_cp_world_size: int = 1,
    cp_world_size: int = 1,
):
    """Dispatch (``policy_loss`` / ``custom_loss``) and Megatron rescaling:
    ``loss * num_microbatches / step_global_batch_size * dp_cp_world_size``, or
    ``loss * cp_world_size`` with ``calculate_per_token_loss`` (then the normalizer
    is ``num_tokens``).  Returns ``(scaled_loss, normalizer, {"keys", "values"})``.

    Transcribes THUDM/slime@624b824a898ab0ec1fcb4d373004c7f3852bf515
    ``slime/backends/megatron_utils/loss.py`` lines 1283-1383.
    """
    num_tokens = sum([torch.clamp_min(loss_mask.sum(), 1) for loss_mask in batch["loss_masks"]])

    sum_of_sample_mean = get_sum_of_sample_mean(
        batch["total_lengths"],
        batch["response_lengths"],
        batch["loss_masks"],
        batch["rollout_mask_sums"],
        args.calculate_per_token_loss,
    )

    # TRANSCRIPTION NOTE: value_loss / sft_loss branches omitted; custom_loss via _load_function.
    if args.loss_type == "policy_loss":
        func = policy_loss_function
    elif args.loss_type == "custom_loss":
        func = _load_function(args.custom_loss_function_path)
    else:
        raise ValueError(f"Unknown loss type: {args.loss_type}")

    # TRANSCRIPTION NOTE: recompute_loss_function (activation checkpoint) does not change values.
    loss, log = func(args, batch, logits, sum_of_sample_mean)

    # TRANSCRIPTION NOTE: mpu.get_data_parallel_world_size(with_context_parallel=True) and
    # mpu.get_context_parallel_world_size() are arguments; the allgather-CP anchor is omitted.
    if not args.calculate_per_token_loss:
        loss = loss * num_microbatches / step_global_batch_size * dp_cp_world_size
    else:
        loss = loss * cp_world_size

    return (
        loss,
        (num_tokens if args.calculate_per_token_loss else torch.tensor(1, device=logits.device)),
        {
            "keys": list(log.keys()),
            "values": torch.tensor(
                [
                    num_tokens if args.calculate_per_token_loss else 0,
                ]
                + list(log.values()),
                device=logits.device,
            ),
        },
    )
