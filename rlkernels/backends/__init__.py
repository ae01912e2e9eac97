"""The one dispatch point: `select(name, logits)` returns the backend that runs the vocabulary passes."""

from functools import lru_cache

import torch

from .base import Backend, RowStats, statistics_dtype
from .torch_backend import TorchBackend

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


def available() -> dict:
    """Which backends can run in this process (for diagnostics and the benchmark harness)."""
    return {"torch": True, "triton": _triton_backend() is not None, "cuda": _cuda_backend() is not None}


def select(name: str, logits: torch.Tensor, chunk_rows=None) -> Backend:
    """Pick the backend for these logits. "auto": Triton on CUDA tensors when importable, else torch."""
    if name == "torch":
        return TorchBackend(chunk_rows)
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
    if name == "auto":
        if logits.is_cuda:
            backend = _triton_backend()
            if backend is not None and backend.supports(logits):
                return backend
        return TorchBackend(chunk_rows)
    raise ValueError(f"backend: expected 'auto', 'torch', 'triton' or 'cuda', got {name!r}")


def select_stage(name: str, tensor: torch.Tensor):
    """The per-sequence stage (SPEC §4-§8 on [N] scalars) that goes with a backend name.

    The fused Triton stage replaces ~60 small torch launches on the GPU; on the CPU, and while
    torch.compile traces (Inductor fuses the torch stage itself), the torch stage runs."""
    from ..loss import sequence_stage

    if name == "auto":
        name = "triton" if tensor.is_cuda else "torch"
    # the fused stage computes in float32: float64 statistics (torch backend only) stay on torch
    if name in ("triton", "cuda") and tensor.dtype != torch.float64 and not torch.compiler.is_compiling():
        backend = _triton_backend()
        if backend is not None and backend.supports(tensor):
            from ..kernels.triton.seq_stage import sequence_stage_triton

            return sequence_stage_triton
    return sequence_stage
