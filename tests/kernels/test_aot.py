"""Ahead-of-time compile of the Triton kernels for every target, without a GPU: every configuration for sm_80 and
sm_90, the bracketing ones (optional features all on, all off) for sm_100, sm_120, gfx942 and gfx950.

The harness (rlkernels/kernels/triton/aot.py) runs in a subprocess without TRITON_INTERPRET (this test session
sets it, and interpreted kernels cannot be compiled), one test per target so that the workers share them out. It
fails on a compile error, a register spill or an occupancy below the floor; `pytest -s` prints its table
(registers, spills, stack, shared, widest load, occupancy and its limiter).
"""

import dataclasses
import os
import re
import subprocess
import sys

import pytest
import triton

from rlkernels.kernels.triton import aot, divergences, forward_grad, token_grad, token_stats
from rlkernels.kernels.triton.tl_math import vocab_config

pytestmark = pytest.mark.aot

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _spec_configs(module):
    return {(s.constexprs["BLOCK_V"], s.constexprs["BLOCK_N"], s.num_warps, s.num_stages) for s in module.aot_specs()}


@pytest.mark.parametrize("module", [token_stats, token_grad], ids=lambda m: m.__name__.rsplit(".", 1)[-1])
def test_specs_cover_exactly_the_heuristic(module):
    # every vocabulary size 1..2^18 maps onto a tier; aot_specs() must list exactly those configs
    picked = set()
    for k in range(19):
        for V in {max(1, (1 << k) - 1), 1 << k, (1 << k) + 1}:
            cfg = vocab_config(V)
            picked.add((cfg.BLOCK_V, cfg.BLOCK_N, cfg.num_warps, cfg.num_stages))
    assert picked == _spec_configs(module)
    names = [s.name for s in module.aot_specs()]
    assert len(names) == len(set(names))
    dtypes = {s.signature["logits_ptr"] for s in module.aot_specs()}
    assert dtypes == {"*fp16", "*bf16", "*fp32"}


def test_discovery_finds_every_kernel_module():
    found = {name: specs for name, specs in aot.discover_specs()}
    assert {"token_stats", "token_grad", "divergences", "vllm_logprobs", "head_columns", "stage",
            "forward_grad"} <= set(found)
    assert all(not isinstance(specs, str) for specs in found.values()), found


def test_widest_global_load_parser():
    ptx = """
    @%p1 ld.global.v4.b32 { %r1, %r2, %r3, %r4 }, [ %rd1 + 0 ];
    ld.global.b16 { %rs1 }, [ %rd2 + 0 ];
    ld.global.L1::evict_last.v2.b64 { %rd5, %rd6 }, [ %rd3 + 0 ];
    """
    assert aot.widest_global_load(ptx) == 128
    assert aot.widest_global_load("ld.global.b16 { %rs1 }, [ %rd2 + 0 ];") == 16
    assert aot.widest_global_load("ld.global.v2.b64 { %rd1, %rd2 }, [ %rd3 + 0 ];") == 0  # int64 labels


# cuobjdump's layout: address comment, optional predicate, opcode, operands, encoding comment
SASS = """
        /*0660*/                   MOV R2, RZ ;                                   /* 0x000000ff00027202 */
        /*0670*/                   LDG.E.128 R4, desc[UR4][R2.64] ;               /* 0x0000000402047981 */
        /*0680*/                   FFMA R6, R4, R8, -R9 ;                         /* 0x0000000804067223 */
        /*0690*/                   MUFU.EX2 R6, R6 ;                              /* 0x0000000600067308 */
        /*06a0*/                   NOP ;                                          /* 0x0000000000007918 */
        /*06b0*/                   BAR.SYNC.DEFER_BLOCKING 0x0 ;                  /* 0x0000000000007b1d */
        /*06c0*/                   LDGSTS.E.BYPASS.128 [R3], desc[UR4][R4.64] ;   /* 0x0000000004037fae */
        /*06d0*/              @!P1 BRA 0x670 ;                                    /* 0xfffffff0002c9947 */
        /*06e0*/                   EXIT ;                                         /* 0x000000000000794d */
        /*06f0*/                   BRA 0x6f0;                                     /* 0xfffffffc00fc7947 */
"""


def test_sass_loop_parser():
    """The loop is the backward branch's span (target to branch), NOPs left out; the trailing self-branch is none."""
    (loop,) = aot.sass_loops(SASS)
    assert (loop.start, loop.end) == (0x670, 0x6D0)
    assert (loop.instructions, loop.barriers, loop.exponentials, loop.cp_async) == (6, 1, 1, 1)
    assert aot.sass_loops(SASS.replace("@!P1 BRA 0x670", "@!P1 BRA 0x6e0")) == []  # a forward branch
    ptx = "ex2.approx.f32 %f1, %f2;\n ex2.approx.ftz.f32 %f3, %f4;\n ex2.approx.f32 %f5, %f6;"
    assert aot.non_ftz_exponentials(ptx) == 2


def test_loop_gate_failures_name_each_excess():
    from rlkernels.kernels.triton.aot_spec import LoopGate

    spec = next(s for s in token_stats.aot_specs() if s.loop_gate is not None)
    (loop,) = aot.sass_loops(SASS)
    res = aot.AotResult(spec.name, "sm_90", spec.num_warps, spec.num_stages, loop=loop, non_ftz=0)
    generous = dataclasses.replace(spec, loop_gate=LoopGate(elements=1, per_element=6, barriers=1, staged=True))
    assert aot.loop_gate_failures(generous, res) == []
    strict = dataclasses.replace(spec, loop_gate=LoopGate(elements=2, per_element=2.5, barriers=0))
    failures = aot.loop_gate_failures(strict, dataclasses.replace(res, non_ftz=3))
    assert len(failures) == 3 and "3.00 SASS instructions per element" in failures[0]
    assert "1 barriers" in failures[1] and "3 non-ftz" in failures[2]
    unstaged = dataclasses.replace(res, loop=dataclasses.replace(loop, cp_async=0))
    assert aot.loop_gate_failures(generous, unstaged) == [f"{spec.name} sm_90: a staged loop without cp.async"]
    assert "no loop" in aot.loop_gate_failures(generous, dataclasses.replace(res, loop=None))[0]
    allowed = dataclasses.replace(generous, loop_gate=LoopGate(elements=1, per_element=6, barriers=1, non_ftz=1))
    assert aot.loop_gate_failures(allowed, dataclasses.replace(res, non_ftz=1)) == []
    assert "2 non-ftz ex2 in the PTX, gate 1" in aot.loop_gate_failures(allowed, dataclasses.replace(res, non_ftz=2))[0]


@pytest.mark.parametrize("module", [token_stats, token_grad, divergences, forward_grad],
                         ids=lambda m: m.__name__.rsplit(".", 1)[-1])
def test_the_streaming_specs_carry_a_loop_gate(module):
    gated = [s for s in module.aot_specs() if s.loop_gate is not None]
    assert gated and all(s.constexprs["BLOCK_N"] == 1 for s in gated)
    # the two tiers of one row per program (the full form's half-width tiles: pair_config)
    assert {s.constexprs["BLOCK_V"] for s in gated} == ({2048, 4096} if module is divergences else {4096, 8192})
    for s in gated:  # a thread's elements per iteration: the tile over the block's threads
        assert s.loop_gate.elements * 32 * s.num_warps == s.constexprs["BLOCK_V"]


def test_compile_spec_refuses_interpreted_kernels():
    if not isinstance(token_stats._token_stats_fwd_kernel, triton.runtime.JITFunction):
        with pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
            aot.compile_spec(token_stats.aot_specs()[0], "sm_90")


def test_occupancy_arithmetic():
    # by hand, the CUDA occupancy calculator's way: 57 registers -> 8 units of 256 per warp -> 32 warps of 64K
    assert aot.occupancy(90, 57, 1088, 16) == (0.5, "registers")
    assert aot.occupancy(90, 32, 0, 4) == (1.0, "warps")  # 16 blocks of 4 warps fill the 64
    assert aot.occupancy(80, 32, 100 * 1024, 4) == (4 / 64, "shared")  # one 100 KiB block fits in 164 KiB
    assert aot.occupancy(120, 64, 0, 16) == (2 / 3, "registers")  # 32 of the consumer SM's 48 warps
    assert aot.occupancy(90, 16, 0, 1) == (0.5, "blocks")  # 32 one-warp blocks


def test_amd_listing_parser():
    listing = """
      .sgpr_count:     50
      .sgpr_spill_count: 0
      .vgpr_count:     29
      .vgpr_spill_count: 3
    ; Occupancy: 6
    ; ScratchSize: 16
    """
    usage = aot.amd_usage(listing)
    assert (usage["vgpr_count"], usage["vgpr_spill_count"], usage["ScratchSize"], usage["Occupancy"]) == (29, 3, 16, 6)
    with pytest.raises(RuntimeError, match="Occupancy"):
        aot.amd_usage(listing.replace("; Occupancy: 6", ""))


def test_brackets_are_the_all_on_and_all_off_variants():
    specs = token_stats.aot_specs()
    bracket = [s for s in specs if aot.brackets(s)]
    assert len(bracket) * 4 == len(specs)  # 2 of the 8 combinations of three flags
    assert {tuple(v for v in s.constexprs.values() if isinstance(v, bool)) for s in bracket} == \
        {(True, True, True), (False, False, False)}


def _expected_compiles(target):
    specs = [s for _, found in aot.discover_specs() for s in found]
    return len(specs) if target in aot.EVERY_CONFIG_TARGETS else sum(aot.brackets(s) for s in specs)


@pytest.mark.parametrize("target", list(aot.TARGETS))
def test_aot_compile_no_spills_and_enough_occupancy(target):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run(
        [sys.executable, "-m", "rlkernels.kernels.triton.aot", "--target", target],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=1800,
    )
    print(proc.stdout)
    assert proc.returncode == 0, (
        f"AOT harness failed (rc={proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    )
    n = _expected_compiles(target)
    summary = re.search(r"(\d+) compiles \((\d+) clean\)", proc.stdout)
    assert summary, proc.stdout[-2000:]
    assert int(summary.group(1)) == n and summary.group(1) == summary.group(2), summary.group(0)
    rows = [line.split() for line in proc.stdout.splitlines()]
    rows = [f for f in rows if len(f) == 12 and f[0] == target]
    assert len(rows) == n
    for fields in rows:  # columns: aot.COLUMNS, then the kernel's configuration
        assert fields[4] == "0", f"spills: {fields}"
        assert float(fields[8]) >= aot.OCCUPANCY_FLOOR, f"occupancy: {fields}"
        streams = ("token_stats_fwd[", "token_grad_bwd[", "full_divergences_fwd[", "full_divergences_bwd[")
        if target.startswith("sm_") and fields[11].startswith(streams):
            assert fields[7] == "128", f"no 16-byte loads of the logits: {fields}"
