"""The hand-written CUDA backend: launchers over `torch.ops.rlkernels_cuda.*` (csrc/).

The kernels come from the compiled extension `rlkernels._C` (`RLKERNELS_BUILD_CUDA=1 pip install -e .
--no-build-isolation`) or, with `RLKERNELS_CUDA_JIT=1`, from a build of csrc/ on first use through
`torch.utils.cpp_extension.load` (needs a CUDA build of torch and nvcc). Without either, importing
this module still works and `CudaBackend().is_built()` is False.

Layout checks (device, dtype, shapes, unit stride along V) are TORCH_CHECKs in csrc/bindings.cpp;
this module only casts the [N] vectors to what the ops take (int64 labels, float32 statistics).
"""

import os
import warnings
from functools import lru_cache
from pathlib import Path
from typing import Optional

import torch

from .base import RowStats, paired_row_groups, row_groups

OPS_NAMESPACE = "rlkernels_cuda"
CSRC_DIR = Path(__file__).resolve().parents[2] / "csrc"
SOURCES = ("bindings.cpp", "token_stats.cu", "token_grad.cu")
# nvcc flags of the build, beyond torch's own (keep in sync with setup.py; tests/test_cuda_compile.py checks)
NVCC_FLAGS = ["-O3", "--use_fast_math", "-lineinfo"]
NVCC_ARCH_FLAGS = [
    "-gencode=arch=compute_80,code=sm_80", "-gencode=arch=compute_90,code=sm_90",
    "-gencode=arch=compute_90,code=compute_90",
]
_SUPPORTED = (torch.float32, torch.float16, torch.bfloat16)


def _register_fakes() -> None:
    """Shape-only implementations, so that the ops trace under torch.compile / FakeTensor."""

    @torch.library.register_fake(f"{OPS_NAMESPACE}::token_stats_fwd")
    def _(logits, labels, temperature, compute_entropy, compute_sum_pi_squared):
        N = logits.shape[0]
        new = lambda n: logits.new_empty((n,), dtype=torch.float32)  # noqa: E731
        return new(N), new(N), new(N), new(N if compute_entropy else 0), new(N if compute_sum_pi_squared else 0)

    @torch.library.register_fake(f"{OPS_NAMESPACE}::token_grad_bwd")
    def _(logits, labels, row_max, log_norm, entropy, coef_logprob, coef_entropy, temperature):
        return torch.empty_like(logits, memory_format=torch.contiguous_format)

    @torch.library.register_fake(f"{OPS_NAMESPACE}::token_grad_bwd_inplace")
    def _(logits, labels, row_max, log_norm, entropy, coef_logprob, coef_entropy, temperature):
        return None

    @torch.library.register_fake(f"{OPS_NAMESPACE}::token_grad_bwd_out")
    def _(logits, labels, row_max, log_norm, entropy, coef_logprob, coef_entropy, temperature, dlogits):
        return None


def _jit_build() -> bool:
    if torch.version.cuda is None:
        warnings.warn("RLKERNELS_CUDA_JIT=1 ignored: this torch build has no CUDA", RuntimeWarning, stacklevel=3)
        return False
    from torch.utils.cpp_extension import load

    load(
        name="rlkernels_cuda_jit",
        sources=[str(CSRC_DIR / s) for s in SOURCES],
        extra_cflags=["-O3"],
        extra_cuda_cflags=NVCC_FLAGS,  # arch: TORCH_CUDA_ARCH_LIST or the visible GPU's
        is_python_module=False,  # loads the library: its TORCH_LIBRARY blocks register the ops
        verbose=os.environ.get("RLKERNELS_CUDA_JIT_VERBOSE") == "1",
    )
    return True


@lru_cache(maxsize=None)
def _load_ops() -> bool:
    """Loads the ops once per process; True when torch.ops.rlkernels_cuda is usable."""
    loaded = False
    try:
        from rlkernels import _C  # noqa: F401  (the import registers the ops)

        loaded = True
    except (ImportError, OSError):
        pass
    if not loaded and os.environ.get("RLKERNELS_CUDA_JIT") == "1":
        try:
            loaded = _jit_build()
        except Exception as exc:  # a failed compile must leave the other backends usable
            warnings.warn(f"RLKERNELS_CUDA_JIT=1: building csrc/ failed: {exc}", RuntimeWarning, stacklevel=2)
    if loaded:
        _register_fakes()
    return loaded


class CudaBackend:
    name = "cuda"

    def is_built(self) -> bool:
        return _load_ops()

    def supports(self, logits: torch.Tensor) -> bool:
        return logits.is_cuda and logits.dtype in _SUPPORTED

    @staticmethod
    def _ops():
        return getattr(torch.ops, OPS_NAMESPACE)

    def token_stats_fwd(self, logits, labels, temperature, compute_entropy, compute_sum_pi_squared) -> RowStats:
        # logits: (N, V) or (B, T, V) with unit stride along V; labels: (N,) int64, -1 on skipped rows.
        # The kernels take one row stride: (B, T, V) views whose rows are not one strided sequence
        # (the causal shift) run one launch per batch row instead of being copied.
        labels = _labels(labels)
        pieces = [
            self._ops().token_stats_fwd(
                rows, labels[start:start + rows.shape[0]], float(temperature), bool(compute_entropy),
                bool(compute_sum_pi_squared),
            )
            for start, rows in row_groups(logits)
        ]
        row_max, log_norm, logprobs, entropy, sum_pi_squared = (
            p[0] if len(pieces) == 1 else torch.cat(p) for p in zip(*pieces)
        )
        return RowStats(
            row_max, log_norm, logprobs, entropy if compute_entropy else None,
            sum_pi_squared if compute_sum_pi_squared else None,
        )

    def token_grad_bwd(
        self, logits, labels, row_max, log_norm, entropy: Optional[torch.Tensor], coef_logprob,
        coef_entropy: Optional[torch.Tensor], temperature, inplace,
    ) -> torch.Tensor:
        # coefficients arrive in the statistics' dtype from autograd; the kernel reads float32 [N]
        has_entropy = coef_entropy is not None
        vectors = (
            _labels(labels), _f32(row_max), _f32(log_norm), _f32(entropy) if has_entropy else None,
            _f32(coef_logprob), _f32(coef_entropy) if has_entropy else None,
        )
        out = logits if inplace else torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)
        for start, rows, out_rows in paired_row_groups(logits, out):
            stop = start + rows.shape[0]
            args = (rows, *(None if v is None else v[start:stop] for v in vectors), float(temperature))
            if inplace:
                self._ops().token_grad_bwd_inplace(*args)  # the caller bumps logits' version counter
            else:
                self._ops().token_grad_bwd_out(*args, out_rows)
        return out


def _labels(labels: torch.Tensor) -> torch.Tensor:
    return labels.to(torch.int64).contiguous()


def _f32(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.float32).contiguous()
