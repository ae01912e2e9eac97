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

import importlib.util
import os
import subprocess
import sys
import types
import zipfile
from pathlib import Path

import pytest
import torch

import rlkernels

from ..cases import interpreted

pytestmark = [
    pytest.mark.interpret,
    pytest.mark.skipif(not interpreted(), reason="vLLM's Triton kernels run on CPU tensors through the interpreter"),
    pytest.mark.filterwarnings("ignore:(divide by zero|invalid value|overflow) encountered:RuntimeWarning"),
]

VERSION = "0.33.0"
FILES = ("vllm/v1/worker/gpu/sample/logprob.py", "vllm/v1/worker/gpu/sample/gumbel.py")


def _cache() -> Path:
    base = os.environ.get("RLKERNELS_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "rlkernels")
    return Path(base) / "peers" / f"vllm-{VERSION}"


def _fetch() -> Path:
    """The two sampler files, unpacked once per machine (the wheel itself is not kept: 336 MB)."""
    root = _cache()
    if all((root / f).is_file() for f in FILES):
        return root
    wheels = root / "wheel"
    wheels.mkdir(parents=True, exist_ok=True)
    try:
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-q", f"vllm=={VERSION}", "-d",
                        str(wheels)], check=True, capture_output=True, text=True, timeout=600)
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as exc:
        pytest.skip(f"vllm=={VERSION}'s wheel could not be fetched: {str(getattr(exc, 'stderr', exc))[-300:]}")
    (wheel,) = wheels.glob("vllm-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        for f in FILES:
            target = root / f
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(archive.read(f))
    wheel.unlink()
    return root


@pytest.fixture(scope="module")
def vllm_kernels():
    """vLLM's logprob.py and gumbel.py as modules, with stubs for the vllm imports they name."""
    import triton
    import triton.language as tl

    root = _fetch()
    stubs = {
        "vllm": types.ModuleType("vllm"),
        "vllm.triton_utils": types.SimpleNamespace(tl=tl, triton=triton),
        "vllm.sampling_params": types.SimpleNamespace(MAX_LOGPROB_TOKEN_IDS=0, SamplingParams=object),
        "vllm.v1.outputs": types.SimpleNamespace(LogprobsTensors=object),
        "vllm.v1.worker.gpu.buffer_utils": types.SimpleNamespace(StagedWriteTensor=object, UvaBackedTensor=object),
    }
    saved = {name: sys.modules.get(name) for name in stubs}
    sys.modules.update(stubs)
    try:
        modules = {}
        for f in FILES:
            name = "vllm_v2_" + Path(f).stem
            spec = importlib.util.spec_from_file_location(name, root / f)
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
            modules[Path(f).stem] = module
    finally:
        for name, module in saved.items():
            if module is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = module
    return modules


def _vllm_processed_logprobs(kernels, logits, labels, temperatures):
    """What vLLM's V2 sampler returns for the sampled tokens (sampler.py: apply_sampling_params, then
    compute_topk_scores): logits as they are when no request needs processing, else a float32 copy with each
    row divided by its temperature; then the log-softmax kernel at the sampled ids."""
    if bool(((temperatures != 0) & (temperatures != 1)).any()):
        logits = torch.empty_like(logits, dtype=torch.float32).copy_(logits)
        kernels["gumbel"].apply_temperature(logits, torch.arange(logits.shape[0]), temperatures)
    return kernels["logprob"].compute_token_logprobs(logits, labels[:, None])[:, 0]


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
    want = _vllm_processed_logprobs(vllm_kernels, logits, labels, temperatures)
    T = temperatures if temperature == "per_row" else temperature
    ours = rlkernels.token_logprobs(logits, labels, temperature=T, numerics="vllm", backend="triton").logprobs
    assert torch.equal(ours, want), (ours - want).abs().max()


def test_past_one_block_the_default_order_is_not_vllms(vllm_kernels):
    """Why the mode exists: the default Triton pass rescales a running sum over 8192-wide blocks and multiplies
    by 1/T, where vLLM makes two passes over 1024-wide blocks and divides; past one block the bits part."""
    gen = torch.Generator().manual_seed(1)
    N, V = 8, 20_001
    logits = (torch.randn(N, V, generator=gen) * 3).to(torch.bfloat16)
    labels = torch.randint(0, V, (N,), generator=gen)
    want = _vllm_processed_logprobs(vllm_kernels, logits, labels, torch.full((N,), 0.7))
    default = rlkernels.token_logprobs(logits, labels, temperature=0.7, backend="triton").logprobs
    mode = rlkernels.token_logprobs(logits, labels, temperature=0.7, numerics="vllm", backend="triton").logprobs
    assert torch.equal(mode, want)
    assert int((default == want).sum()) < N
