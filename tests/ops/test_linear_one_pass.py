"""The fused-linear path's one-pass form (SPEC §2.1): where every token's coefficients are functions of its own
statistics, `linear_decoupled_ppo_loss` forms the gradient while each chunk's logits are in hand (three GEMMs of
the loss's rows instead of four). Both forms against the float64 oracle over the option product, against each
other (bitwise where they accumulate in the same order), which configurations take which form, the GEMMs each
runs, and autograd as PyTorch users expect it: accumulation, .grad already set, tied weights, retain_graph,
scaled losses, no_grad.
"""

import contextlib
from unittest import mock

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import rlkernels
import rlkernels.ops.linear as linear_module
from rlkernels import PolicyLossConfig, RolloutCorrection

from ..cases import BF16, F32, F64, assert_close, make_batch, problems, scaled, tol
from .test_linear import BUDGETS, _compare, _oracle, _ours, make_head


@contextlib.contextmanager
def two_pass():
    """Force the two-pass form (what a blocked configuration runs)."""
    with mock.patch.object(rlkernels.stage, "forward_gradient_blocker", lambda batch, config: "forced"):
        yield


def _inputs(N=96, V=512, H=24, seed=0, dtype=F32, mask_p=0.5):
    batch = make_batch("packed", [40, 0, 30, 26], V, dtype=F32, seed=seed, mask_p=mask_p)
    hidden, weight, b = make_head(torch.Generator().manual_seed(seed), (N,), V, H, dtype, bias=True)
    return batch, hidden, weight, b


def _run(batch, hidden, weight, bias, mode="decoupled", **kw):
    leaves = [t.detach().clone().requires_grad_(True) for t in (hidden, weight, bias)]
    out = rlkernels.linear_decoupled_ppo_loss(leaves[0], leaves[1], batch.labels, batch.advantages,
                                              batch.response_mask, bias=leaves[2], **batch.kwargs(mode), **kw)
    out.loss.backward()
    return out, [t.grad for t in leaves]


# -- which configurations take which form ---------------------------------------------------------------------

ONE_PASS = [
    dict(),
    dict(rollout_correction=RolloutCorrection.seq_mis()),
    dict(rollout_correction=RolloutCorrection.geo_rs_token_tis(), entropy_coeff=0.01),
    dict(rollout_correction=RolloutCorrection(is_level="sequence", is_threshold=2.0, is_batch_normalize=True)),
    dict(loss_type="cispo"), dict(loss_type="sapo"), dict(loss_type="ipo"), dict(loss_type="dppo_tv"),
    dict(kl_coef=0.1), dict(log_ratio_sq_coef=1e-3), dict(vaco_threshold=0.01),
    dict(loss_agg_mode="seq-mean-token-mean"), dict(loss_agg_mode="seq-mean-token-sum-norm"),
]
TWO_PASS = [
    (dict(loss_type="gspo"), "per-sequence sums"),
    (dict(loss_type="geo_mean"), "per-sequence sums"),
    (dict(ratio_level="sequence"), "ratio_level"),
    (dict(loss_type="clip_cov"), "whole batch"),
    (dict(off_policy_mask_threshold=0.1), "off_policy_mask_threshold"),
    (dict(m2po_threshold=0.04), "m2po"),
]


@pytest.mark.parametrize("options", ONE_PASS, ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()) or "ppo")
def test_per_token_configurations_take_the_one_pass_form(options):
    batch, hidden, weight, b = _inputs()
    out, _ = _run(batch, hidden, weight, b, **options)
    assert out.path == "linear_one_pass"


@pytest.mark.parametrize("options, reason", TWO_PASS)
def test_sequence_statistics_of_the_current_policy_keep_two_passes(options, reason):
    batch, hidden, weight, b = _inputs()
    config = PolicyLossConfig(**options)
    prepared_mode = "decoupled"
    out, _ = _run(batch, hidden, weight, b, prepared_mode, config=config)
    assert out.path == "linear_two_pass"
    from rlkernels.inputs import Arguments, prepare_loss

    args = Arguments(labels=batch.labels, advantages=batch.advantages, response_mask=batch.response_mask,
                     old_logprobs=batch.old_logprobs, rollout_logprobs=batch.rollout_logprobs,
                     cu_seqlens=batch.cu_seqlens)
    prepared = prepare_loss("hidden", tuple(hidden.shape[:-1]), weight.shape[0], hidden.device, args, config)
    assert reason in rlkernels.stage.forward_gradient_blocker(prepared, config)


def test_bypass_mode_with_a_correction_keeps_two_passes_and_without_one_does_not():
    batch, hidden, weight, b = _inputs()
    corrected, _ = _run(batch, hidden, weight, b, "bypass", rollout_correction=RolloutCorrection.token_tis())
    plain, _ = _run(batch, hidden, weight, b, "bypass")
    on_policy, _ = _run(batch, hidden, weight, b, "on-policy")
    assert (corrected.path, plain.path, on_policy.path) == ("linear_two_pass", "linear_one_pass", "linear_one_pass")


def test_no_gradient_means_no_gradient_work(monkeypatch):
    batch, hidden, weight, b = _inputs()
    calls = []
    monkeypatch.setattr(linear_module, "_accumulate_weight_grad", lambda *a: calls.append("dW"))
    with torch.no_grad():
        out = rlkernels.linear_decoupled_ppo_loss(hidden.requires_grad_(True), weight, batch.labels, batch.advantages,
                                                  batch.response_mask, bias=b, **batch.kwargs("decoupled"))
    frozen = rlkernels.linear_decoupled_ppo_loss(hidden.detach(), weight, batch.labels, batch.advantages,
                                                 batch.response_mask, bias=b, **batch.kwargs("decoupled"))
    assert out.path == frozen.path == "linear_two_pass" and calls == []
    assert not out.loss.requires_grad and not frozen.loss.requires_grad


def test_compiled_regions_take_the_two_pass_custom_ops():
    batch, hidden, weight, b = _inputs(seed=4)
    config = PolicyLossConfig(rollout_correction=RolloutCorrection.seq_mis(), entropy_coeff=0.01, validate=False)
    paths = []

    def step(h, w, bias):
        out = rlkernels.linear_decoupled_ppo_loss(h, w, batch.labels, batch.advantages, batch.response_mask,
                                                  bias=bias, config=config, **batch.kwargs("decoupled"))
        paths.append(out.path)
        return out.loss

    leaves = [t.detach().clone().requires_grad_(True) for t in (hidden, weight, b)]
    torch.compile(step, fullgraph=True, backend="aot_eager")(*leaves).backward()
    eager = [t.detach().clone().requires_grad_(True) for t in (hidden, weight, b)]
    step(*eager).backward()
    assert paths == ["linear_two_pass", "linear_one_pass"]
    for got, want, name in zip(leaves, eager, ("hidden", "weight", "bias")):
        assert_close(got.grad, want.grad, **tol("reordered.dlogits", F32), name=name)
    torch._dynamo.reset()


# -- parity ---------------------------------------------------------------------------------------------------


@settings(max_examples=scaled(80))
@given(problem=problems(dtype=F64), H=st.integers(1, 9), bias=st.booleans(), budget=st.sampled_from(BUDGETS),
       seed=st.integers(0, 2**31 - 1))
def test_both_forms_match_the_oracle_float64(problem, H, bias, budget, seed):
    batch, mode, config = problem
    hidden, weight, b = make_head(torch.Generator().manual_seed(seed), tuple(batch.labels.shape),
                                  batch.logits.shape[-1], H, F64, bias=bias)
    expected, ref_grads = _oracle(hidden, weight, b, batch, mode, config)
    one, one_grads = _ours(hidden, weight, b, batch, mode, config, memory_budget_bytes=budget)
    with two_pass():
        two, two_grads = _ours(hidden, weight, b, batch, mode, config, memory_budget_bytes=budget)
    assert two.path == "linear_two_pass"
    _compare(one, expected, one_grads, ref_grads, F64, F64)
    _compare(two, expected, two_grads, ref_grads, F64, F64)


@settings(max_examples=scaled(40))
@given(problem=problems(dtype=F32), H=st.integers(1, 9), budget=st.sampled_from(BUDGETS),
       seed=st.integers(0, 2**31 - 1))
def test_both_forms_match_the_oracle_float32(problem, H, budget, seed):
    batch, mode, config = problem
    hidden, weight, b = make_head(torch.Generator().manual_seed(seed), tuple(batch.labels.shape),
                                  batch.logits.shape[-1], H, F32, bias=True)
    expected, ref_grads = _oracle(hidden, weight, b, batch, mode, config)
    for form in (contextlib.nullcontext, two_pass):
        with form():
            out, grads = _ours(hidden, weight, b, batch, mode, config, memory_budget_bytes=budget)
        _compare(out, expected, grads, ref_grads, F32, F32)


@pytest.mark.parametrize("backend", ["cpu", "torch"])
@pytest.mark.parametrize("dtype", [F32, BF16])
@pytest.mark.parametrize("budget", [1, 16 * 512 * 4, None])
def test_bitwise_equal_to_two_passes_when_every_kept_row_has_a_coefficient(backend, dtype, budget):
    """An entropy bonus gives every kept row e_t != 0, so both forms chunk the same rows in the same order:
    the same sums, bit for bit (loss, statistics, metrics and all three gradients). Rejected rows (seq-MIS
    drops some here) are in neither form's gradient GEMMs."""
    batch, hidden, weight, b = _inputs(dtype=dtype)
    kw = dict(rollout_correction=RolloutCorrection.seq_mis(bounds=(0.99, 1.01)), entropy_coeff=0.01, backend=backend,
              memory_budget_bytes=budget)
    one, one_grads = _run(batch, hidden, weight, b, **kw)
    with two_pass():
        two, two_grads = _run(batch, hidden, weight, b, **kw)
    assert (one.path, two.path) == ("linear_one_pass", "linear_two_pass")
    assert not bool(one.mask[batch.response_mask].all()), "the batch should reject something"
    assert torch.equal(one.loss, two.loss) and torch.equal(one.logprobs, two.logprobs)
    assert torch.equal(one.entropy, two.entropy) and torch.equal(one.mask, two.mask)
    assert one.metrics.keys() == two.metrics.keys()
    for name in one.metrics:
        assert torch.equal(one.metrics[name], two.metrics[name]), name
    for name, g1, g2 in zip(("hidden", "weight", "bias"), one_grads, two_grads):
        assert torch.equal(g1, g2), f"{name}: max |diff| {float((g1.double() - g2.double()).abs().max())}"


# -- the GEMMs ------------------------------------------------------------------------------------------------


def _gemm_rows(run):
    """(calls, rows) of the head's GEMMs in `run` (aten::mm / addmm / addmm_ on the CPU), by the profiler: rows
    counts the token rows each GEMM multiplies (M of the logits and d_hidden products, K of the weight's)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True) as prof:
        run()
    calls, rows = 0, 0
    for event in prof.events():
        if event.name not in ("aten::mm", "aten::addmm", "aten::addmm_"):
            continue
        shapes = [s for s in event.input_shapes if len(s) == 2]
        a = shapes[-2]
        calls += 1
        rows += a[1] if a[0] == 512 else a[0]  # [V, n] @ [n, H] for the weight; [n, .] @ [., .] otherwise
    return calls, rows


def test_three_gemms_of_the_loss_rows_instead_of_four():
    batch, hidden, weight, b = _inputs()
    in_loss = int((batch.response_mask & (batch.labels >= 0)).sum())
    kw = dict(entropy_coeff=0.01, memory_budget_bytes=16 * 512 * 4)  # every row kept and live, 16 rows a chunk
    one = _gemm_rows(lambda: _run(batch, hidden, weight, b, **kw))
    with two_pass():
        two = _gemm_rows(lambda: _run(batch, hidden, weight, b, **kw))
    chunks = -(-in_loss // 16)
    assert one == (3 * chunks, 3 * in_loss), one
    assert two == (4 * chunks, 4 * in_loss), two


# -- autograd as users expect it ------------------------------------------------------------------------------


def _leaves(*tensors):
    return [t.detach().clone().requires_grad_(True) for t in tensors]


def _loss(batch, h, w, bias, part=slice(None), **kw):
    sl = lambda t: None if t is None else t[part]  # noqa: E731
    kwargs = {k: sl(v) for k, v in batch.kwargs("decoupled").items() if k != "cu_seqlens"}
    return rlkernels.linear_decoupled_ppo_loss(h[part], w, batch.labels[part], batch.advantages[part],
                                               batch.response_mask[part], bias=bias, **kwargs, **kw)


@pytest.mark.parametrize("form", [contextlib.nullcontext, two_pass], ids=["one_pass", "two_pass"])
def test_micro_batches_accumulate_into_existing_grads(form):
    """Two micro-batches, .grad already holding a value, the loss scaled by 1/2 as gradient accumulation
    does: the same .grad as autograd through the logits path."""
    batch, hidden, weight, b = _inputs(seed=1)
    kw = dict(rollout_correction=RolloutCorrection.seq_tis(), clip_ratio_c=3.0)
    h, w, bias = _leaves(hidden, weight, b)
    w.grad = torch.full_like(w, 0.25)
    with form():
        for part in (slice(0, 48), slice(48, 96)):
            out = _loss(batch, h, w, bias, part, **kw)
            (0.5 * out.loss).backward()
    rh, rw, rb = _leaves(hidden, weight, b)
    rw.grad = torch.full_like(rw, 0.25)
    for part in (slice(0, 48), slice(48, 96)):
        logits = rh[part] @ rw.T + rb
        sl = {k: (None if v is None else v[part]) for k, v in batch.kwargs("decoupled").items() if k != "cu_seqlens"}
        ref = rlkernels.decoupled_ppo_loss(logits, batch.labels[part], batch.advantages[part],
                                           batch.response_mask[part], **sl, **kw)
        (0.5 * ref.loss).backward()
    for got, want, name in ((h, rh, "hidden"), (w, rw, "weight"), (bias, rb, "bias")):
        assert_close(got.grad, want.grad, **tol("linear.grad", F32, scale=float(want.grad.abs().max())), name=name)


def test_tied_weight_and_a_retained_graph():
    """The head weight also used elsewhere (tied embeddings) adds up; a retained graph's second backward adds
    the same gradient again; create_graph is refused by name."""
    batch, hidden, weight, b = _inputs(seed=3)
    h, w, bias = _leaves(hidden, weight, b)
    out = _loss(batch, h, w, bias)
    assert out.path == "linear_one_pass"
    total = out.loss + w.square().sum()
    total.backward(retain_graph=True)
    first = w.grad.clone()
    total.backward()
    rh, rw, rb = _leaves(hidden, weight, b)
    ref = rlkernels.decoupled_ppo_loss(rh @ rw.T + rb, batch.labels, batch.advantages, batch.response_mask,
                                       **batch.kwargs("decoupled"))
    (ref.loss + rw.square().sum()).backward()
    assert_close(first, rw.grad, **tol("linear.grad", F32, scale=float(rw.grad.abs().max())), name="weight.grad")
    assert torch.equal(w.grad, 2 * first), "second backward"
    # both backwards hand back the saved gradients: one modified in place by a hook fails loudly (SPEC §2.4)
    h, w, bias = _leaves(hidden, weight, b)
    out = _loss(batch, h, w, bias)
    w.register_hook(lambda grad: grad.mul_(2.0))  # (hidden's reaches its hook through a slice's backward: a copy)
    out.loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.loss.backward()
    again_leaves = _leaves(hidden, weight, b)
    again = _loss(batch, *again_leaves)
    with pytest.raises(RuntimeError, match="second derivatives"):
        torch.autograd.grad(again.loss, again_leaves, create_graph=True)


def test_linear_one_pass_false_takes_two_passes():
    batch, hidden, weight, b = _inputs(seed=2)
    one, one_grads = _run(batch, hidden, weight, b)
    two, two_grads = _run(batch, hidden, weight, b, linear_one_pass=False)
    assert (one.path, two.path) == ("linear_one_pass", "linear_two_pass")
    for g1, g2 in zip(one_grads, two_grads):
        assert_close(g1, g2, **tol("linear.grad", F32, scale=float(g2.abs().max())), name="gradient")


def test_the_gradients_are_handed_over_without_a_copy():
    """The step holds each gradient once: .grad is the very buffer the forward filled (no copy at the backward,
    no retained graph)."""
    batch, hidden, weight, b = _inputs(seed=6)
    h, w, bias = _leaves(hidden, weight, b)
    out = _loss(batch, h, w, bias)
    formed = out.loss.grad_fn.saved_tensors[1].data_ptr()  # the address only: a reference would force a copy
    out.loss.backward()
    assert w.grad.data_ptr() == formed


def test_frozen_trunk_or_head_forms_only_the_gradients_asked_for():
    batch, hidden, weight, b = _inputs(seed=5)
    h, w = _leaves(hidden, weight)
    out = rlkernels.linear_decoupled_ppo_loss(h, w.detach(), batch.labels, batch.advantages, batch.response_mask,
                                              bias=b, **batch.kwargs("decoupled"))
    out.loss.backward()
    assert out.path == "linear_one_pass" and h.grad is not None
    out = rlkernels.linear_decoupled_ppo_loss(h.detach(), w, batch.labels, batch.advantages, batch.response_mask,
                                              **batch.kwargs("decoupled"))
    out.loss.backward()
    assert out.path == "linear_one_pass" and w.grad is not None and torch.isfinite(w.grad).all()


def test_float16_keeps_two_passes_so_a_loss_scale_reaches_the_dlogits():
    """A loss scaler's 2^16 applied after the fact would overflow in float16 (inf * 0 = NaN) and come too late
    for the dlogits that underflowed: float16 takes the two-pass form, whose backward forms them at that scale."""
    batch, hidden, weight, b = _inputs(dtype=torch.float16)
    out, grads = _run(batch, hidden, weight, b)
    assert out.path == "linear_two_pass"
    h, w, bias = _leaves(hidden, weight, b)
    (_loss(batch, h, w, bias).loss * 65536.0).backward()
    assert all(torch.isfinite(g).all() for g in (h.grad, w.grad, bias.grad))


def test_a_scaled_loss_rounds_the_product_once_in_bfloat16():
    """g = 1/3 on bfloat16 gradients: d * g from a host float (one rounding of the product), against the
    two-pass form's gradient of g * c."""
    batch, hidden, weight, b = _inputs(dtype=BF16, seed=7)
    results = []
    for one_pass in (True, False):
        h, w, bias = _leaves(hidden, weight, b)
        out = _loss(batch, h, w, bias, linear_one_pass=one_pass)
        (out.loss / 3).backward()
        results.append((out.path, w.grad.float(), h.grad.float()))
    (p1, w1, h1), (p2, w2, h2) = results
    assert (p1, p2) == ("linear_one_pass", "linear_two_pass")
    for got, want in ((w1, w2), (h1, h2)):
        assert_close(got, want, **tol("linear.scaled", BF16, scale=float(want.abs().max())), name="scaled gradient")
