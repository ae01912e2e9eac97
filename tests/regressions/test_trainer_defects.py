"""Defects found by using rlkernels the way trainers do (the hardening issue), one test each.

Each test fails on the code before its fix: a compiled step that crashed or recompiled on a new
hyperparameter, the causal-shift view copied to a private [N, V], Inductor's scatter codegen on a
one-sequence batch, narrow label dtypes compared without widening, an in-place backward into
expanded logits, second derivatives silently dropped, and from_verl's threshold handling.
"""

import os

import pytest
import torch
import torch._dynamo

import rlkernels
from rlkernels import PolicyLossConfig, RolloutCorrection, backends

from ..cases import assert_close, make_batch, tol

HAS_TRITON_CPU = backends.available()["triton"] and os.environ.get("TRITON_INTERPRET") == "1"
# the backends that run here: torch everywhere, Triton through its interpreter
LOCAL_BACKENDS = ["torch"] + (["triton"] if HAS_TRITON_CPU else [])
# (device, backend) for the layout tests: these, plus the GPU kernels where a GPU is present
LAYOUT_CASES = [("cpu", b) for b in LOCAL_BACKENDS] + [
    pytest.param("cuda", b, marks=pytest.mark.gpu, id=f"cuda-{b}") for b in ("torch", "triton", "cuda")
]


def _need(device, backend):
    if device == "cuda" and not backends.available()[backend]:
        pytest.skip(f"backend {backend!r} is not available on this GPU machine")


def _packed_batch(lengths=(5, 4, 5), V=23, seed=0, cu_seqlens=True):
    """(keyword inputs, logits [N, V]) of a packed fp32 batch; cu_seqlens=False leaves it out (one sequence)."""
    b = make_batch("packed", lengths, V, dtype=torch.float32, seed=seed, mask_p=0.8)
    return dict(
        labels=b.labels, advantages=b.advantages, response_mask=b.response_mask, old_logprobs=b.old_logprobs,
        rollout_logprobs=b.rollout_logprobs, cu_seqlens=b.cu_seqlens.long() if cu_seqlens else None,
    ), b.logits


class _CountingBackend:
    """A torch.compile backend that counts compilations (each is one Dynamo graph)."""

    def __init__(self):
        self.graphs = 0

    def __call__(self, gm, example_inputs):
        self.graphs += 1
        from torch._dynamo.backends.common import aot_autograd

        return aot_autograd(fw_compiler=lambda g, _: g, bw_compiler=lambda g, _: g)(gm, example_inputs)


# -- compiled training steps --------------------------------------------------------------------
# Per-step hyperparameters of real training: schedules of clip ratios, coefficients, temperature,
# and the global token/sequence counts of data parallelism, which change every step.
SCHEDULE = [
    dict(global_num_tokens=40.0, clip_ratio_high=0.28, entropy_coeff=0.01, temperature=1.0, kl_coef=0.05),
    dict(global_num_tokens=37.0, clip_ratio_high=0.25, entropy_coeff=0.02, temperature=0.9, kl_coef=0.04),
    dict(global_num_tokens=52.0, clip_ratio_high=0.3, entropy_coeff=0.005, temperature=0.7, kl_coef=0.1),
    dict(global_num_tokens=44.5, clip_ratio_high=0.21, entropy_coeff=0.015, temperature=1.3, kl_coef=0.02),
]


@pytest.mark.parametrize("dynamic", [False, True], ids=["default", "dynamic"])
@pytest.mark.parametrize("how", ["overrides", "config"])
def test_compiled_step_changes_hyperparameters_without_recompiling(how, dynamic):
    """Every value changes at every step. torch.compile(dynamic=True): one graph, ever. By default
    Dynamo specialises a float on the first call and recompiles once when it first changes."""
    torch._dynamo.reset()  # this test's own count (a leak from an earlier compilation: see the sampler-head test
    _schedule_compiles_once(how, dynamic)  # in tests/stage/test_sampler_divergences.py)


def _schedule_compiles_once(how, dynamic):
    batch, logits0 = _packed_batch()
    rc_base = dict(is_level="sequence", rs={"seq_mean_k1": (0.5, 2.0), "token_k3": 4.0})

    def loss_of(logits, hp):
        if how == "overrides":
            return rlkernels.decoupled_ppo_loss(
                logits, **batch, ref_logprobs=batch["old_logprobs"], validate=False,
                rollout_correction=RolloutCorrection(**rc_base), **hp,
            ).loss
        return rlkernels.decoupled_ppo_loss(logits, **batch, ref_logprobs=batch["old_logprobs"], config=hp).loss

    def as_arg(hp, step):
        if how == "overrides":
            return hp
        rc = RolloutCorrection(**rc_base, is_threshold=2.0 + step)  # a threshold schedule too
        return PolicyLossConfig(**hp, rollout_correction=rc, validate=False)

    counter = _CountingBackend()
    step = torch.compile(loss_of, fullgraph=True, backend=counter, dynamic=dynamic or None)
    warmup_steps = 1 if dynamic else 2
    for i, hp in enumerate(SCHEDULE):
        logits = logits0.clone().requires_grad_(True)
        if i == warmup_steps:  # warm-up is over: any further compilation is a failure
            graphs_after_warmup = counter.graphs
        loss = step(logits, as_arg(hp, i))
        loss.backward()
        eager_logits = logits0.clone().requires_grad_(True)
        expected = loss_of(eager_logits, as_arg(hp, i))
        expected.backward()
        assert_close(loss.detach(), expected.detach(), **tol("reordered"), name=f"loss at step {i}")
        assert_close(logits.grad, eager_logits.grad, **tol("reordered.dlogits"), name=f"dlogits at step {i}")
    assert counter.graphs == graphs_after_warmup, f"recompiled after warm-up ({counter.graphs} graphs)"
    torch._dynamo.reset()


ADAPTIVE_COEFFICIENTS = [0.05, 0.0, 0.02, 0.0, 0.1]  # TRL's controller: gated to 0, moved by delta


@pytest.mark.parametrize("adaptive", [True, False])
def test_an_adaptive_entropy_coefficient_does_not_recompile(adaptive):
    """adaptive_entropy=True (TRL's adaptive entropy, SPEC §18): the coefficient is a run-time value even at 0,
    so a schedule through 0 keeps the one graph of torch.compile(dynamic=True), and the compiled stage's.
    Without it, 0 means "no entropy term" (a static option): the control recompiles when it first meets 0."""
    batch, logits0 = _packed_batch()

    def loss_of(logits, coefficient):
        return rlkernels.decoupled_ppo_loss(logits, **batch, entropy_coeff=coefficient, adaptive_entropy=adaptive,
                                            compute_entropy=True, validate=False).loss

    counter = _CountingBackend()
    step = torch.compile(loss_of, fullgraph=True, backend=counter, dynamic=True)
    for i, coefficient in enumerate(ADAPTIVE_COEFFICIENTS):
        logits = logits0.clone().requires_grad_(True)
        step(logits, coefficient).backward()
        if i == 0:
            first_call = counter.graphs  # the forward and the backward's graphs
        eager = logits0.clone().requires_grad_(True)
        loss_of(eager, coefficient).backward()
        assert_close(logits.grad, eager.grad, **tol("reordered.dlogits"), name=f"dlogits at step {i}")
    assert (counter.graphs == first_call) == adaptive, f"{counter.graphs} graphs after {first_call}"
    torch._dynamo.reset()
    if not adaptive:
        return
    with torch._dynamo.config.patch(error_on_recompile=False):
        for i, coefficient in enumerate(ADAPTIVE_COEFFICIENTS):
            if i == 1:
                torch._dynamo.config.error_on_recompile = True
            kw = dict(batch, entropy_coeff=coefficient, adaptive_entropy=True)
            got = rlkernels.decoupled_ppo_loss(logits0, **kw, compile_stage=True)
            want = rlkernels.decoupled_ppo_loss(logits0, **kw, compile_stage=False)
            assert_close(got.loss, want.loss, **tol("reordered"), name=f"loss at step {i}")
    torch._dynamo.reset()


def test_compiled_step_reads_the_shifted_view():
    """The causal shift under torch.compile: the [B, T-1, V] view is consumed as it is (deciding that by
    a failing view() inside try/except broke tracing)."""
    model_out, kw = _shifted()

    def step(x):
        return rlkernels.decoupled_ppo_loss(x[:, :-1, :], **kw, validate=False).loss

    compiled = model_out.detach().clone().requires_grad_(True)
    torch.compile(step, fullgraph=True, backend="aot_eager")(compiled).backward()
    step(model_out).backward()
    assert_close(compiled.grad, model_out.grad, **tol("reordered.dlogits"), name="dlogits")
    torch._dynamo.reset()


def test_validation_under_fullgraph_says_validate_false_is_needed():
    batch, logits = _packed_batch()
    step = torch.compile(lambda x: rlkernels.decoupled_ppo_loss(x, **batch).loss, fullgraph=True, backend="aot_eager")
    with pytest.raises(Exception, match="validate=False"):
        step(logits)
    torch._dynamo.reset()


@pytest.mark.parametrize("cu", [False, True], ids=["no_cu_seqlens", "one_segment"])
def test_inductor_compiles_a_one_sequence_batch(cu):
    """Inductor's scatter codegen failed on the index_add_ of a one-segment batch; the segmented sums
    are now fixed-order reductions that Inductor handles."""
    batch, logits0 = _packed_batch(lengths=[14], cu_seqlens=cu)
    config = PolicyLossConfig(rollout_correction=RolloutCorrection.seq_mis(), loss_agg_mode="seq-mean-token-mean",
                              validate=False)

    def step(logits):
        return rlkernels.decoupled_ppo_loss(logits, **batch, config=config).loss

    logits = logits0.clone().requires_grad_(True)
    torch.compile(step, fullgraph=True, backend="inductor")(logits).backward()
    eager = logits0.clone().requires_grad_(True)
    step(eager).backward()
    assert_close(logits.grad, eager.grad, **tol("reordered.dlogits"), name="dlogits")
    torch._dynamo.reset()


def test_compiled_stage_matches_the_eager_stage_and_does_not_recompile():
    """compile_stage=True (the CUDA default) on the CPU: same numbers, one graph for a schedule."""
    batch, logits = _packed_batch()
    rc = RolloutCorrection(is_level="token", rs={"seq_max_k3": 4.0, "seq_sum_k1": (0.1, 10.0)})
    torch._dynamo.reset()
    with torch._dynamo.config.patch(error_on_recompile=False):
        for i, hp in enumerate(SCHEDULE):
            kw = dict(batch, ref_logprobs=batch["old_logprobs"], rollout_correction=rc, **hp)
            if i == 1:
                torch._dynamo.config.error_on_recompile = True
            got = rlkernels.decoupled_ppo_loss(logits, **kw, compile_stage=True)
            want = rlkernels.decoupled_ppo_loss(logits, **kw, compile_stage=False)
            for name in want.metrics:
                assert_close(got.metrics[name], want.metrics[name], **tol("reordered"), name=name)
            assert_close(got.loss, want.loss, **tol("reordered"), name="loss")
    torch._dynamo.reset()


# -- the causal shift ----------------------------------------------------------------------------
def _shifted(B=3, T=9, V=37, dtype=torch.float32, seed=1, device="cpu"):
    """A model output [B, T, V] (a leaf) and the inputs of its first T - 1 positions (the causal shift)."""
    b = make_batch("padded", [T] * B, V, dtype=dtype, seed=seed, mask_p=0.8)
    model_out = b.logits.to(device).requires_grad_(True)
    first = lambda t: t[:, :-1].to(device)  # noqa: E731
    return model_out, dict(labels=first(b.labels), advantages=first(b.advantages), response_mask=first(b.response_mask),
                           old_logprobs=first(b.old_logprobs))


@pytest.mark.parametrize("device, backend", LAYOUT_CASES)
def test_shifted_view_is_read_in_place_not_copied(device, backend, monkeypatch):
    _need(device, backend)
    model_out, kw = _shifted(device=device)
    logits = model_out[:, :-1, :]  # rows are not one strided sequence: reshape(N, V) would copy
    copies = []
    for name in ("contiguous", "reshape", "clone"):
        original = getattr(torch.Tensor, name)

        def spy(self, *a, _original=original, **k):
            out = _original(self, *a, **k)
            if self.numel() >= logits.numel() and out.data_ptr() != self.data_ptr():
                copies.append(tuple(self.shape))
            return out

        monkeypatch.setattr(torch.Tensor, name, spy)
    out = rlkernels.decoupled_ppo_loss(logits, **kw, backend=backend)
    out.loss.backward()
    monkeypatch.undo()
    assert copies == [], f"logits copied: {copies}"

    dense = model_out.detach().clone().requires_grad_(True)
    ref = rlkernels.decoupled_ppo_loss(dense[:, :-1, :].contiguous(), **kw, backend="torch")
    ref.loss.backward()
    assert_close(out.loss.detach(), ref.loss.detach(), **tol("layout"), name="loss")
    assert_close(model_out.grad, dense.grad, **tol("reordered.dlogits"), name="dlogits")


@pytest.mark.parametrize("device, backend", LAYOUT_CASES)
def test_inplace_backward_writes_into_the_model_output(device, backend):
    _need(device, backend)
    model_out, kw = _shifted(device=device)
    dense = model_out.detach().clone().requires_grad_(True)
    ref = rlkernels.decoupled_ppo_loss(dense[:, :-1, :], **kw, backend="torch")
    ref.loss.backward()

    storage = model_out.detach()
    version = storage._version
    out = rlkernels.decoupled_ppo_loss(model_out[:, :-1, :], **kw, backend=backend, inplace_backward=True)
    out.loss.backward()
    assert storage._version > version, "the in-place backward did not bump the version counter"
    # the gradient rows sit where the logits were: in the model output's own storage
    assert_close(storage[:, :-1, :], dense.grad[:, :-1, :], **tol("reordered.dlogits"), name="dlogits in storage")
    assert_close(model_out.grad, dense.grad, **tol("reordered.dlogits"), name="dlogits")


@pytest.mark.parametrize("backend", LOCAL_BACKENDS)
def test_inplace_backward_refuses_expanded_logits(backend):
    """Stride-0 rows share memory: an in-place backward would write one row from several programs
    (the Triton backend gave a relative error of 1.6). Refused before any kernel runs."""
    N, V = 6, 11
    row = torch.randn(1, V, requires_grad=True)
    logits = row.expand(N, V)
    with pytest.raises(ValueError, match="logits: inplace_backward=True"):
        rlkernels.decoupled_ppo_loss(logits, torch.randint(0, V, (N,)), torch.randn(N), torch.ones(N),
                                     backend=backend, inplace_backward=True)
    # rows that partly overlap (batch rows sharing memory): refused too
    overlapping = torch.randn(64).as_strided((3, 4, 7), (7, 7, 1))  # batch b's row t is batch b+1's row t-1
    with pytest.raises(ValueError, match="logits: inplace_backward=True"):
        rlkernels.decoupled_ppo_loss(overlapping, torch.randint(0, 7, (3, 4)), torch.randn(3, 4), torch.ones(3, 4),
                                     backend=backend, inplace_backward=True)
    # without the in-place request the same expanded logits are fine
    out = rlkernels.decoupled_ppo_loss(logits, torch.randint(0, V, (N,)), torch.randn(N), torch.ones(N),
                                       backend=backend)
    out.loss.backward()


# -- label dtypes ------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.uint8, torch.int8, torch.int16, torch.int32])
def test_narrow_labels_are_compared_in_int64(dtype):
    info = torch.iinfo(dtype)
    V = min(info.max + 1, 300)
    N = 12
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(N, V, generator=g)
    wide = torch.randint(0, V, (N,), generator=g)
    wide[0] = V - 1  # the top id of the dtype's range: uint8 156 = -100 wrapped, 255 when V = 256
    if dtype == torch.uint8:
        wide[1] = 156
    ignored = info.min < 0
    if ignored:
        wide[2] = -100
    narrow = wide.to(dtype)
    adv, mask = torch.randn(N, generator=g), torch.ones(N, dtype=torch.bool)
    got = rlkernels.decoupled_ppo_loss(logits, narrow, adv, mask)
    want = rlkernels.decoupled_ppo_loss(logits, wide, adv, mask)
    assert torch.equal(got.mask, want.mask)
    assert torch.equal(got.loss, want.loss), "loss"
    assert bool(got.mask[0]) and (dtype != torch.uint8 or bool(got.mask[1]))
    assert bool(got.mask[2]) is not ignored
    stats = rlkernels.token_logprobs(logits, narrow)
    assert torch.equal(stats.logprobs, rlkernels.token_logprobs(logits, wide).logprobs)


@pytest.mark.parametrize("dtype", [torch.uint16, torch.uint32, torch.uint64, torch.bool, torch.float32])
def test_unsupported_label_dtypes_name_labels(dtype):
    logits = torch.randn(4, 5)
    labels = torch.zeros(4, dtype=dtype)
    with pytest.raises(TypeError, match="labels"):
        rlkernels.decoupled_ppo_loss(logits, labels, torch.randn(4), torch.ones(4))
    with pytest.raises(TypeError, match="labels"):
        rlkernels.token_logprobs(logits, labels)


# -- second derivatives ----------------------------------------------------------------------------
def test_create_graph_raises_instead_of_dropping_the_second_derivative():
    N, V = 5, 7
    logits = torch.randn(N, V, requires_grad=True)
    out = rlkernels.decoupled_ppo_loss(logits, torch.randint(0, V, (N,)), torch.randn(N), torch.ones(N))
    with pytest.raises(RuntimeError, match="second derivatives"):
        torch.autograd.grad(out.loss, logits, create_graph=True)
    lp = torch.randn(N, requires_grad=True)
    out = rlkernels.policy_loss(lp, torch.randn(N), torch.ones(N), old_logprobs=lp.detach() - 0.1)
    with pytest.raises(RuntimeError, match="second derivatives"):
        torch.autograd.grad(out.loss, lp, create_graph=True)
    # a single derivative still works
    (g,) = torch.autograd.grad(out.loss, lp)
    assert torch.isfinite(g).all()


def test_float64_logits_with_triton_get_a_dtype_message():
    logits = torch.randn(3, 5, dtype=torch.float64)
    with pytest.raises(ValueError, match="float64"):
        rlkernels.decoupled_ppo_loss(logits, torch.zeros(3, dtype=torch.long), torch.randn(3, dtype=torch.float64),
                                     torch.ones(3), backend="triton")


# -- from_verl ------------------------------------------------------------------------------------
def test_from_verl_threshold_none_means_no_weights():
    rc = RolloutCorrection.from_verl(rollout_is="token", rollout_is_threshold=None)
    assert rc.is_level is None and not rc.enabled
    rc = RolloutCorrection.from_verl(rollout_is="sequence", rollout_is_threshold=None, rollout_rs="token_k3",
                                     rollout_rs_threshold=0.1)
    assert rc.is_level is None and rc.rs == (("token_k3", 0.1),)


@pytest.mark.parametrize("kwargs, argument, error", [
    (dict(rollout_is="token", rollout_is_threshold=True), "rollout_is_threshold", TypeError),
    (dict(rollout_is="token", rollout_is_threshold=-2.0), "rollout_is_threshold", ValueError),
    (dict(rollout_is="token", rollout_is_threshold="2_0.5"), "rollout_is_threshold", ValueError),
    (dict(rollout_is="tokens"), "rollout_is", ValueError),
    (dict(rollout_rs="seq_mean_k1", rollout_rs_threshold=True), "rollout_rs_threshold", TypeError),
    (dict(rollout_rs="seq_mean_k1", rollout_rs_threshold="2_0.5"), "rollout_rs_threshold", ValueError),
    (dict(rollout_rs="token_k3", rollout_rs_threshold="0.5_2"), "rollout_rs_threshold", TypeError),
    (dict(rollout_rs="token_k4", rollout_rs_threshold=1.0), "rollout_rs", ValueError),
    (dict(rollout_rs="token_k3,token_k3", rollout_rs_threshold=1.0), "rollout_rs", ValueError),
    (dict(rollout_is_batch_normalize="yes"), "rollout_is_batch_normalize", TypeError),
])
def test_from_verl_errors_name_the_verl_argument(kwargs, argument, error):
    with pytest.raises(error, match=rf"^{argument}\b"):
        RolloutCorrection.from_verl(**kwargs)
