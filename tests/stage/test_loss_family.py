"""The loss family beyond the option-product draws: the covariance losses on both entry points,
and closed forms of the options whose selection rule is the point (TOPR's taper, M2PO's threshold
search, LUSPO's aggregation, two-sided IS truncation).

Clip-Cov draws its tokens at random and KL-Cov ranks them, so a float32 path could pick other tokens
than the float64 oracle at a near-tie; they are held to the oracle here in float64, with the default
generator seeded alike before each side (tests/peers/test_verl_losses.py holds them to verl).
"""

import math

import pytest
import torch

import rlkernels
from rlkernels import PolicyLossConfig, RolloutCorrection, reference

from ..cases import approx, assert_close, make_batch, tol


@pytest.mark.parametrize("loss_type", ["clip_cov", "kl_cov"])
@pytest.mark.parametrize("entry", ["logits", "linear"])
@pytest.mark.parametrize("mode", ["decoupled", "bypass"])
@pytest.mark.parametrize("seed", range(3))
def test_covariance_losses_match_the_oracle(loss_type, entry, mode, seed):
    batch = make_batch("packed", [5, 0, 9, 4, 7], 23, dtype=torch.float64, seed=seed, mask_p=0.85)
    config = PolicyLossConfig(loss_type=loss_type, clip_cov_ratio=0.25, clip_cov_lb=-1.0, clip_cov_ub=4.0,
                              kl_cov_ratio=0.2, ppo_kl_coef=0.5, entropy_coeff=0.01, kl_coef=0.05,
                              rollout_correction=RolloutCorrection.token_tis(), loss_agg_mode="seq-mean-token-mean")
    kw = batch.kwargs(mode)
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(batch.labels.shape[0], 8, generator=gen, dtype=torch.float64)
    weight = torch.randn(23, 8, generator=gen, dtype=torch.float64)
    logits = hidden @ weight.T
    args = (batch.labels, batch.advantages, batch.response_mask)
    if entry == "logits":
        leaf = logits.clone().requires_grad_(True)
        torch.manual_seed(seed)
        out = rlkernels.decoupled_ppo_loss(leaf, *args, config=config, backend="torch", **kw)
        (grad,) = torch.autograd.grad(out.loss, leaf)
    else:
        leaf = hidden.clone().requires_grad_(True)
        torch.manual_seed(seed)
        out = rlkernels.linear_decoupled_ppo_loss(leaf, weight, *args, config=config, backend="torch", **kw)
        (grad,) = torch.autograd.grad(out.loss, leaf)
    ref_logits = logits.clone().requires_grad_(True)
    torch.manual_seed(seed)
    expected = reference.decoupled_ppo_loss(ref_logits, *args, config=config, **kw)
    (ref_grad,) = torch.autograd.grad(expected.loss, ref_logits)
    if entry == "linear":
        ref_grad = ref_grad @ weight
    assert int(expected.metrics["actor/pg_clipfrac"] * expected.mask.sum()) >= 1, "the test must select tokens"
    q = tol("value", torch.float64, scale=max(1.0, float(expected.loss.detach().abs())))
    assert_close(out.loss, expected.loss, **q, name="loss")
    assert_close(grad, ref_grad, **tol("value", torch.float64, scale=float(ref_grad.abs().max())), name="gradient")
    for name, value in expected.metrics.items():
        assert_close(out.metrics[name], value, **tol("value", torch.float64, scale=max(1.0, float(value.abs()))),
                     name=name)


def _policy(lp, adv, mask, **kw):
    leaf = lp.clone().requires_grad_(True)
    config = kw.pop("config")
    out = rlkernels.policy_loss(leaf, adv, mask, config=config, **kw)
    (grad,) = torch.autograd.grad(out.loss, leaf)
    return out, grad


def test_topr_tapers_only_negative_sequences():
    """verl PR #6986: tau_i = 1 for a sequence whose mean advantage is >= 0, else clip(exp(mean log-ratio),
    lo, hi); loss -A tau lp, token-mean here."""
    lp = torch.tensor([[-1.0, -2.0], [-0.5, -1.5]], dtype=torch.float64)
    old = torch.tensor([[-1.2, -2.4], [-1.0, -2.0]], dtype=torch.float64)  # mean log-ratios 0.3 and 0.5
    adv = torch.tensor([[1.0, 1.0], [-1.0, -1.0]], dtype=torch.float64)
    mask = torch.ones(2, 2, dtype=torch.bool)
    config = PolicyLossConfig(loss_type="topr", topr_negative_ratio_upper=1.5)
    out, grad = _policy(lp, adv, mask, old_logprobs=old, config=config)
    tau = min(math.exp(0.5), 1.5)
    expected = (-(1.0 * -1.0) - (1.0 * -2.0) - (-1.0 * tau * -0.5) - (-1.0 * tau * -1.5)) / 4
    assert float(out.loss) == approx(expected, "by_hand.relative")
    assert grad.flatten().tolist() == approx([-0.25, -0.25, tau / 4, tau / 4], "by_hand.relative")
    assert float(out.metrics["actor/topr_negative_seq_frac"]) == 0.5
    assert float(out.metrics["actor/topr_taper_weight_mean"]) == approx((1 + tau) / 2, "by_hand.relative")


@pytest.mark.parametrize("quadrant", [False, True])
def test_m2po_keeps_the_longest_prefix_under_the_threshold(quadrant):
    """Squared log-ratios 0.01, 0.04, 0.09, 0.25 (ascending prefix means 0.01, 0.025, 0.0467, 0.0975):
    tau = 0.05 keeps the three smallest. With the quadrant rule the token whose move opposes its advantage
    (d = -0.5, A > 0) is not eligible and keeps its term whatever its M2."""
    d = torch.tensor([0.1, -0.2, 0.3, -0.5], dtype=torch.float64)
    adv = torch.tensor([1.0, -1.0, 1.0, 1.0], dtype=torch.float64)
    old = torch.full((4,), -1.0, dtype=torch.float64)
    lp = old + d
    mask = torch.ones(4, dtype=torch.bool)
    config = PolicyLossConfig(loss_type="gpg", m2po_threshold=0.05, m2po_quadrant=quadrant, loss_agg_mode="token-sum")
    out, grad = _policy(lp, adv, mask, old_logprobs=old, rollout_logprobs=old, config=config)
    kept = [True, True, True, quadrant]
    assert grad.tolist() == [-a if k else 0.0 for a, k in zip(adv.tolist(), kept)]
    assert float(out.metrics["actor/m2po_masked_fraction"]) == pytest.approx(0.0 if quadrant else 0.25)
    assert float(out.metrics["actor/m2po_trust_region_fraction"]) == pytest.approx(0.75 if quadrant else 1.0)


def test_luspo_sums_tokens_and_averages_over_every_sequence():
    lp = torch.tensor([[-1.0, -1.0, -1.0], [-1.0, -1.0, -1.0], [-1.0, -1.0, -1.0]], dtype=torch.float64)
    adv = torch.tensor([[1.0, 1.0, 1.0], [2.0, 2.0, 2.0], [5.0, 5.0, 5.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1], [1, 0, 0], [0, 0, 0]], dtype=torch.bool)  # the third one is empty
    config = PolicyLossConfig(loss_type="luspo", loss_agg_mode="token-mean")  # luspo's own aggregation wins
    out, grad = _policy(lp, adv, mask, old_logprobs=lp, config=config)
    assert float(out.loss) == approx(-(3 * 1.0 + 1 * 2.0) / 3, "by_hand.relative")
    assert grad.flatten().tolist() == approx([-1 / 3] * 3 + [-2 / 3, 0, 0] + [0, 0, 0], "by_hand.relative")


def test_is_truncation_takes_a_lower_bound_and_masks_take_open_bounds():
    train = torch.log(torch.tensor([0.2, 1.0, 4.0], dtype=torch.float64))
    rollout = torch.zeros(3, dtype=torch.float64)
    mask = torch.ones(3, dtype=torch.bool)
    for rc, want in ((RolloutCorrection(is_level="token", is_threshold=(0.5, 2.0), is_mode="truncate"), [0.5, 1, 2]),
                     (RolloutCorrection.from_trl("token_truncate", 0.5, None), [0.5, 1, 4]),
                     (RolloutCorrection.from_trl("token_mask", None, 3.0), [0.2, 1, 0]),
                     (RolloutCorrection.from_trl("token_mask", 0.5, None), [0, 1, 4])):
        out = rlkernels.rollout_correction(train, rollout, mask, config=rc)
        assert out.weights.tolist() == approx(want, "by_hand.relative"), rc
    with pytest.raises(ValueError, match=r"^is_mode: expected one of"):
        RolloutCorrection(is_level="token", is_mode="clip")
    with pytest.raises(ValueError, match=r"^vllm_importance_sampling_clip_min: expected a finite number >= 0"):
        RolloutCorrection.from_trl("token_mask", -1.0, 3.0)


def test_family_options_refuse_combinations_without_meaning():
    with pytest.raises(ValueError, match=r"^ratio_level: 'sequence' applies to loss types"):
        PolicyLossConfig(loss_type="dro", dro_beta=0.1, ratio_level="sequence")
    with pytest.raises(ValueError, match=r"^loss_type: 'geo_mean' is one term per sequence"):
        PolicyLossConfig(loss_type="geo_mean", off_policy_mask_threshold=0.5)
    with pytest.raises(ValueError, match=r"^rollout_correction: loss_type='vespo' folds token-level IS weights"):
        PolicyLossConfig(loss_type="vespo", rollout_correction=RolloutCorrection.seq_tis())
    with pytest.raises(ValueError, match=r"^topr_negative_ratio_lower: expected <= topr_negative_ratio_upper"):
        PolicyLossConfig(loss_type="topr", topr_negative_ratio_lower=2.0)
    with pytest.raises(ValueError, match=r"^seq_mean_over: expected one of"):
        PolicyLossConfig(seq_mean_over="some")
