"""The fused-linear path (`linear_decoupled_ppo_loss`, `linear_token_logprobs`) against the float64
oracle applied to hidden.double() @ weight.double().T + bias, over the option product; plus the
properties that make it worth having: no [N, V] tensor is ever allocated, rows outside the loss (and,
in the backward, rows with zero coefficients) never enter a GEMM, and it composes with autograd and
torch.compile like any other use of the weight.
"""

import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import rlkernels
import rlkernels.ops.linear as linear_module
from rlkernels import PolicyLossConfig, RolloutCorrection, backends, reference

from ..cases import BF16, F16, F32, F64, assert_close, make_batch, problems, scaled, tol

HAS_TRITON_CPU = backends.available()["triton"] and os.environ.get("TRITON_INTERPRET") == "1"
# chunk budgets: 1 byte = one row per chunk; ~1 KiB = a few rows; the default = everything at once
BUDGETS = (1, 1024, None)


def make_head(gen: torch.Generator, token_shape, V: int, H: int, dtype, *, bias: bool, offset: float = 0.0):
    """hidden [..., H], weight [V, H], bias [V] or None; logits ~ N(0, ~4) (+ a common offset via the bias)."""
    hidden = torch.randn(token_shape + (H,), generator=gen, dtype=F64)
    weight = torch.randn(V, H, generator=gen, dtype=F64) * (2.0 / max(H, 1) ** 0.5)
    b = torch.randn(V, generator=gen, dtype=F64) + offset if bias else None
    cast = lambda t: None if t is None else t.to(dtype)  # noqa: E731
    return cast(hidden), cast(weight), cast(b)


def _oracle(hidden, weight, bias, batch, mode, config, head_dtype=None, head_device="cpu"):
    """The float64 oracle on logits = h @ W.T + b, with autograd to h, W, b. head_dtype: form the
    logits in that dtype (on head_device) first -- what a half-precision GEMM hands the statistics --
    then upcast."""
    h, w = hidden.double().requires_grad_(True), weight.double().requires_grad_(True)
    b = None if bias is None else bias.double().requires_grad_(True)
    if head_dtype is None:
        logits = h @ w.T + (0 if b is None else b)
    else:  # the rounded logits are a constant of the comparison; gradients still flow in float64
        on = lambda t: None if t is None else t.to(head_device)  # noqa: E731
        rounded = torch.nn.functional.linear(on(hidden), on(weight), on(bias)).double().cpu()
        exact = h @ w.T + (0 if b is None else b)
        logits = exact + (rounded - exact).detach()
    kw = {k: (None if v is None else (v.double() if v.is_floating_point() else v))
          for k, v in batch.kwargs(mode).items()}
    out = reference.decoupled_ppo_loss(logits, batch.labels, batch.advantages.double(), batch.response_mask,
                                       config=config, **kw)
    grads = torch.autograd.grad(out.loss, [t for t in (h, w, b) if t is not None], allow_unused=True)
    return out, grads


def _ours(hidden, weight, bias, batch, mode, config, device="cpu", **kw):
    """The fused-linear loss on `device`; outputs and gradients come back to the CPU."""
    to = lambda t: None if t is None else t.to(device)  # noqa: E731
    leaves = [None if t is None else t.to(device, copy=True).requires_grad_(True) for t in (hidden, weight, bias)]
    out = rlkernels.linear_decoupled_ppo_loss(
        leaves[0], leaves[1], to(batch.labels), to(batch.advantages), to(batch.response_mask), bias=leaves[2],
        config=config, **{k: to(v) for k, v in batch.kwargs(mode).items()}, **kw,
    )
    present = [t for t in leaves if t is not None]
    grads = torch.autograd.grad(out.loss, present, allow_unused=True)
    cpu = lambda t: None if t is None else t.cpu()  # noqa: E731
    out = out._replace(loss=cpu(out.loss), logprobs=cpu(out.logprobs), mask=cpu(out.mask), entropy=cpu(out.entropy),
                       metrics={k: cpu(v) for k, v in out.metrics.items()})
    return out, [(torch.zeros_like(t) if g is None else g).cpu() for g, t in zip(grads, present)]


def _compare(out, expected, grads, ref_grads, stat_dtype, grad_dtype):
    scale = max(1.0, float(expected.loss.detach().abs()))
    assert_close(out.loss, expected.loss, **tol("value", stat_dtype, scale=scale), name="loss")
    assert_close(out.logprobs, expected.logprobs, **tol("value", stat_dtype), name="logprobs")
    if expected.entropy is not None:
        assert_close(out.entropy, expected.entropy, **tol("value", stat_dtype), name="entropy")
    assert torch.equal(out.mask, expected.mask), "final mask differs"
    for name, value in expected.metrics.items():
        m_scale = max(1.0, float(value.abs())) if torch.isfinite(value) else 1.0
        assert_close(out.metrics[name], value, **tol("value", stat_dtype, scale=m_scale), name=name)
    for name, g, r in zip(("d_hidden", "d_weight", "d_bias"), grads, ref_grads):
        r = torch.zeros_like(g, dtype=F64) if r is None else r
        assert g.dtype == grad_dtype, f"{name} dtype {g.dtype}"
        g_scale = max(1e-3, float(r.abs().max())) if r.numel() else 1.0
        assert_close(g, r, **tol("linear.grad", grad_dtype, scale=g_scale), name=name)


@settings(max_examples=scaled(120))
@given(problem=problems(dtype=F64), H=st.integers(1, 9), bias=st.booleans(),
       offset=st.sampled_from([0.0, 1e4, -1e4]), budget=st.sampled_from(BUDGETS), seed=st.integers(0, 2**31 - 1))
def test_float64_matches_the_oracle(problem, H, bias, offset, budget, seed):
    batch, mode, config = problem
    gen = torch.Generator().manual_seed(seed)
    hidden, weight, b = make_head(gen, tuple(batch.labels.shape), batch.logits.shape[-1], H, F64, bias=bias,
                                  offset=offset)
    expected, ref_grads = _oracle(hidden, weight, b, batch, mode, config)
    out, grads = _ours(hidden, weight, b, batch, mode, config, memory_budget_bytes=budget)
    _compare(out, expected, grads, ref_grads, F64, F64)


@settings(max_examples=scaled(60))
@given(problem=problems(dtype=F32), H=st.integers(1, 9), bias=st.booleans(), budget=st.sampled_from(BUDGETS),
       seed=st.integers(0, 2**31 - 1))
def test_float32_matches_the_oracle(problem, H, bias, budget, seed):
    batch, mode, config = problem
    gen = torch.Generator().manual_seed(seed)
    hidden, weight, b = make_head(gen, tuple(batch.labels.shape), batch.logits.shape[-1], H, F32, bias=bias)
    expected, ref_grads = _oracle(hidden, weight, b, batch, mode, config)
    out, grads = _ours(hidden, weight, b, batch, mode, config, memory_budget_bytes=budget)
    _compare(out, expected, grads, ref_grads, F32, F32)


@pytest.mark.parametrize("dtype", [BF16, F16])
@pytest.mark.parametrize("budget", [1024, None])
@pytest.mark.parametrize("seed", range(4))
def test_half_precision_matches_the_oracle_on_the_rounded_logits(dtype, budget, seed):
    """A half-precision GEMM rounds the logits it hands the statistics; the oracle sees the same
    rounded logits, so statistics and loss keep the fp32 bounds and only the gradient GEMMs add the
    half-precision rounding (TOL 'linear.grad')."""
    mode = ("decoupled", "bypass", "on-policy", "decoupled")[seed]
    batch = make_batch("packed", [5, 0, 7, 3], 37, dtype=F32, seed=seed, mask_p=0.85)
    config = PolicyLossConfig(rollout_correction=RolloutCorrection.seq_mis() if mode != "on-policy" else None,
                              entropy_coeff=0.01, kl_coef=0.05, loss_agg_mode="seq-mean-token-mean")
    hidden, weight, b = make_head(torch.Generator().manual_seed(seed), (15,), 37, 16, dtype, bias=seed % 2 == 0)
    expected, ref_grads = _oracle(hidden, weight, b, batch, mode, config, head_dtype=dtype)
    out, grads = _ours(hidden, weight, b, batch, mode, config, memory_budget_bytes=budget)
    _compare(out, expected, grads, ref_grads, F32, dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["triton", "cuda"])
@pytest.mark.parametrize("dtype", [BF16, F32])
def test_gpu_backends_match_the_oracle(backend, dtype):
    """On a GPU: the chunk's passes on the Triton / CUDA kernels and the GEMMs on cuBLAS."""
    if not backends.available()[backend]:
        pytest.skip(f"backend {backend!r} is not available here")
    batch = make_batch("packed", [40, 0, 33, 27], 1031, dtype=F32, seed=5, mask_p=0.7)
    config = PolicyLossConfig(rollout_correction=RolloutCorrection.seq_mis(), entropy_coeff=0.01, kl_coef=0.05)
    hidden, weight, b = make_head(torch.Generator().manual_seed(5), (100,), 1031, 64, dtype, bias=True)
    # the GEMM on the GPU and on the CPU may round differently: give the oracle the GPU's logits
    expected, ref_grads = _oracle(hidden, weight, b, batch, "decoupled", config, head_dtype=dtype, head_device="cuda")
    out, grads = _ours(hidden, weight, b, batch, "decoupled", config, device="cuda", backend=backend,
                       memory_budget_bytes=16 * 1031 * 4)
    _compare(out, expected, grads, ref_grads, F32, dtype)


@pytest.mark.skipif(not HAS_TRITON_CPU, reason="the Triton backend runs on the CPU only through its interpreter")
@pytest.mark.parametrize("seed", range(3))
def test_triton_backend_matches_the_oracle(seed):
    mode = ("decoupled", "bypass", "on-policy")[seed]
    batch = make_batch("padded", [6, 6, 6], 23, dtype=F32, seed=seed, mask_p=0.85)
    config = PolicyLossConfig(rollout_correction=RolloutCorrection.geo_rs_token_tis(bounds=(0.5, 2.0))
                              if mode != "on-policy" else None, entropy_coeff=0.01, temperature=0.7)
    hidden, weight, b = make_head(torch.Generator().manual_seed(seed), (3, 6), 23, 8, F32, bias=True)
    expected, ref_grads = _oracle(hidden, weight, b, batch, mode, config)
    out, grads = _ours(hidden, weight, b, batch, mode, config, backend="triton", memory_budget_bytes=2048)
    _compare(out, expected, grads, ref_grads, F32, F32)


def test_gradcheck_float64():
    gen = torch.Generator().manual_seed(0)
    hidden, weight, b = make_head(gen, (7,), 5, 3, F64, bias=True)
    labels = torch.tensor([0, 4, -100, 2, 1, 3, 0])
    adv = torch.randn(7, generator=gen, dtype=F64)
    old = -torch.rand(7, generator=gen, dtype=F64)

    def loss(h, w, bias):
        return rlkernels.linear_decoupled_ppo_loss(
            h, w, labels, adv, torch.ones(7), bias=bias, old_logprobs=old, entropy_coeff=0.1, kl_coef=0.1,
            ref_logprobs=old, kl_type="k2", clip_ratio_low=0.9, clip_ratio_high=5.0, memory_budget_bytes=64,
        ).loss

    inputs = tuple(t.requires_grad_(True) for t in (hidden, weight, b))
    assert torch.autograd.gradcheck(loss, inputs, eps=1e-6, **tol("gradcheck", F64))


def test_token_logprobs_match_the_logits_path():
    gen = torch.Generator().manual_seed(1)
    hidden, weight, b = make_head(gen, (2, 5), 11, 4, F64, bias=True)
    labels = torch.randint(0, 11, (2, 5), generator=gen)
    labels[0, 1] = -100
    got = rlkernels.linear_token_logprobs(hidden, weight, labels, bias=b, temperature=0.8, compute_entropy=True,
                                         compute_sum_pi_squared=True, memory_budget_bytes=200)
    want = rlkernels.token_logprobs(hidden @ weight.T + b, labels, temperature=0.8, compute_entropy=True,
                                   compute_sum_pi_squared=True)
    for name in ("logprobs", "entropy", "sum_pi_squared"):
        assert_close(getattr(got, name), getattr(want, name), **tol("value", F64), name=name)


# -- what the fused path is for ----------------------------------------------------------------------
def _loss_inputs(N=96, V=512, H=24, seed=0):
    batch = make_batch("packed", [40, 0, 30, 26], V, dtype=F32, seed=seed, mask_p=0.5)
    hidden, weight, b = make_head(torch.Generator().manual_seed(seed), (N,), V, H, F32, bias=True)
    return batch, hidden.requires_grad_(True), weight.requires_grad_(True), b.requires_grad_(True)


def test_no_tensor_of_n_by_v_is_allocated():
    batch, hidden, weight, b = _loss_inputs()
    N, V = hidden.shape[0], weight.shape[0]
    budget = 16 * V * 4  # 16 rows per chunk
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        out = rlkernels.linear_decoupled_ppo_loss(hidden, weight, batch.labels, batch.advantages, batch.response_mask,
                                                  bias=b, entropy_coeff=0.01, memory_budget_bytes=budget,
                                                  **batch.kwargs("decoupled"))
        out.loss.backward()
    allocations = [e.cpu_memory_usage for e in prof.events() if e.cpu_memory_usage > 0]
    assert allocations, "the profiler recorded no allocation: the check would pass vacuously"
    # the weight gradient (V x H fp32) is the largest legitimate buffer; [N, V] fp32 is 4 x larger here
    assert max(allocations) < N * V * 4 / 2, f"an allocation of {max(allocations)} bytes ~ [N, V] = {N * V * 4}"


def test_rows_outside_the_loss_never_enter_a_gemm(monkeypatch):
    """The two-pass form (here forced: this batch's coefficients are per-token, which would take the one-pass
    form, tests/ops/test_linear_one_pass.py): its backward recomputes only the rows with a coefficient."""
    monkeypatch.setattr(rlkernels.stage, "forward_gradient_blocker", lambda batch, config: "forced")
    batch, hidden, weight, b = _loss_inputs()
    seen = []
    head = linear_module._head
    monkeypatch.setattr(linear_module, "_head", lambda h, *rest: (seen.append(h.shape[0]), head(h, *rest))[1])
    # zero advantages on the last sequences: their coefficients are exactly 0 (on-policy, nothing clips,
    # so every other row in the loss has c = -A / N != 0)
    adv = batch.advantages.clone()
    adv[56:] = 0.0
    out = rlkernels.linear_decoupled_ppo_loss(hidden, weight, batch.labels, adv, batch.response_mask, bias=b,
                                              memory_budget_bytes=8 * 512 * 4, **batch.kwargs("on-policy"))
    in_loss = int((batch.response_mask & (batch.labels >= 0)).sum())
    forward_rows = sum(seen)
    assert forward_rows == in_loss < hidden.shape[0]
    seen.clear()
    out.loss.backward()
    live = int((out.mask & (adv != 0)).sum())
    assert sum(seen) == live < in_loss, f"backward GEMM rows {sum(seen)}, rows with a coefficient {live}"
    skipped = ~(out.mask & (adv != 0))
    assert torch.equal(hidden.grad[skipped], torch.zeros_like(hidden.grad[skipped])), "skipped rows got a gradient"


def test_weight_gradient_accumulates_with_other_uses():
    """A tied embedding: the head weight is also used elsewhere; both gradients add up in .grad."""
    batch, hidden, weight, b = _loss_inputs(seed=3)
    out = rlkernels.linear_decoupled_ppo_loss(hidden, weight, batch.labels, batch.advantages, batch.response_mask,
                                              bias=b, **batch.kwargs("decoupled"))
    (out.loss + weight.square().sum()).backward()
    w2 = weight.detach().clone().requires_grad_(True)
    logits = hidden.detach() @ w2.T + b.detach()
    ref = rlkernels.decoupled_ppo_loss(logits, batch.labels, batch.advantages, batch.response_mask,
                                       **batch.kwargs("decoupled"))
    (ref.loss + w2.square().sum()).backward()
    assert_close(weight.grad, w2.grad, **tol("linear.grad", F32, scale=float(w2.grad.abs().max())), name="weight.grad")


def test_compiles_fullgraph():
    batch, hidden, weight, b = _loss_inputs(seed=4)
    config = PolicyLossConfig(rollout_correction=RolloutCorrection.seq_mis(), entropy_coeff=0.01, validate=False)

    def step(h, w, bias):
        return rlkernels.linear_decoupled_ppo_loss(h, w, batch.labels, batch.advantages, batch.response_mask,
                                                   bias=bias, config=config, **batch.kwargs("decoupled")).loss

    leaves = [t.detach().clone().requires_grad_(True) for t in (hidden, weight, b)]
    torch.compile(step, fullgraph=True, backend="aot_eager")(*leaves).backward()
    step(hidden, weight, b).backward()
    for got, want, name in zip(leaves, (hidden, weight, b), ("hidden", "weight", "bias")):
        assert_close(got.grad, want.grad, **tol("reordered.dlogits", F32), name=name)
    torch._dynamo.reset()


@pytest.mark.parametrize("call, match", [
    (lambda h, w, b, y: rlkernels.linear_token_logprobs(h, w.double(), y), "weight: expected the dtype"),
    (lambda h, w, b, y: rlkernels.linear_token_logprobs(h, w[:, :-1], y), "weight: expected"),
    (lambda h, w, b, y: rlkernels.linear_token_logprobs(h, w.T, y), "weight: expected"),
    (lambda h, w, b, y: rlkernels.linear_token_logprobs(h, w, y, bias=b[:-1]), "bias: expected shape"),
    (lambda h, w, b, y: rlkernels.linear_token_logprobs(h, w, y, bias=b.double()), "bias: expected the dtype"),
    (lambda h, w, b, y: rlkernels.linear_token_logprobs(h.long(), w, y), "hidden: expected a floating"),
    (lambda h, w, b, y: rlkernels.linear_token_logprobs(h, w, y[:-1]), "labels: expected shape"),
    (lambda h, w, b, y: rlkernels.linear_token_logprobs(h, w, y, memory_budget_bytes=0), "memory_budget_bytes"),
    (lambda h, w, b, y: rlkernels.linear_decoupled_ppo_loss(h[None, None], w, y[None, None], torch.zeros(1, 1, 6),
                                                            torch.ones(1, 1, 6)), "hidden: expected"),
])
def test_bad_inputs_name_the_argument(call, match):
    hidden, weight, b = make_head(torch.Generator().manual_seed(0), (6,), 7, 4, F32, bias=True)
    labels = torch.zeros(6, dtype=torch.long)
    with pytest.raises((TypeError, ValueError), match=match):
        call(hidden, weight, b, labels)
