"""rlkernels' advantage estimators in verl's registry: `algorithm.adv_estimator=rlkernels_optimal_token_baseline`
(verl's OTB) and `rlkernels_tir_optimal_token_baseline` (its TIR-OTB), `rlkernels.optimal_token_baseline` with verl's
estimator signature. Their values are those of verl's estimators of the same name, through verl's own
`compute_advantage` (tests/integrations/test_verl_estimators.py).

Where the inputs come from. verl 0.9.1's `compute_advantage` (trainer/ppo/ray_trainer.py) hands `sum_pi_squared`,
`old_log_probs` and `rollout_is_weights` only to its own two OTB names; an estimator registered under any other name
gets `token_level_rewards`, `response_mask`, `config`, `index` (and `reward_baselines`), none of which leads back to
the batch. No path of rlkernels' own reaches it: the π_old forward runs in the workers, where the routes' log-prob
hook can fill only verl's output keys (verl copies `sum_pi_squared` into the driver's batch, as from its own pass);
from there to `compute_advantage` the driver runs verl's code, plus rlkernels' opt-in correction only where a rollout
correction is configured. So the estimator reads its direct caller's `data` (one frame, read only, no walk up the
stack) and takes it only when that batch holds the very `response_mask` tensor it was handed, i.e. the estimator was
called by verl's `compute_advantage` on that batch.
"""

import sys

import numpy as np
import torch
from verl.trainer.ppo import core_algos

from ...api import optimal_token_baseline

OTB_ESTIMATORS = {"rlkernels_optimal_token_baseline": False, "rlkernels_tir_optimal_token_baseline": True}


def _compute_advantage_batch(response_mask):
    """The DataProto of verl's `compute_advantage` that called the estimator, or None: the caller's `data`,
    when its batch has sum_pi_squared and is where `response_mask` came from (see the module docstring)."""
    data = sys._getframe(2).f_locals.get("data")  # 0: here, 1: the estimator, 2: its caller
    batch = getattr(data, "batch", None)
    if batch is None or not {"sum_pi_squared", "old_log_probs", "response_mask"} <= set(batch.keys()):
        return None
    return data if batch["response_mask"] is response_mask else None


def make_advantage_estimator(multi_turn: bool):
    """verl's advantage-estimator signature around `rlkernels.optimal_token_baseline` (verl's OTB, or with
    multi_turn its TIR-OTB): the same inputs (`index` numpy ids) and values, segmented (no loop over groups)."""

    def compute_rlkernels_optimal_token_baseline(token_level_rewards, response_mask, index=None, old_log_probs=None,
                                                 sum_pi_squared=None, rollout_is_weights=None, handle_zero_tail=True,
                                                 epsilon=1e-8, **kwargs):
        if sum_pi_squared is None or old_log_probs is None:
            data = _compute_advantage_batch(response_mask)
            if data is None:
                raise ValueError("sum_pi_squared: the optimal token baseline needs sum_pi_squared and old_log_probs "
                                 "from the actor's log-prob pass (actor.calculate_sum_pi_squared=True)")
            old_log_probs, sum_pi_squared = data.batch["old_log_probs"], data.batch["sum_pi_squared"]
            if rollout_is_weights is None and "rollout_is_weights" in data.batch.keys():
                rollout_is_weights = data.batch["rollout_is_weights"]
        if index is None:
            raise ValueError("index: the optimal token baseline needs verl's prompt ids (non_tensor_batch['uid'])")
        groups = torch.as_tensor(np.unique(np.asarray(index), return_inverse=True)[1].reshape(-1),
                                 device=token_level_rewards.device)
        out = optimal_token_baseline(token_level_rewards, response_mask, groups, old_log_probs, sum_pi_squared,
                                     is_weights=rollout_is_weights, multi_turn=multi_turn,
                                     handle_zero_tail=handle_zero_tail, eps=epsilon, validate=False)
        return out.advantages, out.returns

    compute_rlkernels_optimal_token_baseline.__name__ = (
        f"compute_rlkernels_{'tir_' if multi_turn else ''}optimal_token_baseline")
    return compute_rlkernels_optimal_token_baseline


def register_advantage_estimators() -> None:
    """rlkernels' names in verl's advantage-estimator registry (idempotent)."""
    for name, multi_turn in OTB_ESTIMATORS.items():
        if name not in core_algos.ADV_ESTIMATOR_REGISTRY:
            core_algos.register_adv_est(name)(make_advantage_estimator(multi_turn))
