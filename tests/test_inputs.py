"""Bad input (SPEC §11): every case raises TypeError/ValueError naming the argument, before any kernel."""

import math

import pytest
import torch

import rlkernels
from rlkernels import PolicyLossConfig, RolloutCorrection
from rlkernels.backends.torch_backend import TorchBackend

from .cases import make_batch

B, T, V = 2, 3, 5


def good():
    """The arguments of a valid decoupled call (every token in the response), as keywords."""
    b = make_batch("padded", [T] * B, V, dtype=torch.float32)
    return dict(logits=b.logits, labels=b.labels, advantages=b.advantages, response_mask=b.response_mask,
                old_logprobs=b.old_logprobs, rollout_logprobs=b.rollout_logprobs)


def call(**changes):
    kw = good()
    kw.update(changes)
    pos = [kw.pop(k) for k in ("logits", "labels", "advantages", "response_mask")]
    return rlkernels.decoupled_ppo_loss(*pos, **kw)


def packed(**changes):
    b = make_batch("packed", [2, 4], V, dtype=torch.float32)
    kw = dict(logits=b.logits, labels=b.labels, advantages=b.advantages, response_mask=b.response_mask,
              cu_seqlens=b.cu_seqlens)
    kw.update(changes)
    pos = [kw.pop(k) for k in ("logits", "labels", "advantages", "response_mask")]
    return rlkernels.decoupled_ppo_loss(*pos, **kw)


def labels_with(value):
    labels = good()["labels"].clone()
    labels[1, 2] = value
    return labels


def adv_with(value):
    adv = good()["advantages"].clone()
    adv[0, 1] = value
    return adv


# (case id, thunk, exception type, the argument the message must name)
BAD_INPUTS = [
    ("logits_not_tensor", lambda: call(logits=[[0.0]]), TypeError, "logits"),
    ("logits_integer", lambda: call(logits=torch.zeros(B, T, V, dtype=torch.long)), TypeError, "logits"),
    ("logits_rank_1", lambda: call(logits=torch.zeros(V)), ValueError, "logits"),
    ("logits_rank_4", lambda: call(logits=torch.zeros(1, B, T, V)), ValueError, "logits"),
    ("logits_empty_vocab", lambda: call(logits=torch.zeros(B, T, 0)), ValueError, "logits"),
    ("labels_float", lambda: call(labels=torch.zeros(B, T)), TypeError, "labels"),
    ("labels_bool", lambda: call(labels=torch.zeros(B, T, dtype=torch.bool)), TypeError, "labels"),
    ("labels_wrong_shape", lambda: call(labels=torch.zeros(B, T + 1, dtype=torch.long)), ValueError, "labels"),
    ("labels_too_large", lambda: call(labels=labels_with(V)), ValueError, "labels"),
    ("labels_negative", lambda: call(labels=labels_with(-3)), ValueError, "labels"),
    ("advantages_wrong_shape", lambda: call(advantages=torch.zeros(B * T)), ValueError, "advantages"),
    ("advantages_integer", lambda: call(advantages=torch.zeros(B, T, dtype=torch.long)), TypeError, "advantages"),
    ("advantages_nan", lambda: call(advantages=adv_with(float("nan"))), ValueError, "advantages"),
    ("advantages_inf", lambda: call(advantages=adv_with(float("inf"))), ValueError, "advantages"),
    ("mask_wrong_shape", lambda: call(response_mask=torch.ones(B, 1, dtype=torch.bool)), ValueError, "response_mask"),
    ("old_logprobs_nan", lambda: call(old_logprobs=torch.full((B, T), float("nan"))), ValueError, "old_logprobs"),
    # a log-prob may be -inf (probability 0, test_infinite_logprob_is_legal), never +inf
    ("rollout_logprobs_plus_inf", lambda: call(rollout_logprobs=torch.full((B, T), math.inf)), ValueError,
     "rollout_logprobs"),
    ("rollout_wrong_shape", lambda: call(rollout_logprobs=torch.zeros(B, T, 1)), ValueError, "rollout_logprobs"),
    ("meta_device_mismatch", lambda: call(advantages=torch.zeros(B, T, device="meta")), ValueError, "advantages"),
    ("cu_seqlens_with_padded", lambda: call(cu_seqlens=torch.tensor([0, 3, 6])), ValueError, "cu_seqlens"),
    ("cu_seqlens_float", lambda: packed(cu_seqlens=torch.tensor([0.0, 2.0, 6.0])), TypeError, "cu_seqlens"),
    ("cu_seqlens_2d", lambda: packed(cu_seqlens=torch.tensor([[0, 2, 6]])), ValueError, "cu_seqlens"),
    ("cu_seqlens_not_from_zero", lambda: packed(cu_seqlens=torch.tensor([1, 2, 6])), ValueError, "cu_seqlens"),
    ("cu_seqlens_decreasing", lambda: packed(cu_seqlens=torch.tensor([0, 4, 2, 6])), ValueError, "cu_seqlens"),
    ("cu_seqlens_wrong_total", lambda: packed(cu_seqlens=torch.tensor([0, 2, 5])), ValueError, "cu_seqlens"),
    ("reinforce_with_old", lambda: call(loss_type="reinforce"), ValueError, "old_logprobs"),
    ("kl_without_ref", lambda: call(kl_coef=0.1), ValueError, "ref_logprobs"),
    ("correction_without_rollout",
     lambda: call(rollout_logprobs=None, rollout_correction=RolloutCorrection.token_tis()), ValueError,
     "rollout_logprobs"),
    ("unknown_override", lambda: call(clip_ratio=0.2), TypeError, "clip_ratio"),
    ("config_wrong_type", lambda: call(config={"clip_ratio_low": 0.2}), TypeError, "config"),
    ("temperature_zero", lambda: PolicyLossConfig(temperature=0.0), ValueError, "temperature"),
    ("temperature_negative", lambda: PolicyLossConfig(temperature=-1.0), ValueError, "temperature"),
    ("temperature_nan", lambda: PolicyLossConfig(temperature=math.nan), ValueError, "temperature"),
    ("eps_negative", lambda: PolicyLossConfig(clip_ratio_low=-0.1), ValueError, "clip_ratio_low"),
    ("eps_high_negative", lambda: PolicyLossConfig(clip_ratio_high=-0.1), ValueError, "clip_ratio_high"),
    ("eps_low_ge_one", lambda: PolicyLossConfig(clip_ratio_low=1.0), ValueError, "clip_ratio_low"),
    ("dual_clip_le_one", lambda: PolicyLossConfig(clip_ratio_c=1.0), ValueError, "clip_ratio_c"),
    ("unknown_loss_type", lambda: PolicyLossConfig(loss_type="grpo"), ValueError, "loss_type"),
    ("unknown_agg_mode", lambda: PolicyLossConfig(loss_agg_mode="mean"), ValueError, "loss_agg_mode"),
    ("unknown_kl_type", lambda: PolicyLossConfig(kl_type="k4"), ValueError, "kl_type"),
    ("negative_kl_coef", lambda: PolicyLossConfig(kl_coef=-0.1), ValueError, "kl_coef"),
    ("unknown_backend", lambda: PolicyLossConfig(backend="tpu"), ValueError, "backend"),
    ("zero_global_tokens", lambda: PolicyLossConfig(global_num_tokens=0), ValueError, "global_num_tokens"),
    ("correction_wrong_type", lambda: PolicyLossConfig(rollout_correction="token_tis"), TypeError,
     "rollout_correction"),
    ("unknown_is_level", lambda: RolloutCorrection(is_level="arithmetic"), ValueError, "is_level"),
    ("is_threshold_negative", lambda: RolloutCorrection(is_level="token", is_threshold=-2.0), ValueError,
     "is_threshold"),
    ("icepop_lo_gt_hi", lambda: RolloutCorrection(is_level="token", is_threshold=(2.0, 0.5)), ValueError,
     "is_threshold"),
    ("unknown_rs_option", lambda: RolloutCorrection(rs={"seq_max_k1": 2.0}), ValueError, "seq_max_k1"),
    ("rs_k1_lo_gt_hi", lambda: RolloutCorrection(rs={"seq_mean_k1": (1.1, 0.9)}), ValueError, "seq_mean_k1"),
    ("rs_k1_negative_lo", lambda: RolloutCorrection(rs={"token_k1": (-0.5, 2.0)}), ValueError, "token_k1"),
    ("rs_seq_tokens", lambda: RolloutCorrection(rs={"token_k1": 2.0}, seq_tokens="all"), ValueError, "seq_tokens"),
    ("rs_mode_without_weights", lambda: RolloutCorrection(rs={"token_k1": 2.0}, rs_mode="zero_weight"), ValueError,
     "rs_mode"),
    ("kl_score_and_bias", lambda: PolicyLossConfig(kl_score_gradient=True, kl_bias_correction=True), ValueError,
     "kl_score_gradient"),
    ("seq_mean_advantages_geo", lambda: PolicyLossConfig(loss_type="geo_mean", seq_mean_advantages=True), ValueError,
     "seq_mean_advantages"),
    ("rs_k1_single_below_one", lambda: RolloutCorrection(rs={"token_k1": 0.5}), ValueError, "token_k1"),
    ("rs_k3_pair", lambda: RolloutCorrection(rs={"seq_mean_k3": (0.1, 0.2)}), TypeError, "seq_mean_k3"),
    ("rs_k2_negative", lambda: RolloutCorrection(rs={"token_k2": -1.0}), ValueError, "token_k2"),
    ("verl_bad_threshold", lambda: RolloutCorrection.from_verl(rollout_rs="token_k1", rollout_rs_threshold="a_b"),
     ValueError, "rollout_rs_threshold"),
    ("verl_threshold_count", lambda: RolloutCorrection.from_verl(rollout_rs="token_k1,token_k2,token_k3",
                                                                rollout_rs_threshold="2.0,0.1"),
     ValueError, "rollout_rs_threshold"),
    ("token_logprobs_temperature", lambda: rlkernels.token_logprobs(torch.zeros(2, 3), torch.zeros(2, dtype=torch.long),
                                                                     temperature=0), ValueError, "temperature"),
    ("token_logprobs_label_range", lambda: rlkernels.token_logprobs(torch.zeros(2, 3), torch.tensor([0, 3])),
     ValueError, "labels"),
    ("policy_loss_entropy_missing", lambda: rlkernels.policy_loss(torch.zeros(4), torch.zeros(4), torch.ones(4),
                                                                  entropy_coeff=0.01), ValueError, "entropy"),
    ("policy_loss_logprobs_nan",
     lambda: rlkernels.policy_loss(torch.tensor([0.0, math.nan]), torch.zeros(2), torch.ones(2)),
     ValueError, "logprobs"),
    ("rollout_correction_config", lambda: rlkernels.rollout_correction(torch.zeros(3), torch.zeros(3), torch.ones(3),
                                                                       config=PolicyLossConfig()), TypeError, "config"),
]


@pytest.mark.parametrize("thunk,exc,argument", [c[1:] for c in BAD_INPUTS], ids=[c[0] for c in BAD_INPUTS])
def test_bad_input_raises_naming_the_argument(thunk, exc, argument):
    with pytest.raises(exc) as info:
        thunk()
    assert argument in str(info.value), f"message does not name {argument!r}: {info.value}"
    message = str(info.value)
    assert "expected" in message or "unknown" in message or "must" in message or "only valid" in message


def test_every_entry_point_needs_a_token_dimension():
    """One row is [1, V] (or [1, H]): 1-D logits or hidden states are refused alike, never read as a 0-d result."""
    cases = [(lambda: rlkernels.token_logprobs(torch.randn(V), torch.tensor(1)), "logits"),
             (lambda: rlkernels.linear_token_logprobs(torch.randn(4), torch.randn(V, 4), torch.tensor(1)), "hidden"),
             (lambda: rlkernels.token_divergences(torch.randn(V), torch.tensor(1), reference_logits=torch.randn(V)),
              "logits"),
             (lambda: call(logits=torch.zeros(V)), "logits")]
    for thunk, name in cases:
        with pytest.raises(ValueError, match=rf"^{name}: expected"):
            thunk()
    one = rlkernels.token_logprobs(torch.randn(1, V), torch.tensor([1]))
    assert one.logprobs.shape == (1,)


@pytest.mark.parametrize("value", [0.5, 2.0, math.nan])
def test_a_mask_of_anything_but_0_1_is_refused(value):
    """A numeric response mask is read as bool: a 0.5 (a weight) or a 2 would count as a whole token, silently."""
    mask = good()["response_mask"].float().clone()
    mask[0, 1] = value
    with pytest.raises(ValueError, match="response_mask: expected a bool mask or values 0 and 1"):
        call(response_mask=mask)
    mask[0, 1] = 1.0
    assert torch.isfinite(call(response_mask=mask).loss)


def test_bad_input_raises_before_any_kernel(monkeypatch):
    calls = []
    monkeypatch.setattr(TorchBackend, "token_stats_fwd", lambda *a, **k: calls.append(1))
    for _, thunk, exc, _ in BAD_INPUTS:
        with pytest.raises(exc):
            thunk()
    assert not calls


def test_out_of_range_labels_without_validation_are_masked_not_read():
    kw = good()
    kw["labels"] = labels_with(10**9)
    pos = [kw.pop(k) for k in ("logits", "labels", "advantages", "response_mask")]
    out = rlkernels.decoupled_ppo_loss(*pos, validate=False, **kw)
    assert torch.isfinite(out.loss)
    assert not bool(out.mask[1, 2]) and out.logprobs[1, 2].item() == 0.0


def test_padding_may_hold_garbage():
    kw = good()
    mask = kw["response_mask"].clone()
    mask[0, 0] = False
    labels, adv = kw["labels"].clone(), kw["advantages"].clone()
    labels[0, 0], adv[0, 0] = 10**6, math.nan
    old = kw["old_logprobs"].clone()
    old[0, 0] = math.nan
    out = rlkernels.decoupled_ppo_loss(kw["logits"], labels, adv, mask, old_logprobs=old,
                                       rollout_logprobs=kw["rollout_logprobs"])
    assert torch.isfinite(out.loss)
    assert all(torch.isfinite(v) for v in out.metrics.values())


def test_infinite_logprob_is_legal():
    kw = good()
    roll = kw["rollout_logprobs"].clone()
    roll[0, 0] = -math.inf  # the engine reported probability 0: Delta = +inf, tamed by the clamp
    out = rlkernels.decoupled_ppo_loss(kw["logits"], kw["labels"], kw["advantages"], kw["response_mask"],
                                       old_logprobs=kw["old_logprobs"], rollout_logprobs=roll,
                                       rollout_correction=RolloutCorrection.token_tis())
    assert torch.isfinite(out.loss)
    assert out.is_weights[0, 0].item() == 2.0
