"""`PolicyLossConfig.from_verl_actor` on random verl 0.9.1 actor configurations: for every policy loss verl
registers (its own names, read from verl's registry) and for `bypass_mode`, the config built from the
ActorConfig gives the loss and gradient of verl's own registered function called with that ActorConfig.

A config built from a verl actor must give verl's numbers, including where verl's function ignores
`loss_agg_mode` (sapo: seq-mean-token-mean) or reads its rollout correction from
`policy_loss.rollout_correction` (bypass mode, where verl's `old_log_prob` is the rollout's: it is passed as
`rollout_logprobs`). Float64 on both sides; verl's means divide by n + 1e-8, hence the "verl" tolerance
scaled by the sum of the terms' magnitudes (as tests/peers/test_verl_losses.py). k1 bounds are symmetric
(1/h, h), where verl's code and docs agree, and bypass batches have no empty row (verl's sequence means
count empty rows: a documented difference).
"""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import rlkernels
from rlkernels import PolicyLossConfig, RolloutCorrection

from ..cases import approx, assert_close, scaled, tol
from ..verl_import import import_verl_or_skip

_, core_algos, ActorConfig = import_verl_or_skip()
from verl.workers.config.actor import PolicyLossConfig as VerlPolicyLossConfig  # noqa: E402

VERL_LOSSES = sorted(k for k in core_algos.POLICY_LOSS_REGISTRY if not k.startswith("rlkernels"))
AGG_MODES = ("token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
RS = {"seq_max_k2": 2.0, "seq_sum_k1": "0.5_2.0", "seq_mean_k1": "0.8_1.25", "token_k1": "0.5_2.0",
      "token_k3": 0.05, "seq_mean_k3": 0.05}


@st.composite
def actors(draw, loss):
    """A verl ActorConfig (and its bypass correction) with the options of `loss` drawn."""
    policy = {"loss_mode": loss, "dro_beta": draw(st.sampled_from([0.1, 0.5]))}
    if loss in ("clip_cov", "kl_cov"):
        policy.update(clip_cov_ratio=0.3, clip_cov_lb=draw(st.sampled_from([0.0, 0.5])), clip_cov_ub=3.0,
                      kl_cov_ratio=draw(st.sampled_from([0.1, 0.3])), ppo_kl_coef=draw(st.sampled_from([0.5, 1.0])))
    if loss == "bypass_mode":
        options = draw(st.lists(st.sampled_from(sorted(RS)), max_size=2, unique=True))
        policy["rollout_correction"] = {
            "loss_type": draw(st.sampled_from(["ppo_clip", "reinforce"])),
            "rollout_is": draw(st.sampled_from([None, "token", "sequence"])),
            "rollout_is_threshold": draw(st.sampled_from([1.5, 2.0, 5.0])),
            "rollout_is_batch_normalize": draw(st.booleans()),
            "rollout_rs": ",".join(options) or None,
            "rollout_rs_threshold": ",".join(str(RS[o]) for o in options) or None,
        }
    low, high = draw(st.sampled_from([(0.2, 0.2), (0.15, 0.3), (0.1, 0.28)]))
    actor = ActorConfig(strategy="fsdp", rollout_n=1, ppo_micro_batch_size_per_gpu=1, clip_ratio_low=low,
                        clip_ratio_high=high, clip_ratio_c=draw(st.sampled_from([3.0, 10.0])),
                        loss_agg_mode=draw(st.sampled_from(AGG_MODES)),
                        tau_pos=draw(st.sampled_from([1.0, 2.0])), tau_neg=draw(st.sampled_from([1.05, 0.5])),
                        policy_loss=VerlPolicyLossConfig(**{k: v for k, v in policy.items()
                                                            if k != "rollout_correction"}))
    if "rollout_correction" in policy:  # verl's apply_bypass_mode writes it there (open_dict)
        object.__setattr__(actor.policy_loss, "rollout_correction", policy["rollout_correction"])
    return actor


def _batch(seed, empty_rows: bool):
    gen = torch.Generator().manual_seed(seed)
    B, T = 4, 6
    old = -torch.rand(B, T, generator=gen, dtype=torch.float64) * 3
    lp = old + torch.randn(B, T, generator=gen, dtype=torch.float64) * 0.3
    adv = torch.randn(B, T, generator=gen, dtype=torch.float64)
    mask = torch.rand(B, T, generator=gen) < 0.8
    mask[:, 0] = True
    if empty_rows:
        mask[1] = False
    return lp, old, adv, mask


@pytest.mark.parametrize("loss", VERL_LOSSES)
@settings(max_examples=scaled(25))
@given(data=st.data(), seed=st.integers(0, 2**31 - 1), empty_rows=st.booleans())
def test_from_verl_actor_gives_verls_loss(loss, data, seed, empty_rows):
    actor = data.draw(actors(loss))
    lp, old, adv, mask = _batch(seed, empty_rows and loss != "bypass_mode")
    leaf = lp.clone().requires_grad_(True)
    torch.manual_seed(seed)  # Clip-Cov's draw (verl's torch.randperm), the same on both sides
    want, want_metrics = core_algos.get_policy_loss_fn(loss)(old, leaf, adv, mask.double(), actor.loss_agg_mode,
                                                             actor, None)
    (want_grad,) = torch.autograd.grad(want, leaf, allow_unused=True)
    want_grad = torch.zeros_like(lp) if want_grad is None else want_grad
    config = PolicyLossConfig.from_verl_actor(actor)
    # bypass mode: verl's old_log_prob is the rollout's (apply_bypass_mode), which is rlkernels' bypass mode
    logprobs = dict(rollout_logprobs=old) if loss == "bypass_mode" else dict(old_logprobs=old)
    mine = lp.clone().requires_grad_(True)
    torch.manual_seed(seed)
    out = rlkernels.policy_loss(mine, adv, mask, config=config, **logprobs)
    (grad,) = torch.autograd.grad(out.loss, mine)
    terms = adv.abs() * (torch.exp((lp - old).clamp(max=20)) + lp.abs() + 2) + (lp - old).square()
    scale = max(1.0, float(terms[mask].sum()) * (5.0 if loss == "bypass_mode" else 1.0))  # IS weights <= 5
    what = f"{loss} {actor.loss_agg_mode} {getattr(actor.policy_loss, 'rollout_correction', '')}"
    assert_close(out.loss.detach(), want.detach(), **tol("verl", torch.float64, scale=scale), name=f"{what}: loss")
    assert_close(grad, want_grad, **tol("verl", torch.float64, scale=scale), name=f"{what}: gradient")
    for name, value in want_metrics.items():
        if name.startswith("actor/") and name in out.metrics:
            assert float(out.metrics[name]) == approx(value, "verl.metrics"), f"{what}: {name}"


def test_the_issues_bypass_configuration():
    """rollout_is="sequence" (1.5), rollout_rs="seq_max_k2" (2.0), loss_type="reinforce": the correction under
    policy_loss.rollout_correction was dropped before (the issue measured loss -0.389 where verl gave -0.259)."""
    actor = {"loss_agg_mode": "token-mean", "policy_loss": {"loss_mode": "bypass_mode", "rollout_correction": {
        "loss_type": "reinforce", "rollout_is": "sequence", "rollout_is_threshold": 1.5, "rollout_rs": "seq_max_k2",
        "rollout_rs_threshold": 2.0}}}
    config = PolicyLossConfig.from_verl_actor(actor)
    assert config.loss_type == "reinforce"
    assert config.rollout_correction == RolloutCorrection(is_level="sequence", is_threshold=1.5,
                                                          rs={"seq_max_k2": 2.0})
    explicit = RolloutCorrection.token_tis()
    assert PolicyLossConfig.from_verl_actor(actor, rollout_correction=explicit).rollout_correction == explicit


def test_sapo_keeps_verls_aggregation_from_a_verl_actor_only():
    actor = {"loss_agg_mode": "token-sum", "policy_loss": {"loss_mode": "sapo"}}
    assert PolicyLossConfig.from_verl_actor(actor).loss_agg_mode == "seq-mean-token-mean"
    assert PolicyLossConfig.from_verl_actor(actor, loss_agg_mode="token-sum").loss_agg_mode == "token-sum"
    assert PolicyLossConfig(loss_type="sapo", loss_agg_mode="token-sum").loss_agg_mode == "token-sum"


@pytest.mark.parametrize("form", ["keyword", "node", "rs_keyword", "node_without_level"])
def test_a_bool_threshold_raises_in_every_form(form):
    call = {"keyword": lambda: RolloutCorrection.from_verl(rollout_is="token", rollout_is_threshold=True),
            "node": lambda: RolloutCorrection.from_verl({"rollout_is": "token", "rollout_is_threshold": True}),
            "rs_keyword": lambda: RolloutCorrection.from_verl(rollout_rs="seq_max_k2", rollout_rs_threshold=False),
            "node_without_level": lambda: RolloutCorrection.from_verl({"rollout_is_threshold": True})}[form]
    with pytest.raises(TypeError, match="threshold: expected a number"):
        call()
