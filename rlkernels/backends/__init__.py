"""The one dispatch point: `select(name, logits)` returns the backend that runs the vocabulary passes,
`select_stage(...)` how the single per-sequence stage runs (eager or compiled)."""

import os
from functools import lru_cache
from typing import Optional

import torch

from .base import Backend, RowStats, statistics_dtype
from .torch_backend import TorchBackend

KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)  # what the Triton and CUDA kernels read

__all__ = ["Backend", "RowStats", "available", "select", "select_stage", "statistics_dtype"]


@lru_cache(maxsize=None)
def _triton_backend():
    try:
        from .triton_backend import TritonBackend
    except ImportError:
        return None
    return TritonBackend()


@lru_cache(maxsize=None)
def _cuda_backend():
    try:
        from .cuda_backend import CudaBackend
    except ImportError:
        return None
    backend = CudaBackend()
    return backend if backend.is_built() else None


@lru_cache(maxsize=None)
def _cpu_backend():
    from .cpu_backend import CpuBackend

    backend = CpuBackend()
    return backend if backend.is_built() else None  # builds on first use (cpu_backend.py)


def available() -> dict:
    """Which backends can run in this process (for diagnostics and the benchmark harness)."""
    return {"torch": True, "cpu": _cpu_backend() is not None, "triton": _triton_backend() is not None,
            "cuda": _cuda_backend() is not None}


def select(name: str, logits: torch.Tensor, chunk_rows=None, vocab_shard: bool = False) -> Backend:
    """Pick the backend for these logits. "auto": Triton on CUDA tensors when importable; the CPU
    kernels on CPU tensors of a kernel dtype when they build; else torch (float64 included).

    vocab_shard: the logits are one shard of a vocabulary-parallel head (rlkernels.distributed):
    rows may carry FOREIGN_TARGET, and the backward must form p from the given (row_max, log_norm),
    the whole vocabulary's normaliser. The kernels (Triton, CUDA, CPU) do both always; the torch
    backend is told to (it otherwise recomputes the softmax of the rows it has, and skips the
    foreign-target work)."""
    if name == "torch":
        return TorchBackend(chunk_rows, vocab_shard)
    if name in ("triton", "cuda", "cpu") and logits.dtype not in KERNEL_DTYPES:
        raise ValueError(
            f"backend={name!r}: supports float16, bfloat16 and float32 logits, got {logits.dtype}; "
            "use backend='torch' (or 'auto') for float64"
        )
    if name == "triton":
        backend = _triton_backend()
        if backend is None:
            raise RuntimeError("backend='triton': Triton is not importable in this environment (pip install triton)")
        if not backend.supports(logits):
            raise ValueError(
                f"backend='triton': needs CUDA logits (or TRITON_INTERPRET=1 for CPU), got device {logits.device}"
            )
        return backend
    if name == "cuda":
        backend = _cuda_backend()
        if backend is None:
            raise RuntimeError(
                "backend='cuda': the rlkernels CUDA extension is not built (see README, 'CUDA backend')"
            )
        if not backend.supports(logits):
            raise ValueError(f"backend='cuda': needs CUDA logits, got device {logits.device}")
        return backend
    if name == "cpu":
        backend = _cpu_backend()
        if backend is None:
            if os.environ.get("RLKERNELS_CPU_KERNELS") == "0":
                raise RuntimeError("backend='cpu': the CPU kernels are turned off (RLKERNELS_CPU_KERNELS=0)")
            raise RuntimeError("backend='cpu': the CPU kernels could not be built (see the warning above; "
                               "backend='torch' runs everywhere)")
        if not backend.supports(logits):
            raise ValueError(f"backend='cpu': needs CPU logits, got device {logits.device}")
        return backend
    if name == "auto":
        backend = _triton_backend() if logits.is_cuda else _cpu_backend() if logits.device.type == "cpu" else None
        if backend is not None and backend.supports(logits):
            return backend
        return TorchBackend(chunk_rows, vocab_shard)
    raise ValueError(f"backend: expected 'auto', 'torch', 'cpu', 'triton' or 'cuda', got {name!r}")


# Graphs the compiled stage may hold: Dynamo specialises sizes 0 and 1 even with dynamic=True, so one
# option set can take ~5 graphs (padded B > 1, B = 1, T = 1, packed, one sequence); the default limit
# of 8 would send a second option set back to eager without a word.
STAGE_RECOMPILE_LIMIT = 64


@lru_cache(maxsize=None)
def _compiled_stage():
    """The torch stage under torch.compile(dynamic=True). Dynamo keeps one compiled graph per static
    option set (loss type, aggregation, IS level, rejection options, which inputs are present) and per
    size specialisation, guarded on those; every float hyperparameter stays a run-time input (see
    segments.hyper), so a new clip ratio, threshold, coefficient or global count reuses the graph."""
    from ..loss import sequence_stage

    compiled = torch.compile(sequence_stage, dynamic=True)

    def run(*args):
        # no_grad: the stage's inputs are detached anyway, and Dynamo guards on grad mode (one graph
        # for training steps and one for evaluation otherwise)
        with torch.no_grad(), torch._dynamo.config.patch(recompile_limit=STAGE_RECOMPILE_LIMIT):
            return compiled(*args)

    return run


def select_stage(tensor: torch.Tensor, compile_stage: Optional[bool]):
    """The per-sequence stage (SPEC §4-§8 on [N] scalars): one torch implementation, run eagerly or
    compiled. `compile_stage=None` compiles on CUDA, where its ~100 small ops would otherwise be as
    many kernel launches; on the CPU they cost less than compilation saves. Inside a caller's
    torch.compile region the eager function is returned, to be traced into the caller's graph."""
    from ..loss import sequence_stage

    if torch.compiler.is_compiling():
        return sequence_stage
    if compile_stage is None:  # Inductor generates Triton code for CUDA: without Triton, stay eager
        compile_stage = tensor.is_cuda and _triton_backend() is not None
    return _compiled_stage() if compile_stage else sequence_stage
