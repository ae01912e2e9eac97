"""rlkernels inside verl 0.9.1, loaded by verl itself through its `verl.plugins` entry point.

With rlkernels installed, `import verl` imports this module (pyproject: `[project.entry-points."verl.plugins"]`),
which
- registers rlkernels' policy losses with verl: `actor.policy_loss.loss_mode=rlkernels` (PPO clip) or
  `rlkernels_<loss_type>` (any of rlkernels' loss types: `rlkernels_cispo`, `rlkernels_gspo`, ...),
  configured from the actor config by `PolicyLossConfig.from_verl_actor` and taking verl's
  `rollout_is_weights` and global batch counts;
- replaces verl's driver-side rollout correction, `rollout_corr_helper.compute_rollout_correction_and_add_to_batch`,
  with `compute_rollout_correction_and_add_to_batch` below, built on `rlkernels.rollout_correction`: the
  rejection mask and IS weights are computed once on the driver, before micro-batching, so verl's global
  token counts stay right. `RLKERNELS_VERL_CORRECTION=0` keeps verl's own.

Differences from verl's own correction are those of docs/spec.md ("Deliberate differences"): k1 bounds
keep lo <= rho <= hi as verl's docs state (verl's code keeps 1/hi <= rho <= 1/lo; equal for symmetric
bounds), metrics of empty rows, sequence-level metric weighting. The losses equal verl's registered
functions of the same name (tests/integrations/test_verl_plugin.py).
"""

import os

from verl.protocol import DataProto
from verl.trainer.ppo import core_algos, rollout_corr_helper

from ..api import metrics_to_floats, policy_loss, rollout_correction
from ..config import LOSS_TYPES, PolicyLossConfig, RolloutCorrection

_TYPES = tuple(t for t in LOSS_TYPES if t not in ("ppo_clip", "reinforce"))
# verl's own driver-side correction, kept for comparison (saved by install(), so a re-import finds it)
verl_compute_rollout_correction_and_add_to_batch = getattr(
    rollout_corr_helper, "_verl_compute_rollout_correction_and_add_to_batch",
    rollout_corr_helper.compute_rollout_correction_and_add_to_batch)


def _global_counts(loss_agg_mode: str, info: dict) -> dict:
    """verl's global batch info -> this library's global counts. verl divides by the whole batch's
    count and multiplies by dp_size (so that DDP's mean of the ranks' gradients is the whole batch's);
    dividing by count / dp_size is the same."""
    dp = info.get("dp_size", 1) or 1
    out = {}
    if info.get("batch_num_tokens") is not None:
        out["global_num_tokens"] = float(info["batch_num_tokens"]) / dp
    if info.get("global_batch_size") is not None:
        out["global_num_seqs"] = float(info["global_batch_size"]) / dp
    if info.get("loss_scale_factor") is not None:
        out["loss_scale_factor"] = float(info["loss_scale_factor"])
    return out


def make_policy_loss(loss_type: str):
    """verl's registered-loss signature around `rlkernels.policy_loss` with this loss type."""

    def compute_policy_loss_rlkernels(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean",
                                      config=None, rollout_is_weights=None):
        if config is None:
            raise ValueError("config: verl's actor config is required by the rlkernels policy loss")
        info = dict(getattr(config, "global_batch_info", None) or {})
        dp = info.get("dp_size", 1) or 1
        overrides = dict(loss_type=loss_type, loss_agg_mode=loss_agg_mode, validate=False,
                         **_global_counts(loss_agg_mode, info))
        rl_config = PolicyLossConfig.from_verl_actor(config, **overrides).with_overrides(
            kl_coef=0.0, entropy_coeff=0.0)  # verl adds its KL and entropy terms outside the policy loss
        out = policy_loss(log_prob, advantages, response_mask.bool(), old_logprobs=old_log_prob,
                          is_weights=rollout_is_weights, config=rl_config)
        loss = out.loss * dp if loss_agg_mode == "token-sum" else out.loss  # verl's token-sum is x dp_size
        metrics = {k: v for k, v in metrics_to_floats(out.metrics).items() if k.startswith("actor/")}
        metrics.pop("actor/pg_loss", None)  # verl logs the loss it returns itself
        return loss, metrics

    compute_policy_loss_rlkernels.__name__ = f"compute_policy_loss_rlkernels_{loss_type}"
    return compute_policy_loss_rlkernels


def compute_rollout_correction_and_add_to_batch(batch: DataProto, rollout_corr_config):
    """verl's driver-side rollout correction (same signature and effect: the batch's response_mask with
    the rejection applied, `rollout_is_weights` added when an IS level is set, rollout_corr/* metrics as
    floats), computed by `rlkernels.rollout_correction`."""
    get = rollout_corr_config.get
    rc = RolloutCorrection.from_verl(get("rollout_is", None), get("rollout_is_threshold", 2.0),
                                     get("rollout_rs", None), get("rollout_rs_threshold", None),
                                     get("rollout_is_batch_normalize", False))
    mask = batch.batch["response_mask"]
    out = rollout_correction(batch.batch["old_log_probs"], batch.batch["rollout_log_probs"], mask.bool(), config=rc,
                             validate=False)
    batch.batch["response_mask"] = out.mask.to(mask.dtype)
    if out.weights is not None:
        weights = out.weights.to(batch.batch["old_log_probs"].dtype)  # verl's weights are in the log-probs' dtype
        batch = batch.union(DataProto.from_dict(tensors={"rollout_is_weights": weights}))
    return batch, metrics_to_floats(out.metrics)


def install() -> None:
    """Register the losses (idempotent) and, unless RLKERNELS_VERL_CORRECTION=0, the driver-side correction."""
    for loss_type in _TYPES:
        name = "rlkernels" if loss_type == "vanilla" else f"rlkernels_{loss_type}"
        if name not in core_algos.POLICY_LOSS_REGISTRY:
            core_algos.register_policy_loss(name)(make_policy_loss(loss_type))
    if os.environ.get("RLKERNELS_VERL_CORRECTION", "1") != "0":
        rollout_corr_helper._verl_compute_rollout_correction_and_add_to_batch = (
            verl_compute_rollout_correction_and_add_to_batch)
        rollout_corr_helper.compute_rollout_correction_and_add_to_batch = compute_rollout_correction_and_add_to_batch


install()
