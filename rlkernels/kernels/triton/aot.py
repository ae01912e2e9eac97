"""Ahead-of-time compile check of every Triton kernel configuration for every target, without a GPU.

`python -m rlkernels.kernels.triton.aot [--target sm_80 sm_90 sm_100 sm_120 gfx942 gfx950]` compiles every
`AotSpec` of every module under rlkernels/kernels/triton/ that defines `aot_specs()` (found with pkgutil, so new
kernel modules join automatically) through Triton's own pipeline down to the machine code of each target (ptxas
for NVIDIA, the AMD backend's assembler for ROCm: both ship with Triton's wheel, so no GPU and no toolkit are
needed), and prints one row per (spec, target): registers, spills, stack, shared memory, the widest global load
(NVIDIA: 128 = 16-byte vector loads) and the theoretical occupancy with what limits it (`occupancy()`). A spec with a
`loop_gate` (the streaming kernels' tiers for LLM vocabularies) also has its hot loop read from the SASS on sm_90
(`sass_loops`: instructions per element, barriers, MUFU.EX2, cp.async) and its PTX searched for non-ftz ex2; one
LOOP line each. It exits 1 on any compile error, any spill, an occupancy below OCCUPANCY_FLOOR, or a loop over its
gate.

Under TRITON_INTERPRET=1, `@triton.jit` yields interpreter objects that cannot be compiled, so the
command re-runs itself in a child process without that variable.
"""

import argparse
import dataclasses
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

# name -> Triton's GPUTarget(backend, arch, warp size). Ampere, Hopper, Blackwell datacentre (B200) and consumer
# (RTX 50), and AMD's CDNA3 (MI300) and CDNA4 (MI350).
TARGETS = {
    "sm_80": ("cuda", 80, 32), "sm_90": ("cuda", 90, 32), "sm_100": ("cuda", 100, 32), "sm_120": ("cuda", 120, 32),
    "gfx942": ("hip", "gfx942", 64), "gfx950": ("hip", "gfx950", 64),
}
# Every configuration compiles for these; for the others, each (kernel, dtype, tier) with its optional features all
# on (the most code and registers) and all off, which bracket the combinations in between at a quarter of the
# compiles (CI has two cores). `--every-config` compiles every configuration for every target.
EVERY_CONFIG_TARGETS = ("sm_80", "sm_90")
# Per NVIDIA compute capability (CUDA C++ Programming Guide, "Technical Specifications per Compute Capability"):
# resident warps and blocks per SM, 32-bit registers per SM, shared memory per SM (bytes). Registers are allocated
# per warp in units of 256; each block also reserves 1 KiB of shared memory (compute capability >= 8.0).
SM_LIMITS = {
    80: dict(warps=64, blocks=32, registers=65536, shared=164 * 1024),
    90: dict(warps=64, blocks=32, registers=65536, shared=228 * 1024),
    100: dict(warps=64, blocks=32, registers=65536, shared=228 * 1024),
    120: dict(warps=48, blocks=32, registers=65536, shared=100 * 1024),
}
RESERVED_SHARED_PER_BLOCK = 1024
REGISTER_UNIT = 256
# AMD CDNA3/CDNA4: waves per SIMD at most (the occupancy LLVM reports, "; Occupancy: N", is out of this)
WAVES_PER_SIMD = 8
# The gate: a kernel that streams the logits once needs enough loads in flight to cover the memory latency
# (Little's law: 4.8 TB/s x ~0.6 us ~ 2.9 MB across an H200's 132 SMs, ~22 KB per SM). Below a quarter of the
# SM's warps (16 of 64 on Hopper; 2 of 8 waves per SIMD on CDNA) with 16-byte loads that is out of reach.
OCCUPANCY_FLOOR = 0.25
# The hot loops' static gate (AotSpec.loop_gate) runs on Hopper, the target the issue budget is set for: an H200 issues
# about 15.6 thread-instructions per bf16 element at its copy rate (docs/backends.md).
LOOP_GATE_TARGET = "sm_90"
_RESOURCE_RE = re.compile(r"(REG|STACK|SHARED|LOCAL):(\d+)")
# ld.global[.cache hints][.v2|.v4].b16|.b32|...: the PTX global loads (ptxas keeps their width; read
# from the PTX because `cuobjdump --dump-sass` costs ~1 s per kernel)
_LD_GLOBAL_RE = re.compile(r"\bld\.global((?:\.[\w:]+)+)")


@dataclass
class AotResult:
    name: str
    target: str
    num_warps: int
    num_stages: int
    regs: Optional[int] = None  # per thread (NVIDIA) or VGPRs per lane (AMD)
    spills: Optional[int] = None  # NVIDIA: LOCAL bytes per thread; AMD: spilled registers + scratch bytes
    stack: Optional[int] = None
    shared: Optional[int] = None  # the kernel's bytes per block: static + dynamic (the driver's reservation apart)
    ldg_bits: Optional[int] = None  # widest global load (NVIDIA; 0 where not read)
    occupancy: Optional[float] = None  # resident warps (waves) over the most the SM (SIMD) holds
    limiter: str = ""
    seconds: float = 0.0
    error: Optional[str] = None
    loop: Optional["SassLoop"] = None  # the gated hottest loop, barriers summed over all (LOOP_GATE_TARGET)
    non_ftz: Optional[int] = None  # ex2.approx.f32 without ftz in the PTX (gated specs)

    @property
    def ok(self) -> bool:
        return self.error is None and self.spills == 0 and self.occupancy >= OCCUPANCY_FLOOR


def _nvidia_bin(tool: str) -> str:
    import triton

    path = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", tool)
    if not os.path.exists(path):
        raise FileNotFoundError(f"{tool}: not found at {path} (shipped with Triton's NVIDIA backend)")
    return path


def gpu_target(target):
    """Triton's GPUTarget of a TARGETS name ("sm_90", "gfx942", ...)."""
    from triton.backends.compiler import GPUTarget

    if target not in TARGETS:
        raise ValueError(f"target: expected one of {sorted(TARGETS)}, got {target!r}")
    return GPUTarget(*TARGETS[target])


def compile_spec(spec, target):
    """Compile one AotSpec for a target of TARGETS; returns the CompiledKernel (asm["cubin"] and asm["ptx"] for
    NVIDIA, asm["amdgcn"] and asm["hsaco"] for AMD, ...).

    Arguments named in `spec.aligned` get tt.divisibility=16, the specialisation the JIT gives
    16-byte-aligned pointers and 16-divisible integers; without it the SASS shows the narrow loads
    of an unaligned launch instead of the 16-byte ones a real launch gets.
    """
    import triton
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
        src, target=gpu_target(target), options={"num_warps": spec.num_warps, "num_stages": spec.num_stages}
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


# one SASS instruction of `cuobjdump --dump-sass`: /*0670*/  [@!P1] OPCODE[.MODIFIERS] operands ;
_SASS_RE = re.compile(r"^\s*/\*([0-9a-f]{4,})\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)([^;]*);", re.M)


@dataclass(frozen=True)
class SassLoop:
    """One loop of a kernel's SASS: the instructions from a backward branch's target to the branch, what they
    spend per loop iteration. `cp_async`: LDGSTS / LDGDEPBAR (cp.async) or UBLKCP / UTMALDG (TMA) inside it."""

    start: int
    end: int
    instructions: int  # NOPs (alignment padding) left out
    barriers: int  # BAR.SYNC / BAR.RED / BAR.ARV
    exponentials: int  # MUFU.EX2
    cp_async: int


def sass_loops(sass: str) -> List[SassLoop]:
    """Every loop of a SASS listing (innermost and outer alike), in address order. A branch to itself (the
    trailing `BRA` after EXIT) is no loop."""
    code = [(int(addr, 16), op, operands) for addr, _, op, operands in _SASS_RE.findall(sass)]
    loops = []
    for addr, op, operands in code:
        target = re.search(r"0x([0-9a-f]+)", operands) if op.startswith("BRA") else None
        if target is None or int(target.group(1), 16) >= addr:
            continue
        start = int(target.group(1), 16)
        body = [o for a, o, _ in code if start <= a <= addr and o != "NOP"]
        loops.append(SassLoop(
            start=start, end=addr, instructions=len(body),
            barriers=sum(o.startswith(("BAR.SYNC", "BAR.RED", "BAR.ARV")) for o in body),
            exponentials=sum(o.startswith("MUFU.EX2") for o in body),
            cp_async=sum(o.startswith(("LDGSTS", "LDGDEPBAR", "UBLKCP", "UTMALDG")) for o in body)))
    return loops


def dump_sass(cubin: bytes) -> str:
    """`cuobjdump --dump-sass` of a cubin (about a second per kernel)."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "kernel.cubin")
        with open(path, "wb") as f:
            f.write(cubin)
        return subprocess.run([_nvidia_bin("cuobjdump"), "--dump-sass", path], capture_output=True, text=True,
                              check=True).stdout


def non_ftz_exponentials(ptx: str) -> int:
    """`ex2.approx.f32` without ftz in the PTX: each costs ~3 fix-up instructions around its MUFU (tl.exp lowers
    to it; tl.math.exp2 to the ftz form)."""
    return len(re.findall(r"\bex2\.approx\.f32\b", ptx))


_AMD_RE = re.compile(r"^\s*(?:\.(vgpr_count|sgpr_count|agpr_count|vgpr_spill_count|sgpr_spill_count):\s*(\d+)"
                     r"|; (ScratchSize|Occupancy): (\d+))", re.M)


def amd_usage(amdgcn: str) -> Dict[str, int]:
    """VGPRs, AGPRs, SGPRs, spilled registers, scratch bytes and LLVM's occupancy (waves per SIMD) of the kernel
    in an AMDGCN assembly listing (its metadata block and the comments LLVM writes after the function)."""
    found: Dict[str, int] = {}
    for key, value, comment, number in _AMD_RE.findall(amdgcn):
        found[key or comment] = int(value or number)
    wanted = {"vgpr_count", "sgpr_count", "vgpr_spill_count", "sgpr_spill_count", "ScratchSize", "Occupancy"}
    missing = wanted - set(found)
    if missing:
        raise RuntimeError(f"AMDGCN listing: no {sorted(missing)}")
    return found


def occupancy(cc: int, regs: int, shared: int, num_warps: int):
    """(fraction of the SM's warps resident, the limiter) of a kernel with `regs` registers per thread, `shared`
    bytes of shared memory per block and `num_warps` warps per block on compute capability `cc`: the CUDA occupancy
    calculator's arithmetic (warps, blocks, registers in 256-register units per warp, shared memory with the 1 KiB
    each block reserves)."""
    limits = SM_LIMITS[cc]
    per_warp = -(-max(regs, 1) * 32 // REGISTER_UNIT) * REGISTER_UNIT
    blocks = {
        "warps": limits["warps"] // num_warps,
        "blocks": limits["blocks"],
        "registers": (limits["registers"] // per_warp) // num_warps,
        "shared": limits["shared"] // (shared + RESERVED_SHARED_PER_BLOCK),
    }
    limiter = min(blocks, key=blocks.get)
    return blocks[limiter] * num_warps / limits["warps"], limiter


def _kernel_shared(cc: int, static: int) -> int:
    """The kernel's own static shared memory. From sm_90 on, cuobjdump's SHARED also counts the 1 KiB the driver
    reserves per block (a kernel with none reads 1024 there, 0 on sm_80); occupancy() adds that reservation once."""
    return max(0, static - RESERVED_SHARED_PER_BLOCK) if cc >= 90 else static


def run_spec(spec, target: str) -> AotResult:
    res = AotResult(spec.name, target, spec.num_warps, spec.num_stages)
    t0 = time.perf_counter()
    try:
        kernel = compile_spec(spec, target)
        if TARGETS[target][0] == "cuda":
            usage = resource_usage(kernel.asm["cubin"])
            res.regs, res.spills, res.stack = usage["REG"], usage["LOCAL"], usage["STACK"]
            res.shared = _kernel_shared(TARGETS[target][1], usage["SHARED"]) + kernel.metadata.shared
            res.ldg_bits = widest_global_load(kernel.asm["ptx"])
            res.occupancy, res.limiter = occupancy(TARGETS[target][1], res.regs, res.shared, spec.num_warps)
            if spec.loop_gate is not None and target == LOOP_GATE_TARGET:
                loops = sass_loops(dump_sass(kernel.asm["cubin"]))
                # the hottest loop by instructions, with the barriers of every loop (a kernel may stream twice)
                if loops:
                    hottest = max(loops, key=lambda loop: loop.instructions)
                    res.loop = dataclasses.replace(hottest, barriers=sum(loop.barriers for loop in loops))
                res.non_ftz = non_ftz_exponentials(kernel.asm["ptx"])
        else:
            usage = amd_usage(kernel.asm["amdgcn"])
            res.regs, res.stack, res.shared, res.ldg_bits = usage["vgpr_count"], 0, kernel.metadata.shared, 0
            res.spills = usage["vgpr_spill_count"] + usage["sgpr_spill_count"] + usage["ScratchSize"]
            res.occupancy = usage["Occupancy"] / WAVES_PER_SIMD
            res.limiter = "registers" if usage["Occupancy"] < WAVES_PER_SIMD else "waves"
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


def brackets(spec) -> bool:
    """Whether a spec has its optional features (the boolean constexprs) all on or all off."""
    flags = [v for v in spec.constexprs.values() if isinstance(v, bool)]
    return all(flags) or not any(flags)


_WORKER_SPECS: Dict[str, list] = {}


def _run_indexed(job) -> AotResult:
    """Worker entry: (module name, spec index, target). Specs hold JITFunctions, which do not pickle, so
    each worker process imports the kernel module itself."""
    module, index, target = job
    if module not in _WORKER_SPECS:
        from . import __name__ as pkg_name

        _WORKER_SPECS[module] = list(importlib.import_module(f"{pkg_name}.{module}").aot_specs())
    return run_spec(_WORKER_SPECS[module][index], target)


def run_all(jobs, workers: int) -> List[AotResult]:
    if workers <= 1 or len(jobs) <= 1:
        return [_run_indexed(j) for j in jobs]
    import multiprocessing

    # fork: the children inherit the imported modules and compile independently (no GPU involved)
    with multiprocessing.get_context("fork").Pool(workers) as pool:
        return pool.map(_run_indexed, jobs, chunksize=1)


COLUMNS = ("target", "warps", "stages", "regs", "spills", "stack", "shared", "ldg", "occ", "limiter", "sec")


def format_table(results: List[AotResult]) -> str:
    """One row per (spec, target); numbers first so that long kernel names cannot push them apart (the columns:
    COLUMNS, then the kernel's configuration)."""
    head = (f"{'target':>6} {'warps':>5} {'stages':>6} {'regs':>4} {'spills':>6} {'stack':>5} {'shared':>6} {'ldg':>4} "
            f"{'occ':>4} {'limiter':>9} {'sec':>5}  kernel config")
    lines = [head, "-" * len(head)]
    for r in results:
        if r.error:
            lines.append(f"{r.target:>6} {r.num_warps:>5} {r.num_stages:>6} {'ERROR':>4}  {r.name}: {r.error}")
            continue
        lines.append(
            f"{r.target:>6} {r.num_warps:>5} {r.num_stages:>6} {r.regs:>4} {r.spills:>6} {r.stack:>5} {r.shared:>6} "
            f"{r.ldg_bits:>4} {r.occupancy:>4.2f} {r.limiter:>9} {r.seconds:>5.2f}  {r.name}"
        )
    return "\n".join(lines)


def loop_gate_failures(spec, res: AotResult) -> List[str]:
    """Where a gated spec's hot loop exceeds its LoopGate (an empty list: it passes)."""
    gate = spec.loop_gate
    if res.loop is None:
        return [f"{res.name} {res.target}: no loop in the SASS"]
    out = []
    per = res.loop.instructions / gate.elements
    if per > gate.per_element:
        out.append(f"{res.name} {res.target}: {per:.2f} SASS instructions per element in the loop, gate "
                   f"{gate.per_element}")
    if res.loop.barriers > gate.barriers:
        out.append(f"{res.name} {res.target}: {res.loop.barriers} barriers in the loop, gate {gate.barriers}")
    if res.non_ftz > gate.non_ftz:
        out.append(f"{res.name} {res.target}: {res.non_ftz} non-ftz ex2 in the PTX, gate {gate.non_ftz}")
    if gate.staged and not res.loop.cp_async:
        out.append(f"{res.name} {res.target}: a staged loop without cp.async")
    return out


def format_loops(results: List[AotResult], specs: Dict[str, object]) -> str:
    """One line per gated spec: its hot loop's instructions per element, barriers, MUFU.EX2 and cp.async per
    iteration, and the gate."""
    lines = []
    for r in results:
        if r.loop is None:
            continue
        gate = specs[r.name].loop_gate
        lines.append(f"LOOP {r.target} {r.loop.instructions / gate.elements:.2f}/elt (gate {gate.per_element}) "
                     f"{r.loop.instructions} instr {r.loop.barriers} bar {r.loop.exponentials} ex2 "
                     f"{r.loop.cp_async} cp.async {r.non_ftz} non-ftz  {r.name}")
    return "\n".join(lines)


def summary(results: List[AotResult]) -> str:
    """Per kernel and target, over its configurations: registers (min-max), the most spilled, the most shared
    memory, and the lowest occupancy with its limiter (the table of docs/backends.md)."""
    groups: Dict[tuple, List[AotResult]] = {}
    for r in results:
        if not r.error:
            groups.setdefault((r.name.split("[")[0], r.target), []).append(r)
    lines = ["| kernel | target | configs | registers | spills | shared (B) | lowest occupancy |",
             "|---|---|---|---|---|---|---|"]
    for (kernel, target), rows in sorted(groups.items(), key=lambda kv: (kv[0][0], list(TARGETS).index(kv[0][1]))):
        low = min(rows, key=lambda r: r.occupancy)
        regs = sorted(r.regs for r in rows)
        lines.append(f"| {kernel} | {target} | {len(rows)} | {regs[0]}-{regs[-1]} | {max(r.spills for r in rows)} | "
                     f"{max(r.shared for r in rows)} | {low.occupancy:.2f} ({low.limiter}) |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m rlkernels.kernels.triton.aot", description=__doc__.split("\n")[0])
    parser.add_argument("--target", nargs="+", default=list(TARGETS), choices=list(TARGETS),
                        help="targets (default: all of them)")
    parser.add_argument("--every-config", action="store_true",
                        help="every configuration for every target (default: EVERY_CONFIG_TARGETS only)")
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
        jobs += [(module, i, target) for i, spec in enumerate(specs) for target in args.target
                 if args.every_config or target in EVERY_CONFIG_TARGETS or brackets(spec)]
    t0 = time.perf_counter()
    results = run_all(jobs, args.jobs)
    print(format_table(results))
    print()
    print(summary(results))
    specs = {spec.name: spec for _, found in discover_specs(args.only) if not isinstance(found, str) for spec in found}
    gated = [r for r in results if not r.error and r.target == LOOP_GATE_TARGET and specs[r.name].loop_gate]
    if gated:
        print()
        print(format_loops(gated, specs))
    failures += [f for r in gated for f in loop_gate_failures(specs[r.name], r)]
    failures += [f"{r.name} {r.target}: {r.error}" for r in results if r.error]
    failures += [f"{r.name} {r.target}: {r.spills} spilled" for r in results if not r.error and r.spills]
    failures += [f"{r.name} {r.target}: occupancy {r.occupancy:.2f} ({r.limiter}) below {OCCUPANCY_FLOOR}"
                 for r in results if not r.error and r.occupancy < OCCUPANCY_FLOOR]
    clean = sum(r.ok for r in results)
    print(f"\n{len(results)} compiles ({clean} clean) in {time.perf_counter() - t0:.1f} s wall, {args.jobs} jobs")
    if not results and not failures:
        failures.append("no AotSpec found")
    for f in failures:
        print(f"FAIL {f}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
