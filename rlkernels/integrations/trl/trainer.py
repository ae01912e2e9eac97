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
(ratio 1, as TRL's IS weights), and is left out of the opt-in parity report (RLKERNELS_LOGPROB_PARITY=1:
`logprob_parity/...` of the old log-probs against the sampler's, in TRL's logged metrics; parity.py); for OPSM
that token then adds old - current to its sequence's mean (TRL: 0), which differs only when old != current
(`num_iterations > 1`).

The loss is computed inside the model's forward, as TRL's fused head is: the trainer calls the model it
is handed (DDP- or FSDP-wrapped) with `rlkernels_loss=`, and the forward (patched on top of TRL's) runs
the decoder and computes the loss from its last hidden states within the LM head's own call
(`integrations.hf.add_loss_forward`). So the wrappers' hooks run as for any forward: DDP reduces the
gradients, FSDP gathers the head (its own unit or the root's) and reduces its gradient. Limits (each
raises): vision-language models and inputs, models that transform their logits after the head
(softcapping, logit scales) or carry an adapter on it, MoE auxiliary losses, `top_entropy_quantile < 1`,
DeepSpeed ZeRO-3 (its partitioned head would have to be gathered again in the backward,
which recomputes the logits from the weight).

TRL's adaptive entropy (`use_adaptive_entropy`, TRL PR #6140) runs as in TRL: each micro-batch applies the
coefficient of the last optimizer step, and only while the entropy measured then was at or below
`entropy_target`. The window's entropy sums and token counts are reduced across processes at each optimizer step,
and the coefficient moves by `entropy_coef_delta` within [`entropy_coef_min`, `entropy_coef_max`]. The state is the
trainer's own (`entropy_coef`, `_last_world_entropy`, saved with TRL's checkpoints). The coefficient reaches the
loss as a run-time value of a config with `adaptive_entropy=True`, so neither a new value nor 0 recompiles a
compiled step.
"""

from typing import Optional

import torch

from ... import api
from ...config import PolicyLossConfig, RolloutCorrection
from ..hf import add_loss_forward, hidden_state_loss_blocker
from ..parity import parity_metrics, parity_requested
from ..requirements import import_trainer

_TRLGRPOTrainer = import_trainer("trl", "trl").GRPOTrainer

# TRL loss types whose normaliser is the window's token count (`num_items_in_batch`), not the
# gradient-accumulation steps
_TOKEN_COUNT_LOSSES = ("dapo", "cispo", "vespo")
_VISION_KEYS = ("pixel_values", "image_grid_thw", "pixel_attention_mask", "image_sizes", "spatial_shapes",
                "num_tiles", "image_position_ids", "mm_token_type_ids", "token_type_ids")


def _zero_stage(accelerator) -> Optional[int]:
    plugin = getattr(accelerator.state, "deepspeed_plugin", None)
    return None if plugin is None else getattr(plugin, "zero_stage", None)


class GRPOTrainer(_TRLGRPOTrainer):
    """`trl.GRPOTrainer` with rlkernels computing the loss (see the module docstring)."""

    def __init__(self, *args, rollout_correction: Optional[RolloutCorrection] = None, **kwargs):
        super().__init__(*args, **kwargs)
        if rollout_correction is not None and not isinstance(rollout_correction, RolloutCorrection):
            raise TypeError(f"rollout_correction: expected a RolloutCorrection or None, got "
                            f"{type(rollout_correction).__name__}")
        if getattr(self, "aux_loss_enabled", False):
            raise ValueError("model: MoE router auxiliary losses are not supported by rlkernels' GRPOTrainer")
        if getattr(self, "is_deepspeed_enabled", False) and _zero_stage(self.accelerator) == 3:
            raise ValueError("args.deepspeed: ZeRO stage 3 is not supported by rlkernels' GRPOTrainer (the backward "
                             "recomputes the logits from the partitioned LM head); use stage 1 or 2, FSDP, or "
                             "trl.GRPOTrainer")
        base = self.model.get_base_model() if hasattr(self.model, "get_base_model") else self.model
        blocker = hidden_state_loss_blocker(base)
        if blocker is not None:
            raise ValueError(f"model: {blocker} is not supported by rlkernels' GRPOTrainer, which computes the loss "
                             "from the last hidden states and the LM head's weight; use trl.GRPOTrainer")
        add_loss_forward(base)
        config = PolicyLossConfig.from_trl(self.args)
        # TRL's own vLLM weights arrive as `importance_sampling_ratio` and go in as is_weights; a
        # RolloutCorrection given here replaces them (computed from the sampler's log-probs)
        # TRL always computes (and logs) the entropy
        self.rlkernels_config = config.with_overrides(rollout_correction=rollout_correction, compute_entropy=True)
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

        mode = "train" if self.model.training else "eval"
        accumulation = self.current_gradient_accumulation_steps if mode == "train" else 1
        config = self.rlkernels_config
        coefficient = self._entropy_coefficient()
        overrides = {"entropy_coeff": coefficient} if config.adaptive_entropy else {}
        entropy_scale = 1.0  # TRL's entropy bonus is this micro-batch's token mean, whatever the loss divides by
        if self.loss_type in _TOKEN_COUNT_LOSSES:
            normaliser = inputs["num_items_in_batch"].clamp(min=1.0) / self.accelerator.num_processes
            if mode == "train":
                normaliser = normaliser * accumulation / self.args.steps_per_generation
            # one host read (TRL's normaliser is a tensor; the config takes a float): the loss divides every
            # token-mean by the normaliser, so the entropy's coefficient carries normaliser / local count
            normaliser, local = torch.stack([normaliser.float(), mask.sum().float()]).tolist()
            entropy_scale = normaliser / local if local > 0 else 0.0
            overrides.update(global_num_tokens=normaliser, entropy_coeff=coefficient * entropy_scale / accumulation)
        old = inputs.get("old_per_token_logps")
        sampling = inputs.get("sampling_per_token_logps")
        use_sampling = sampling is not None and (self.rlkernels_uses_own_correction or
                                                 config.off_policy_mask_threshold is not None)
        is_weights = None
        if not self.rlkernels_uses_own_correction and "importance_sampling_ratio" in inputs:
            ratio = inputs["importance_sampling_ratio"]
            is_weights = ratio.expand_as(completion_ids).to(torch.float32) if ratio.dim() == 2 else ratio

        C = completion_ids.size(1)

        def loss_of(hidden, weight, bias):  # run inside the model's forward (see the module docstring)
            # hidden state t predicts token t + 1: positions P - 1 .. P + C - 2 predict the completion
            hidden = hidden[:, P - 1:P + C - 1].to(weight.dtype)
            old_logprobs, rollout = old, sampling
            if use_sampling and old_logprobs is None:
                # TRL's old log-probs are then the current ones, detached (ratio 1); computed here, since
                # rollout log-probs without old ones would mean the bypass mode (a ratio against the sampler)
                with torch.no_grad():
                    old_logprobs = api.linear_token_logprobs(hidden, weight, completion_ids, bias=bias,
                                                             temperature=config.temperature, validate=False,
                                                             select_loss_rows=True).logprobs
            if rollout is not None and old_logprobs is not None:  # TRL: a token vLLM could not score: ratio 1
                rollout = torch.where(torch.isnan(rollout), old_logprobs, rollout)
            out = api.linear_decoupled_ppo_loss(
                hidden, weight, completion_ids, inputs["advantages"], mask.bool(), bias=bias,
                old_logprobs=old_logprobs, rollout_logprobs=rollout if use_sampling else None,
                ref_logprobs=inputs.get("ref_per_token_logps") if config.kl_coef else None,
                # no value checks; the fused-linear row selection (one host read) keeps the padding out of the GEMMs
                is_weights=is_weights, config=config, validate=False, select_loss_rows=True, **overrides,
            )
            return out, old_logprobs

        with self.accelerator.autocast():
            out, old = model(input_ids=input_ids, attention_mask=attention_mask, rlkernels_loss=loss_of)
        loss = out.loss if self.loss_type in _TOKEN_COUNT_LOSSES else out.loss / accumulation
        if getattr(self, "use_adaptive_entropy", False) and mode == "train":
            self._adapt_entropy_coefficient(out.entropy, mask)
        if mode == "train" and self.accelerator.sync_gradients and getattr(self, "_entropy_bonus_enabled", False):
            self._metrics[mode]["entropy_coef"].append(self.entropy_coef)  # TRL logs it at each optimizer step
        metrics = dict(out.metrics)
        if sampling is not None and parity_requested():  # opt-in (parity.py): pi_old, or the current, against vLLM's
            scored = mask.bool() & ~torch.isnan(sampling)  # a token vLLM could not score is not compared
            metrics.update(parity_metrics(out.logprobs if old is None else old, sampling, scored))
        self._log_rlkernels_metrics(mode, metrics, entropy_scale)
        self._log_trl_metrics(mode, out.logprobs, old, inputs, mask)
        return loss

    def _entropy_coefficient(self) -> float:
        """The entropy coefficient of this micro-batch: the static one, or TRL's adaptive one gated by the entropy
        measured at the last optimizer step (inf before the first: no bonus)."""
        if not getattr(self, "use_adaptive_entropy", False):
            return self.rlkernels_config.entropy_coeff
        return self.entropy_coef if self._last_world_entropy <= self.args.entropy_target else 0.0

    @torch.no_grad()
    def _adapt_entropy_coefficient(self, entropy, mask):
        """TRL's controller: the window's entropy sum and token count, on the device until the optimizer step; there
        reduced across processes (one host read, as TRL's), the coefficient moved toward the target."""
        m = mask.to(entropy.dtype)
        stats = torch.stack([(entropy * m).sum(), m.sum()])
        self._entropy_window_stats = stats if self._entropy_window_stats is None else self._entropy_window_stats + stats
        if not self.accelerator.sync_gradients:
            return
        total = self.accelerator.reduce(self._entropy_window_stats, reduction="sum")
        world_entropy = (total[0] / total[1].clamp(min=1.0)).item()
        args = self.args
        if world_entropy <= args.entropy_target:
            self.entropy_coef = min(self.entropy_coef + args.entropy_coef_delta, args.entropy_coef_max)
        else:
            self.entropy_coef = max(self.entropy_coef - args.entropy_coef_delta, args.entropy_coef_min)
        self._last_world_entropy = world_entropy
        self._entropy_window_stats = None

    @torch.no_grad()
    def _log_trl_metrics(self, mode, logprobs, old, inputs, mask):
        """The metrics TRL's _compute_loss logs under its names, from TRL's own definitions (its ratio at
        the token or sequence level, its masked means reduced across processes): clip_ratio/* for the
        PPO-clip types, cispo_clip_ratio, vespo/phi_seq_mean (TRL's get_gamma_weights), and kl."""
        m = mask.to(logprobs.dtype)
        old = logprobs if old is None else old.to(logprobs.dtype)
        log_ratio = logprobs - old
        if self.importance_sampling_level == "sequence":
            log_iw = ((log_ratio * m).sum(-1) / m.sum(-1).clamp(min=1.0)).unsqueeze(-1)
        else:
            log_iw = log_ratio
        ratio = torch.exp(log_iw)
        advantages = inputs["advantages"]
        adv = advantages if advantages.dim() == 2 else advantages[:, None]

        def masked_mean(x):  # TRL's global_masked_mean
            x = x.to(logprobs.dtype)
            if x.shape[1] == 1:
                totals = torch.stack([x.sum(), torch.tensor(float(x.shape[0]), device=x.device, dtype=x.dtype)])
            else:
                totals = torch.stack([(x * m).sum(), m.sum()])
            totals = self.accelerator.reduce(totals, reduction="sum")
            return (totals[0] / totals[1].clamp(min=1.0)).item()

        def seq_mean(x):  # TRL's masked_seq_mean, gathered
            x = x.to(logprobs.dtype)
            return self.accelerator.gather(x.squeeze(1) if x.shape[1] == 1 else (x * m).sum(-1) / m.sum(-1))

        log = self._metrics[mode]
        if self.beta != 0.0 and inputs.get("ref_per_token_logps") is not None:
            d = inputs["ref_per_token_logps"].to(logprobs.dtype) - logprobs
            kl = torch.exp(d) - d - 1
            log["kl"].append(masked_mean(kl * ratio if self.args.use_bias_correction_kl else kl))
        if self.loss_type in ("grpo", "bnpo", "dr_grpo", "dapo", "luspo"):
            low = (ratio < 1 - self.epsilon_low) & (adv < 0)
            high = (ratio > 1 + self.epsilon_high) & (adv > 0)
            log["clip_ratio/low_mean"].append(masked_mean(low))
            log["clip_ratio/high_mean"].append(masked_mean(high))
            log["clip_ratio/region_mean"].append(masked_mean(low | high))
            log["clip_ratio/low_min"].append(torch.nan_to_num(seq_mean(low), nan=float("inf")).min().item())
            log["clip_ratio/high_max"].append(torch.nan_to_num(seq_mean(high), nan=float("-inf")).max().item())
        elif self.loss_type == "cispo":
            log["cispo_clip_ratio"].append(masked_mean((ratio > self.epsilon_high) & (adv > 0)))
        elif self.loss_type == "vespo":
            phi = self.get_gamma_weights(
                advantages=adv, log_ratio_per_token=log_ratio, mask=mask,
                importance_sampling_ratio=inputs.get("importance_sampling_ratio"),
                k_pos=self.args.vespo_k_pos, lambda_pos=self.args.vespo_lambda_pos,
                k_neg=self.args.vespo_k_neg, lambda_neg=self.args.vespo_lambda_neg)
            log["vespo/phi_seq_mean"].append(masked_mean(phi))

    def _log_rlkernels_metrics(self, mode, metrics, entropy_scale: float):
        """rlkernels' metrics under their names, plus TRL's `entropy`, gathered across processes and
        averaged as TRL averages its own. `entropy_scale` turns actor/entropy (divided by the loss's
        normaliser) back into the micro-batch's token mean TRL logs."""
        values = api.metrics_to_floats(metrics)  # one synchronisation
        if "actor/entropy" in values:
            values["entropy"] = values["actor/entropy"] * entropy_scale
        for name, value in values.items():
            gathered = self.accelerator.gather(torch.tensor(value, device=self.accelerator.device)).nanmean().item()
            self._metrics[mode][name].append(gathered)
