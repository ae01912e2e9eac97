"""Hypothesis invariants that hold for any input, on the default backend."""

import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

import rlkernels
from rlkernels import RolloutCorrection
from rlkernels.config import IS_LEVELS

from ..cases import MODES, assert_close, batches, configs, scaled, tol


def run(batch, mode, config, logits=None, **kw):
    args = batch.kwargs(mode)
    args.update(kw)
    logits = batch.logits if logits is None else logits
    return rlkernels.decoupled_ppo_loss(logits, batch.labels, batch.advantages, batch.response_mask, config=config,
                                        **args)


def _close(a, b, name, quantity="identity"):
    """float64 identities: TOL[quantity, float64], atol scaled by max(1, max |b|)."""
    scale = max(1.0, float(b.detach().abs().max()) if b.numel() else 1.0)
    assert_close(a, b, **tol(quantity, torch.float64, scale=scale), name=name)


@settings(max_examples=scaled(60))
@given(batch=batches(), mode=st.sampled_from(MODES), shift=st.sampled_from([-37.5, 3.0, 1000.0]), data=st.data())
def test_row_shift_changes_nothing(batch, mode, shift, data):
    config = data.draw(configs(mode))
    rows = batch.logits[..., :1].numel()
    shifts = shift * torch.arange(1, rows + 1, dtype=torch.float64).reshape(batch.logits.shape[:-1] + (1,))
    a, b = run(batch, mode, config), run(batch, mode, config, logits=batch.logits + shifts)
    # a shift of up to ~1e4 moves float64 rounding by 1e4 * 2^-53 ~ 1e-12 per logit
    _close(b.loss, a.loss, "loss", "identity.shift")
    _close(b.logprobs, a.logprobs, "logprobs", "identity.shift")
    assert torch.equal(a.mask, b.mask)


@settings(max_examples=scaled(40))
@given(batch=batches(), mode=st.sampled_from(MODES), temperature=st.sampled_from([0.5, 1.3]), data=st.data())
def test_temperature_equals_scaled_logits(batch, mode, temperature, data):
    config = data.draw(configs(mode, temperature=temperature))
    a = run(batch, mode, config)
    b = run(batch, mode, config.with_overrides(temperature=1.0), logits=batch.logits / temperature)
    _close(a.loss, b.loss, "loss")
    _close(a.logprobs, b.logprobs, "logprobs")


@settings(max_examples=scaled(40))
@given(batch=batches(), level=st.sampled_from([lv for lv in IS_LEVELS if lv is not None]),
       C=st.sampled_from([1.0, 2.0]))
def test_weights_are_one_when_rollout_equals_old(batch, level, C):
    rc = RolloutCorrection(is_level=level, is_threshold=C)
    out = rlkernels.decoupled_ppo_loss(batch.logits, batch.labels, batch.advantages, batch.response_mask,
                                       old_logprobs=batch.old_logprobs, rollout_logprobs=batch.old_logprobs,
                                       cu_seqlens=batch.cu_seqlens, rollout_correction=rc)
    m = out.mask
    assert torch.equal(out.is_weights[m], torch.ones_like(out.is_weights[m]))
    assert torch.count_nonzero(out.is_weights[~m]) == 0


@settings(max_examples=scaled(40))
@given(batch=batches(layout="padded"), mode=st.sampled_from(MODES), data=st.data())
def test_permuting_sequences_permutes_outputs(batch, mode, data):
    config = data.draw(configs(mode))
    perm = torch.tensor(data.draw(st.permutations(range(batch.labels.shape[0]))), dtype=torch.long)
    a = run(batch, mode, config)
    p = lambda t: None if t is None else t[perm]  # noqa: E731
    kw = {k: p(v) for k, v in batch.kwargs(mode).items() if k != "cu_seqlens"}
    b = rlkernels.decoupled_ppo_loss(batch.logits[perm], batch.labels[perm], batch.advantages[perm],
                                     batch.response_mask[perm], config=config, **kw)
    _close(b.loss, a.loss, "loss")
    _close(b.logprobs, a.logprobs[perm], "logprobs")
    assert torch.equal(b.mask, a.mask[perm])
    for name in a.metrics:
        _close(b.metrics[name], a.metrics[name], name)


@settings(max_examples=scaled(60))
@given(batch=batches(layout="padded"), mode=st.sampled_from(MODES), data=st.data())
def test_padded_equals_packed(batch, mode, data):
    config = data.draw(configs(mode))
    if config.loss_agg_mode == "seq-mean-token-sum-norm" and config.loss_scale_factor is None:
        config = config.with_overrides(loss_scale_factor=float(batch.labels.shape[1]))  # K defaults differ by layout
    B, T = batch.labels.shape
    a = run(batch, mode, config)
    flat = lambda t: None if t is None else t.reshape(B * T, *t.shape[2:])  # noqa: E731
    kw = {k: flat(v) for k, v in batch.kwargs(mode).items() if k != "cu_seqlens"}
    cu = torch.arange(0, B * T + 1, T, dtype=torch.int64)
    b = rlkernels.decoupled_ppo_loss(flat(batch.logits), flat(batch.labels), flat(batch.advantages),
                                     flat(batch.response_mask), cu_seqlens=cu, config=config, **kw)
    _close(b.loss, a.loss, "loss")
    assert torch.equal(b.mask, flat(a.mask))
    for name in a.metrics:
        _close(b.metrics[name], a.metrics[name], name)
    la = batch.logits.clone().requires_grad_(True)
    lb = flat(batch.logits).clone().requires_grad_(True)
    ga, = torch.autograd.grad(run(batch, mode, config, logits=la).loss, la)
    out_b = rlkernels.decoupled_ppo_loss(lb, flat(batch.labels), flat(batch.advantages), flat(batch.response_mask),
                                         cu_seqlens=cu, config=config, **kw)
    gb, = torch.autograd.grad(out_b.loss, lb)
    _close(gb, flat(ga), "dlogits")


@settings(max_examples=scaled(40))
@given(batch=batches(layout="packed", allow_empty=False), extra=st.integers(1, 3), data=st.data())
def test_fully_masked_sequences_do_not_change_token_mean(batch, extra, data):
    config = data.draw(configs("decoupled", loss_agg_mode="token-mean", entropy_agg_mode=None))
    # GMPO and LUSPO average over every sequence, empty ones included (verl's / TRL's): not invariant
    assume(config.loss_type not in ("geo_mean", "luspo"))
    a = run(batch, "decoupled", config)
    V, N = batch.logits.shape[-1], batch.labels.shape[0]
    pad = 3 * extra
    cat = lambda t, fill: torch.cat([t, torch.full((pad,) + t.shape[1:], fill, dtype=t.dtype)])  # noqa: E731
    cu = torch.cat([batch.cu_seqlens.long(), N + 3 * torch.arange(1, extra + 1)])
    b = rlkernels.decoupled_ppo_loss(
        cat(batch.logits, 0.5), cat(batch.labels, 1 % V), cat(batch.advantages, 1.0), cat(batch.response_mask, False),
        old_logprobs=cat(batch.old_logprobs, -1.0), rollout_logprobs=cat(batch.rollout_logprobs, -1.0),
        ref_logprobs=cat(batch.ref_logprobs, -1.0), cu_seqlens=cu, config=config)
    _close(b.loss, a.loss, "loss")


@settings(max_examples=scaled(40))
@given(batch=batches(), mode=st.sampled_from([m for m in MODES if m != "on-policy"]), data=st.data())
def test_masked_tokens_get_zero_gradient_and_weights_stay_below_C(batch, mode, data):
    config = data.draw(configs(mode))
    logits = batch.logits.clone().requires_grad_(True)
    out = run(batch, mode, config, logits=logits)
    (g,) = torch.autograd.grad(out.loss, logits)
    assert torch.count_nonzero(g[~batch.response_mask]) == 0
    rc = config.rollout_correction
    if out.is_weights is not None and not rc.is_icepop and not rc.is_batch_normalize:
        assert bool((out.is_weights <= rc.is_range[1]).all())
