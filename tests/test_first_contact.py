"""A new user's first compiled step, in fresh interpreters: an in-process test cannot see this class of
failure, since an earlier test has long since built and loaded the CPU kernels and imported Triton.

The scenarios (tests/support/first_contact.py) compile a training step with per-step hyperparameters
(fullgraph, aot_eager and Inductor), a one-sequence batch, the no-grad log-prob pass, the fused-linear loss and the
loss alone (the fused stage eagerly, the torch stage compiled), each compared with eager. One interpreter runs them
in turn with an empty kernel cache: its first call is an Inductor step, so the CPU kernels are built while Dynamo
traces it for Inductor (the stricter backend: Inductor runs AOTAutograd as aot_eager does, then generates code), and
the rest follow under aot_eager. A second interpreter runs every scenario under Inductor with the cache warm (loaded
while tracing).
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from .cases import F32, tol

SCRIPT = Path(__file__).parent / "support" / "first_contact.py"
ALL = ("compiled_step", "one_sequence", "no_grad_logprobs", "fused_linear", "loss_only")
BUILD_MESSAGE = "rlkernels: compiling the CPU kernels once"
TIMEOUT_S = 600  # a busy 2-core machine; the two runs take ~40-70 s each with cold caches


def _run(cache: Path, scenarios):
    """Runs `scenarios` ("name@backend") in turn in one fresh interpreter using the kernel cache `cache`."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("TRITON_INTERPRET", "RLKERNELS_CPU_KERNELS", "TORCHINDUCTOR_COMPILE_THREADS")}
    env["RLKERNELS_CACHE"] = str(cache)
    bound = tol("reordered", F32)  # compiled against eager: the same fp32 formulas, reductions reordered
    run = subprocess.run([sys.executable, "-W", "always", str(SCRIPT), repr(bound["rtol"]), repr(bound["atol"]),
                          *scenarios],
                         capture_output=True, text=True, timeout=TIMEOUT_S, env=env)
    assert run.returncode == 0, f"stdout:\n{run.stdout}\nstderr:\n{run.stderr[-6000:]}"
    for scenario in scenarios:
        assert f"ok {scenario.replace('@', ' ')}" in run.stdout
    # the probes are constants to Dynamo: it must never meet the lru_cache or the file system behind them
    assert "lru_cache" not in run.stderr, run.stderr[-4000:]
    assert "'cpu': True" in run.stdout, "the CPU kernels did not build or load: the scenarios ran the torch backend"
    return run


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("rlkernels-cache")


def test_first_compiled_calls_with_an_empty_kernel_cache(cache):
    run = _run(cache, ["compiled_step@inductor"] + [f"{name}@aot_eager" for name in ALL])
    assert BUILD_MESSAGE in run.stderr  # the build really ran, inside the first traced call


def test_first_compiled_calls_with_a_warm_kernel_cache(cache):
    if not any(cache.iterdir()):
        _run(cache, ["no_grad_logprobs@aot_eager"])  # run alone: build the cache first
    run = _run(cache, [f"{name}@inductor" for name in ALL])
    assert BUILD_MESSAGE not in run.stderr
