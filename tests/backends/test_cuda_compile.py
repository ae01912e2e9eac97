"""csrc/ compiles for sm_80, sm_90, sm_100 and sm_120 without a GPU: no errors, no unexplained warnings, no
local-memory spills.

nvcc compiles each .cu with the flags the real build uses (torch's COMMON_NVCC_FLAGS, the nvcc flags
of setup.py, torch's ABI define) plus `-Xptxas -v`, whose per-kernel resource report is parsed; g++
compiles bindings.cpp against the installed torch headers, and `nm` checks that every launcher it
calls is defined by the .cu objects (a prototype drifting from its definition would otherwise only
fail at import time on a GPU machine). `torch.utils.cpp_extension` refuses CUDA sources on a CPU
torch (it raises before compiling), so the compilers are called directly. All compiles run in parallel, once per
module (~30 s on 2 cores).
"""

import os
import re
import shutil
import subprocess
import sysconfig
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
import torch.utils.cpp_extension as cpp_extension

from rlkernels.backends.cuda_backend import CSRC_DIR, NVCC_ARCH_FLAGS, NVCC_FLAGS, SOURCES

pytestmark = pytest.mark.cuda_compile

CU_FILES = sorted(p.name for p in CSRC_DIR.glob("*.cu"))
# Ampere, Hopper, Blackwell datacentre (B200) and consumer (RTX 50): nvcc 13 compiles all four offline
ARCHS = ("sm_80", "sm_90", "sm_100", "sm_120")


def _gencode(arch: str) -> str:
    cc = arch.split("_")[1]
    return f"-gencode=arch=compute_{cc},code={arch}"
# Warnings that are expected and harmless, each with the reason. Anything else fails the test.
ALLOWED_WARNINGS = {
    # (none so far: keep this a dict of regex -> justification)
}


def _find_nvcc():
    for candidate in (
        shutil.which("nvcc"),
        os.path.join(os.environ.get("CUDA_HOME", ""), "bin", "nvcc"),
        "/usr/local/cuda/bin/nvcc",
    ):
        if candidate and os.path.isfile(candidate) and os.access(candidate, os.X_OK):
            return candidate
    return None


NVCC = _find_nvcc()
CXX = shutil.which("g++")


def _torch_defines():
    return [
        "-DTORCH_EXTENSION_NAME=_C",
        "-DTORCH_API_INCLUDE_EXTENSION_H",
        f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
    ]


def _torch_includes(flag):
    dirs = list(cpp_extension.include_paths())
    # a CUDA wheel's own runtime headers (nvidia-cuda-runtime), if installed; nvcc adds its own
    for site in {Path(torch.__file__).parents[1]}:
        dirs += [str(p) for p in site.glob("nvidia/cuda_runtime/include")]
    return [x for d in dirs for x in (flag, d)]


def _cxx_std():
    # the standard torch's extension builder uses (c++20 from torch 2.10; c++17 before)
    return "c++20" if "-std=c++20" in Path(cpp_extension.__file__).read_text() else "c++17"


def _run(cmd):
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    return proc.returncode, proc.stdout + proc.stderr, cmd


def _nvcc_cmd(src: Path, obj: Path, arch: str):
    # -std=c++17: the kernels include no torch header, so they build under the standard of every torch >= 2.4
    return (
        [NVCC, "-c", str(src), "-o", str(obj), _gencode(arch), "-std=c++17", "-Xptxas=-v,-warn-spills,-warn-lmem-usage",
         "-Xcompiler=-fPIC,-Wall,-Wextra"]
        + NVCC_FLAGS + cpp_extension.COMMON_NVCC_FLAGS + _torch_defines() + _torch_includes("-I")
    )


def _bindings_cmd(obj: Path):
    python_include = sysconfig.get_paths()["include"]
    return (
        [CXX, "-c", str(CSRC_DIR / "bindings.cpp"), "-o", str(obj), f"-std={_cxx_std()}", "-O0", "-fPIC", "-Wall",
         "-Wextra"]
        # torch and Python headers as system headers: their own warnings are not ours to fix
        + _torch_defines() + _torch_includes("-isystem") + ["-isystem", python_include]
    )


@pytest.fixture(scope="module")
def builds(tmp_path_factory):
    if NVCC is None:
        pytest.skip("nvcc not found (PATH, $CUDA_HOME/bin, /usr/local/cuda/bin): cannot compile csrc/*.cu")
    out = tmp_path_factory.mktemp("cuda_compile")
    jobs = {(name, arch): _nvcc_cmd(CSRC_DIR / name, out / f"{name}.{arch}.o", arch)
            for name in CU_FILES for arch in ARCHS}
    if CXX is not None and Path(sysconfig.get_paths()["include"], "Python.h").is_file():
        jobs["bindings.cpp"] = _bindings_cmd(out / "bindings.cpp.o")
    with ThreadPoolExecutor(max_workers=len(jobs)) as pool:
        results = dict(zip(jobs, pool.map(_run, jobs.values())))
    return {"dir": out, "results": results}


def _unexplained_warnings(log: str):
    lines = [ln for ln in log.splitlines() if re.search(r"\bwarning\b", ln, re.IGNORECASE)]
    return [ln for ln in lines if not any(re.search(rx, ln) for rx in ALLOWED_WARNINGS)]


def _demangle(names):
    if not names or shutil.which("c++filt") is None:
        return names
    proc = subprocess.run(["c++filt"], input="\n".join(names), capture_output=True, text=True)
    return proc.stdout.splitlines() if proc.returncode == 0 else names


def _short(kernel: str) -> str:
    # rlkernels::(anonymous namespace)::token_grad_bwd_kernel<__nv_bfloat16, 256, true>(...) -> name<args>
    m = re.search(r"(\w+_kernel<[^>]*>)", kernel)
    return m.group(1) if m else kernel


def ptxas_resources(log: str):
    """{kernel: dict(registers, stack, spill_stores, spill_loads, smem)} from `ptxas -v` output."""
    table, current = {}, None
    for line in log.splitlines():
        m = re.search(r"Compiling entry function '(\w+)'", line)
        if m:
            current = m.group(1)
            table[current] = dict(registers=0, stack=0, spill_stores=0, spill_loads=0, smem=0)
            continue
        if current is None:
            continue
        m = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", line)
        if m:
            table[current].update(stack=int(m[1]), spill_stores=int(m[2]), spill_loads=int(m[3]))
        m = re.search(r"Used (\d+) registers", line)
        if m:
            table[current]["registers"] = int(m[1])
            s = re.search(r"(\d+) bytes smem", line)
            table[current]["smem"] = int(s[1]) if s else 0
    names = _demangle(list(table))
    return {_short(n): v for n, v in zip(names, table.values())}


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("name", CU_FILES)
def test_cu_compiles_without_spills(builds, name, arch):
    rc, log, cmd = builds["results"][name, arch]
    assert rc == 0, f"nvcc failed on {name}:\n{' '.join(cmd)}\n{log}"
    warnings = _unexplained_warnings(log)
    assert not warnings, (f"{name}: unexplained warnings (fix them or justify them in ALLOWED_WARNINGS):\n"
                          + "\n".join(warnings))
    table = ptxas_resources(log)
    assert table, f"{name}: no kernel in the ptxas report:\n{log}"
    print(f"\n{name} ({arch}): kernel | registers | stack | spill st/ld | smem")
    for kernel, r in sorted(table.items()):
        print(f"  {kernel:55s} {r['registers']:4d} regs {r['stack']:4d} B stack "
              f"{r['spill_stores']}/{r['spill_loads']} B spill {r['smem']:4d} B smem")
    spills = {k: r for k, r in table.items() if r["spill_stores"] or r["spill_loads"]}
    assert not spills, f"{name}: local-memory spills: {spills}"
    # a stack frame without spills means a register array indexed at run time went to local memory
    stacks = {k: r["stack"] for k, r in table.items() if r["stack"]}
    assert not stacks, f"{name}: stack frames (local memory): {stacks}"
    # 256 threads per block: more than 128 registers would leave a single block per SM
    heavy = {k: r["registers"] for k, r in table.items() if r["registers"] > 128}
    assert not heavy, f"{name}: register use above 128: {heavy}"


def test_bindings_compile_and_link_against_the_launchers(builds):
    if "bindings.cpp" not in builds["results"]:
        pytest.skip("g++ or the Python headers (Python.h) are missing: bindings.cpp not compiled")
    rc, log, cmd = builds["results"]["bindings.cpp"]
    assert rc == 0, f"g++ failed on bindings.cpp:\n{' '.join(cmd)}\n{log}"
    warnings = _unexplained_warnings(log)
    assert not warnings, "bindings.cpp: unexplained warnings:\n" + "\n".join(warnings)
    if shutil.which("nm") is None:
        pytest.skip("nm not found: launcher symbols not cross-checked")
    for name in CU_FILES:
        assert builds["results"][name, "sm_90"][0] == 0, f"{name} did not compile"

    def symbols(obj, flag):
        proc = subprocess.run(["nm", "-C", flag, str(obj)], capture_output=True, text=True, check=True)
        # "<address> T name" for defined symbols, "<spaces> U name" for undefined ones
        return {re.sub(r"^\s*[0-9a-fA-F]*\s+[A-Za-z]\s+", "", ln) for ln in proc.stdout.splitlines()
                if "_launch(" in ln}

    needed = symbols(builds["dir"] / "bindings.cpp.o", "--undefined-only")
    defined = set()
    for name in CU_FILES:
        defined |= symbols(builds["dir"] / f"{name}.sm_90.o", "--defined-only")
    assert needed, "bindings.cpp calls no launcher?"
    assert needed <= defined, f"launchers declared in common.cuh but not defined alike: {needed - defined}"


def test_build_flags_in_sync_with_setup_py():
    text = (CSRC_DIR.parent / "setup.py").read_text()
    for flag in NVCC_FLAGS + NVCC_ARCH_FLAGS + [f"csrc/{s}" for s in SOURCES]:
        assert f'"{flag}"' in text, f"setup.py lacks {flag!r} (rlkernels/backends/cuda_backend.py has it)"
    assert sorted(p.name for p in CSRC_DIR.glob("*.c*") if p.suffix in (".cu", ".cpp")) == sorted(SOURCES)


def _check_messages(source: str):
    """(line, argument) of every TORCH_CHECK message argument in `source`: the arguments after the condition,
    split at top-level commas."""
    found = []
    for match in re.finditer(r"TORCH_CHECK\(", source):
        depth, i, args, start = 1, match.end(), [], match.end()
        while depth:
            ch = source[i]
            if ch in "([{":
                depth += 1
            elif ch in ")]}":
                depth -= 1
            elif ch == '"':
                i = source.index('"', i + 1)
            elif ch == "," and depth == 1:
                args.append(source[start:i])
                start = i + 1
            i += 1
        args.append(source[start:i - 1])
        line = source.count("\n", 0, match.start()) + 1
        found += [(line, " ".join(a.split())) for a in args[1:]]
    return found


# a name, a string, a dtype (streamed as its name) or a number already formatted: never a number or a shape
_MESSAGE_ARGUMENT = re.compile(
    r'^("[^"]*"|op|name|err|dtype|dt|text\(.*\)|std::to_string\(.*\)|[\w.>-]*scalar_type\(\))$')


@pytest.mark.parametrize("path", ["bindings.cpp", "cpu/token_passes.cpp"])
def test_check_messages_stream_no_numbers(path):
    """On the lent H200 (2026-12-04) a TORCH_CHECK that streamed a double or an integer into its message crashed
    the process instead of raising (csrc/bindings.cpp, text()): every message argument is a name, a literal or a
    string formatted beforehand."""
    checks = _check_messages((CSRC_DIR / path).read_text())
    assert len(checks) > 10
    streamed = [(line, arg) for line, arg in checks if not _MESSAGE_ARGUMENT.match(arg)]
    assert not streamed, streamed
