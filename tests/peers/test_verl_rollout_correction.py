"""Rollout correction against verl 0.9.1's own `compute_rollout_correction_and_rejection_mask`: IS
weights, the rejection mask, and every rollout_corr/* metric verl reports — each must exist here under
verl's name, and equal verl's value unless SPEC §14 defines it otherwise.

Batches have no empty row: verl counts empty rows in its sequence means, this library does not (a
documented difference that would otherwise touch most sequence metrics). k1 bounds are symmetric
(1/h, h), where verl's code and its docs agree. Both sides run in float64: the IS weights agree to a few ulps
(TOL "verl.is_weights"); verl's means divide by n + 1e-8, hence 1e-7 relative for the metrics (TOL "verl.metrics").
"""

import re

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import rlkernels
from rlkernels import RolloutCorrection

from ..cases import F64, approx, assert_close, scaled, tol
from ..verl_import import import_verl_or_skip

helper, _, _ = import_verl_or_skip()

RS_SPECS = {"token_k1": "0.5_2.0", "token_k2": "0.02", "token_k3": "0.05", "seq_sum_k1": "0.25_4.0",
            "seq_sum_k2": "0.5", "seq_sum_k3": "0.3", "seq_mean_k1": "0.8_1.25", "seq_mean_k2": "0.03",
            "seq_mean_k3": "0.05", "seq_max_k2": "0.1", "seq_max_k3": "0.2"}


def _by_design(name: str, is_level) -> bool:
    """verl's values that this library defines otherwise on purpose (docs/spec.md)."""
    if re.fullmatch(r"rollout_rs_seq_(sum|mean|max)_k\d_(mean|std)", name):
        return True  # a sequence option's mean / std: one value per sequence, not the per-token broadcast
    return is_level == "sequence" and name in ("rollout_is_min", "rollout_is_max", "rollout_is_oob_ratio")


@settings(max_examples=scaled(60))
@given(seed=st.integers(0, 2**31 - 1), is_level=st.sampled_from([None, "token", "sequence"]),
       threshold=st.sampled_from([2.0, 1.2, "0.5_2.0", "0.8_1.5"]),
       options=st.lists(st.sampled_from(sorted(RS_SPECS)), max_size=3, unique=True),
       spread=st.sampled_from([0.05, 0.3]))
def test_rollout_correction_matches_verl(seed, is_level, threshold, options, spread):
    gen = torch.Generator().manual_seed(seed)
    B, T = 4, 6
    old = -torch.rand(B, T, generator=gen, dtype=torch.float64) * 3
    rollout = old + torch.randn(B, T, generator=gen, dtype=torch.float64) * spread
    mask = (torch.rand(B, T, generator=gen) < 0.8).double()
    mask[:, 0] = 1  # no empty row (see the module docstring)
    rs = ",".join(options) or None
    rs_threshold = ",".join(RS_SPECS[o] for o in options) or None
    try:
        weights, final_mask, metrics = helper.compute_rollout_correction_and_rejection_mask(
            old, rollout, mask, rollout_is=is_level, rollout_is_threshold=threshold, rollout_rs=rs,
            rollout_rs_threshold=rs_threshold)
    except ZeroDivisionError:  # verl's ESS when IcePop zeroes every weight (docs/spec.md: ours is 0)
        return
    config = RolloutCorrection.from_verl(is_level, threshold, rs, rs_threshold)
    out = rlkernels.rollout_correction(old, rollout, mask.bool(), config=config)
    assert torch.equal(out.mask, (final_mask * mask).bool()), "rejection mask"
    if is_level is not None:
        want = weights.batch["rollout_is_weights"] * mask
        assert_close(out.weights, want, **tol("verl.is_weights", F64), name="IS weights")
    ours = {name.split("/", 1)[1]: float(v) for name, v in out.metrics.items()}
    for key, value in metrics.items():
        name = key.split("/")[-1]
        assert name in ours, f"verl's metric {name} is missing"
        if not _by_design(name, is_level):
            assert ours[name] == approx(value, "verl.metrics"), f"{name}: {ours[name]} vs verl {value}"


def test_from_verl_refuses_the_levels_verl_refuses():
    """`from_verl` is verl's config: a level verl's own weights refuse ("Must be one of {'token', 'sequence'}") is
    refused here too, even where rlkernels has it under another name (the geometric level)."""
    log_ratio, mask = torch.zeros(2, 3, dtype=torch.float64), torch.ones(2, 3, dtype=torch.float64)
    for level in ("token", "sequence", "geometric", "seq", "tokens"):
        try:
            helper.compute_rollout_correction_weights(log_ratio, mask, rollout_is=level)
            verl_accepts = True
        except ValueError:
            verl_accepts = False
        try:
            RolloutCorrection.from_verl(rollout_is=level)
            ours_accepts = True
        except ValueError as exc:
            assert str(exc).startswith("rollout_is: verl takes None, 'token' or 'sequence'"), exc
            ours_accepts = False
        assert ours_accepts == verl_accepts, level
