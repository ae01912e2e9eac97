"""The benchmark harness end to end on one tiny case: it runs, writes the JSON it promises, and the
naive PyTorch baseline computes the same loss as rlkernels (so the benchmark compares like with like).
"""

import json
import re
from pathlib import Path

import pytest
import torch

from .cases import TOL, approx, assert_close, tol

# the repository root is on sys.path: pytest prepends the rootdir of this test package (tests/ and benchmarks/
# are packages), so `benchmarks` imports without a path edit

run = pytest.importorskip("benchmarks.run")
pytest.importorskip("tqdm")

RECORD_FIELDS = {"provider", "kind", "op", "case", "N", "V", "dtype", "mode", "status", "time_ms", "samples_ms",
                 "peak_mem_bytes", "mem_method", "bytes_model", "gbps", "value"}
ENV_FIELDS = {"date", "cpu_model", "cpu_cores", "torch", "triton", "git_commit", "rlkernels_backends"}


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    rc = run.main([
        "--device", "cpu", "--in-process", "--no-plot", "--out", str(out), "--tag", "smoke",
        "--providers", "naive,rlkernels[torch]", "--warmup", "1", "--reps", "2",
        "--shape", "ppo:seq_mis:192:1000:fp32", "--shape", "logprobs:-:192:1000:fp32",
    ])
    with open(out / "smoke.json") as f:
        return rc, json.load(f)


def test_harness_writes_expected_json(result):
    rc, data = result
    assert rc == 0
    assert data["schema"] == "rlkernels-bench/1"
    assert ENV_FIELDS <= set(data["environment"])
    assert data["settings"]["device"] == "cpu"
    ok = [r for r in data["results"] if r["status"] == "ok"]
    # 2 providers x 2 ops x 2 modes
    assert len(ok) == 8, [(r["provider"], r["op"], r["mode"], r.get("reason")) for r in data["results"]]
    for r in ok:
        assert RECORD_FIELDS <= set(r), RECORD_FIELDS - set(r)
        assert r["time_ms"]["p20"] <= r["time_ms"]["median"] <= r["time_ms"]["p80"]
        elem = 4
        assert r["bytes_model"] == (1 if r["mode"] == "fwd" else 3) * r["N"] * r["V"] * elem
        if r["mode"] == "fwdbwd":
            assert "grad_abs_sum" in r


def test_naive_and_rlkernels_agree(result):
    _, data = result
    checks = [c for c in data["checks"] if c["provider"] == "naive"]
    assert {(c["op"], c["mode"], c["field"]) for c in checks} >= {
        ("ppo", "fwd", "value"), ("ppo", "fwdbwd", "value"), ("ppo", "fwdbwd", "grad_abs_sum"),
        ("logprobs", "fwd", "value"),
    }
    for c in checks:
        assert c["rel_err"] <= TOL["benchmark", torch.float32].rtol, c
    loss = [r["value"] for r in data["results"] if r["op"] == "ppo" and r["mode"] == "fwd"]
    assert len(loss) == 2 and loss[0] != 0.0  # the case does real work: a nonzero loss



def test_the_baseline_benchmark_times_verl_and_rlkernels_on_the_same_advantages(tmp_path, monkeypatch):
    """benchmarks/baseline.py on a small batch, both variants: its rows name both providers, and the three
    versions' advantages agree (float32 inputs; rlkernels sums in float32 too, in other orders: 1e-6 of the
    largest return). Without verl, it times rlkernels alone and adds the same shape in groups of one."""
    baseline = pytest.importorskip("benchmarks.baseline")
    rows = baseline.main(["--batch", "24x16x4", "--reps", "1", "--json", str(tmp_path / "otb.json")])
    written = json.load(open(tmp_path / "otb.json"))
    assert written["rows"] == rows and ENV_FIELDS <= set(written["environment"])
    if baseline._verl_functions() is not None:
        assert [r["variant"] for r in rows] == ["otb", "tir"]
        for r in rows:
            assert r["groups"] == 6 and r["verl_ms"] > 0 and r["rlkernels_vs_verl"] > 0
            assert set(r["max_rel_diff"]) == {"verl", "rlkernels", "rlkernels_compiled"}
            assert max(r["max_rel_diff"].values()) <= TOL["otb", torch.float32].atol, r  # already / the scale
    monkeypatch.setattr(baseline, "_verl_functions", lambda: None)
    alone = baseline.main(["--batch", "24x16x4", "--reps", "1", "--variant", "otb"])
    assert [(r["groups"], "verl_ms" in r) for r in alone] == [(6, False), (24, False)]


def test_linear_benchmark_counts_three_gemms_for_the_one_pass_form(tmp_path):
    """benchmarks/linear.py end to end on a tiny head (time, the GEMM count, the JSON): every provider computes
    the same loss, the one-pass form multiplies 3 f N token rows and the two-pass form more (its backward
    recomputes the logits of the rows with a coefficient)."""
    linear = pytest.importorskip("benchmarks.linear")
    N, f = 512, 0.5
    rows = linear.main(["--N", str(N), "--H", "16", "--V", "384", "--fractions", str(f), "--reps", "1", "--case",
                        "token_tis", "--providers", "naive,rlkernels[linear],rlkernels[linear-two-pass]",
                        "--gemm-count", "--no-memory", "--out", str(tmp_path), "--tag", "smoke"])
    by = {r["provider"]: r for r in rows}
    assert set(by) == {"naive", "rlkernels[linear]", "rlkernels[linear-two-pass]"}
    assert by["naive"]["gemm_calls"] == 3 and by["naive"]["gemm_rows"] == 3 * N
    assert by["rlkernels[linear]"]["gemm_rows"] == 3 * f * N
    assert 3 * f * N < by["rlkernels[linear-two-pass]"]["gemm_rows"] <= 4 * f * N
    with open(tmp_path / "smoke.json") as fh:
        assert len(json.load(fh)["rows"]) == 3


def test_divergences_benchmark_runs_every_provider(tmp_path):
    """benchmarks/divergences.py end to end on a tiny vocabulary (time, the JSON): every provider's value is finite
    and the rlkernels forms agree with the naive ones on the loss they time. Fresh-process memory (one process
    per provider, ~8 s each here) is measured for one naive and one rlkernels provider: the same worker code
    builds and runs every provider, and the timing pass has just run each one."""
    divergences = pytest.importorskip("benchmarks.divergences")
    out = tmp_path / "div.json"
    rows = divergences.main(["--N", "32", "--V", "96", "--k", "5", "--reps", "1", "--no-memory", "--json", str(out)])
    by = {(r["provider"], r["mode"]): r for r in rows}
    assert {p for p, _ in by} == set(divergences.PROVIDERS)
    value = {p: by[(p, "fwd")]["value"] for p in divergences.PROVIDERS}
    assert value["rlkernels[topk]"] == approx(value["naive[topk]"], "benchmark.divergences", torch.float32)
    assert value["rlkernels[full]"] == approx(value["naive[full]"], "benchmark.divergences", torch.float32)
    x = divergences.make_inputs(32, 96, 5, "fp32", "cpu")  # the inputs the run drew (seed 0): kl alone, naively
    naive_kl = float(divergences._naive_full(x["logits"], x["sampler_logits"])[0].mean())
    assert value["rlkernels[full:kl]"] == approx(naive_kl, "benchmark.divergences", torch.float32)
    assert out.exists()
    measured = divergences.main(["--N", "32", "--V", "96", "--k", "5", "--reps", "1",
                                 "--providers", "naive[full],rlkernels[full]"])
    assert {r["provider"] for r in measured} == {"naive[full]", "rlkernels[full]"}
    assert all(r["peak_working_bytes"] is not None for r in measured)


def test_the_revisions_benchmark_compares_two_checkouts(tmp_path):
    """benchmarks/revisions.py against HEAD: both revisions time every case, in fresh processes, and the JSON holds
    the medians (a worktree of HEAD is made and removed)."""
    from benchmarks import revisions

    out = tmp_path / "revisions.json"
    revisions.main(["--base", "HEAD", "--rounds", "1", "--reps", "1", "--N", "64", "--V", "128", "--H", "8",
                    "--json", str(out)])
    medians = json.loads(out.read_text())["medians"]
    cases = {"logprobs", "ppo", "linear", "linear_two_pass", "policy"}
    assert set(medians) == {"base", "head"} and all(set(m) == cases for m in medians.values())
    assert all(v > 0 for m in medians.values() for v in m.values())


@pytest.mark.parametrize("case", ["token_tis", "seq_mis"])
def test_the_linear_benchmarks_gemm_yardstick_runs_for_every_case(case):
    """The GEMM alone (t_GEMM, the yardstick of the one- and two-pass forms) is the same for every loss: the first
    H200 run lost it for seq_mis ("gemm runs the token_tis case only")."""
    linear = pytest.importorskip("benchmarks.linear")
    x = linear.make_inputs(64, 8, 40, 0.5, "fp32", "cpu")
    logits = linear.build("gemm", x, case)()
    assert torch.equal(logits, x["hidden"] @ x["weight"].T)


def test_every_linear_provider_the_gpu_script_names_builds_and_runs():
    """benchmarks/gpu_check.sh's linear step names its providers in a string no parser checks: each one builds here
    and takes a step on a tiny bf16 head (a misspelt one would only fail on a lent GPU)."""
    linear = pytest.importorskip("benchmarks.linear")
    from .test_gpu_check import _steps

    (argv,) = [argv for name, _, argv in _steps() if name == "linear"]
    providers = argv[argv.index("--providers") + 1].split(",")
    assert "rlkernels[linear-tf32-head]" in providers
    x = linear.make_inputs(512, 8, 64, 0.5, "bf16", "cpu")
    for provider in providers:
        x["hidden"].requires_grad_(True)
        x["weight"].requires_grad_(True)
        loss = linear.build(provider, x, "seq_mis")()
        assert torch.isfinite(loss), provider


def test_the_numerics_benchmark_counts_matches_and_costs():
    """benchmarks/numerics.py end to end on a tiny batch: numerics="vllm" matches vLLM on every row of every
    backend here (V1 on torch and cpu; V2's own kernels on Triton through the interpreter, where its wheel is
    reachable), and each mode is timed against "default"."""
    numerics = pytest.importorskip("benchmarks.numerics")
    matches, costs = numerics.main(["--N", "8", "--V", "300", "--reps", "1"])
    assert matches and all(r["equal"] == r["N"] for r in matches if r["numerics"] == "vllm")
    assert {r["backend"] for r in matches} >= {"torch"}
    assert {r["numerics"] for r in costs} == {"default", "vllm", "batch_invariant"}


def test_a_shape_run_never_writes_over_a_suites_results():
    """`--shape` without `--tag` is named after its shapes (docs/numerics.md's command once overwrote the committed
    cpu-quick.json); a suite keeps its own name."""
    assert run.default_tag("cpu", "quick", None) == "cpu-quick"
    tag = run.default_tag("cpu", "quick", ["logprobs:-:4096:32768:fp32", "ppo:seq_mis:4096:32768:fp32"])
    assert tag == "cpu-shapes-logprobs-4096-32768-fp32_ppo-seq_mis-4096-32768-fp32"
    committed = {p.stem for p in (Path(run.__file__).parent / "results").glob("*.json")}
    assert tag not in committed


def test_without_the_reference_provider_agreement_is_not_claimed(tmp_path, capsys):
    rc = run.main(["--device", "cpu", "--in-process", "--no-plot", "--out", str(tmp_path), "--providers", "naive",
                   "--warmup", "0", "--reps", "1", "--shape", "logprobs:-:64:128:fp32"])
    printed = capsys.readouterr().out
    assert rc == 0
    assert "agreement: not checked (rlkernels[torch], the reference, was not among the providers)" in printed
    assert "0/0" not in printed
    assert (tmp_path / "cpu-shapes-logprobs-64-128-fp32.json").exists()


DOC_COMMAND = re.compile(r"`python -m benchmarks\.(run|linear) ([^`]*)`")
RESULTS_FILE = re.compile(r"benchmarks/results/([\w.-]+)\.json")


def test_the_docs_benchmark_commands_write_the_files_they_cite():
    """Every `python -m benchmarks.run|linear` command of the docs that a results file follows (within its
    paragraph) names that file with --tag: rerunning it regenerates the figure's source, and nothing else."""
    root = Path(run.__file__).resolve().parents[1]
    checked = 0
    for page in [root / "README.md", *(root / "docs").glob("*.md")]:
        text = page.read_text()
        for match in DOC_COMMAND.finditer(text):
            paragraph = text[match.end():].split("\n\n", 1)[0]
            cited = RESULTS_FILE.search(paragraph)
            if cited is None:
                continue
            tag = re.search(r"--tag (\S+)", match.group(2))
            assert tag and tag.group(1) == cited.group(1), f"{page.name}: `{match.group(0)[:90]}...` writes " \
                f"{tag.group(1) if tag else 'its default name'}, the page cites {cited.group(1)}.json"
            checked += 1
    assert checked >= 3


def test_the_trainer_logprobs_benchmark_compares_like_with_like():
    """benchmarks/trainer_logprobs.py: each trainer's pass and its adapter's route compute the same log-probs and
    entropy (float32 logits: the float32 rows), and the fresh-process measurement runs (one pair here, ~8 s per
    process; the same worker code builds every provider)."""
    bench = pytest.importorskip("benchmarks.trainer_logprobs")
    g = torch.Generator().manual_seed(0)
    logits, labels = torch.randn(1, 24, 57, generator=g) * 2, torch.randint(0, 57, (1, 24), generator=g)
    try:
        values = {p: [v.detach().float() for v in bench.build(p)(logits.clone(), labels)] for p in bench.PROVIDERS}
    except ImportError as exc:  # pragma: no cover - CI installs every trainer
        pytest.skip(f"a trainer is not importable here ({exc})")
    for trainer in ("areal", "skyrl", "openrlhf"):
        for name, ours, theirs in zip(("logprobs", "entropy"), values[f"rlkernels[{trainer}]"], values[trainer]):
            assert_close(ours, theirs, **tol("value", torch.float32, scale=4.0), name=f"{trainer} {name}")
    rows = bench.main(["--N", "64", "--V", "128", "--providers", "openrlhf,rlkernels[openrlhf]"])
    assert [r["provider"] for r in rows] == ["openrlhf", "rlkernels[openrlhf]"]
    assert all("error" not in r and r["peak_working_bytes"] is not None for r in rows), rows


def test_the_kernels_benchmark_sets_each_pass_against_its_ceiling(tmp_path):
    """benchmarks/kernels.py on a tiny batch: every case timed with its bytes (a forward one read, a backward a read
    and a write, fwd + bwd three passes), each ceiling 100 % of itself, the launchers of the CPU kernels beside the
    public call with validate on and off, and the JSON written."""
    kernels = pytest.importorskip("benchmarks.kernels")
    out = tmp_path / "kernels.json"
    assert kernels.main(["--N", "8", "--V", "256", "--rounds", "2", "--json", str(out)]) == 0
    with open(out) as f:
        result = json.load(f)
    cases, read = result["cases"], 8 * 256 * 2
    assert {"read_ceiling", "copy_ceiling", "api.forward[validate=True]", "api.forward[validate=False]",
            "api.fwd_bwd[validate=True]", "api.fwd_bwd[validate=False]"} <= set(cases)
    assert "graph.forward" not in cases  # CUDA only
    for ceiling in ("read_ceiling", "copy_ceiling"):
        assert cases[ceiling]["pct_of_ceiling"] == pytest.approx(100.0)
    assert cases["read_ceiling"]["bytes"] == read and cases["api.fwd_bwd[validate=False]"]["bytes"] == 3 * read
    from rlkernels import backends

    if backends.is_available("cpu"):
        assert cases["cpu.forward"]["bytes"] == read and cases["cpu.backward"]["bytes"] == 2 * read
        assert cases["cpu.divergences"]["bytes"] == 2 * read and cases["cpu.divergences[tv]"]["bytes"] == 4 * read
    assert all(len(c["samples_ms"]) == 2 and c["ms"] > 0 for c in cases.values())


def test_the_sanitizer_script_reaches_every_kernel_family(capsys):
    """benchmarks/sanitize.py (what compute-sanitizer wraps in gpu_check.sh) through the CPU kernels: every call
    runs, one line each, so that a sanitizer report can be placed; its flags as the script passes them."""
    sanitize = pytest.importorskip("benchmarks.sanitize")
    from rlkernels import backends

    if not backends.is_available("cpu"):
        pytest.skip("the CPU kernels did not build here: nothing for the script to launch on a CPU")
    assert sanitize.main(["--V", "512", "--N", "4"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split(": ")[1] for line in lines] == [
        "token_stats + token_grad", "token_stats + token_grad, entropy, in place", "head columns (sampler top-k)",
        "full divergences fwd + bwd", "vllm_logprobs"]
    script = (Path(sanitize.__file__).parent / "gpu_check.sh").read_text()
    assert "compute-sanitizer --tool memcheck" in script and "compute-sanitizer --tool racecheck" in script


def test_the_stage_benchmark_sets_the_fused_stage_against_the_torch_stage(tmp_path):
    """benchmarks/stage.py --fused-only (gpu_check.sh's stage_fused step) under the interpreter: a covered case gets
    every variant's loss, equal to the eager one's; a case outside the family says why instead of a time."""
    stage = pytest.importorskip("benchmarks.stage")
    rows = stage.main(["--device", "cpu", "--tokens", "64", "--seqs", "4", "--reps", "1", "--fused-only",
                       "--case", "seq_mis+kl+entropy", "--case", "family", "--json", str(tmp_path / "s.json")])
    covered, family = rows
    assert {"eager_ms", "compiled_ms", "fused_ms"} <= set(covered)
    assert max(covered["loss_max_rel_diff"].values()) <= TOL[("reordered", torch.float32)].rtol
    assert family["fused"].startswith("not covered: m2po_threshold=0.04")  # its OPSM is covered since 7cbe13a
    assert json.loads((tmp_path / "s.json").read_text()) == rows
