"""verl's driver-side rollout correction (`rollout_corr_helper.compute_rollout_correction_and_add_to_batch`),
verl's unless asked for: `RLKERNELS_VERL_CORRECTION=1` in the driver's environment, or `install_correction()`,
puts `compute_rollout_correction_and_add_to_batch` below, built on `rlkernels.rollout_correction`, in its place. Its
differences from verl's are those of SPEC §14: k1 bounds keep lo <= rho <= hi as verl's docs state (verl's code keeps
1/hi <= rho <= 1/lo; equal for symmetric bounds), metrics of empty rows, sequence-level metric weighting. With
RLKERNELS_LOGPROB_PARITY=1 its metrics include the parity report of `old_log_probs` against `rollout_log_probs`
(`logprob_parity/...`; rlkernels/integrations/parity.py).
"""

from ...api import metrics_to_floats, rollout_correction
from ...config import RolloutCorrection
from ..parity import parity_metrics

CORRECTION_ENV = "RLKERNELS_VERL_CORRECTION"  # the explicit opt-in ("1")


def verl_compute_rollout_correction_and_add_to_batch(batch, rollout_corr_config):
    """verl's own driver-side correction, whether or not `install_correction()` replaced it."""
    from verl.trainer.ppo import rollout_corr_helper

    verl_fn = getattr(rollout_corr_helper, "_verl_compute_rollout_correction_and_add_to_batch",
                      rollout_corr_helper.compute_rollout_correction_and_add_to_batch)
    return verl_fn(batch, rollout_corr_config)


def compute_rollout_correction_and_add_to_batch(batch, rollout_corr_config):
    """verl's driver-side rollout correction (same signature and effect: the batch's response_mask with
    the rejection applied, `rollout_is_weights` added when an IS level is set, rollout_corr/* metrics as
    floats), computed by `rlkernels.rollout_correction`. In place of verl's only after `install_correction()`
    (or RLKERNELS_VERL_CORRECTION=1)."""
    from verl.protocol import DataProto

    get = rollout_corr_config.get
    rc = RolloutCorrection.from_verl(get("rollout_is", None), get("rollout_is_threshold", 2.0),
                                     get("rollout_rs", None), get("rollout_rs_threshold", None),
                                     get("rollout_is_batch_normalize", False))
    mask = batch.batch["response_mask"]
    old, rollout = batch.batch["old_log_probs"], batch.batch["rollout_log_probs"]
    out = rollout_correction(old, rollout, mask.bool(), config=rc, validate=False)
    report = parity_metrics(old, rollout, mask)  # opt-in (RLKERNELS_LOGPROB_PARITY=1): pi_old against the sampler
    batch.batch["response_mask"] = out.mask.to(mask.dtype)
    if out.weights is not None:
        weights = out.weights.to(batch.batch["old_log_probs"].dtype)  # verl's weights are in the log-probs' dtype
        batch = batch.union(DataProto.from_dict(tensors={"rollout_is_weights": weights}))
    return batch, metrics_to_floats({**out.metrics, **report})


def install_correction() -> None:
    """The explicit opt-in (also RLKERNELS_VERL_CORRECTION=1): verl's driver-side
    `compute_rollout_correction_and_add_to_batch` replaced by this module's (idempotent)."""
    from verl.trainer.ppo import rollout_corr_helper

    if not hasattr(rollout_corr_helper, "_verl_compute_rollout_correction_and_add_to_batch"):
        rollout_corr_helper._verl_compute_rollout_correction_and_add_to_batch = (
            rollout_corr_helper.compute_rollout_correction_and_add_to_batch)
    rollout_corr_helper.compute_rollout_correction_and_add_to_batch = compute_rollout_correction_and_add_to_batch


def uninstall_correction() -> None:
    from verl.trainer.ppo import rollout_corr_helper

    original = rollout_corr_helper.__dict__.pop("_verl_compute_rollout_correction_and_add_to_batch", None)
    if original is not None:
        rollout_corr_helper.compute_rollout_correction_and_add_to_batch = original
