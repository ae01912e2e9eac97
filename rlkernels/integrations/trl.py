"""rlkernels inside TRL 1.16: `GRPOTrainer`, a drop-in for `trl.GRPOTrainer`.

    from rlkernels.integrations.trl import GRPOTrainer   # instead of: from trl import GRPOTrainer

Same constructor, plus `rollout_correction=` (a `RolloutCorrection` applied against the sampler's
log-probs, in place of TRL's vLLM importance sampling). The loss is computed by
`rlkernels.linear_decoupled_ppo_loss` from the policy's last hidden states and its LM head: the [B, C, V]
logits of the completions are never formed (TRL's own path patches the model's forward with a fused
head). Everything else (generation, rewards, advantages, old / reference log-probs, logging) is TRL's.

The configuration comes from `PolicyLossConfig.from_trl(args)`: TRL's loss type as its loss and
aggregation, epsilons, delta, beta with TRL's (bias-corrected) k3, importance-sampling level, OPSM,
SAPO / VESPO parameters, the sampling temperature; unsupported options raise naming the option. The
normalisers are TRL's: the grpo-like types divide by the gradient-accumulation steps, dapo / cispo /
vespo by `num_items_in_batch` over the processes and the accumulation window; the entropy bonus is a
token mean divided by the accumulation steps. TRL's vLLM importance-sampling ratios (already computed,
NaN log-probs turned into ratio 1) are passed as `is_weights`.

Without old log-probs (TRL's `num_iterations = 1`) but with the sampler's (OPSM, or a
`rollout_correction`), the old log-probs are the current ones, detached, as in TRL: computed here
without autograd from the same hidden states. A sampler log-prob that is NaN stands for the old one
(ratio 1, as TRL's IS weights); for OPSM that token then adds old - current to its sequence's mean
(TRL: 0), which differs only when old != current (`num_iterations > 1`).

Limits (each raises): vision-language inputs, MoE auxiliary losses, `top_entropy_quantile < 1`,
adaptive entropy. The decoder is called through `get_decoder()` of the unwrapped model: under DDP /
FSDP wrappers use the logits-free path only if your wrapper tolerates calls to submodules (single
process and DeepSpeed ZeRO-1/2 do).
"""

from typing import Optional

import torch

try:
    from trl import GRPOTrainer as _TRLGRPOTrainer
except ImportError as exc:  # pragma: no cover - the message says what to install
    raise ImportError("rlkernels.integrations.trl needs TRL 1.16: pip install 'rlkernels[trl]'") from exc

from .. import api
from ..config import PolicyLossConfig, RolloutCorrection
from .hf import response_hidden_states

# TRL loss types whose normaliser is the window's token count (`num_items_in_batch`), not the
# gradient-accumulation steps
_TOKEN_COUNT_LOSSES = ("dapo", "cispo", "vespo")
_VISION_KEYS = ("pixel_values", "image_grid_thw", "pixel_attention_mask", "image_sizes", "spatial_shapes",
                "num_tiles", "image_position_ids", "mm_token_type_ids", "token_type_ids")


class GRPOTrainer(_TRLGRPOTrainer):
    """`trl.GRPOTrainer` with rlkernels computing the loss (see the module docstring)."""

    def __init__(self, *args, rollout_correction: Optional[RolloutCorrection] = None, **kwargs):
        super().__init__(*args, **kwargs)
        if rollout_correction is not None and not isinstance(rollout_correction, RolloutCorrection):
            raise TypeError(f"rollout_correction: expected a RolloutCorrection or None, got "
                            f"{type(rollout_correction).__name__}")
        if getattr(self, "aux_loss_enabled", False):
            raise ValueError("model: MoE router auxiliary losses are not supported by rlkernels' GRPOTrainer")
        config = PolicyLossConfig.from_trl(self.args)
        # TRL's own vLLM weights arrive as `importance_sampling_ratio` and go in as is_weights; a
        # RolloutCorrection given here replaces them (computed from the sampler's log-probs)
        self.rlkernels_config = config.with_overrides(rollout_correction=rollout_correction)
        self.rlkernels_uses_own_correction = rollout_correction is not None

    def _compute_loss(self, model, inputs):
        for key in _VISION_KEYS:
            if inputs.get(key) is not None:
                raise ValueError(f"inputs: {key!r} (vision-language models) is not supported by rlkernels' "
                                 "GRPOTrainer; use trl.GRPOTrainer")
        prompt_ids, prompt_mask = inputs["prompt_ids"], inputs["prompt_mask"]
        completion_ids, completion_mask = inputs["completion_ids"], inputs["completion_mask"]
        mask = completion_mask if "tool_mask" not in inputs else completion_mask * inputs["tool_mask"]
        P = prompt_ids.size(1)
        input_ids = torch.cat([prompt_ids, completion_ids], dim=1)
        attention_mask = torch.cat([prompt_mask, completion_mask], dim=1)

        # hidden state t predicts token t + 1: positions P - 1 .. P + C - 2 predict the completion
        unwrapped = self.accelerator.unwrap_model(model)
        head = unwrapped.get_output_embeddings()
        with self.accelerator.autocast():
            hidden, _ = response_hidden_states(unwrapped, input_ids, attention_mask, P)
        hidden = hidden.to(head.weight.dtype)

        mode = "train" if self.model.training else "eval"
        accumulation = self.current_gradient_accumulation_steps if mode == "train" else 1
        config = self.rlkernels_config
        overrides = {}
        entropy_scale = 1.0  # TRL's entropy bonus is this micro-batch's token mean, whatever the loss divides by
        if self.loss_type in _TOKEN_COUNT_LOSSES:
            normaliser = inputs["num_items_in_batch"].clamp(min=1.0) / self.accelerator.num_processes
            if mode == "train":
                normaliser = normaliser * accumulation / self.args.steps_per_generation
            # one host read (TRL's normaliser is a tensor; the config takes a float): the loss divides every
            # token-mean by the normaliser, so the entropy's coefficient carries normaliser / local count
            normaliser, local = torch.stack([normaliser.float(), mask.sum().float()]).tolist()
            entropy_scale = normaliser / local if local > 0 else 0.0
            overrides.update(global_num_tokens=normaliser,
                             entropy_coeff=config.entropy_coeff * entropy_scale / accumulation)
        old = inputs.get("old_per_token_logps")
        sampling = inputs.get("sampling_per_token_logps")
        use_sampling = sampling is not None and (self.rlkernels_uses_own_correction or
                                                 config.off_policy_mask_threshold is not None)
        if use_sampling and old is None:
            # TRL's old log-probs are then the current ones, detached (ratio 1); computed here, since
            # rollout log-probs without old ones would mean the bypass mode (a ratio against the sampler)
            with torch.no_grad():
                old = api.linear_token_logprobs(hidden, head.weight, completion_ids, bias=head.bias,
                                                temperature=config.temperature, validate=False).logprobs
        is_weights = None
        if sampling is not None and old is not None:  # TRL: a token vLLM could not score gets ratio 1
            sampling = torch.where(torch.isnan(sampling), old, sampling)
        if not self.rlkernels_uses_own_correction and "importance_sampling_ratio" in inputs:
            ratio = inputs["importance_sampling_ratio"]
            is_weights = ratio.expand_as(completion_ids).to(torch.float32) if ratio.dim() == 2 else ratio
        out = api.linear_decoupled_ppo_loss(
            hidden, head.weight, completion_ids, inputs["advantages"], mask.bool(), bias=head.bias,
            old_logprobs=old, rollout_logprobs=sampling if use_sampling else None,
            ref_logprobs=inputs.get("ref_per_token_logps") if config.kl_coef else None,
            is_weights=is_weights, config=config, validate=False, **overrides,
        )
        loss = out.loss if self.loss_type in _TOKEN_COUNT_LOSSES else out.loss / accumulation
        self._log_rlkernels_metrics(mode, out.metrics, entropy_scale)
        return loss

    def _log_rlkernels_metrics(self, mode, metrics, entropy_scale: float):
        """rlkernels' metrics under their names, plus TRL's where they mean the same, gathered across
        processes and averaged as TRL averages its own. `entropy_scale` turns actor/entropy (divided
        by the loss's normaliser) back into the micro-batch's token mean TRL logs as `entropy`."""
        values = api.metrics_to_floats(metrics)  # one synchronisation
        if "actor/entropy" in values:
            values["entropy"] = values["actor/entropy"] * entropy_scale
        if "actor/pg_clipfrac" in values:
            values["clip_ratio/region_mean"] = values["actor/pg_clipfrac"]
        for name, value in values.items():
            gathered = self.accelerator.gather(torch.tensor(value, device=self.accelerator.device)).nanmean().item()
            self._metrics[mode][name].append(gathered)
