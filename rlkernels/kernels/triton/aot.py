"""Ahead-of-time compile check of every Triton kernel configuration, without a GPU.

`python -m rlkernels.kernels.triton.aot [--cc 80 90]` compiles every `AotSpec` of every module under
rlkernels/kernels/triton/ that defines `aot_specs()` (found with pkgutil, so new kernel modules join
automatically) to a cubin for each compute capability, reads its resource usage with the cuobjdump
shipped in Triton's package, and prints one row per (spec, cc): registers, spill bytes (LOCAL),
stack, static shared memory and the widest global load (128 = 16-byte vector loads).
It exits 1 on any compile error or any spill.

Under TRITON_INTERPRET=1, `@triton.jit` yields interpreter objects that cannot be compiled, so the
command re-runs itself in a child process without that variable.
"""

import argparse
import importlib
import os
import pkgutil
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Dict, List, Optional

DEFAULT_CCS = (80, 90)
_RESOURCE_RE = re.compile(r"(REG|STACK|SHARED|LOCAL):(\d+)")
# ld.global[.cache hints][.v2|.v4].b16|.b32|...: the PTX global loads (ptxas keeps their width; read
# from the PTX because `cuobjdump --dump-sass` costs ~1 s per kernel)
_LD_GLOBAL_RE = re.compile(r"\bld\.global((?:\.[\w:]+)+)")


@dataclass
class AotResult:
    name: str
    cc: int
    num_warps: int
    num_stages: int
    regs: Optional[int] = None
    spills: Optional[int] = None  # LOCAL bytes per thread
    stack: Optional[int] = None
    shared: Optional[int] = None
    ldg_bits: Optional[int] = None  # widest global load
    seconds: float = 0.0
    error: Optional[str] = None

    @property
    def ok(self) -> bool:
        return self.error is None and self.spills == 0


def _nvidia_bin(tool: str) -> str:
    import triton

    path = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", tool)
    if not os.path.exists(path):
        raise FileNotFoundError(f"{tool}: not found at {path} (shipped with Triton's NVIDIA backend)")
    return path


def compile_spec(spec, cc: int):
    """Compile one AotSpec for sm_<cc>; returns the CompiledKernel (asm["cubin"], asm["ptx"], ...).

    Arguments named in `spec.aligned` get tt.divisibility=16, the specialisation the JIT gives
    16-byte-aligned pointers and 16-divisible integers; without it the SASS shows the narrow loads
    of an unaligned launch instead of the 16-byte ones a real launch gets.
    """
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    if not isinstance(spec.fn, triton.runtime.JITFunction):
        raise RuntimeError(
            f"{spec.name}: the kernel is not a JITFunction (TRITON_INTERPRET=1 is set?); "
            "AOT compilation must run in a process without TRITON_INTERPRET"
        )
    arg_names = spec.fn.arg_names
    for name in list(spec.signature) + list(spec.constexprs) + list(spec.aligned):
        if name not in arg_names:
            raise ValueError(f"{spec.name}: {name!r} is not an argument of {spec.fn.__name__}")
    # positional keys: accepted by every Triton 3.x ASTSource (string keys only by newer ones)
    constexprs = {(arg_names.index(k),): v for k, v in spec.constexprs.items()}
    attrs = {(arg_names.index(k),): [["tt.divisibility", 16]] for k in spec.aligned}
    signature = {k: spec.signature[k] for k in arg_names}  # in argument order
    src = ASTSource(fn=spec.fn, signature=signature, constexprs=constexprs, attrs=attrs)
    return triton.compile(
        src, target=GPUTarget("cuda", cc, 32), options={"num_warps": spec.num_warps, "num_stages": spec.num_stages}
    )


def widest_global_load(ptx: str) -> int:
    """Bits moved by the widest global load of 8-32-bit elements in the PTX (128 = the 16-byte vector
    loads we want for the logits; 64-bit elements, i.e. int64 labels, are left out so they cannot stand in)."""
    widest = 0
    for quals in _LD_GLOBAL_RE.findall(ptx):
        vec, size = 1, 0
        for q in quals.strip(".").split("."):
            if q in ("v2", "v4", "v8"):
                vec = int(q[1:])
            elif re.fullmatch(r"[busf](8|16|32)", q):
                size = int(q[1:])
        widest = max(widest, vec * size)
    return widest


def resource_usage(cubin: bytes) -> Dict[str, int]:
    """REG / STACK / SHARED / LOCAL (spill bytes) of the (single) kernel in a cubin."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "kernel.cubin")
        with open(path, "wb") as f:
            f.write(cubin)
        usage = subprocess.run(
            [_nvidia_bin("cuobjdump"), "--dump-resource-usage", path], capture_output=True, text=True, check=True
        )
    found = {k: int(v) for k, v in _RESOURCE_RE.findall(usage.stdout)}
    missing = {"REG", "STACK", "SHARED", "LOCAL"} - set(found)
    if missing:
        raise RuntimeError(f"cuobjdump --dump-resource-usage: no {sorted(missing)} in:\n{usage.stdout}")
    return found


def run_spec(spec, cc: int) -> AotResult:
    res = AotResult(spec.name, cc, spec.num_warps, spec.num_stages)
    t0 = time.perf_counter()
    try:
        kernel = compile_spec(spec, cc)
        usage = resource_usage(kernel.asm["cubin"])
        res.regs, res.spills, res.stack, res.shared = usage["REG"], usage["LOCAL"], usage["STACK"], usage["SHARED"]
        res.ldg_bits = widest_global_load(kernel.asm["ptx"])
    except Exception as exc:  # reported in the table; the exit status says it failed
        first = str(exc).strip().splitlines()
        res.error = f"{type(exc).__name__}: {first[0] if first else ''}"[:200]
    res.seconds = time.perf_counter() - t0
    return res


def discover_specs(only: Optional[str] = None):
    """(module name, specs or the import error) for every kernel module defining aot_specs()."""
    from . import __name__ as pkg_name
    from . import __path__ as pkg_path

    out = []
    for info in sorted(pkgutil.iter_modules(pkg_path), key=lambda m: m.name):
        if info.name in ("aot", "aot_spec") or (only and only not in info.name):
            continue
        try:
            module = importlib.import_module(f"{pkg_name}.{info.name}")
        except Exception as exc:
            out.append((info.name, f"import failed: {type(exc).__name__}: {exc}"))
            continue
        if hasattr(module, "aot_specs"):
            out.append((info.name, list(module.aot_specs())))
    return out


_WORKER_SPECS: Dict[str, list] = {}


def _run_indexed(job) -> AotResult:
    """Worker entry: (module name, spec index, cc). Specs hold JITFunctions, which do not pickle, so
    each worker process imports the kernel module itself."""
    module, index, cc = job
    if module not in _WORKER_SPECS:
        from . import __name__ as pkg_name

        _WORKER_SPECS[module] = list(importlib.import_module(f"{pkg_name}.{module}").aot_specs())
    return run_spec(_WORKER_SPECS[module][index], cc)


def run_all(jobs, workers: int) -> List[AotResult]:
    if workers <= 1 or len(jobs) <= 1:
        return [_run_indexed(j) for j in jobs]
    import multiprocessing

    # fork: the children inherit the imported modules and compile independently (no GPU involved)
    with multiprocessing.get_context("fork").Pool(workers) as pool:
        return pool.map(_run_indexed, jobs, chunksize=1)


def format_table(results: List[AotResult]) -> str:
    """One row per (spec, cc); numbers first so that long kernel names cannot push them apart."""
    head = (f"{'cc':>3} {'warps':>5} {'stages':>6} {'regs':>4} {'spills':>6} {'stack':>5} {'shared':>6} {'ldg':>4} "
            f"{'sec':>5}  kernel config")
    lines = [head, "-" * len(head)]
    for r in results:
        if r.error:
            lines.append(f"{r.cc:>3} {r.num_warps:>5} {r.num_stages:>6} {'ERROR':>4}  {r.name}: {r.error}")
            continue
        lines.append(
            f"{r.cc:>3} {r.num_warps:>5} {r.num_stages:>6} {r.regs:>4} {r.spills:>6} {r.stack:>5} {r.shared:>6} "
            f"{r.ldg_bits:>4} {r.seconds:>5.2f}  {r.name}"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m rlkernels.kernels.triton.aot", description=__doc__.split("\n")[0])
    parser.add_argument("--cc", type=int, nargs="+", default=list(DEFAULT_CCS), help="compute capabilities (80 90)")
    parser.add_argument("--only", default=None, help="only kernel modules whose name contains this")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="parallel compiles (default: all cores)")
    args = parser.parse_args(argv)

    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        cmd = [sys.executable, "-m", "rlkernels.kernels.triton.aot", *(argv if argv is not None else sys.argv[1:])]
        return subprocess.run(cmd, env=env).returncode

    # Triton 3.9 warns when this is unset; "1" is its current default (and Triton 3.6's behaviour),
    # so the AOT compile matches a JIT launch
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    jobs, failures = [], []
    for module, specs in discover_specs(args.only):
        if isinstance(specs, str):
            failures.append(f"{module}: {specs}")
            continue
        jobs += [(module, i, cc) for i in range(len(specs)) for cc in args.cc]
    t0 = time.perf_counter()
    results = run_all(jobs, args.jobs)
    print(format_table(results))
    failures += [f"{r.name} sm_{r.cc}: {r.error}" for r in results if r.error]
    failures += [f"{r.name} sm_{r.cc}: {r.spills} bytes spilled" for r in results if not r.error and r.spills]
    clean = sum(r.ok for r in results)
    print(f"\n{len(results)} compiles ({clean} clean) in {time.perf_counter() - t0:.1f} s wall, {args.jobs} jobs")
    if not results and not failures:
        failures.append("no AotSpec found")
    for f in failures:
        print(f"FAIL {f}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
