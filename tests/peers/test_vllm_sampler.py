"""numerics="vllm" on the Triton backend against vLLM 0.33.0's own V2 sampler kernels, taken from its wheel
(`pip download --no-deps vllm==0.33.0`, two files unpacked, their `vllm.*` imports stubbed) and run beside ours.

What this certifies, under Triton's CPU interpreter: the operation order. Both kernels run through the same
interpreter, whose loads, divisions, exponentials and block sums are numpy's, so equal bits here mean the same
operations on the same values in the same order and blocking (the float32 copy, the division by the float32
temperature, rows at T = 1 left alone, the max pass and the sum pass over 1024-wide blocks, `x - max - log(se)`).
What only a GPU can certify: the device's bits, which also need the same Triton version on both sides (its code
generation, the layout of a 4-warp tl.sum): benchmarks/gpu_check.sh runs tests/ops/test_numerics.py's GPU cases.

Skipped, with the reason, where the wheel cannot be fetched.
"""

import pytest
import torch

import rlkernels
from rlkernels.testing.peers import vllm_v2_processed_logprobs, vllm_v2_sampler

from ..cases import interpreted

pytestmark = [
    pytest.mark.interpret,
    pytest.mark.skipif(not interpreted(), reason="vLLM's Triton kernels run on CPU tensors through the interpreter"),
    pytest.mark.filterwarnings("ignore:(divide by zero|invalid value|overflow) encountered:RuntimeWarning"),
]


@pytest.fixture(scope="module")
def vllm_kernels():
    try:
        return vllm_v2_sampler()
    except RuntimeError as exc:
        pytest.skip(str(exc))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("V", [1000, 3001, 4097])
@pytest.mark.parametrize("temperature", [1.0, 0.7, "per_row"])
def test_the_triton_backend_has_vllm_v2s_operation_order(vllm_kernels, dtype, V, temperature):
    gen = torch.Generator().manual_seed(V)
    N = 6
    logits = (torch.randn(N, V, generator=gen) * 3).to(dtype)
    labels = torch.randint(0, V, (N,), generator=gen)
    if temperature == "per_row":
        temperatures = (0.3 + torch.rand(N, generator=gen)).to(torch.float32)
        temperatures[2] = 1.0  # a request at T = 1 in a batch that is processed: left alone, as vLLM leaves it
    else:
        temperatures = torch.full((N,), temperature, dtype=torch.float32)
    want = vllm_v2_processed_logprobs(vllm_kernels, logits, labels, temperatures)
    T = temperatures if temperature == "per_row" else temperature
    ours = rlkernels.token_logprobs(logits, labels, temperature=T, numerics="vllm", backend="triton").logprobs
    assert torch.equal(ours, want), (ours - want).abs().max()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_raw_logprobs_are_vllm_v2s_on_the_logits_as_they_are(vllm_kernels, dtype):
    """numerics="vllm_raw" (vLLM's default logprobs_mode): its log-softmax kernel on the unprocessed logits, in their
    own dtype (the max pass then compares bf16 values), whatever the trainer's temperature."""
    gen = torch.Generator().manual_seed(2)
    logits = (torch.randn(6, 3001, generator=gen) * 3).to(dtype)
    labels = torch.randint(0, 3001, (6,), generator=gen)
    want = vllm_kernels["logprob"].compute_token_logprobs(logits, labels[:, None])[:, 0]
    ours = rlkernels.token_logprobs(logits, labels, temperature=0.7, numerics="vllm_raw", backend="triton").logprobs
    assert torch.equal(ours, want)


def test_past_one_block_the_default_order_is_not_vllms(vllm_kernels):
    """Why the mode exists: the default Triton pass rescales a running sum over 8192-wide blocks and multiplies
    by 1/T, where vLLM makes two passes over 1024-wide blocks and divides; past one block the bits part."""
    gen = torch.Generator().manual_seed(1)
    N, V = 8, 20_001
    logits = (torch.randn(N, V, generator=gen) * 3).to(torch.bfloat16)
    labels = torch.randint(0, V, (N,), generator=gen)
    want = vllm_v2_processed_logprobs(vllm_kernels, logits, labels, torch.full((N,), 0.7))
    default = rlkernels.token_logprobs(logits, labels, temperature=0.7, backend="triton").logprobs
    mode = rlkernels.token_logprobs(logits, labels, temperature=0.7, numerics="vllm", backend="triton").logprobs
    assert torch.equal(mode, want)
    assert int((default == want).sum()) < N
