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

import torch

from .extension import ExtensionBackend, register_fakes

OPS_NAMESPACE = "rlkernels_cuda"
CSRC_DIR = Path(__file__).resolve().parents[2] / "csrc"
SOURCES = ("bindings.cpp", "token_stats.cu", "token_grad.cu")
# nvcc flags of the build, beyond torch's own (keep in sync with setup.py; tests/backends/test_cuda_compile.py checks)
NVCC_FLAGS = ["-O3", "--use_fast_math", "-lineinfo"]
NVCC_ARCH_FLAGS = [
    "-gencode=arch=compute_80,code=sm_80", "-gencode=arch=compute_90,code=sm_90",
    "-gencode=arch=compute_90,code=compute_90",
]
_SUPPORTED = (torch.float32, torch.float16, torch.bfloat16)


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
        register_fakes(OPS_NAMESPACE)
    return loaded


class CudaBackend(ExtensionBackend):
    name = "cuda"
    namespace = OPS_NAMESPACE

    def is_built(self) -> bool:
        return _load_ops()

    def supports(self, logits: torch.Tensor) -> bool:
        return logits.is_cuda and logits.dtype in _SUPPORTED
