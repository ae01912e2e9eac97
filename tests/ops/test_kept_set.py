"""Sampler replay (SPEC §2.3): a per-token temperature and the rollout's kept
token set, on the four entry points, against the float64 oracle (a masked log-softmax of z / T_t over
the kept ids).

The kept set is drawn per row: the label, K - 1 other distinct ids, then some slots replaced by -1
padding (never the label's), in a random slot order; K runs from 1 to V.
"""

import contextlib

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import rlkernels
from rlkernels import PolicyLossConfig, RolloutCorrection, reference
from rlkernels.ops import kept_set as sampler

from ..backends.parity import _label_column_floor
from ..cases import F32, F64, MODES, assert_close, batches, configs, make_batch, scaled, tol
from .test_linear import make_head


def make_support(labels: torch.Tensor, V: int, K: int, seed: int, pad_p: float = 0.3) -> torch.Tensor:
    """[..., K] kept ids: each row's label, K - 1 other distinct ids (fewer if V is small: -1 fills),
    some replaced by -1, in a shuffled slot order."""
    gen = torch.Generator().manual_seed(seed)
    flat = labels.reshape(-1).clamp(0, V - 1)
    rows = []
    for y in flat.tolist():
        others = torch.randperm(V, generator=gen)
        others = others[others != y][: K - 1]
        others = torch.where(torch.rand(others.shape, generator=gen) < pad_p, -1, others)
        row = torch.cat([torch.tensor([y]), others, torch.full((K - 1 - others.numel(),), -1, dtype=torch.long)])
        rows.append(row[torch.randperm(K, generator=gen)])
    return torch.stack(rows).reshape(labels.shape + (K,)) if rows else torch.zeros(labels.shape + (K,),
                                                                                   dtype=torch.long)


@st.composite
def sampler_inputs(draw, dtype=F64):
    batch = draw(batches(dtype=dtype))
    V = batch.logits.shape[-1]
    shape = tuple(batch.labels.shape)
    seed = draw(st.integers(0, 2**31 - 1))
    gen = torch.Generator().manual_seed(seed)
    support = None
    if draw(st.booleans()):
        support = make_support(batch.labels, V, draw(st.integers(1, V)), seed, draw(st.sampled_from([0.0, 0.4])))
    kind = draw(st.sampled_from(["float", "token", "sequence"]))
    temperature = draw(st.sampled_from([1.0, 0.7]))
    if kind == "token":
        temperature = 0.3 + torch.rand(shape, generator=gen, dtype=F32) * 1.5
    elif kind == "sequence" and len(shape) == 2:
        temperature = 0.3 + torch.rand(shape[0], 1, generator=gen, dtype=F32) * 1.5
    return batch, support, temperature


@contextlib.contextmanager
def _path(path: str):
    """Route every kept set through the gather ("gather") or the masked vocabulary pass ("masked"),
    whatever its size (sampler.GATHER_RATIO picks one by K / V otherwise)."""
    saved = sampler.GATHER_RATIO
    sampler.GATHER_RATIO = 0 if path == "gather" else 10**9
    try:
        yield
    finally:
        sampler.GATHER_RATIO = saved


def _oracle_stats(logits, labels, temperature, support):
    return reference.token_stats(logits, labels, temperature=temperature, sampling_support=support)


def _scale(t):
    return max(1.0, float(t.detach().abs().max())) if t.numel() else 1.0


@pytest.mark.parametrize("path", ["gather", "masked"])
@pytest.mark.parametrize("dtype", [F64, F32, torch.bfloat16, torch.float16])
@settings(max_examples=scaled(40))
@given(data=st.data())
def test_token_logprobs_match_the_oracle(path, dtype, data):
    batch, support, temperature = data.draw(sampler_inputs(dtype))
    logits = batch.logits.clone().requires_grad_(True)
    with _path(path):
        out = rlkernels.token_logprobs(logits, batch.labels, temperature=temperature, sampling_support=support,
                                       compute_entropy=True, compute_sum_pi_squared=True)
    ref_logits = batch.logits.double().clone().requires_grad_(True)
    lp, H, s2 = _oracle_stats(ref_logits, batch.labels, temperature, support)
    stat = F64 if dtype == F64 else F32
    for name, got, want in (("logprobs", out.logprobs, lp), ("entropy", out.entropy, H),
                            ("sum_pi_squared", out.sum_pi_squared, s2)):
        assert_close(got, want, **tol("value", stat, scale=_scale(want)), name=name)
    weight = torch.linspace(-1, 1, batch.labels.numel(), dtype=F64).reshape(batch.labels.shape)
    (grad,) = torch.autograd.grad((out.logprobs * weight.to(out.logprobs.dtype)).sum() + out.entropy.sum(), logits)
    (ref_grad,) = torch.autograd.grad((lp * weight).sum() + H.sum(), ref_logits)
    if support is not None:
        ids = torch.where(support >= 0, support, batch.logits.shape[-1])  # padding -> a column dropped below
        kept = torch.zeros(batch.labels.shape + (batch.logits.shape[-1] + 1,), dtype=torch.bool)
        kept = kept.scatter(-1, ids, True)[..., :-1]
        assert not bool(grad.detach()[~kept].any()), "a gradient outside the kept set"
    row = "sampler.dlogits" if dtype in (torch.bfloat16, torch.float16) else "dlogits"
    q = tol(row, dtype, scale=max(1e-3, float(ref_grad.abs().max())) if ref_grad.numel() else 1.0)
    if dtype != F64 and batch.labels.numel():
        # the entropy's gradient -p (log p + H) / T and the label's (p_y - 1) / T cancel O(1) terms in
        # float32: an absolute 2^-23 |coef| / T whatever the size of the result (coef here is <= 1)
        inv_t = 1.0 / (temperature if isinstance(temperature, float) else float(temperature.min()))
        q["atol"] = max(q["atol"], 2.0**-22 * inv_t)
    assert_close(grad, ref_grad, **q, name="dlogits")


@pytest.mark.parametrize("path", ["gather", "masked"])
@pytest.mark.parametrize("dtype", [F64, F32])
@settings(max_examples=scaled(30))
@given(data=st.data())
def test_linear_token_logprobs_match_the_oracle(path, dtype, data):
    """A small kept set reads only the K kept rows of the head (a gather); a large one masks the chunks
    of logits of the fused-linear pass. The gradient reaches hidden, weight and bias either way; the
    oracle forms the logits and masks the rest."""
    batch, support, temperature = data.draw(sampler_inputs(dtype))
    V = batch.logits.shape[-1]
    shape = tuple(batch.labels.shape)
    hidden, weight, bias = make_head(torch.Generator().manual_seed(1), shape, V, 6, dtype, bias=True)
    leaves = [t.clone().requires_grad_(True) for t in (hidden, weight, bias)]
    with _path(path):
        out = rlkernels.linear_token_logprobs(leaves[0], leaves[1], batch.labels, bias=leaves[2],
                                              temperature=temperature, sampling_support=support,
                                              compute_entropy=True, memory_budget_bytes=256)  # a few rows per chunk
    ref = [t.double().clone().requires_grad_(True) for t in (hidden, weight, bias)]
    lp, H, _ = _oracle_stats(ref[0] @ ref[1].T + ref[2], batch.labels, temperature, support)
    stat = F64 if dtype == F64 else F32
    assert_close(out.logprobs, lp, **tol("value", stat, scale=_scale(lp)), name="logprobs")
    assert_close(out.entropy, H, **tol("value", stat, scale=_scale(H)), name="entropy")
    grads = torch.autograd.grad(out.logprobs.sum() + out.entropy.sum(), leaves)
    ref_grads = torch.autograd.grad(lp.sum() + H.sum(), ref)
    for name, g, r in zip(("d_hidden", "d_weight", "d_bias"), grads, ref_grads):
        assert_close(g, r, **tol("value", stat, scale=_scale(r)), name=name)


@pytest.mark.parametrize("path", ["gather", "masked"])
@settings(max_examples=scaled(30))
@given(data=st.data(), dtype=st.sampled_from([F64, F32]))
def test_loss_with_sampler_inputs_matches_the_oracle(path, data, dtype):
    """decoupled_ppo_loss over the option product, with a per-token temperature and a kept set: loss,
    statistics, metrics and gradient against the oracle."""
    batch, support, temperature = data.draw(sampler_inputs(dtype))
    mode = data.draw(st.sampled_from(MODES))
    config = data.draw(configs(mode, temperature=1.0))
    kw = batch.kwargs(mode)
    logits = batch.logits.clone().requires_grad_(True)
    args = (batch.labels, batch.advantages, batch.response_mask)
    with _path(path):
        out = rlkernels.decoupled_ppo_loss(logits, *args, config=config, temperature=temperature,
                                           sampling_support=support, **kw)
    ref_logits = batch.logits.double().clone().requires_grad_(True)
    ref_kw = {k: (None if v is None else (v.double() if v.is_floating_point() else v)) for k, v in kw.items()}
    expected = reference.decoupled_ppo_loss(ref_logits, batch.labels, batch.advantages.double(), batch.response_mask,
                                            config=config, temperature=temperature, sampling_support=support, **ref_kw)
    stat = F64 if dtype == F64 else F32
    assert_close(out.loss, expected.loss, **tol("value", stat, scale=_scale(expected.loss)), name="loss")
    assert_close(out.logprobs, expected.logprobs, **tol("value", stat), name="logprobs")
    for name, value in expected.metrics.items():
        assert_close(out.metrics[name], value, **tol("value", stat, scale=_scale(value)), name=name)
    (grad,) = torch.autograd.grad(out.loss, logits)
    (ref_grad,) = torch.autograd.grad(expected.loss, ref_logits)
    q = tol("dlogits", dtype, scale=max(1e-3, float(ref_grad.abs().max())) if ref_grad.numel() else 1.0)
    if dtype == F32:
        q["atol"] = max(q["atol"], _label_column_floor(batch, config, ref_grad, temperature, support))
    assert_close(grad, ref_grad, **q, name="dlogits")


def test_a_kept_set_never_runs_the_vocabulary_pass(monkeypatch):
    """With a support the statistics come from the K gathered logits alone: the vocabulary-wide op is
    never called (its cost would scale with V)."""
    from rlkernels.ops import vocab as custom_ops

    def refuse(*args, **kwargs):
        raise AssertionError("the vocabulary-wide pass ran")

    monkeypatch.setattr(custom_ops, "token_stats", refuse)
    batch = make_batch("packed", [4, 3], 200, dtype=F32, seed=2)
    support = make_support(batch.labels, 200, 5, seed=3)  # 5 of 200: the gather (sampler.gathers)
    assert sampler.gathers(5, 200)
    out = rlkernels.decoupled_ppo_loss(batch.logits, batch.labels, batch.advantages, batch.response_mask,
                                       old_logprobs=batch.old_logprobs, cu_seqlens=batch.cu_seqlens,
                                       sampling_support=support, config=PolicyLossConfig(entropy_coeff=0.01))
    assert torch.isfinite(out.loss)


def test_full_support_equals_no_support():
    batch = make_batch("padded", [5, 5], 9, dtype=F64, seed=4)
    support = torch.arange(9).expand(2, 5, 9)
    t = torch.tensor([[0.5], [1.3]], dtype=F64)
    a = rlkernels.token_logprobs(batch.logits, batch.labels, temperature=t, sampling_support=support,
                                 compute_entropy=True)
    b = rlkernels.token_logprobs(batch.logits, batch.labels, temperature=t, compute_entropy=True)
    assert_close(a.logprobs, b.logprobs, **tol("kept_set.full_support", F64), name="logprobs")
    assert_close(a.entropy, b.entropy, **tol("kept_set.full_support", F64), name="entropy")


ERRORS = [
    (dict(sampling_support=torch.full((2, 3, 2), 9)), ValueError, r"^sampling_support: expected token ids in \[0, 7\)"),
    (dict(sampling_support=torch.zeros(2, 3, 2, dtype=torch.long)), ValueError,
     r"^sampling_support: an id appears twice"),
    (dict(sampling_support=torch.full((2, 3, 1), -1)), ValueError, r"^sampling_support: a label in the loss is not"),
    (dict(sampling_support=torch.zeros(2, 3, dtype=torch.long)), ValueError,
     r"^sampling_support: expected shape \(2, 3, 'K'\)"),
    (dict(sampling_support=torch.zeros(2, 3, 1)), TypeError, r"^sampling_support"),
    (dict(temperature=torch.ones(3, 2)), ValueError, r"^temperature: expected a float or a tensor broadcastable"),
    (dict(temperature=torch.ones(2)), ValueError, r"^temperature: expected a tensor with the labels' 2 dimensions"),
    (dict(sampling_support=torch.zeros(2, 3, 0, dtype=torch.long)), ValueError,
     r"^sampling_support: expected shape \(2, 3, 'K'\)"),
    (dict(temperature=torch.zeros(2, 1)), ValueError, r"^temperature: expected finite values > 0"),
]


@pytest.mark.parametrize("kw,error,match", ERRORS, ids=[m for _, _, m in ERRORS])
def test_bad_sampler_inputs_name_the_argument(kw, error, match):
    logits = torch.randn(2, 3, 7)
    labels = torch.tensor([[1, 2, 3], [4, 5, 6]])
    with pytest.raises(error, match=match):
        rlkernels.token_logprobs(logits, labels, **kw)


def test_tensor_temperature_and_config_temperature_are_one_or_the_other():
    batch = make_batch("padded", [3, 3], 5, dtype=F32, seed=5)
    with pytest.raises(ValueError, match=r"^temperature: given as a tensor while config.temperature=0.7"):
        rlkernels.decoupled_ppo_loss(batch.logits, batch.labels, batch.advantages, batch.response_mask,
                                     config=PolicyLossConfig(temperature=0.7), temperature=torch.ones(2, 1))
    rc = RolloutCorrection.token_tis()
    out = rlkernels.decoupled_ppo_loss(batch.logits, batch.labels, batch.advantages, batch.response_mask,
                                       rollout_logprobs=batch.rollout_logprobs, rollout_correction=rc,
                                       temperature=torch.full((2, 1), 0.7))
    same = rlkernels.decoupled_ppo_loss(batch.logits, batch.labels, batch.advantages, batch.response_mask,
                                        rollout_logprobs=batch.rollout_logprobs, rollout_correction=rc,
                                        temperature=0.7, backend="torch")
    assert_close(out.loss, same.loss, **tol("tensor_temperature", F32), name="loss")


def _backend_available(name: str) -> bool:
    from rlkernels import backends

    if name == "triton":
        return backends.available()["triton"] and backends.select("triton", torch.zeros(1, 2)) is not None
    return backends.available()[name]


@pytest.mark.parametrize("backend", ["torch", "cpu", "triton"])
@settings(max_examples=scaled(30))
@given(data=st.data(), dtype=st.sampled_from([F32, torch.bfloat16]))
def test_per_token_temperature_on_every_backend(backend, data, dtype):
    """The vocabulary passes themselves take the rows' temperatures (no kept set): each backend's
    statistics and gradient against the oracle (CUDA: tests/backends/test_cuda_backend.py on a GPU)."""
    if not _backend_available(backend):
        pytest.skip(f"the {backend} backend is not available here")
    batch = data.draw(batches(dtype=dtype))
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2**16)))
    temperature = 0.3 + torch.rand(batch.labels.shape, generator=gen) * 1.5
    logits = batch.logits.clone().requires_grad_(True)
    out = rlkernels.token_logprobs(logits, batch.labels, temperature=temperature, compute_entropy=True,
                                   compute_sum_pi_squared=True, backend=backend)
    ref_logits = batch.logits.double().clone().requires_grad_(True)
    lp, H, s2 = _oracle_stats(ref_logits, batch.labels, temperature, None)
    for name, got, want in (("logprobs", out.logprobs, lp), ("entropy", out.entropy, H),
                            ("sum_pi_squared", out.sum_pi_squared, s2)):
        assert_close(got, want, **tol("value", F32, scale=_scale(want)), name=name)
    weight = torch.linspace(-1, 1, batch.labels.numel(), dtype=F64).reshape(batch.labels.shape)
    (grad,) = torch.autograd.grad((out.logprobs * weight.float()).sum() + out.entropy.sum(), logits)
    (ref_grad,) = torch.autograd.grad((lp * weight).sum() + H.sum(), ref_logits)
    row = "dlogits@interpreter" if backend == "triton" and dtype == torch.bfloat16 else "dlogits"
    q = tol(row, dtype, scale=max(1e-3, float(ref_grad.abs().max())) if ref_grad.numel() else 1.0)
    if batch.labels.numel():  # the float32 cancellations of the label and entropy terms (see above)
        q["atol"] = max(q["atol"], 2.0**-22 / float(temperature.min()))
    assert_close(grad, ref_grad, **q, name="dlogits")


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["triton", "cuda"])
@pytest.mark.parametrize("seed", range(4))
def test_sampler_inputs_on_gpu_backends(backend, seed):
    """On a GPU: the kernels' per-row temperature (Triton compiled, CUDA extension) and a kept set,
    against the oracle on CUDA tensors."""
    if not _backend_available(backend):
        pytest.skip(f"the {backend} backend is not available here")
    batch = make_batch("packed", [7, 0, 33, 5], 1000, dtype=torch.bfloat16 if seed % 2 else F32, seed=seed,
                       logit_kind=("normal", "offset_pos", "neg_inf", "one_hot")[seed])
    gen = torch.Generator().manual_seed(seed)
    temperature = (0.3 + torch.rand(batch.labels.shape, generator=gen) * 1.5).cuda()
    support = make_support(batch.labels, 1000, 50, seed).cuda() if seed >= 2 else None
    logits = batch.logits.cuda().requires_grad_(True)
    out = rlkernels.token_logprobs(logits, batch.labels.cuda(), temperature=temperature, sampling_support=support,
                                   compute_entropy=True, backend=backend)
    ref_logits = batch.logits.double().cuda().requires_grad_(True)
    lp, H, _ = _oracle_stats(ref_logits, batch.labels.cuda(), temperature, support)
    assert_close(out.logprobs, lp, **tol("value", F32, scale=_scale(lp)), name="logprobs")
    assert_close(out.entropy, H, **tol("value", F32, scale=_scale(H)), name="entropy")
    (grad,) = torch.autograd.grad(out.logprobs.sum() + out.entropy.sum(), logits)
    (ref_grad,) = torch.autograd.grad(lp.sum() + H.sum(), ref_logits)
    q = tol("sampler.dlogits" if logits.dtype == torch.bfloat16 else "dlogits", logits.dtype,
            scale=max(1e-3, float(ref_grad.abs().max())))
    q["atol"] = max(q["atol"], 2.0**-22 / float(temperature.min()))
    assert_close(grad, ref_grad, **q, name="dlogits")


@pytest.mark.parametrize("path", ["gather", "masked"])
@settings(max_examples=scaled(20))
@given(data=st.data())
def test_linear_loss_with_sampler_inputs_matches_the_oracle(path, data):
    """linear_decoupled_ppo_loss with a per-token temperature and a kept set, float64, against the
    oracle on the head's logits: loss, metrics and the gradients of hidden, weight and bias."""
    batch, support, temperature = data.draw(sampler_inputs(F64))
    mode = data.draw(st.sampled_from(MODES))
    config = data.draw(configs(mode, temperature=1.0))
    shape = tuple(batch.labels.shape)
    hidden, weight, bias = make_head(torch.Generator().manual_seed(2), shape, batch.logits.shape[-1], 5, F64,
                                     bias=True)
    leaves = [t.clone().requires_grad_(True) for t in (hidden, weight, bias)]
    args = (batch.labels, batch.advantages, batch.response_mask)
    with _path(path):
        out = rlkernels.linear_decoupled_ppo_loss(leaves[0], leaves[1], *args, bias=leaves[2], config=config,
                                                  temperature=temperature, sampling_support=support,
                                                  memory_budget_bytes=512, **batch.kwargs(mode))
    ref = [t.clone().requires_grad_(True) for t in (hidden, weight, bias)]
    expected = reference.decoupled_ppo_loss(ref[0] @ ref[1].T + ref[2], *args, config=config, temperature=temperature,
                                            sampling_support=support, **batch.kwargs(mode))
    assert_close(out.loss, expected.loss, **tol("value", F64, scale=_scale(expected.loss)), name="loss")
    for name, value in expected.metrics.items():
        assert_close(out.metrics[name], value, **tol("value", F64, scale=_scale(value)), name=name)
    for name, g, r in zip(("d_hidden", "d_weight", "d_bias"), torch.autograd.grad(out.loss, leaves),
                          torch.autograd.grad(expected.loss, ref)):
        assert_close(g, r, **tol("value", F64, scale=_scale(r)), name=name)


@pytest.mark.parametrize("path", ["gather", "masked"])
def test_kept_set_on_the_causal_shift_view(path):
    """model_out[:, :-1] (rows that are not one strided sequence) with a kept set, read where it lies."""
    gen = torch.Generator().manual_seed(7)
    out = torch.randn(2, 6, 40, generator=gen, dtype=F64)
    labels = torch.randint(0, 40, (2, 5), generator=gen)
    support = make_support(labels, 40, 2, seed=8)
    t = torch.tensor([[0.6], [1.4]], dtype=F64)
    shifted = out[:, :-1]
    with _path(path):
        got = rlkernels.token_logprobs(shifted, labels, temperature=t, sampling_support=support, compute_entropy=True)
    lp, H, _ = _oracle_stats(shifted, labels, t, support)
    assert_close(got.logprobs, lp, **tol("value", F64), name="logprobs")
    assert_close(got.entropy, H, **tol("value", F64), name="entropy")
