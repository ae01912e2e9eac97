"""numerics="vllm": the sampled token's log-prob with vLLM 0.33.0's V1 sampler's bits on the torch, CPU and CUDA
backends, for every dtype, temperature and layout, through every entry point; the default is not bit-equal to it
(which is why the mode exists), and the gradient does not change. The Triton backend reproduces vLLM's V2 sampler
instead (its default runner on a GPU): tests/peers/test_vllm_sampler.py checks it against vLLM's own kernels.

The comparison is vLLM's own V1 arithmetic (vllm/v1/sample/sampler.py): `logits.to(torch.float32)` (:158),
`logits.div_(temp.unsqueeze(dim=1))` with the float32 per-request temperatures (:291-300), then
`logits.log_softmax(dim=-1, dtype=torch.float32)` (:368-370). Those three ATen calls are the engine's code path on
a CPU (the V1 runner, or V2 without Triton); they run here on the CPU, so equality is bitwise on this device. On a
GPU the same calls give vLLM's V1 CUDA bits; vLLM's default V2 runner there uses Triton kernels of its own, whose
order the Triton backend follows (docs/numerics.md).
"""

import pytest
import torch
import torch.nn.functional as F

import rlkernels
from rlkernels import backends
from rlkernels.testing.peers import vllm_v1_processed_logprobs as vllm_v1

from ..cases import BF16, F16, F32, assert_close, interpreted, tol

BACKENDS = ["torch", pytest.param("cpu", marks=pytest.mark.skipif(not backends.available()["cpu"], reason=
            "the CPU kernels could not be built here"))]


def _batch(dtype, V=517, seed=0):
    gen = torch.Generator().manual_seed(seed)
    logits = (torch.randn(3, 6, V, generator=gen) * 3).to(dtype)
    labels = torch.randint(0, V, (3, 6), generator=gen)
    labels[0, :2] = -100
    return logits, labels


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [F32, BF16, F16], ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("temperature", [1.0, 0.7, "per_row"])
def test_token_logprobs_have_vllms_bits(backend, dtype, temperature):
    logits, labels = _batch(dtype, seed=3)
    T = (0.5 + torch.rand(labels.shape, generator=torch.Generator().manual_seed(1))) if temperature == "per_row" \
        else temperature
    out = rlkernels.token_logprobs(logits, labels, temperature=T, numerics="vllm", backend=backend)
    want = vllm_v1(logits, labels, T)
    assert torch.equal(out.logprobs, want)
    # the causal-shift view [B, T + 1, V][:, :-1], read where it lies
    whole = torch.cat([logits, logits[:, :1]], dim=1)
    shifted = rlkernels.token_logprobs(whole[:, :-1], labels, temperature=T, numerics="vllm", backend=backend)
    assert torch.equal(shifted.logprobs, want)


@pytest.mark.parametrize("backend", BACKENDS)
def test_raw_logprobs_are_vllms_before_the_temperature(backend):
    """vllm_raw: vLLM's default logprobs_mode ("raw_logprobs"): log_softmax of the logits as the model gave them
    (V1: `logits.log_softmax(dim=-1, dtype=torch.float32)`, a float32 copy first on the CPU), whatever T is."""
    logits, labels = _batch(BF16, seed=12)
    out = rlkernels.token_logprobs(logits, labels, temperature=0.6, numerics="vllm_raw", backend=backend)
    assert torch.equal(out.logprobs, vllm_v1(logits, labels, 1.0))
    assert not torch.equal(out.logprobs, vllm_v1(logits, labels, 0.6))


def test_the_default_is_not_vllms_order_and_the_gradient_is_the_same():
    logits, labels = _batch(F32, V=4099)
    results = {}
    for numerics in ("default", "vllm"):
        leaf = logits.clone().requires_grad_(True)
        out = rlkernels.token_logprobs(leaf, labels, temperature=0.7, compute_entropy=True, numerics=numerics)
        (out.logprobs.sum() + out.entropy.sum()).backward()
        results[numerics] = (out, leaf.grad)
    want = vllm_v1(logits, labels, 0.7)
    assert not torch.equal(results["default"][0].logprobs, want)  # 1/T multiplied after the max, other sums
    assert torch.equal(results["vllm"][0].logprobs, want)
    assert torch.equal(results["vllm"][0].entropy, results["default"][0].entropy)
    assert torch.equal(results["vllm"][1], results["default"][1])  # "the gradient is the ordinary one"


@pytest.mark.parametrize("one_pass", [True, False])
def test_the_losses_and_the_fused_linear_path_report_vllms_bits(one_pass):
    logits, labels = _batch(BF16, seed=5)
    mask = labels >= 0
    adv = torch.randn(labels.shape, generator=torch.Generator().manual_seed(2))
    old = -torch.rand(labels.shape, generator=torch.Generator().manual_seed(4))
    out = rlkernels.decoupled_ppo_loss(logits, labels, adv, mask, old_logprobs=old, numerics="vllm", temperature=0.8)
    assert torch.equal(torch.where(mask, out.logprobs, 0.0), vllm_v1(logits, labels, 0.8))
    # from hidden states: the logits the head forms for the rows in the loss, as one chunk (one GEMM shape)
    gen = torch.Generator().manual_seed(6)
    N, H, V = 18, 16, 517
    hidden = torch.randn(N, H, generator=gen).to(BF16).requires_grad_(True)
    weight = (torch.randn(V, H, generator=gen) * 0.5).to(BF16).requires_grad_(True)
    flat_labels, flat_mask = labels.reshape(-1), mask.reshape(-1)
    rows = torch.nonzero(flat_mask).squeeze(1)
    head_logits = F.linear(hidden.detach().index_select(0, rows), weight.detach())
    want = torch.zeros(N).index_copy(0, rows, vllm_v1(head_logits, flat_labels.index_select(0, rows), 0.8))
    stats = rlkernels.linear_token_logprobs(hidden, weight, flat_labels, temperature=0.8, numerics="vllm")
    assert torch.equal(stats.logprobs, want)
    loss = rlkernels.linear_decoupled_ppo_loss(hidden, weight, flat_labels, adv.reshape(-1), flat_mask,
                                               old_logprobs=old.reshape(-1), temperature=0.8, numerics="vllm",
                                               linear_one_pass=one_pass)
    loss.loss.backward()
    assert loss.path == ("linear_one_pass" if one_pass else "linear_two_pass")
    assert torch.equal(torch.where(flat_mask, loss.logprobs, 0.0), want)


def test_a_compiled_step_keeps_the_bits():
    logits, labels = _batch(F32, seed=7)

    def step(x, y):
        return rlkernels.token_logprobs(x, y, temperature=0.9, numerics="vllm", validate=False).logprobs

    assert torch.equal(torch.compile(step, fullgraph=True)(logits, labels), vllm_v1(logits, labels, 0.9))
    torch._dynamo.reset()


def test_bad_or_unsupported_numerics_are_named():
    logits, labels = _batch(F32)
    with pytest.raises(ValueError, match="numerics: expected 'default', 'vllm', 'vllm_raw' or 'batch_invariant', "
                                         "got 'sglang'"):
        rlkernels.token_logprobs(logits, labels, numerics="sglang")
    with pytest.raises(ValueError, match="numerics: expected"):
        rlkernels.PolicyLossConfig(numerics="exact")
    gen = torch.Generator().manual_seed(0)
    support = torch.stack([torch.randperm(517, generator=gen)[:4] for _ in range(18)]).reshape(3, 6, 4)
    kept_labels = torch.where(labels >= 0, support[..., 0], labels)
    with pytest.raises(ValueError, match="numerics: 'vllm' is not supported with a small kept set"):
        rlkernels.token_logprobs(logits, kept_labels, numerics="vllm", sampling_support=support)


@pytest.mark.interpret
@pytest.mark.skipif(not interpreted(), reason="the Triton backend on CPU tensors needs the interpreter")
def test_the_triton_backends_v2_order_keeps_each_rows_bits_whatever_the_batch():
    """vLLM V2's order on the Triton backend: one program per row, so a row's bits do not depend on the others;
    the values are vLLM V1's to float32 rounding (the two engines' orders differ in the last bits)."""
    logits, labels = _batch(BF16, V=3001, seed=11)
    whole = rlkernels.token_logprobs(logits, labels, temperature=0.7, numerics="vllm", backend="triton").logprobs
    lone = torch.stack([rlkernels.token_logprobs(logits[i:i + 1], labels[i:i + 1], temperature=0.7,
                                                 numerics="vllm", backend="triton").logprobs[0] for i in range(3)])
    assert torch.equal(whole, lone)
    want = vllm_v1(logits, labels, 0.7)
    assert_close(whole, want, **tol("kernel.stats"), name="v2 against v1")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [F32, BF16], ids=["fp32", "bf16"])
def test_on_a_gpu_the_cuda_backend_has_vllms_v1_cuda_bits(dtype):
    if not backends.is_available("cuda"):
        pytest.skip("the CUDA extension is not built here")
    logits, labels = _batch(dtype, V=151_936 // 8, seed=9)
    logits, labels = logits.cuda(), labels.cuda()
    out = rlkernels.token_logprobs(logits, labels, temperature=0.7, numerics="vllm", backend="cuda")
    assert torch.equal(out.logprobs, vllm_v1(logits, labels, 0.7))
    # the Triton backend follows V2 instead: each row's bits whatever the batch, V1's values to rounding
    v2 = rlkernels.token_logprobs(logits, labels, temperature=0.7, numerics="vllm", backend="triton").logprobs
    lone = torch.cat([rlkernels.token_logprobs(logits[:, i:i + 1], labels[:, i:i + 1], temperature=0.7,
                                               numerics="vllm", backend="triton").logprobs for i in range(6)], 1)
    assert torch.equal(v2, lone)
    assert_close(v2, out.logprobs, **tol("kernel.stats"), name="v2 against v1")
