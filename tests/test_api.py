"""Behaviour users rely on: empty batches, untouched inputs, no host sync, the secondary entry points."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import rlkernels
from rlkernels import PolicyLossConfig, RolloutCorrection, reference
from rlkernels.config import LOSS_AGG_MODES

from .cases import F64, MODES, approx, assert_close, batches, configs, make_batch, scaled, tol

ALL_CORRECTIONS = [None, RolloutCorrection.token_tis(), RolloutCorrection.seq_mis(),
                   RolloutCorrection.geo_rs_token_tis(), RolloutCorrection.icepop(), RolloutCorrection.k3_rs(),
                   RolloutCorrection.seq_tis(is_batch_normalize=True)]


def _empty_cases():
    V = 7
    no_tokens = (torch.zeros(0, V), torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=torch.bool))
    yield ("N=0 packed", *no_tokens, torch.tensor([0]))
    yield ("N=0 no sequences", *no_tokens, torch.tensor([0, 0, 0]))
    yield ("all masked padded", torch.randn(2, 3, V), torch.randint(0, V, (2, 3)), torch.zeros(2, 3, dtype=torch.bool),
           None)
    yield ("B=0 padded", torch.zeros(0, 4, V), torch.zeros(0, 4, dtype=torch.long), torch.zeros(0, 4, dtype=torch.bool),
           None)
    mask = torch.tensor([False, False, True, True, False])
    yield "empty sequences", torch.randn(5, V), torch.randint(0, V, (5,)), mask, torch.tensor([0, 0, 2, 5, 5])


@pytest.mark.parametrize("case", list(_empty_cases()), ids=lambda c: c[0])
@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
@pytest.mark.parametrize("rc", ALL_CORRECTIONS, ids=str)
def test_empty_and_all_masked_give_zero_loss_and_gradient(case, mode, rc):
    _, logits, labels, mask, cu = case
    logits = logits.clone().requires_grad_(True)
    shape = labels.shape
    # a rejection that removes everything: Geo-RS with a bound nothing satisfies exactly
    out = rlkernels.decoupled_ppo_loss(
        logits, labels, torch.randn(shape), mask, old_logprobs=-torch.rand(shape), rollout_logprobs=-torch.rand(shape),
        ref_logprobs=-torch.rand(shape), cu_seqlens=cu, loss_agg_mode=mode, rollout_correction=rc, kl_coef=0.1,
        entropy_coeff=0.01,
    )
    valid_left = bool(out.mask.any())
    if not valid_left:
        assert out.loss.item() == 0.0
    (g,) = torch.autograd.grad(out.loss, logits)
    assert torch.isfinite(g).all()
    if not mask.any():
        assert torch.count_nonzero(g) == 0
    for name, value in out.metrics.items():
        assert torch.isfinite(value), name


def test_rejecting_everything_gives_zero_not_nan():
    # verl returns NaN here (0/0); SPEC §7: nothing to average -> 0
    batch = make_batch("padded", [4, 4], 5, dtype=torch.float32)
    logits = batch.logits.requires_grad_(True)
    old = batch.old_logprobs  # every token's ratio is e, far outside the bounds
    out = rlkernels.decoupled_ppo_loss(logits, batch.labels, batch.advantages, batch.response_mask,
                                       old_logprobs=old, rollout_logprobs=old - 1.0,
                                       rollout_correction=RolloutCorrection.geo_rs(bounds=(0.999, 1.001)))
    assert not out.mask.any() and out.loss.item() == 0.0
    assert out.metrics["rollout_corr/rollout_rs_masked_fraction"].item() == 1.0
    out.loss.backward()
    assert torch.count_nonzero(logits.grad) == 0


def test_icepop_zeroing_every_weight_gives_finite_ess():
    # verl raises ZeroDivisionError in its ESS here; this project reports 0 (docs/spec.md, SPEC §8)
    old = torch.zeros(1, 3)
    out = rlkernels.rollout_correction(old, old - 5.0, torch.ones(1, 3), config=RolloutCorrection.icepop())
    assert out.weights.abs().sum().item() == 0.0
    assert out.metrics["rollout_corr/rollout_is_eff_sample_size"].item() == 0.0


@settings(max_examples=scaled(40))
@given(batch=batches(dtype=torch.float32), mode=st.sampled_from(MODES), data=st.data())
def test_inputs_are_never_modified(batch, mode, data):
    config = data.draw(configs(mode))
    kw = batch.kwargs(mode)
    tensors = [batch.logits, batch.labels, batch.advantages, batch.response_mask]
    tensors += [v for v in kw.values() if v is not None]
    before = [(t.clone(), t._version) for t in tensors]
    logits = batch.logits.requires_grad_(True)
    out = rlkernels.decoupled_ppo_loss(logits, batch.labels, batch.advantages, batch.response_mask, config=config, **kw)
    out.loss.backward()
    for t, (copy, version) in zip(tensors, before):
        same_nan = torch.isnan(copy).any() and torch.equal(torch.isnan(t), torch.isnan(copy))
        assert torch.equal(t.detach(), copy) or same_nan
        assert t._version == version


def test_no_host_sync_with_validation_off(monkeypatch):
    """validate=False must not read device memory from Python: every sync path raises here."""
    batch = make_batch("padded", [4] * 3, 11, dtype=torch.float32, mask_p=0.7)
    logits = batch.logits.requires_grad_(True)
    old = batch.old_logprobs
    args = (logits, batch.labels, batch.advantages, batch.response_mask)

    import sys

    def forbidden(*_a, **_k):
        # the temperature travels as a 0-d CPU tensor by design (see rlkernels/ops/vocab.py) and is
        # read on the host by host_float(); every other read is a sync on a GPU
        if sys._getframe(1).f_code.co_name == "host_float":
            return host_read(*_a)
        raise AssertionError("host synchronisation on the hot path")

    host_read = torch.Tensor.__float__

    for name in ("item", "tolist", "__bool__", "__float__", "__int__", "nonzero", "cpu", "numpy"):
        monkeypatch.setattr(torch.Tensor, name, forbidden)
    for rc in ALL_CORRECTIONS:
        for mode in LOSS_AGG_MODES:
            out = rlkernels.decoupled_ppo_loss(*args, old_logprobs=old, rollout_logprobs=old - 0.1, ref_logprobs=old,
                                               rollout_correction=rc, loss_agg_mode=mode, kl_coef=0.1,
                                               entropy_coeff=0.01, validate=False)
            torch.autograd.grad(out.loss, logits)
    monkeypatch.undo()


def test_metrics_to_floats():
    old = -torch.rand(2, 5)
    out = rlkernels.rollout_correction(old, old - 0.1, torch.ones(2, 5), config=RolloutCorrection.seq_mis())
    floats = rlkernels.metrics_to_floats(out.metrics)
    assert set(floats) == set(out.metrics)
    assert all(isinstance(v, float) for v in floats.values())
    assert floats["rollout_corr/kl"] == approx(-0.1, "fp32_difference", torch.float32)  # mean(l_mu - l_train)
    assert rlkernels.metrics_to_floats({}) == {}


def test_metrics_to_floats_takes_what_a_user_passes_and_names_what_it_refuses():
    """Numbers pass through, one-element tensors of any real dtype are read (in the dict's order); anything else is
    refused by name, never with PyTorch's internal messages."""
    mixed = {"a": torch.tensor(2), "b": 0.5, "c": torch.tensor([True]), "d": torch.tensor(1.5, dtype=torch.float64)}
    assert list(rlkernels.metrics_to_floats(mixed).items()) == [("a", 2.0), ("b", 0.5), ("c", 1.0), ("d", 1.5)]
    cases = [([torch.tensor(1.0)], TypeError, "metrics: expected a dict"),
             ({"x": torch.ones(3)}, ValueError, r"metrics\['x'\]: expected a 0-d"),
             ({"x": torch.tensor(1j)}, ValueError, r"metrics\['x'\]: expected a 0-d \(one-element\) real"),
             ({"x": "0.5"}, TypeError, r"metrics\['x'\]: expected a 0-d tensor or a number"),
             ({"x": None}, TypeError, r"metrics\['x'\]"), ({"x": True}, TypeError, r"metrics\['x'\]")]
    for metrics, exc, message in cases:
        with pytest.raises(exc, match=message):
            rlkernels.metrics_to_floats(metrics)


@settings(max_examples=scaled(60))
@given(batch=batches(), mode=st.sampled_from(MODES), data=st.data())
def test_policy_loss_matches_reference(batch, mode, data):
    config = data.draw(configs(mode))
    lp_ref, ent_ref, _ = reference.token_stats(batch.logits, batch.labels, temperature=config.temperature)
    lp = lp_ref.detach().clone().requires_grad_(True)
    ent = ent_ref.detach().clone().requires_grad_(True) if config.needs_entropy else None
    kw = batch.kwargs(mode)
    out = rlkernels.policy_loss(lp, batch.advantages, batch.response_mask, entropy=ent, config=config, **kw)
    lp2 = lp_ref.detach().clone().requires_grad_(True)
    ent2 = ent_ref.detach().clone().requires_grad_(True) if ent is not None else None
    exp = reference.policy_loss(lp2, batch.advantages, batch.response_mask, entropy=ent2, config=config, **kw)
    scale = max(1.0, abs(float(exp.loss.detach())))
    assert_close(out.loss, exp.loss, **tol("value", torch.float64, scale=scale), name="loss")
    for name in exp.metrics:
        assert_close(out.metrics[name], exp.metrics[name], **tol("identity", torch.float64), name=name)
    assert torch.equal(out.mask, exp.mask)
    inputs = [lp] + ([ent] if ent is not None else [])
    grads = torch.autograd.grad(out.loss, inputs, allow_unused=True)
    ref_grads = torch.autograd.grad(exp.loss, [lp2] + ([ent2] if ent2 is not None else []), allow_unused=True)
    for g, rg in zip(grads, ref_grads):
        g = torch.zeros_like(lp) if g is None else g
        rg = torch.zeros_like(lp) if rg is None else rg
        assert_close(g, rg, **tol("identity.small", torch.float64), name="dloss/dstat")


def test_policy_loss_equals_decoupled_ppo_loss_on_the_same_logprobs():
    batch = make_batch("padded", [5] * 3, 13, dtype=torch.float64, mask_p=0.8)
    logits = batch.logits.requires_grad_(True)
    labels, adv, mask = batch.labels, batch.advantages, batch.response_mask
    old, roll = batch.old_logprobs, batch.rollout_logprobs
    cfg = PolicyLossConfig(rollout_correction=RolloutCorrection.geo_rs_token_tis(bounds=(0.5, 2.0)), entropy_coeff=0.01)
    fused = rlkernels.decoupled_ppo_loss(logits, labels, adv, mask, old_logprobs=old, rollout_logprobs=roll, config=cfg)
    stats = rlkernels.token_logprobs(logits, labels, compute_entropy=True)
    split = rlkernels.policy_loss(stats.logprobs, adv, mask, entropy=stats.entropy, old_logprobs=old,
                                  rollout_logprobs=roll, config=cfg)
    assert_close(fused.loss, split.loss, **tol("same_path", torch.float64), name="loss")
    g1, = torch.autograd.grad(fused.loss, logits)
    g2, = torch.autograd.grad(split.loss, logits)
    assert_close(g1, g2, **tol("same_path", torch.float64), name="dlogits")


@settings(max_examples=scaled(60))
@given(batch=batches(), temperature=st.sampled_from([1.0, 0.6, 1.7]), data=st.data())
def test_token_logprobs_matches_reference(batch, temperature, data):
    logits = batch.logits.clone().requires_grad_(True)
    stats = rlkernels.token_logprobs(logits, batch.labels, temperature=temperature, compute_entropy=True,
                                     compute_sum_pi_squared=True)
    ref_logits = batch.logits.clone().requires_grad_(True)
    r_lp, r_ent, r_s2 = reference.token_stats(ref_logits, batch.labels, temperature=temperature)
    assert_close(stats.logprobs, r_lp, **tol("value", torch.float64), name="logprobs")
    assert_close(stats.entropy, r_ent, **tol("value", torch.float64), name="entropy")
    assert_close(stats.sum_pi_squared, r_s2, **tol("identity.small", torch.float64), name="sum_pi_squared")
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2**31 - 1)))
    c = torch.randn(batch.labels.shape, generator=gen, dtype=torch.float64)
    e = torch.randn(batch.labels.shape, generator=gen, dtype=torch.float64)
    (g,) = torch.autograd.grad((stats.logprobs * c).sum() + (stats.entropy * e).sum(), logits)
    (rg,) = torch.autograd.grad((r_lp * c).sum() + (r_ent * e).sum(), ref_logits)
    scale = max(1e-3, float(rg.abs().max()) if rg.numel() else 1.0)
    assert_close(g, rg, **tol("identity", torch.float64, scale=scale), name="dlogits")


@settings(max_examples=scaled(60))
@given(batch=batches(), rc=st.sampled_from(ALL_CORRECTIONS[1:]))
def test_rollout_correction_matches_reference(batch, rc):
    out = rlkernels.rollout_correction(batch.old_logprobs, batch.rollout_logprobs, batch.response_mask,
                                       cu_seqlens=batch.cu_seqlens, config=rc)
    cfg = PolicyLossConfig(rollout_correction=rc)
    exp = reference.policy_loss(batch.old_logprobs, torch.zeros_like(batch.old_logprobs), batch.response_mask,
                                old_logprobs=batch.old_logprobs, rollout_logprobs=batch.rollout_logprobs,
                                cu_seqlens=batch.cu_seqlens, config=cfg)
    assert torch.equal(out.mask, exp.mask)
    if rc.is_level is not None:
        assert_close(out.weights, exp.is_weights, **tol("identity.small", torch.float64), name="weights")
    for name, value in exp.metrics.items():
        if name.startswith("rollout_corr/"):
            assert_close(out.metrics[name], value, **tol("identity", torch.float64), name=name)


def test_inplace_backward_bumps_version_and_matches():
    batch = make_batch("padded", [3, 3], 9, dtype=torch.float32)
    base, labels, adv, mask = batch.logits, batch.labels, batch.advantages, batch.response_mask
    a = base.clone().requires_grad_(True)
    out = rlkernels.decoupled_ppo_loss(a, labels, adv, mask)
    (expected,) = torch.autograd.grad(out.loss, a)

    leaf = base.clone().requires_grad_(True)
    logits = leaf * 1.0  # a non-leaf buffer the caller allows us to overwrite
    out = rlkernels.decoupled_ppo_loss(logits, labels, adv, mask, inplace_backward=True)
    version = logits._version
    out.loss.backward()
    assert logits._version > version
    assert_close(leaf.grad, expected, **tol("reordered.dlogits"), name="dlogits")

    # another op that saved the logits now fails loudly instead of using the overwritten values
    leaf = base.clone().requires_grad_(True)
    logits = leaf * 1.0
    other = (logits**2).sum()  # pow saves its input
    out = rlkernels.decoupled_ppo_loss(logits, labels, adv, mask, inplace_backward=True)
    out.loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        other.backward()


def test_overrides_and_config_compose():
    batch = make_batch("padded", [3, 3], 5, dtype=torch.float64)
    args = (batch.logits, batch.labels, batch.advantages, batch.response_mask)
    a = rlkernels.decoupled_ppo_loss(*args, config=PolicyLossConfig(temperature=0.5, loss_agg_mode="token-sum"))
    b = rlkernels.decoupled_ppo_loss(*args, config=PolicyLossConfig(loss_agg_mode="token-sum"), temperature=0.5)
    assert torch.equal(a.loss, b.loss) and torch.equal(a.logprobs, b.logprobs)


def test_output_shapes_and_dtypes():
    for batch in [make_batch("padded", [3, 3], 7, dtype=torch.bfloat16),
                  make_batch("packed", [2, 4], 7, dtype=torch.float16)]:
        shape = batch.labels.shape
        # a float 0/1 mask: the output mask is bool all the same
        out = rlkernels.decoupled_ppo_loss(batch.logits, batch.labels, batch.advantages, batch.response_mask.float(),
                                           cu_seqlens=batch.cu_seqlens, old_logprobs=batch.old_logprobs,
                                           rollout_logprobs=batch.rollout_logprobs,
                                           rollout_correction=RolloutCorrection.token_tis(), compute_entropy=True)
        assert out.loss.shape == () and out.loss.dtype == torch.float32
        assert out.logprobs.shape == shape and out.logprobs.dtype == torch.float32 and not out.logprobs.requires_grad
        assert out.entropy.shape == shape and out.is_weights.shape == shape
        assert out.mask.shape == shape and out.mask.dtype == torch.bool
        assert all(v.shape == () for v in out.metrics.values())
        assert math.isfinite(out.loss.item())


@pytest.mark.parametrize("layout", ["padded", "packed"])
@pytest.mark.parametrize("column", [False, True])
def test_per_sequence_advantages_broadcast_to_their_tokens(layout, column):
    """GRPO-style outcome advantages, one per sequence ([S] or [S, 1]), give exactly the loss and
    gradient of the same values written on every token of the sequence."""
    lengths = [4, 4, 4] if layout == "padded" else [3, 0, 5, 2]
    batch = make_batch(layout, lengths, 11, seed=5, mask_p=0.8)
    S = len(lengths)
    per_seq = torch.randn(S, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    seq_of_token = (torch.arange(S).repeat_interleave(4) if layout == "padded"
                    else torch.arange(S).repeat_interleave(torch.tensor(lengths)))
    per_token = per_seq[seq_of_token].reshape(batch.labels.shape)
    kw = batch.kwargs("decoupled")
    outs = []
    for adv in (per_token, per_seq[:, None] if column else per_seq):
        logits = batch.logits.clone().requires_grad_(True)
        out = rlkernels.decoupled_ppo_loss(logits, batch.labels, adv, batch.response_mask, **kw)
        outs.append((out.loss.detach(), torch.autograd.grad(out.loss, logits)[0]))
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])


def test_advantages_of_neither_shape_name_both_options():
    batch = make_batch("packed", [3, 2], 7, seed=2)
    with pytest.raises(ValueError, match=r"advantages: expected shape \(5,\) \(per token\) or \(2,\) / \(2, 1\)"):
        rlkernels.decoupled_ppo_loss(batch.logits, batch.labels, torch.zeros(4, dtype=torch.float64),
                                     batch.response_mask, cu_seqlens=batch.cu_seqlens)


def test_given_is_weights_multiply_the_policy_term_and_exclude_computed_ones():
    """is_weights=: the policy term of every token scaled by the trainer's weight (here checked as the
    loss with weights 2 being twice the loss without, for token-sum), and refused beside an IS level."""
    batch = make_batch("packed", [3, 4], 9, seed=4)
    kw = dict(batch.kwargs("decoupled"), loss_agg_mode="token-sum", clip_ratio_c=None)
    args = (batch.logits, batch.labels, batch.advantages, batch.response_mask)
    plain = rlkernels.decoupled_ppo_loss(*args, **kw)
    doubled = rlkernels.decoupled_ppo_loss(*args, is_weights=torch.full_like(batch.advantages, 2.0), **kw)
    assert_close(doubled.metrics["actor/pg_loss"], 2 * plain.metrics["actor/pg_loss"],
                 **tol("is_weights.doubled", F64))
    with pytest.raises(ValueError, match="is_weights: given while rollout_correction computes IS weights too"):
        rlkernels.decoupled_ppo_loss(*args, is_weights=torch.ones_like(batch.advantages),
                                     rollout_correction=RolloutCorrection.token_tis(), **kw)


def test_token_shaped_advantages_are_per_token_even_when_they_could_be_per_sequence():
    """[S] with S == N (an empty sequence makes it so) is read per token; [S, 1] is per sequence."""
    batch = make_batch("packed", [0, 2], 7, seed=6)
    adv = torch.tensor([5.0, 1.0], dtype=torch.float64)
    grads = []
    for a in (adv, adv[:, None], torch.tensor([1.0, 1.0], dtype=torch.float64)):
        logits = batch.logits.clone().requires_grad_(True)
        out = rlkernels.decoupled_ppo_loss(logits, batch.labels, a, batch.response_mask, cu_seqlens=batch.cu_seqlens,
                                           loss_agg_mode="token-sum")
        grads.append(torch.autograd.grad(out.loss, logits)[0])
    assert not torch.equal(grads[0], grads[1])  # per token [5, 1] vs the second sequence's 1 on both tokens
    assert torch.equal(grads[1], grads[2])
