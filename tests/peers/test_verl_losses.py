"""Each policy loss against verl 0.9.1's own registered function (`core_algos.get_policy_loss_fn`),
on hypothesis-generated padded batches (verl takes [B, T]): the loss value, its gradient w.r.t. the
log-probs (autograd through verl's function against rlkernels' closed-form coefficients) and the
actor/* metrics verl reports.

verl runs in float64 here, as does rlkernels' `policy_loss`, so the comparison is float64 against
float64: 2e-8 relative (the "verl" row of cases.TOL: verl's means divide by n + 1e-8). verl's metrics
are Python floats (`.item()`); ours are device tensors. With no token in the mask verl's token-mean
loss is 0/0 = NaN; ours is 0 (docs/spec.md, SPEC §7), which the test asserts instead.

Needs verl (`pip install --no-deps verl==0.9.1` + packaging omegaconf codetiming tensordict==0.10.0;
ray and transformers are stood in for during the import only, as the benchmarks do).
"""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import rlkernels
from rlkernels import PolicyLossConfig

from ..cases import approx, assert_close, scaled, tol
from ..verl_import import import_verl_or_skip

_, core_algos, ActorConfig = import_verl_or_skip()
from verl.workers.config.actor import PolicyLossConfig as VerlPolicyLossConfig  # noqa: E402

LOSSES = ("vanilla", "gpg", "sapo", "gspo", "geo_mean", "cispo", "dro", "dppo_tv", "dppo_kl")
AGG_MODES = ("token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")


@st.composite
def batches(draw):
    B, T = draw(st.integers(1, 4)), draw(st.integers(1, 7))
    seed = draw(st.integers(0, 2**31 - 1))
    spread = draw(st.sampled_from([0.01, 0.3, 2.0, 30.0]))  # log-ratios up to past the +-20 clamp
    gen = torch.Generator().manual_seed(seed)
    old = -torch.rand(B, T, generator=gen, dtype=torch.float64) * 4
    lp = old + torch.randn(B, T, generator=gen, dtype=torch.float64) * spread
    adv = torch.randn(B, T, generator=gen, dtype=torch.float64)
    mask = torch.rand(B, T, generator=gen) < draw(st.sampled_from([1.0, 0.7]))
    if draw(st.booleans()):
        mask[0] = False  # an empty sequence
    return lp, old, adv, mask


DRO_BETA = 0.3


def _verl(loss, lp, old, adv, mask, agg, clip_c, tau, weights=None):
    config = ActorConfig(strategy="fsdp", rollout_n=1, ppo_micro_batch_size_per_gpu=1, clip_ratio_low=0.2,
                         clip_ratio_high=0.28, clip_ratio_c=clip_c, loss_agg_mode=agg, tau_pos=tau[0],
                         tau_neg=tau[1], policy_loss=VerlPolicyLossConfig(loss_mode=loss, dro_beta=DRO_BETA))
    leaf = lp.clone().requires_grad_(True)
    value, metrics = core_algos.get_policy_loss_fn(loss)(old, leaf, adv, mask.double(), agg, config, weights)
    (grad,) = torch.autograd.grad(value, leaf, allow_unused=True)
    return value.detach(), torch.zeros_like(lp) if grad is None else grad, metrics


@pytest.mark.parametrize("loss", LOSSES)
@settings(max_examples=scaled(60))
@given(batch=batches(), agg=st.sampled_from(AGG_MODES), clip_c=st.sampled_from([3.0, 10.0]),
       tau=st.sampled_from([(1.0, 1.05), (2.0, 0.5)]), weighted=st.booleans())
def test_policy_loss_matches_verl(loss, batch, agg, clip_c, tau, weighted):
    """weighted: the trainer's own rollout IS weights (verl's `rollout_is_weights`, our `is_weights=`)."""
    lp, old, adv, mask = batch
    weights = 0.25 + torch.rand(lp.shape, generator=torch.Generator().manual_seed(3), dtype=torch.float64) * 2
    weights = weights if weighted else None
    # verl's sapo always aggregates seq-mean-token-mean (SPEC §14)
    ours_agg = "seq-mean-token-mean" if loss == "sapo" else agg
    want, want_grad, want_metrics = _verl(loss, lp, old, adv, mask, agg, clip_c, tau, weights)
    if not mask.any():  # nothing to average: verl divides 0 by 0
        out = rlkernels.policy_loss(lp, adv, mask, old_logprobs=old, loss_type=loss, loss_agg_mode=ours_agg,
                                    dro_beta=DRO_BETA)
        assert float(out.loss) == 0.0
        return
    config = PolicyLossConfig(loss_type=loss, clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=clip_c,
                              loss_agg_mode=ours_agg, tau_pos=tau[0], tau_neg=tau[1], dro_beta=DRO_BETA)
    leaf = lp.clone().requires_grad_(True)
    out = rlkernels.policy_loss(leaf, adv, mask, old_logprobs=old, config=config, is_weights=weights)
    (grad,) = torch.autograd.grad(out.loss, leaf)
    # verl's 1e-8 / n deviation is relative to each sequence's term, and terms of opposite signs cancel in
    # the total: scale by the sum of the terms' magnitudes (|A| (|lp| + 2) bounds each loss's per-token
    # term, plus DRO's penalty), not by the total
    terms = (adv.abs() * (lp.abs() + 2) + DRO_BETA * (lp - old).square()) * (1 if weights is None else weights)
    scale = max(1.0, float(want.abs()), float(terms[mask].sum()))
    if loss == "geo_mean":  # exp(x / (n + 1e-8)) vs exp(x / n): a relative |x| 1e-8 / n, |x / n| <= max |lp - old|
        scale *= 1 + float((lp - old)[mask].abs().max())
    q = tol("verl", torch.float64, scale=scale)
    assert_close(out.loss.detach(), want, **q, name=f"{loss} loss")
    g_scale = max(1e-3, float(want_grad.abs().max())) * (scale / max(1.0, float(want.abs())))
    assert_close(grad, want_grad, **tol("verl", torch.float64, scale=g_scale), name=f"{loss} d loss / d logprobs")
    for name, value in want_metrics.items():
        got = float(out.metrics[name])
        assert got == approx(value, "verl"), f"{loss} {name}: {got} vs verl {value}"


@pytest.mark.parametrize("loss", LOSSES)
def test_from_verl_actor_reproduces_verls_loss(loss):
    """A verl ActorConfig -> PolicyLossConfig.from_verl_actor: the same loss and gradient as verl's
    function run with that ActorConfig (non-default clip ratios, dual clip, taus, aggregation)."""
    gen = torch.Generator().manual_seed(11)
    old = -torch.rand(3, 5, generator=gen, dtype=torch.float64) * 3
    lp = old + torch.randn(3, 5, generator=gen, dtype=torch.float64) * 0.4
    adv = torch.randn(3, 5, generator=gen, dtype=torch.float64)
    mask = torch.rand(3, 5, generator=gen) < 0.8
    agg = "seq-mean-token-mean"
    actor = ActorConfig(strategy="fsdp", rollout_n=1, ppo_micro_batch_size_per_gpu=1, clip_ratio_low=0.15,
                        clip_ratio_high=0.3, clip_ratio_c=4.0, loss_agg_mode=agg, tau_pos=1.5, tau_neg=0.8,
                        policy_loss=VerlPolicyLossConfig(loss_mode=loss, dro_beta=DRO_BETA))
    leaf = lp.clone().requires_grad_(True)
    want, _ = core_algos.get_policy_loss_fn(loss)(old, leaf, adv, mask.double(), agg, actor, None)
    (want_grad,) = torch.autograd.grad(want, leaf, allow_unused=True)
    config = PolicyLossConfig.from_verl_actor(actor)
    got = (config.loss_type, config.clip_ratio_low, config.clip_ratio_high, config.clip_ratio_c)
    assert got == (loss, 0.15, 0.3, 4.0)
    mine = lp.clone().requires_grad_(True)
    out = rlkernels.policy_loss(mine, adv, mask, old_logprobs=old, config=config)
    (grad,) = torch.autograd.grad(out.loss, mine)
    # O(1) terms and log-ratios (spread 0.4): verl's 1e-8 / n deviation, amplified at most ~2x (GMPO's
    # exponent), stays below TOL "verl.actor"
    assert_close(out.loss.detach(), want.detach(), **tol("verl.actor", torch.float64), name="loss")
    if want_grad is not None:
        assert_close(grad, want_grad, **tol("verl.actor", torch.float64), name="gradient")


def test_from_verl_actor_maps_kl_and_names_verls_options():
    actor = {"clip_ratio": 0.25, "clip_ratio_low": None, "use_kl_loss": True, "kl_loss_coef": 0.02,
             "kl_loss_type": "mse", "entropy_coeff": 0.01, "policy_loss": {"loss_mode": "vanilla"}}
    config = PolicyLossConfig.from_verl_actor(actor)
    assert (config.clip_ratio_low, config.clip_ratio_high, config.kl_coef, config.kl_type, config.entropy_coeff) == (
        0.25, 0.25, 0.02, "k2", 0.01)
    bypass = {"policy_loss": {"loss_mode": "bypass_mode", "rollout_correction": {"loss_type": "reinforce"}}}
    assert PolicyLossConfig.from_verl_actor(bypass).loss_type == "reinforce"
    with pytest.raises(ValueError, match=r"actor.policy_loss.loss_mode: 'rloo' is not computed by rlkernels"):
        PolicyLossConfig.from_verl_actor({"policy_loss": {"loss_mode": "rloo"}})
    with pytest.raises(ValueError, match=r"actor.policy_loss.clip_cov_ratio: expected a finite number > 0"):
        PolicyLossConfig.from_verl_actor({"policy_loss": {"loss_mode": "clip_cov", "clip_cov_ratio": 0.0}})
    cov = PolicyLossConfig.from_verl_actor({"policy_loss": {"loss_mode": "kl_cov", "kl_cov_ratio": 0.01,
                                                            "ppo_kl_coef": 0.5, "clip_cov_lb": None}})
    assert (cov.loss_type, cov.kl_cov_ratio, cov.ppo_kl_coef, cov.clip_cov_lb) == ("kl_cov", 0.01, 0.5, 1.0)
    with pytest.raises(ValueError, match=r"actor.kl_loss_type: 'full' is not computed"):  # needs the vocabulary
        PolicyLossConfig.from_verl_actor({"use_kl_loss": True, "kl_loss_type": "full"})
    with pytest.raises(ValueError, match=r"actor.policy_loss.dro_beta: expected a number > 0"):
        PolicyLossConfig.from_verl_actor({"policy_loss": {"loss_mode": "dro"}})
    with pytest.raises(ValueError, match=r"actor.clip_ratio_c: expected c > 1"):
        PolicyLossConfig.from_verl_actor({"clip_ratio_c": 0.5})


@pytest.mark.parametrize("kl_type", [k for k in ("kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3")]
                         + [f"{k}+" for k in ("kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3")])
@settings(max_examples=scaled(25))
@given(batch=batches())
def test_kl_penalty_matches_verl(kl_type, batch):
    """The KL term (value and d / d logprobs, token-sum so each token's term is compared) against verl's
    own kl_penalty, straight-through "+" variants included."""
    lp, old, adv, mask = batch
    ref = old  # a reference policy at the log-ratios of the batch (up to past the +-20 clamp)
    leaf = lp.clone().requires_grad_(True)
    want = (core_algos.kl_penalty(leaf, ref, kl_type) * mask).sum()
    (want_grad,) = torch.autograd.grad(want, leaf)
    mine = lp.clone().requires_grad_(True)
    config = PolicyLossConfig(kl_coef=1.0, kl_type=kl_type, loss_agg_mode="token-sum")
    out = rlkernels.policy_loss(mine, torch.zeros_like(lp), mask, ref_logprobs=ref, config=config)
    (grad,) = torch.autograd.grad(out.loss, mine)
    scale = max(1.0, float((core_algos.kl_penalty(lp, ref, kl_type).abs() * mask).sum()))
    assert_close(out.metrics["actor/kl_loss"], want.detach(), **tol("verl", torch.float64, scale=scale), name="kl")
    assert_close(grad, want_grad, **tol("verl", torch.float64, scale=max(1.0, float(want_grad.abs().max()))),
                 name="d kl / d logprobs")


COV_PARAMS = dict(clip_cov_ratio=0.3, clip_cov_lb=0.0, clip_cov_ub=3.0, kl_cov_ratio=0.3, ppo_kl_coef=0.7)


@pytest.mark.parametrize("loss", ["clip_cov", "kl_cov"])
@settings(max_examples=scaled(40))
@given(batch=batches(), agg=st.sampled_from(AGG_MODES), weighted=st.booleans(), seed=st.integers(0, 2**16))
def test_covariance_losses_match_verl_under_the_same_seed(loss, batch, agg, weighted, seed):
    """Clip-Cov draws its tokens with torch.randperm on the default generator, as verl's does: seeded
    alike, both pick the same tokens. KL-Cov's top-k is deterministic. Spread <= 2: verl does not clamp
    the log-ratio of these two losses and neither does rlkernels (docs/spec.md)."""
    lp, old, adv, mask = batch
    lp = old + (lp - old).clamp(-2, 2)
    weights = (0.25 + torch.rand(lp.shape, generator=torch.Generator().manual_seed(3), dtype=torch.float64) * 2
               if weighted else None)
    actor = ActorConfig(strategy="fsdp", rollout_n=1, ppo_micro_batch_size_per_gpu=1, clip_ratio_low=0.2,
                        clip_ratio_high=0.28, loss_agg_mode=agg,
                        policy_loss=VerlPolicyLossConfig(loss_mode=loss, **COV_PARAMS))
    if not mask.any():
        return  # verl divides 0 by 0 (see test_policy_loss_matches_verl)
    leaf = lp.clone().requires_grad_(True)
    torch.manual_seed(seed)
    want, want_metrics = core_algos.get_policy_loss_fn(loss)(old, leaf, adv, mask.double(), agg, actor, weights)
    (want_grad,) = torch.autograd.grad(want, leaf)
    config = PolicyLossConfig.from_verl_actor(actor)
    assert (config.loss_type, config.clip_cov_ratio, config.ppo_kl_coef) == (loss, 0.3, 0.7)
    mine = lp.clone().requires_grad_(True)
    torch.manual_seed(seed)
    out = rlkernels.policy_loss(mine, adv, mask, old_logprobs=old, config=config, is_weights=weights)
    (grad,) = torch.autograd.grad(out.loss, mine)
    terms = (adv.abs() * (torch.exp(lp - old) + 2) + (lp - old).abs()) * (1 if weights is None else weights)
    scale = max(1.0, float(terms[mask].sum()))
    assert_close(out.loss.detach(), want.detach(), **tol("verl", torch.float64, scale=scale), name=f"{loss} loss")
    assert_close(grad, want_grad, **tol("verl", torch.float64, scale=scale), name=f"{loss} gradient")
    for name, value in want_metrics.items():
        got = float(out.metrics[name])
        assert got == approx(value, "verl"), f"{loss} {name}: {got} vs verl {value}"
