"""Transcription of prime-rl's per-sample RL loss functions.

Source: PrimeIntellect-ai/prime-rl, commit 559b44772e471d1538537b8805cc77f3824a5e64
(2026-08-21, "chore: bump verifiers to latest main (#3337)"):

- ``src/prime_rl/trainer/rl/loss.py`` (losses, ``compute_loss``)
- ``packages/prime-rl-configs/src/prime_rl/configs/trainer.py`` lines 494-532 (loss configs)

The arithmetic is copied statement by statement.  Deliberate differences, each also
marked ``# TRANSCRIPTION NOTE:`` in the code:

- jaxtyping / beartype annotations are dropped (shapes are documented instead).
- Config objects are replaced by keyword arguments (same field names and defaults) or
  small dataclasses; pydantic validation (``ge=0``) is not reproduced.
- ``CustomLossConfig.import_path`` is replaced by a callable (no ``import_object``).
- ``compute_loss`` is reduced to the rl component (no ce / ref_kl streams) and takes
  a list of :class:`LossInputs`; the trainer's global token count ``rl_scale`` is an
  argument, as in prime-rl.

Only ``torch``, ``dataclasses`` and ``types`` are imported.
"""

from dataclasses import dataclass, field
from types import SimpleNamespace

import torch
from torch import Tensor

__all__ = [
    "CustomLossConfig",
    "DefaultLossConfig",
    "IPOLossConfig",
    "LossInputs",
    "LossOutputs",
    "ce_loss_fn",
    "compute_importance_ratio_and_mismatch_kl",
    "compute_loss",
    "default_loss_fn",
    "ipo_loss_fn",
    "ref_kl_loss_fn",
    "setup_rl_loss_fn",
]


@dataclass
class LossInputs:
    """Inputs for computing loss on a single sample (all 1-D ``[seq]``).

    Transcribes PrimeIntellect-ai/prime-rl@559b44772e471d1538537b8805cc77f3824a5e64
    ``src/prime_rl/trainer/rl/loss.py`` lines 13-28.

    ``loss_mask`` (bool) already selects the tokens that belong to the receiving
    component.  ``loss_weights`` is the component's per-token weight stream (None
    means 1.0 everywhere).  There are no old (pi_old) log-probs: ratios are taken
    against ``inference_logprobs`` (the sampler).
    """

    # TRANSCRIPTION NOTE: jaxtyping annotations Float[Tensor, " seq"] / Bool[...] dropped.
    trainer_logprobs: Tensor
    inference_logprobs: Tensor
    ref_logprobs: Tensor | None
    advantages: Tensor
    loss_mask: Tensor
    loss_weights: Tensor | None = field(default=None)


@dataclass
class LossOutputs:
    """Outputs from computing loss on a single sample: a 0-d ``loss`` (a SUM over the
    sample's tokens) and a ``metrics`` dict.

    Transcribes PrimeIntellect-ai/prime-rl@559b44772e471d1538537b8805cc77f3824a5e64
    ``src/prime_rl/trainer/rl/loss.py`` lines 31-36.
    """

    loss: Tensor
    metrics: dict[str, Tensor]


# A per-sample loss function: ``fn(inputs: LossInputs, **kwargs) -> LossOutputs`` (loss.py lines 39-45).
LossFn = object


@dataclass
class DefaultLossConfig:
    """``DefaultLossConfig`` fields and defaults.

    Transcribes PrimeIntellect-ai/prime-rl@559b44772e471d1538537b8805cc77f3824a5e64
    ``packages/prime-rl-configs/src/prime_rl/configs/trainer.py`` lines 494-507.
    """

    # TRANSCRIPTION NOTE: pydantic BaseConfig with Field(..., ge=0) -> plain dataclass.
    type: str = "default"
    dppo_mask_low: float = 0.2
    dppo_mask_high: float = 0.2
    adv_tau: float = 1.0
    kl_tau: float = 1e-3


@dataclass
class IPOLossConfig:
    """``IPOLossConfig`` fields and defaults.

    Transcribes PrimeIntellect-ai/prime-rl@559b44772e471d1538537b8805cc77f3824a5e64
    ``packages/prime-rl-configs/src/prime_rl/configs/trainer.py`` lines 510-519.
    """

    type: str = "ipo"
    ipo_threshold: float = 0.1
    adv_tau: float = 1.0
    kl_tau: float = 1e-3


@dataclass
class CustomLossConfig:
    """``CustomLossConfig``: ``fn(inputs, **kwargs) -> LossOutputs``.

    Transcribes PrimeIntellect-ai/prime-rl@559b44772e471d1538537b8805cc77f3824a5e64
    ``packages/prime-rl-configs/src/prime_rl/configs/trainer.py`` lines 522-529.
    """

    # TRANSCRIPTION NOTE: prime-rl stores ``import_path: str`` and resolves it with
    # ``import_object``; here the callable itself is stored.
    fn: object  # Callable[..., LossOutputs]
    kwargs: dict[str, object] = field(default_factory=dict)
    type: str = "custom"


def _safe_mean(values: Tensor, mask: Tensor) -> Tensor:
    """Mean of values over a boolean mask; returns 0 when mask is empty.

    Transcribes PrimeIntellect-ai/prime-rl@559b44772e471d1538537b8805cc77f3824a5e64
    ``src/prime_rl/trainer/rl/loss.py`` lines 94-97.
    """
    denom = torch.clamp_min(mask.sum(), 1)
    return values[mask].sum() / denom


def compute_importance_ratio_and_mismatch_kl(
    trainer_logprobs: Tensor, inference_logprobs: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    """Return ``(log_ratio, ratio, ratio - log_ratio - 1)`` of trainer vs inference.

    Transcribes PrimeIntellect-ai/prime-rl@559b44772e471d1538537b8805cc77f3824a5e64
    ``src/prime_rl/trainer/rl/loss.py`` lines 100-106.
    """
    log_importance_ratio = trainer_logprobs - inference_logprobs
    importance_ratio = torch.exp(log_importance_ratio)
    mismatch_kl = importance_ratio - log_importance_ratio - 1
    return log_importance_ratio, importance_ratio, mismatch_kl


def default_loss_fn(
    inputs: LossInputs,
    *,
    dppo_mask_low: float = 0.2,
    dppo_mask_high: float = 0.2,
    adv_tau: float = 1.0,
    kl_tau: float = 1e-3,
) -> LossOutputs:
    """DPPO-Binary-TV (mask conditioned on the advantage sign) + Kimi-K2.5 KL; a SUM
    over the sample.

    Transcribes PrimeIntellect-ai/prime-rl@559b44772e471d1538537b8805cc77f3824a5e64
    ``src/prime_rl/trainer/rl/loss.py`` lines 109-161
    (``default_loss_fn(inputs, loss_config: DefaultLossConfig)``).

    For A > 0 tokens with ``p - q > dppo_mask_high`` are masked; for A < 0 (and,
    literally, for A == 0) tokens with ``p - q < -dppo_mask_low`` are masked
    (``torch.where(A > 0, high, low)``).  ``per_token = -keep*adv_tau*A*ratio +
    kl_tau * loss_mask * log_ratio**2``, times ``loss_weights`` if given.

    There is no ``teacher_tau`` field at this commit.
    """
    # TRANSCRIPTION NOTE: the DefaultLossConfig object is rebuilt from keyword args so
    # that the body below reads ``loss_config.<field>`` exactly as in prime-rl.
    loss_config = SimpleNamespace(
        dppo_mask_low=dppo_mask_low, dppo_mask_high=dppo_mask_high, adv_tau=adv_tau, kl_tau=kl_tau
    )
    trainer_logprobs = inputs.trainer_logprobs
    inference_logprobs = inputs.inference_logprobs
    advantages = inputs.advantages
    loss_mask = inputs.loss_mask

    log_importance_ratio, importance_ratio, mismatch_kl = compute_importance_ratio_and_mismatch_kl(
        trainer_logprobs, inference_logprobs
    )

    probs_diff = torch.exp(trainer_logprobs) - torch.exp(inference_logprobs)
    dppo_invalid_mask_high = probs_diff > loss_config.dppo_mask_high
    dppo_invalid_mask_low = probs_diff < -loss_config.dppo_mask_low
    positive_advantages = advantages > 0
    negative_advantages = advantages < 0
    dppo_invalid_mask = torch.where(positive_advantages, dppo_invalid_mask_high, dppo_invalid_mask_low)

    is_masked = dppo_invalid_mask
    is_masked_high = positive_advantages & dppo_invalid_mask_high
    is_masked_low = negative_advantages & dppo_invalid_mask_low
    drop_mask = loss_mask & is_masked
    keep_mask = loss_mask & ~is_masked

    advantages = loss_config.adv_tau * advantages
    pg_loss = keep_mask * advantages * importance_ratio
    kl_loss = loss_mask * log_importance_ratio**2
    per_token_loss = -pg_loss + loss_config.kl_tau * kl_loss
    if inputs.loss_weights is not None:
        per_token_loss = per_token_loss * inputs.loss_weights
    loss = per_token_loss.sum()

    metrics = {
        "masked_mismatch_kl": _safe_mean(mismatch_kl, loss_mask & is_masked),  # all trainable, masked tokens
        "unmasked_mismatch_kl": _safe_mean(mismatch_kl, keep_mask),  # all trainable, unmasked tokens
        "is_masked": _safe_mean(is_masked, loss_mask),
        "is_masked_low": _safe_mean(is_masked_low, loss_mask),
        "is_masked_high": _safe_mean(is_masked_high, loss_mask),
        "masked_advantage_positive": _safe_mean(positive_advantages, drop_mask),
        "masked_advantage_negative": _safe_mean(negative_advantages, drop_mask),
    }

    return LossOutputs(loss=loss, metrics=metrics)


def ipo_loss_fn(
    inputs: LossInputs,
    *,
    ipo_threshold: float = 0.1,
    adv_tau: float = 1.0,
    kl_tau: float = 1e-3,
) -> LossOutputs:
    """IPO loss: keep iff ``|p - q| <= ipo_threshold``; pg via the ratio; KL
    ``kl_tau * (log p/q)**2`` on EVERY loss token; a SUM over the sample.

    Transcribes PrimeIntellect-ai/prime-rl@559b44772e471d1538537b8805cc77f3824a5e64
    ``src/prime_rl/trainer/rl/loss.py`` lines 164-196
    (``ipo_loss_fn(inputs, loss_config: IPOLossConfig)``).
    """
    # TRANSCRIPTION NOTE: IPOLossConfig rebuilt from keyword args (same field names/defaults).
    loss_config = SimpleNamespace(ipo_threshold=ipo_threshold, adv_tau=adv_tau, kl_tau=kl_tau)
    trainer_logprobs = inputs.trainer_logprobs
    inference_logprobs = inputs.inference_logprobs
    advantages = inputs.advantages
    loss_mask = inputs.loss_mask

    log_importance_ratio, importance_ratio, mismatch_kl = compute_importance_ratio_and_mismatch_kl(
        trainer_logprobs, inference_logprobs
    )

    abs_probs_diff = torch.abs(torch.exp(trainer_logprobs) - torch.exp(inference_logprobs))

    is_masked = abs_probs_diff > loss_config.ipo_threshold
    keep_mask = loss_mask & ~is_masked

    advantages = loss_config.adv_tau * advantages
    pg_loss = keep_mask * advantages * importance_ratio
    kl_loss = loss_mask * log_importance_ratio**2
    per_token_loss = -pg_loss + loss_config.kl_tau * kl_loss
    if inputs.loss_weights is not None:
        per_token_loss = per_token_loss * inputs.loss_weights
    loss = per_token_loss.sum()

    metrics = {
        "masked_mismatch_kl": _safe_mean(mismatch_kl, loss_mask & is_masked),  # all trainable, masked tokens
        "unmasked_mismatch_kl": _safe_mean(mismatch_kl, keep_mask),  # all trainable, unmasked tokens
        "is_masked": _safe_mean(is_masked, loss_mask),
    }

    return LossOutputs(loss=loss, metrics=metrics)


def ref_kl_loss_fn(inputs: LossInputs) -> LossOutputs:
    """Ref-KL loss (on-policy distillation): ``sg(ref - p) * ratio`` on kept tokens,
    one-sided mask ``p - q < -0.2``, ``1e-3 * (log p/q)**2`` on every loss token.

    Transcribes PrimeIntellect-ai/prime-rl@559b44772e471d1538537b8805cc77f3824a5e64
    ``src/prime_rl/trainer/rl/loss.py`` lines 199-243.
    """
    trainer_logprobs = inputs.trainer_logprobs
    inference_logprobs = inputs.inference_logprobs
    ref_logprobs = inputs.ref_logprobs
    loss_mask = inputs.loss_mask

    if ref_logprobs is None:
        raise ValueError("ref_kl loss type requires ref_logprobs — use the 'opd' or 'opsd' algorithm.")

    log_importance_ratio, importance_ratio, mismatch_kl = compute_importance_ratio_and_mismatch_kl(
        trainer_logprobs, inference_logprobs
    )

    probs_diff = torch.exp(trainer_logprobs) - torch.exp(inference_logprobs)
    is_masked = probs_diff < -0.2
    drop_mask = loss_mask & is_masked
    keep_mask = loss_mask & ~is_masked

    ref_kl = ref_logprobs - trainer_logprobs

    pg_loss = keep_mask * ref_kl.detach() * importance_ratio
    kl_loss = loss_mask * log_importance_ratio**2
    per_token_loss = -pg_loss + 1e-3 * kl_loss
    if inputs.loss_weights is not None:
        per_token_loss = per_token_loss * inputs.loss_weights
    loss = per_token_loss.sum()

    metrics = {
        "ref_kl/masked_mismatch_kl": _safe_mean(mismatch_kl, drop_mask),
        "ref_kl/unmasked_mismatch_kl": _safe_mean(mismatch_kl, keep_mask),
        "ref_kl/is_masked": _safe_mean(is_masked, loss_mask),
        "ref_kl": _safe_mean(ref_kl, loss_mask),
    }

    return LossOutputs(loss=loss, metrics=metrics)


def ce_loss_fn(inputs: LossInputs) -> LossOutputs:
    """Cross-entropy loss type: masked NLL sum.

    Transcribes PrimeIntellect-ai/prime-rl@559b44772e471d1538537b8805cc77f3824a5e64
    ``src/prime_rl/trainer/rl/loss.py`` lines 246-259.
    """
    trainer_logprobs = inputs.trainer_logprobs
    loss_mask = inputs.loss_mask

    nll = -trainer_logprobs
    if inputs.loss_weights is not None:
        nll = nll * inputs.loss_weights
    loss = nll[loss_mask].sum()
    metrics = {
        "nll": _safe_mean(-trainer_logprobs, loss_mask),
    }
    return LossOutputs(loss=loss, metrics=metrics)


def setup_rl_loss_fn(loss_config: DefaultLossConfig | IPOLossConfig | CustomLossConfig) -> LossFn:
    """Build the rl loss fn from ``trainer.loss`` (default / ipo / custom).

    Transcribes PrimeIntellect-ai/prime-rl@559b44772e471d1538537b8805cc77f3824a5e64
    ``src/prime_rl/trainer/rl/loss.py`` lines 262-282.
    """
    if isinstance(loss_config, CustomLossConfig):
        # TRANSCRIPTION NOTE: ``import_object(loss_config.import_path)`` -> ``loss_config.fn``.
        custom_fn = loss_config.fn
        kwargs = loss_config.kwargs

        def rl_fn(inputs: LossInputs) -> LossOutputs:
            return custom_fn(inputs, **kwargs)
    elif isinstance(loss_config, IPOLossConfig):

        def rl_fn(inputs: LossInputs) -> LossOutputs:
            # TRANSCRIPTION NOTE: config passed as keyword args.
            return ipo_loss_fn(
                inputs,
                ipo_threshold=loss_config.ipo_threshold,
                adv_tau=loss_config.adv_tau,
                kl_tau=loss_config.kl_tau,
            )
    else:

        def rl_fn(inputs: LossInputs) -> LossOutputs:
            # TRANSCRIPTION NOTE: config passed as keyword args.
            return default_loss_fn(
                inputs,
                dppo_mask_low=loss_config.dppo_mask_low,
                dppo_mask_high=loss_config.dppo_mask_high,
                adv_tau=loss_config.adv_tau,
                kl_tau=loss_config.kl_tau,
            )

    return rl_fn


def compute_loss(
    samples: list[LossInputs],
    rl_scale: int,
    *,
    rl_loss_fn: LossFn | None = None,
) -> tuple[Tensor, dict[str, object]]:
    """Sum the per-sample rl losses and divide by the global rl-token count.

    Transcribes PrimeIntellect-ai/prime-rl@559b44772e471d1538537b8805cc77f3824a5e64
    ``src/prime_rl/trainer/rl/loss.py`` lines 285-403 (rl component only).

    Each ``samples[i]`` carries one packed sample's 1-D tensors; its ``loss_weights``
    plays the role of prime-rl's ``rl_weights[i]``.  With no weights the loss fn sees
    the full ``loss_mask`` and ``loss_weights=None``; with weights it sees
    ``loss_mask & (w != 0)`` and the weights, and samples with no such token are
    skipped.  ``rl_scale`` is the trainer's global token count
    ``max(sum_i (mask_i & (w_i != 0)).sum() or mask_i.sum(), 1)`` over all dp/cp ranks
    and micro-batches (``src/prime_rl/trainer/rl/train.py`` lines 307-323).
    ``rl_loss_fn`` defaults to ``setup_rl_loss_fn(DefaultLossConfig())``.

    Returns ``(rl_loss / rl_scale, aggregated_metrics)``.
    """
    # TRANSCRIPTION NOTE: prime-rl's signature takes parallel lists (trainer_logprobs,
    # inference_logprobs, ref_logprobs, advantages, loss_mask, rl_weights, ce_weights,
    # ref_kl_weights, rl_loss_fn, rl_scale, ce_scale, ref_kl_scale).  Here the rl stream
    # only: the ce / ref_kl components (``ce_loss / ce_scale + ref_kl_loss /
    # ref_kl_scale``, both 0.0 when their weight streams are None) are omitted.
    if rl_loss_fn is None:
        rl_loss_fn = setup_rl_loss_fn(DefaultLossConfig())

    all_metrics: dict[str, list[Tensor]] = {}

    def run_loss_fn(loss_fn: LossFn, inputs: LossInputs) -> Tensor:
        result = loss_fn(inputs)
        for k, v in result.metrics.items():
            all_metrics.setdefault(k, []).append(v)
        return result.loss

    # Graph anchor (see prime-rl): an all-empty micro batch still returns a backward-able loss.
    rl_loss = samples[0].trainer_logprobs.sum() * 0.0
    for sample in samples:
        t_logp = sample.trainer_logprobs
        i_logp = sample.inference_logprobs
        ref_logp = sample.ref_logprobs
        adv = sample.advantages
        mask = sample.loss_mask
        rl_w = sample.loss_weights

        def make_inputs(component_mask: Tensor, weights: Tensor | None) -> LossInputs:
            return LossInputs(
                trainer_logprobs=t_logp,  # noqa: B023 (literal; called in the same iteration)
                inference_logprobs=i_logp,  # noqa: B023 (literal; called in the same iteration)
                ref_logprobs=ref_logp,  # noqa: B023 (literal; called in the same iteration)
                advantages=adv,  # noqa: B023 (literal; called in the same iteration)
                loss_mask=component_mask,
                loss_weights=weights,
            )

        if rl_w is None:
            rl_loss = rl_loss + run_loss_fn(rl_loss_fn, make_inputs(mask, None))
        else:
            rl_mask = mask & (rl_w != 0)
            if bool(rl_mask.any()):
                rl_loss = rl_loss + run_loss_fn(rl_loss_fn, make_inputs(rl_mask, rl_w))

    scaled_loss = rl_loss / rl_scale

    aggregated: dict[str, object] = {}
    for k, v in all_metrics.items():
        if v[0].dim() == 0:
            aggregated[k] = torch.stack(v)
        else:
            aggregated[k] = torch.cat(v)

    return scaled_loss, aggregated
