"""The one dispatch point of the vocabulary passes: `resolve(name, tensor)` says which backend runs them on
a tensor, `instance(name)` hands that backend out.

Whether a backend can run (the CPU kernels built and loaded, the CUDA extension importable, Triton
importable) is probed once per process by `is_available`, and that answer is a constant to
torch.compile (`torch.compiler.assume_constant_result`): Dynamo calls the probe itself while tracing
-- the first call of a fresh process builds the CPU kernels there, outside the graph -- and never
traces the file-system and import work inside it. The memo is a plain dict, not `functools.lru_cache`,
which Dynamo warns about whenever it meets one.
"""

import os
from typing import Callable, Dict, Optional, Tuple

import torch

from ..kernels.stage_options import TokenFactors, option_codes
from .base import Backend, RowStats, statistics_dtype
from .torch_backend import TorchBackend

KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)  # what the Triton and CUDA kernels read
NAMES = ("auto", "torch", "cpu", "triton", "cuda")

__all__ = ["Backend", "NAMES", "RowStats", "available", "instance", "is_available", "resolve", "select",
           "stage_factors", "statistics_dtype"]


def _probe_triton():
    try:
        from .triton_backend import TritonBackend
    except ImportError:
        return None
    return TritonBackend()


def _probe_cuda():
    try:
        from .cuda_backend import CudaBackend
    except ImportError:
        return None
    backend = CudaBackend()
    return backend if backend.is_built() else None


def _probe_cpu():
    from .cpu_backend import CpuBackend

    backend = CpuBackend()
    return backend if backend.is_built() else None  # builds on first use (cpu_backend.py)


_PROBES: Dict[str, Callable] = {"cpu": _probe_cpu, "triton": _probe_triton, "cuda": _probe_cuda}
_KERNEL_BACKENDS: Dict[str, Optional[object]] = {}  # name -> backend instance or None, probed once per process


def _kernel_backend(name: str):
    if name not in _KERNEL_BACKENDS:
        _KERNEL_BACKENDS[name] = _PROBES[name]()
    return _KERNEL_BACKENDS[name]


@torch.compiler.assume_constant_result
def is_available(name: str) -> bool:
    """Whether backend `name` can run in this process (probed once; a constant under torch.compile)."""
    return name == "torch" or _kernel_backend(name) is not None


@torch.compiler.assume_constant_result
def triton_interpreter() -> bool:
    """TRITON_INTERPRET=1: Triton kernels run on CPU tensors (the tests' interpreter)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def available() -> dict:
    """Which backends can run in this process (for diagnostics and the benchmark harness)."""
    return {name: is_available(name) for name in NAMES[1:]}


def _device_type(tensor) -> str:
    return tensor.device.type


def _supports(name: str, tensor) -> bool:
    """Whether kernel backend `name` runs on this tensor's device and dtype (`tensor` may be anything
    with .device and .dtype)."""
    if tensor.dtype not in KERNEL_DTYPES:
        return False
    device = _device_type(tensor)
    if name == "triton":
        return device == "cuda" or (device == "cpu" and triton_interpreter())
    return device == ("cuda" if name == "cuda" else "cpu")


def resolve(name: str, tensor) -> str:
    """The backend that runs on `tensor` for the user's `backend=` name. "auto": Triton on CUDA tensors
    when importable; the CPU kernels on CPU tensors of a kernel dtype when they build; else torch
    (float64 included). An explicit name that cannot run here raises, naming why.

    Traceable by torch.compile with no graph break: availability is a constant (is_available), the
    rest reads only the tensor's device and dtype."""
    if name == "torch":
        return "torch"
    if name == "auto":
        device = _device_type(tensor)
        preferred = "triton" if device == "cuda" else "cpu" if device == "cpu" else None
        if preferred is not None and is_available(preferred) and _supports(preferred, tensor):
            return preferred
        return "torch"
    if name not in NAMES:
        raise ValueError(f"backend: expected 'auto', 'torch', 'cpu', 'triton' or 'cuda', got {name!r}")
    if tensor.dtype not in KERNEL_DTYPES:
        raise ValueError(
            f"backend={name!r}: supports float16, bfloat16 and float32 logits, got {tensor.dtype}; "
            "use backend='torch' (or 'auto') for float64"
        )
    if not is_available(name):
        raise RuntimeError(_unavailable[name]())
    if not _supports(name, tensor):
        need = {"triton": "CUDA logits (or TRITON_INTERPRET=1 for CPU)", "cuda": "CUDA logits",
                "cpu": "CPU logits"}[name]
        raise ValueError(f"backend={name!r}: needs {need}, got device {tensor.device}")
    return name


def _cpu_unavailable() -> str:
    if os.environ.get("RLKERNELS_CPU_KERNELS") == "0":
        return "backend='cpu': the CPU kernels are turned off (RLKERNELS_CPU_KERNELS=0)"
    return ("backend='cpu': the CPU kernels could not be built (see the warning above; backend='torch' runs "
            "everywhere)")


_unavailable = {
    "triton": lambda: "backend='triton': Triton is not importable in this environment (pip install triton)",
    "cuda": lambda: "backend='cuda': the rlkernels CUDA extension is not built (see README, 'CUDA backend')",
    "cpu": _cpu_unavailable,
}


def instance(name: str, chunk_rows=None, vocab_shard: bool = False) -> Backend:
    """The backend object of a resolved name (eager code: the custom ops' bodies).

    vocab_shard: the logits are one shard of a vocabulary-parallel head (ops/vocab_parallel.py):
    rows may carry FOREIGN_TARGET, and the backward must form p from the given (row_max, log_norm),
    the whole vocabulary's normaliser. The kernels (Triton, CUDA, CPU) do both always; the torch
    backend is told to (it otherwise recomputes the softmax of the rows it has, and skips the
    foreign-target work)."""
    if name == "torch":
        return TorchBackend(chunk_rows, vocab_shard)
    return _kernel_backend(name)


def select(name: str, logits, chunk_rows=None, vocab_shard: bool = False) -> Backend:
    """resolve() and instance() in one call: the backend object for these logits."""
    return instance(resolve(name, logits), chunk_rows, vocab_shard)


def stage_factors(name: str, inputs, options: dict, hyper: dict) -> Tuple[TokenFactors, dict]:
    """(TokenFactors, the option codes): the fused stage's kernels `name` ("triton" or "cpu") in their factors mode,
    what the gradient formed in the forward forms each token's coefficients from (stage/fused.py forward_factors runs
    them on placeholder log-probs), as both backends' forward_gradient read them: float32, contiguous."""
    codes = option_codes(options)
    factor, _, a, coef_entropy, weights, _ = instance(name).sequence_stage(inputs, options, hyper, True)
    f32 = lambda t: None if t is None else t.to(torch.float32).contiguous()  # noqa: E731
    proximal = (None, inputs.old, inputs.rollout)[codes["PROXIMAL"]]
    return TokenFactors(inputs.mask.to(torch.bool).contiguous(), f32(inputs.advantages), f32(proximal),
                        f32(inputs.ref), a, weights, factor if codes["NORMALIZE"] else None, coef_entropy), codes
