"""benchmarks/cpu.py end to end at a tiny size (it needs none of the bench extra's packages, so it runs
in CI, unlike the harness smoke test)."""

import json

import pytest

# the repository root is on sys.path: pytest prepends the rootdir of this test package (tests/ and benchmarks/
# are packages), so `benchmarks` imports without a path edit


def test_cpu_benchmark_runs_and_measures_every_provider(tmp_path):
    """benchmarks/cpu.py at a tiny size: every provider timed in both cases, quiet and contended, and the
    bandwidth floor measured (the figures themselves are not checked: timing is not a unit test)."""
    cpu = pytest.importorskip("benchmarks.cpu")
    out = tmp_path / "cpu.json"
    results = cpu.main(["--N", "64", "--V", "256", "--reps", "1", "--json", str(out)])
    for state in ("quiet", "contended"):
        for case in ("train", "logprobs"):
            assert (case, "naive") in results[state] and (case, "rlkernels[torch]") in results[state]
            assert all(ms > 0 for ms in results[state].values())
    assert results["floor"]["read_GBps"] > 0
    assert json.loads(out.read_text())["N"] == 64


def test_sampler_benchmark_runs_every_variant(tmp_path):
    """benchmarks/sampler.py at a tiny size: the full pass, the per-token temperature, and the kept set
    and its naive masked form at each K, with and without the backward (figures not checked)."""
    sampler = pytest.importorskip("benchmarks.sampler")
    out = tmp_path / "sampler.json"
    results = sampler.main(["--N", "32", "--V", "64", "--K", "5", "--K", "64", "--reps", "1", "--json", str(out)])
    for case in ("fwd+bwd", "fwd"):
        assert set(results[case]) == {"full", "full+T_t", "kept K=5", "naive K=5", "kept K=64", "naive K=64"}
        assert results[case]["full"]["vs_full"] == 1.0
    assert json.loads(out.read_text())["K"] == [5, 64]
