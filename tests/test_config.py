"""Configuration objects: presets of SPEC §5, verl's option strings, immutability, overrides."""

import dataclasses

import pytest

from rlkernels import PolicyLossConfig, RolloutCorrection


def test_presets_match_spec():
    assert RolloutCorrection.token_tis() == RolloutCorrection(is_level="token", is_threshold=2.0)
    assert RolloutCorrection.seq_tis() == RolloutCorrection(is_level="sequence", is_threshold=2.0)
    assert RolloutCorrection.seq_mis().rs == (("seq_sum_k1", (0.5, 2.0)),)
    assert RolloutCorrection.seq_mis().is_level == "sequence"
    assert RolloutCorrection.geo_rs().rs == (("seq_mean_k1", (0.999, 1.001)),)
    assert RolloutCorrection.geo_rs().is_level is None
    g = RolloutCorrection.geo_rs_token_tis()
    assert g.is_level == "token" and g.is_threshold == 2.0 and g.rs == (("seq_mean_k1", (0.999, 1.001)),)
    assert RolloutCorrection.k3_rs().rs == (("seq_mean_k3", 0.01),)
    ice = RolloutCorrection.icepop()
    assert ice.is_level == "token" and ice.is_threshold == (0.5, 5.0) and ice.is_icepop


def test_presets_take_parameters_and_keywords():
    assert RolloutCorrection.geo_rs(bounds=(0.5, 2.0)).rs == (("seq_mean_k1", (0.5, 2.0)),)
    assert RolloutCorrection.token_tis(5.0, is_batch_normalize=True).is_batch_normalize
    assert RolloutCorrection.seq_tis(threshold=3.0).is_threshold == 3.0


def test_single_k1_bound_means_reciprocal_pair():
    assert RolloutCorrection(rs={"token_k1": 2.0}).rs == (("token_k1", (0.5, 2.0)),)


def test_rs_accepts_pairs_and_mapping_equally():
    a = RolloutCorrection(rs={"token_k2": 0.1, "seq_max_k3": 0.5})
    b = RolloutCorrection(rs=[("token_k2", 0.1), ("seq_max_k3", 0.5)])
    assert a == b and hash(a) == hash(b)


@pytest.mark.parametrize("kwargs,expected", [
    (dict(rollout_is="token", rollout_is_threshold=2.0), RolloutCorrection.token_tis()),
    (dict(rollout_is="sequence", rollout_is_threshold="2.0"), RolloutCorrection.seq_tis()),
    (dict(rollout_is="token", rollout_is_threshold="0.5_5.0"), RolloutCorrection.icepop()),
    (dict(rollout_is=None, rollout_rs="seq_mean_k1", rollout_rs_threshold="0.999_1.001"), RolloutCorrection.geo_rs()),
    (dict(rollout_is="token", rollout_rs="seq_mean_k1", rollout_rs_threshold="0.999_1.001"),
     RolloutCorrection.geo_rs_token_tis()),
    (dict(rollout_is="sequence", rollout_rs="seq_sum_k1", rollout_rs_threshold="0.5_2.0"), RolloutCorrection.seq_mis()),
    (dict(rollout_rs="seq_mean_k3", rollout_rs_threshold=0.01), RolloutCorrection.k3_rs()),
    (dict(rollout_rs="seq_mean_k1,token_k3", rollout_rs_threshold="0.5_2.0,0.01"),
     RolloutCorrection(rs={"seq_mean_k1": (0.5, 2.0), "token_k3": 0.01})),
    (dict(rollout_rs="token_k1", rollout_rs_threshold="2.0"), RolloutCorrection(rs={"token_k1": (0.5, 2.0)})),
    (dict(rollout_rs="token_k2,seq_max_k2", rollout_rs_threshold="0.1"),
     RolloutCorrection(rs={"token_k2": 0.1, "seq_max_k2": 0.1})),
    (dict(rollout_is="token", rollout_is_batch_normalize=True), RolloutCorrection.token_tis(is_batch_normalize=True)),
    (dict(rollout_is="none"), RolloutCorrection()),
])
def test_from_verl(kwargs, expected):
    assert RolloutCorrection.from_verl(**kwargs) == expected


def test_configs_are_frozen_and_hashable():
    cfg = PolicyLossConfig(rollout_correction=RolloutCorrection.seq_mis())
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.temperature = 2.0
    assert hash(cfg) == hash(PolicyLossConfig(rollout_correction=RolloutCorrection.seq_mis()))


def test_overrides_replace_fields_and_keep_the_rest():
    base = PolicyLossConfig(clip_ratio_high=0.28, loss_agg_mode="token-sum")
    new = base.with_overrides(temperature=0.5)
    assert new.temperature == 0.5 and new.clip_ratio_high == 0.28 and new.loss_agg_mode == "token-sum"
    assert base.temperature == 1.0


def test_defaults_are_the_documented_ones():
    cfg = PolicyLossConfig()
    assert (cfg.loss_type, cfg.clip_ratio_low, cfg.clip_ratio_high, cfg.clip_ratio_c) == ("ppo_clip", 0.2, 0.2, 3.0)
    assert (cfg.loss_agg_mode, cfg.temperature, cfg.backend, cfg.validate) == ("token-mean", 1.0, "auto", True)
    assert PolicyLossConfig(kl_type="low_var_kl").kl_type == "k3"
    assert PolicyLossConfig(clip_ratio_c=None).clip_ratio_c is None
