"""Score centering (loss_type="score_centering", SPEC §6.1 / §9) against the float64 oracle's autograd form
(reference/policy_terms.py), over its IS functions f, the rejection options, the aggregation modes and the
layouts, on logits and hidden states; and its closed forms: on-policy the correction vanishes, with H = V and
f = 1 the weights are q - p (the gradient -A (e_y - q) / T), and with f(r) = r (truncation at (0, inf)) the
correction vanishes identically."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import rlkernels
from rlkernels import PolicyLossConfig, RolloutCorrection, reference
from rlkernels.config import LOG_RATIO_RS_OPTIONS, LOSS_AGG_MODES

from ..cases import F32, F64, approx, assert_close, batches, scaled, tol

IS_RULES = {
    "none": None,
    "truncate": dict(is_level="token", is_threshold=1.5),
    "icepop": dict(is_level="token", is_threshold=(0.5, 2.0)),
    "identity": dict(is_level="token", is_threshold=(0.0, math.inf), is_mode="truncate"),
}


def _sampler(batch, k: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    z = batch.logits.double()
    mu = torch.log_softmax(z + torch.randn(z.shape, generator=gen, dtype=F64) * 0.7, -1)
    mu = torch.where(torch.isfinite(z), mu, torch.full_like(mu, float("-inf")))
    mu = torch.log_softmax(mu, -1)
    ids = mu.topk(min(k, z.shape[-1]), -1).indices
    labels = batch.labels.clamp_min(0)
    rollout = mu.gather(-1, labels[..., None]).squeeze(-1)
    return ids, mu.gather(-1, ids), rollout


def _rc(rule: str, rs):
    kw = IS_RULES[rule]
    if kw is None and not rs:
        return None
    return RolloutCorrection(**(kw or {}), rs=rs)


@pytest.mark.parametrize("dtype,backend", [(F64, "torch"), (F32, "torch"), (F32, "cpu")])
@settings(max_examples=scaled(40), deadline=None)
@given(batch=batches(max_vocab=24), k=st.integers(1, 8), seed=st.integers(0, 2**31 - 1),
       rule=st.sampled_from(sorted(IS_RULES)), agg=st.sampled_from(LOSS_AGG_MODES),
       rs=st.lists(st.sampled_from([o for o in LOG_RATIO_RS_OPTIONS if not o.endswith("k1")]), max_size=1))
def test_score_centering_matches_the_oracle(dtype, backend, batch, k, seed, rule, agg, rs):
    from rlkernels import backends

    if backend == "cpu" and not backends.available()["cpu"]:
        pytest.skip("the CPU kernels could not be built here")
    ids, lq, rollout = _sampler(batch, k, seed)
    config = PolicyLossConfig(loss_type="score_centering", loss_agg_mode=agg, backend=backend,
                              rollout_correction=_rc(rule, {o: 0.5 for o in rs}))
    logits = batch.logits.to(dtype).clone().requires_grad_(True)
    kw = dict(rollout_logprobs=rollout.to(F32 if dtype == F32 else F64), cu_seqlens=batch.cu_seqlens, config=config,
              sampler_topk_ids=ids, sampler_topk_logprobs=lq.to(F32 if dtype == F32 else F64))
    out = rlkernels.decoupled_ppo_loss(logits, batch.labels, batch.advantages, batch.response_mask, **kw)
    ref_logits = logits.detach().double().requires_grad_(True)
    ref = reference.decoupled_ppo_loss(ref_logits, batch.labels, batch.advantages, batch.response_mask, **kw)
    stat = F64 if dtype == F64 else F32
    scale = max(1.0, float(ref.loss.detach().abs()))
    assert_close(out.loss, ref.loss, **tol("value", stat, scale=scale), name="loss")
    assert torch.equal(out.mask, ref.mask)
    (grad,) = torch.autograd.grad(out.loss, logits)
    (ref_grad,) = torch.autograd.grad(ref.loss, ref_logits)
    q = tol("dlogits", dtype, scale=max(1e-3, float(ref_grad.abs().max())) if ref_grad.numel() else 1.0)
    assert_close(grad, ref_grad, **q, name="dlogits")
    for name in ("actor/pg_loss", "actor/pg_clipfrac"):
        assert_close(out.metrics[name], ref.metrics[name], **tol("value", stat, scale=scale), name=name)


@settings(max_examples=scaled(20), deadline=None)
@given(batch=batches(max_vocab=24), k=st.integers(1, 8), seed=st.integers(0, 2**31 - 1),
       rule=st.sampled_from(sorted(IS_RULES)))
def test_score_centering_on_hidden_states_matches_the_logits_path(batch, k, seed, rule):
    gen = torch.Generator().manual_seed(seed)
    shape, V = tuple(batch.labels.shape), batch.logits.shape[-1]
    hidden = torch.randn(shape + (5,), generator=gen, dtype=F64)
    weight = torch.randn(V, 5, generator=gen, dtype=F64)
    z = hidden @ weight.T
    mu = torch.log_softmax(z + torch.randn(z.shape, generator=gen, dtype=F64) * 0.7, -1)
    ids = mu.topk(min(k, V), -1).indices
    rollout = mu.gather(-1, batch.labels.clamp_min(0)[..., None]).squeeze(-1)
    config = PolicyLossConfig(loss_type="score_centering", rollout_correction=_rc(rule, {}))
    kw = dict(rollout_logprobs=rollout, cu_seqlens=batch.cu_seqlens, config=config, sampler_topk_ids=ids,
              sampler_topk_logprobs=mu.gather(-1, ids))
    h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    out = rlkernels.linear_decoupled_ppo_loss(h, w, batch.labels, batch.advantages, batch.response_mask, **kw)
    hr, wr = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    ref = reference.decoupled_ppo_loss(hr @ wr.T, batch.labels, batch.advantages, batch.response_mask, **kw)
    assert_close(out.loss, ref.loss, **tol("value", F64, scale=max(1.0, float(ref.loss.detach().abs()))), name="loss")
    grads = torch.autograd.grad(out.loss, (h, w))
    ref_grads = torch.autograd.grad(ref.loss, (hr, wr))
    for name, g, r in zip(("d_hidden", "d_weight"), grads, ref_grads):
        assert_close(g, r, **tol("value", F64, scale=max(1.0, float(r.abs().max())) if r.numel() else 1.0), name=name)
    assert out.path == "linear_two_pass"


def _one_batch(B=3, T=5, V=12, seed=0):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(B, T, V, generator=gen, dtype=F64)
    labels = torch.randint(0, V, (B, T), generator=gen)
    adv = torch.randn(B, T, generator=gen, dtype=F64)
    return logits, labels, adv, torch.ones(B, T)


def _grad(logits, labels, adv, mask, ids, lq, rollout, rc=None, agg="token-sum"):
    leaf = logits.clone().requires_grad_(True)
    out = rlkernels.decoupled_ppo_loss(leaf, labels, adv, mask, rollout_logprobs=rollout, sampler_topk_ids=ids,
                                       sampler_topk_logprobs=lq, config=PolicyLossConfig(
                                           loss_type="score_centering", loss_agg_mode=agg, rollout_correction=rc))
    return torch.autograd.grad(out.loss, leaf)[0], out


def test_on_policy_the_correction_vanishes():
    """q = p on the head (the sampler is the trainer): every weight is 0, the gradient is REINFORCE's -A (e_y - p)."""
    logits, labels, adv, mask = _one_batch()
    logp = torch.log_softmax(logits, -1)
    ids = logp.topk(4, -1).indices
    rollout = logp.gather(-1, labels[..., None]).squeeze(-1)
    for rc in (None, RolloutCorrection.token_tis(1.5), RolloutCorrection.icepop((0.5, 2.0))):
        g, _ = _grad(logits, labels, adv, mask, ids, logp.gather(-1, ids), rollout, rc)
        expected = -adv[..., None] * (torch.nn.functional.one_hot(labels, 12).double() - logp.exp())
        assert_close(g, expected, **tol("dlogits", F64), name="dlogits")


def test_the_whole_vocabulary_as_head_gives_weights_q_minus_p():
    """H = V, f = 1: the correction's weights are q_v - p_v, and the gradient -A (e_y - p - (q - p)) = -A (e_y - q)."""
    logits, labels, adv, mask = _one_batch()
    gen = torch.Generator().manual_seed(1)
    mu = torch.log_softmax(logits + torch.randn(logits.shape, generator=gen, dtype=F64), -1)
    ids = torch.arange(12).expand(3, 5, 12)
    rollout = mu.gather(-1, labels[..., None]).squeeze(-1)
    g, _ = _grad(logits, labels, adv, mask, ids, mu, rollout)
    expected = -adv[..., None] * (torch.nn.functional.one_hot(labels, 12).double() - mu.exp())
    assert_close(g, expected, **tol("dlogits", F64), name="dlogits")


def test_truncation_at_zero_and_infinity_is_plain_importance_sampling():
    """f(r) = r: alpha = 1 and q f(r) = p, so every weight is 0 and the loss is -A sg(p_y / q_y) log p_y."""
    logits, labels, adv, mask = _one_batch()
    gen = torch.Generator().manual_seed(2)
    mu = torch.log_softmax(logits + torch.randn(logits.shape, generator=gen, dtype=F64) * 0.3, -1)
    ids = mu.topk(5, -1).indices
    rollout = mu.gather(-1, labels[..., None]).squeeze(-1)
    rc = RolloutCorrection(is_level="token", is_threshold=(0.0, math.inf), is_mode="truncate")
    g, out = _grad(logits, labels, adv, mask, ids, mu.gather(-1, ids), rollout, rc)
    logp = torch.log_softmax(logits, -1)
    r_y = torch.exp(logp.gather(-1, labels[..., None]).squeeze(-1) - rollout)
    expected = -(adv * r_y)[..., None] * (torch.nn.functional.one_hot(labels, 12).double() - logp.exp())
    assert_close(g, expected, **tol("dlogits", F64), name="dlogits")
    assert float(out.metrics["actor/score_centering_weight_abs_mean"]) == approx(0.0, "by_hand")


def test_score_centering_inputs_are_checked():
    logits, labels, adv, mask = _one_batch()
    ids = torch.arange(3).expand(3, 5, 3)
    lq = torch.full((3, 5, 3), -3.0)
    config = PolicyLossConfig(loss_type="score_centering")
    with pytest.raises(ValueError, match="sampler_topk_ids: loss_type='score_centering' needs"):
        rlkernels.decoupled_ppo_loss(logits, labels, adv, mask, rollout_logprobs=torch.zeros(3, 5), config=config)
    with pytest.raises(ValueError, match="needs the sampler's top-k"):
        rlkernels.decoupled_ppo_loss(logits, labels, adv, mask, rollout_logprobs=torch.zeros(3, 5), config=config,
                                     sampler_logits=logits)
    with pytest.raises(ValueError, match="rollout_logprobs: expected a tensor since loss_type='score_centering'"):
        rlkernels.decoupled_ppo_loss(logits, labels, adv, mask, config=config, sampler_topk_ids=ids,
                                     sampler_topk_logprobs=lq)
    with pytest.raises(ValueError, match="is_weights: loss_type='score_centering' takes its weights"):
        rlkernels.decoupled_ppo_loss(logits, labels, adv, mask, rollout_logprobs=torch.zeros(3, 5), config=config,
                                     sampler_topk_ids=ids, sampler_topk_logprobs=lq, is_weights=torch.ones(3, 5))
    with pytest.raises(ValueError, match="is_level='sequence' has no per-token f"):
        PolicyLossConfig(loss_type="score_centering", rollout_correction=RolloutCorrection.seq_tis())
