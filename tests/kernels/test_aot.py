"""Ahead-of-time compile of every Triton kernel configuration for sm_80 and sm_90, without a GPU.

The harness (rlkernels/kernels/triton/aot.py) runs in a subprocess without TRITON_INTERPRET (this
test session sets it, and interpreted kernels cannot be compiled). It fails on a compile error or
any register spill; `pytest -s` prints its table (registers, spills, stack, shared, widest load).
"""

import os
import re
import subprocess
import sys

import pytest
import triton

from rlkernels.kernels.triton import aot, token_grad, token_stats
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
    assert {"token_stats", "token_grad"} <= set(found)
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


def test_compile_spec_refuses_interpreted_kernels():
    if not isinstance(token_stats._token_stats_fwd_kernel, triton.runtime.JITFunction):
        with pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
            aot.compile_spec(token_stats.aot_specs()[0], 90)


def test_aot_compile_sm80_sm90_no_spills():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run(
        [sys.executable, "-m", "rlkernels.kernels.triton.aot", "--cc", "80", "90"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=1800,
    )
    print(proc.stdout)
    assert proc.returncode == 0, (
        f"AOT harness failed (rc={proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    )
    n_specs = len(token_stats.aot_specs()) + len(token_grad.aot_specs())
    summary = re.search(r"(\d+) compiles \((\d+) clean\)", proc.stdout)
    assert summary, proc.stdout[-2000:]
    assert int(summary.group(1)) >= 2 * n_specs and summary.group(1) == summary.group(2), summary.group(0)
    rows = [line.split() for line in proc.stdout.splitlines()]
    rows = [f for f in rows if len(f) == 10 and f[9].startswith(("token_stats_fwd[", "token_grad_bwd["))]
    assert len(rows) == 2 * n_specs
    for fields in rows:  # columns: cc warps stages regs spills stack shared ldg sec name
        assert fields[4] == "0", f"spills: {fields}"
        assert fields[7] == "128", f"no 16-byte loads of the logits: {fields}"
