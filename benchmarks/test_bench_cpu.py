"""pytest-benchmark cases for the CPU, outside the default test path (`tests/`).

    python -m pytest benchmarks/test_bench_cpu.py --benchmark-only
    python -m pytest benchmarks/test_bench_cpu.py --benchmark-only -k "fwdbwd and 4096"

Each case times one provider on one problem (forward, or forward + backward) with the same inputs
and loss configuration as `python -m benchmarks.run`; peak memory and the JSON record are the
harness's job. Providers that do not apply (Liger off its token-level case, backends that need a
GPU) are skipped with the reason.
"""


import pytest

# the repository root is on sys.path: pytest prepends the rootdir of this test package (tests/ and benchmarks/
# are packages), so `benchmarks` imports without a path edit
from benchmarks.problems import CASES, make_inputs
from benchmarks.providers import PROVIDERS

pytestmark = pytest.mark.benchmark_suite

# (op, case, N, V): the quick suite's CPU shapes; token_tis at V=4096 is where Liger's CPU path runs
PROBLEMS = [
    ("ppo", "seq_mis", 1024, 32768),
    ("ppo", "seq_mis", 4096, 32768),
    ("ppo", "token_tis", 1024, 4096),
    ("logprobs", None, 1024, 32768),
    ("logprobs", None, 512, 151936),
]


@pytest.mark.parametrize("mode", ["fwd", "fwdbwd"])
@pytest.mark.parametrize("provider", list(PROVIDERS))
@pytest.mark.parametrize("op,case,N,V", PROBLEMS, ids=lambda v: str(v))
def test_cpu(benchmark, op, case, N, V, provider, mode):
    prov = PROVIDERS[provider]
    c = CASES[case] if case else None
    reason = prov.skip_reason(op, c, V, "cpu")
    if reason:
        pytest.skip(reason)
    x = make_inputs(N, V, "fp32", c.layout if c else "mixed", "cpu")
    fn = prov.build(op, c, x)
    leaf = x.get("liger_logits", x["logits"])

    def forward():
        out = fn()
        return out if out.dim() == 0 else out.sum()

    def step():
        if mode == "fwd":
            return forward()
        leaf.grad = None
        forward().backward()

    try:
        step()  # warm-up outside the timed rounds (torch.compile compiles here)
    except Exception as exc:  # noqa: BLE001 - e.g. torch.compile failing on this machine
        pytest.skip(f"{provider} failed on this machine: {type(exc).__name__}: {exc}")
    bytes_model = (1 if mode == "fwd" else 3) * N * V * 4
    benchmark.extra_info.update(op=op, case=case, N=N, V=V, dtype="fp32", bytes_model=bytes_model)
    benchmark.pedantic(step, rounds=3, iterations=1, warmup_rounds=0)
