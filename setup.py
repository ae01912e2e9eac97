"""The optional CUDA extension build. Package metadata (name, version, dependencies) lives in
pyproject.toml; this file only decides whether csrc/ is compiled.

A pure-Python install by default. The CUDA extension in csrc/ is built only when asked for
(RLKERNELS_BUILD_CUDA=1) on a machine with a CUDA build of PyTorch and nvcc; see README.
"""

import os
import shutil

from setuptools import setup
from setuptools.command.build_py import build_py


class BuildPyWithCpuSource(build_py):
    """Ships csrc/cpu/token_passes.cpp inside the package (rlkernels/_csrc/cpu/) so that an installed,
    non-editable copy can compile the CPU kernels on first use (rlkernels/backends/cpu_backend.py)."""

    def run(self):
        super().run()
        target = os.path.join(self.build_lib, "rlkernels", "_csrc", "cpu")
        os.makedirs(target, exist_ok=True)
        shutil.copy(os.path.join("csrc", "cpu", "token_passes.cpp"), target)


ext_modules, cmdclass = [], {"build_py": BuildPyWithCpuSource}
if os.environ.get("RLKERNELS_BUILD_CUDA") == "1":
    # Needs a CUDA build of torch and nvcc; build with --no-build-isolation so that the installed torch
    # (whose headers and ABI the extension must match) is the one compiled against.
    from torch.utils.cpp_extension import BuildExtension, CUDAExtension

    # nvcc flags: keep in sync with NVCC_FLAGS / NVCC_ARCH_FLAGS in rlkernels/backends/cuda_backend.py
    # (tests/backends/test_cuda_compile.py checks). Default targets sm_80, sm_90 (+ PTX); TORCH_CUDA_ARCH_LIST, when
    # set, replaces them (torch ignores that variable as soon as any -gencode flag is given).
    nvcc_flags = ["-O3", "--use_fast_math", "-lineinfo"]
    nvcc_arch_flags = [] if os.environ.get("TORCH_CUDA_ARCH_LIST") else [
        "-gencode=arch=compute_80,code=sm_80", "-gencode=arch=compute_90,code=sm_90",
        "-gencode=arch=compute_90,code=compute_90",
    ]
    ext_modules = [
        CUDAExtension(
            "rlkernels._C",  # an empty Python module; importing it registers torch.ops.rlkernels_cuda.*
            ["csrc/bindings.cpp", "csrc/token_stats.cu", "csrc/token_grad.cu"],
            extra_compile_args={"cxx": ["-O3"], "nvcc": nvcc_flags + nvcc_arch_flags},
        )
    ]
    cmdclass["build_ext"] = BuildExtension

setup(ext_modules=ext_modules, cmdclass=cmdclass)
