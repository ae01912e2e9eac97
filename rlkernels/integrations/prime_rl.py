"""rlkernels inside prime-rl: custom per-sample losses for `[trainer.loss] type = "custom"`.

    [trainer.loss]
    type = "custom"
    import_path = "rlkernels.integrations.prime_rl.default_loss_fn"   # or ...ipo_loss_fn
    kwargs = { dppo_mask_low = 0.2, dppo_mask_high = 0.2, adv_tau = 1.0, kl_tau = 1e-3 }

prime-rl (at 559b4477) calls a custom loss once per sample with 1-D tensors (`LossInputs`: trainer and inference
log-probs, advantages, the bool loss mask, optional per-token loss weights) and expects `LossOutputs(loss,
metrics)` whose loss is a **sum** over the sample (its `compute_loss` adds the samples and divides by the global
token count). There are no old log-probs: the ratio p/q is against the sampler, rlkernels' bypass mode.
- `default_loss_fn`: prime-rl's default, DPPO binary-TV conditioned on the advantage's sign
  (`loss_type="dppo_binary_tv_signed"`, `binary_tv_low/high` = `dppo_mask_low/high`) and the Kimi-K2.5 term
  kl_tau·(log p/q)² on every loss token (`log_ratio_sq_coef`);
- `ipo_loss_fn`: IPO, keep iff |p − q| ≤ `ipo_threshold` (`loss_type="ipo"`), the same KL term;
- `adv_tau` scales the advantages; the ratio is unclamped (prime-rl's); `loss_weights` multiply each token's
  whole loss: the policy term through rlkernels' `is_weights=`, the KL term here (rlkernels' log-ratio-square term
  takes no per-token weight).
Metrics: prime-rl's `is_masked` (the fraction of loss tokens outside the region), and rlkernels' own; with
RLKERNELS_LOGPROB_PARITY=1, `logprob_parity/...` of the trainer's log-probs against the inference engine's (parity.py).
"""

from dataclasses import dataclass
from typing import Dict

import torch

from ..api import policy_loss
from ..config import PolicyLossConfig
from .parity import parity_metrics


@dataclass
class LossOutputs:
    """prime-rl's `LossOutputs` (src/prime_rl/trainer/rl/loss.py): used where prime-rl is not importable."""
    loss: torch.Tensor
    metrics: Dict[str, torch.Tensor]


def _outputs_class():
    try:
        from prime_rl.trainer.rl.loss import LossOutputs as prime_rl_outputs
    except ImportError:
        return LossOutputs
    return prime_rl_outputs


def _sample_loss(inputs, config: PolicyLossConfig, adv_tau: float, kl_tau: float):
    mask = inputs.loss_mask.bool()
    weights = getattr(inputs, "loss_weights", None)
    if weights is None:
        config = config.with_overrides(log_ratio_sq_coef=kl_tau)
    out = policy_loss(inputs.trainer_logprobs, adv_tau * inputs.advantages, mask,
                      rollout_logprobs=inputs.inference_logprobs.detach(), config=config, is_weights=weights)
    loss = out.loss
    if weights is not None and kl_tau:  # the KL term, weighted per token as prime-rl weights it
        d = inputs.trainer_logprobs - inputs.inference_logprobs.detach()
        loss = loss + kl_tau * torch.where(mask, weights * d * d, torch.zeros_like(d)).sum()
    metrics = dict(out.metrics)
    metrics["is_masked"] = out.metrics["actor/pg_clipfrac"]
    metrics.update(parity_metrics(inputs.trainer_logprobs, inputs.inference_logprobs, mask))  # opt-in: parity.py
    return _outputs_class()(loss=loss, metrics=metrics)


def _config(loss_type: str, **fields) -> PolicyLossConfig:
    return PolicyLossConfig(loss_type=loss_type, loss_agg_mode="token-sum", log_ratio_clamp=None, ipo_kl_tau=0.0,
                            **fields)


def default_loss_fn(inputs, *, dppo_mask_low: float = 0.2, dppo_mask_high: float = 0.2, adv_tau: float = 1.0,
                    kl_tau: float = 1e-3):
    """prime-rl's `default_loss_fn` (DefaultLossConfig's fields and defaults), by rlkernels."""
    config = _config("dppo_binary_tv_signed", binary_tv_low=dppo_mask_low, binary_tv_high=dppo_mask_high)
    return _sample_loss(inputs, config, adv_tau, kl_tau)


def ipo_loss_fn(inputs, *, ipo_threshold: float = 0.1, adv_tau: float = 1.0, kl_tau: float = 1e-3):
    """prime-rl's `ipo_loss_fn` (IPOLossConfig's fields and defaults at 559b4477), by rlkernels."""
    return _sample_loss(inputs, _config("ipo", ipo_eps=ipo_threshold), adv_tau, kl_tau)
