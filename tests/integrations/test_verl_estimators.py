"""The plugin's advantage estimators (`algorithm.adv_estimator=rlkernels_optimal_token_baseline`,
`rlkernels_tir_optimal_token_baseline`) through verl 0.9.1's own `compute_advantage`: its source, compiled from
verl's trainer module (whose import would pull in verl's rollout servers), called as verl's trainer calls it, on a
DataProto with the π_old forward's sum_pi_squared. The advantages equal those of verl's own estimators of the
same name on the same batch, in float64 to 1e-12 of the largest return (orders of summation differ: TOL "otb")."""

import numpy as np
import pytest
import torch

from rlkernels.testing.peers import verl_source_function

from ..cases import F64, assert_close, tol
from ..verl_import import import_verl_or_skip

_, core_algos, _ = import_verl_or_skip()
from verl.protocol import DataProto  # noqa: E402
from verl.trainer.config import AlgoConfig  # noqa: E402
from verl.trainer.ppo.core_algos import AdvantageEstimator  # noqa: E402

import rlkernels.integrations.verl  # noqa: E402,F401  (the plugin, as `import verl` loads it)


def _compute_advantage():
    def compute_response_mask(data):  # verl's helper, not reached: the batch carries its response_mask
        raise AssertionError("response_mask is in the batch")

    return verl_source_function("verl.trainer.ppo.ray_trainer", "compute_advantage", dict(
        core_algos=core_algos, AdvantageEstimator=AdvantageEstimator, DataProto=DataProto, AlgoConfig=AlgoConfig,
        Optional=__import__("typing").Optional, compute_response_mask=compute_response_mask))


def _batch(seed, weighted):
    g = torch.Generator().manual_seed(seed)
    B, T = 16, 12
    lengths = torch.randint(0, T + 1, (B,), generator=g)
    mask = (torch.arange(T)[None] < lengths[:, None]) & (torch.rand(B, T, generator=g) < 0.9)
    rewards = torch.zeros(B, T, dtype=torch.float64)
    rewards[torch.arange(B), (lengths - 1).clamp_min(0)] = torch.randn(B, generator=g, dtype=torch.float64)
    tensors = dict(token_level_rewards=rewards, response_mask=mask.double(),
                   old_log_probs=-torch.rand(B, T, generator=g, dtype=torch.float64) * 2,
                   sum_pi_squared=torch.rand(B, T, generator=g, dtype=torch.float64) * 0.5)
    if weighted:
        tensors["rollout_is_weights"] = 0.5 + torch.rand(B, T, generator=g, dtype=torch.float64)
    uid = np.array([f"prompt-{i}" for i in torch.randint(0, 5, (B,), generator=g).tolist()], dtype=object)
    return tensors, uid


@pytest.mark.parametrize("verl_name", ["optimal_token_baseline", "tir_optimal_token_baseline"])
@pytest.mark.parametrize("weighted", [False, True], ids=["no_is", "is_weights"])
def test_the_registered_estimators_give_verls_advantages_through_verls_compute_advantage(verl_name, weighted):
    compute_advantage = _compute_advantage()
    for seed in range(4):
        tensors, uid = _batch(seed, weighted)
        results = []
        for name in (verl_name, f"rlkernels_{verl_name}"):
            data = DataProto.from_dict(tensors={k: v.clone() for k, v in tensors.items()},
                                       non_tensors={"uid": uid})
            out = compute_advantage(data, name, config=AlgoConfig())
            results.append((out.batch["advantages"], out.batch["returns"]))
        (want_adv, want_ret), (got_adv, got_ret) = results
        scale = max(1.0, float(want_ret.abs().max()))
        assert_close(got_adv, want_adv, **tol("otb", F64, scale=scale), name=f"{verl_name} {seed}: advantages")
        assert_close(got_ret, want_ret, **tol("otb", F64, scale=scale), name=f"{verl_name} {seed}: returns")


def test_without_sum_pi_squared_the_estimator_says_what_it_needs():
    fn = core_algos.get_adv_estimator_fn("rlkernels_optimal_token_baseline")
    with pytest.raises(ValueError, match="actor.calculate_sum_pi_squared=True"):
        fn(token_level_rewards=torch.zeros(2, 3), response_mask=torch.ones(2, 3), index=np.array(["a", "b"]))


def _estimate(fn, rewards, mask, uid):
    """A caller that holds no batch: the estimator does not look further up."""
    return fn(token_level_rewards=rewards, response_mask=mask, index=uid)


def test_the_estimators_read_only_the_batch_that_handed_them_the_mask():
    """The inputs verl hands only to its own OTB names come from the direct caller's `data`, and only when that
    batch holds the very response_mask the estimator was handed (integrations/verl/estimators.py says why)."""
    fn = core_algos.get_adv_estimator_fn("rlkernels_optimal_token_baseline")
    tensors, uid = _batch(0, False)
    data = DataProto.from_dict(tensors=tensors, non_tensors={"uid": uid})
    rewards, mask = data.batch["token_level_rewards"], data.batch["response_mask"]
    advantages, _ = fn(token_level_rewards=rewards, response_mask=mask, index=uid)  # `data` here: this batch
    assert advantages.shape == mask.shape
    with pytest.raises(ValueError, match="actor.calculate_sum_pi_squared=True"):
        fn(token_level_rewards=rewards, response_mask=mask.clone(), index=uid)  # not this batch's mask
    with pytest.raises(ValueError, match="actor.calculate_sum_pi_squared=True"):
        _estimate(fn, rewards, mask, uid)  # the batch is two frames up
