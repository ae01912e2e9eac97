"""The mismatch study's smoke run (benchmarks/mismatch_study.py --smoke), as a user runs it: a fresh process per
backend, the JSON it promises, rlkernels' first-step loss against the naive PyTorch loss over the full logits,
and the mismatch it is built on (none in the on-policy control, some on the served path)."""

import json
import math
import os
import subprocess
import sys

import pytest
import torch

from .cases import BF16, F32, F64, approx, tol

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REQUIRED_ARMS = ("none", "token_tis", "seq_tis", "seq_mis", "geo_rs", "trm", "otb", "group_mean")
PER_STEP = ("step", "reward", "loss", "grad_norm", "entropy", "response_length", "rejected_seq_fraction", "kl",
            "chi2_token", "out_of_band_fraction", "collapsed", "seconds", "rss_mib", "sample_hash")


def _study(out, *args):
    done = subprocess.run([sys.executable, "-m", "benchmarks.mismatch_study", "--smoke", "--out", str(out), *args],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    with open(out / "mismatch-study.json") as f:
        return json.load(f)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    auto, reference = tmp_path_factory.mktemp("auto"), tmp_path_factory.mktemp("torch")
    return auto, _study(auto), reference, _study(reference, "--backend", "torch")


def test_json_has_every_arm_and_curve(runs):
    _, data, _, _ = runs
    assert {"config", "mismatch", "arms", "summary"} <= set(data)
    names = " ".join(data["arms"])
    for required in REQUIRED_ARMS:
        assert required in names, f"no arm named with {required!r}: {sorted(data['arms'])}"
    steps = data["config"]["rl_steps"]
    for name, arm in data["arms"].items():
        assert len(arm["seeds"]) == data["config"]["seeds"]
        for seed in arm["seeds"]:
            for measure in PER_STEP:
                assert len(seed[measure]) == steps, (name, measure)
            assert all(0.0 <= r <= 1.0 for r in seed["reward"]), name
            assert all(math.isfinite(x) for x in seed["loss"] + seed["grad_norm"] + seed["entropy"]), name
            assert not any(seed["collapsed"]), name  # four steps cannot fall 0.15 below a 10-step peak


def test_first_step_loss_equals_the_naive_loss(runs):
    _, data, _, _ = runs
    checked = 0
    for name, arm in data["arms"].items():
        check = arm["seeds"][0]["first_step_naive_check"]
        if "skipped" in check:
            continue
        # float32 both ways, sums over ~100 tokens in another order: the parity tests' float32 value tolerance
        q = tol("value", F32, scale=max(1.0, abs(check["naive"])))
        assert check["abs_diff"] <= q["atol"] + q["rtol"] * abs(check["naive"]), (name, check)
        checked += 1
    assert checked >= 5  # none, token_tis, seq_tis, geo_rs_token_tis, the OTB arm, the LR-control arm


def test_the_mismatch_is_real_and_the_control_has_none(runs):
    _, data, _, _ = runs
    measured = data["mismatch"]
    # the same weights and numerics
    assert measured["fp32/top_p=1"]["exact_kl_mu_pi_token_mean"] == approx(0.0, "mismatch.fp32_kl", F32)
    assert measured["fp8/top_p=1"]["exact_kl_mu_pi_token_mean"] > 1e-5  # the served path differs
    control = data["arms"]["on_policy_reference"]["seeds"][0]
    served = data["arms"]["none_group_mean"]["seeds"][0]
    assert control["chi2_token"] == approx([0.0] * len(control["chi2_token"]), "mismatch.control_chi2", F32)
    assert max(served["out_of_band_fraction"]) > 0.0
    # the preset geometric-mean bounds (0.999, 1.001) reject sequences at this mismatch
    assert max(data["arms"]["geo_rs_token_tis"]["seeds"][0]["rejected_seq_fraction"]) > 0.0


def test_backends_agree_on_the_same_samples(runs, tmp_path):
    auto, data, reference, _ = runs
    done = subprocess.run([sys.executable, "-m", "benchmarks.mismatch_study", "--compare",
                           str(auto / "mismatch-study.json"), str(reference / "mismatch-study.json"),
                           "--out", str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    with open(tmp_path / "mismatch-study-backends.json") as f:
        report = json.load(f)
    assert report["backends"][1] == "torch"
    for name, arm in report["arms"].items():
        for seed in arm["seeds"]:
            # staleness 2: the first three steps sample from the starting weights in both runs
            assert seed["identical_steps"] >= min(3, seed["steps"]), (name, seed)
            assert seed["first_step_within_tolerance"], (name, seed)


# -- the collapse study (benchmarks/collapse_study.py, `--regime collapse`) ---------------------------------------

COLLAPSE_ARM_WORDS = ("bypass", "decoupled", "moe", "replay", "pg_seq_is", "on_policy", "token_tis", "seq_tis",
                      "seq_mis", "geo_rs", "trm", "router32")
# the causal arms of the MoE collapse: the failing objective with each correction, with replay, without the flips
CAUSAL_ARMS = ("moe_bypass_seq_tis", "moe_bypass_seq_mis", "moe_bypass_token_tis", "moe_bypass_pg_seq_is_geo_rs",
               "moe_bypass_pg_seq_is_trm", "moe_replay_bypass_pg_seq_is", "moe_router32_bypass_pg_seq_is",
               "moe_on_policy_bypass_pg_seq_is", "moe_on_policy_bypass_none")
COLLAPSE_PER_STEP = ("step", "reward", "loss", "grad_norm", "entropy", "response_length", "seq_ess", "topk_kl_mean",
                     "k3_kl", "rejected_seq_fraction", "out_of_clip_fraction", "routing_flip_rate", "collapsed",
                     "seconds", "sample_hash")


@pytest.fixture(scope="module")
def collapse(tmp_path_factory):
    out = tmp_path_factory.mktemp("collapse")
    done = subprocess.run([sys.executable, "-m", "benchmarks.mismatch_study", "--regime", "collapse", "--smoke",
                           "--out", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    with open(out / "collapse-study.json") as f:
        return json.load(f)


def test_collapse_json_has_every_arm_curve_and_definition(collapse):
    assert {"config", "calibration", "thresholds", "definitions", "arms", "summary", "predictors"} <= set(collapse)
    names = " ".join(collapse["arms"])
    for word in COLLAPSE_ARM_WORDS:
        assert word in names, f"no arm named with {word!r}: {sorted(collapse['arms'])}"
    steps = collapse["config"]["rl_steps"]
    for name, arm in collapse["arms"].items():
        for seed in arm["seeds"]:
            for measure in COLLAPSE_PER_STEP:
                assert len(seed[measure]) == steps, (name, measure)
            assert all(math.isfinite(x) for x in seed["loss"] + seed["grad_norm"] + seed["seq_ess"]), name
            assert all(0.0 < x <= 1.0 + 1e-9 for x in seed["seq_ess"]), name
        assert [p["seed"] for p in collapse["predictors"][name]] == list(range(collapse["config"]["seeds"]))
    # the band and the bound are measured, not a preset: one per served path, from its calibration
    for path in ("dense/fp8", "moe/fp8"):
        lo, hi = collapse["thresholds"][path]["geo_rs_band"]
        assert lo < 1.0 < hi and lo * hi == pytest.approx(1.0)
        assert collapse["thresholds"][path]["trm_eps"] > 0


def test_collapse_first_step_loss_equals_the_naive_loss(collapse):
    for name, arm in collapse["arms"].items():
        check = arm["seeds"][0]["first_step_naive_check"]
        # the arm's own advantages (0 when every sample of a group scored alike) and the +-1 probe, which is not 0
        assert check["probe"]["naive"] != 0.0, name
        for c in (check, check["probe"]):
            q = tol("value", F32, scale=max(1.0, abs(c["naive"])))
            assert c["abs_diff"] <= q["atol"] + q["rtol"] * abs(c["naive"]), (name, c)


def test_collapse_moe_sampler_flips_routes_and_the_fp32_sampler_does_not(collapse):
    calibration = collapse["calibration"]
    assert calibration["moe/fp8"]["routing_flip_rate"] > 0.0  # bf16 router on bf16 activations
    assert calibration["moe/fp32"]["routing_flip_rate"] == 0.0  # the trainer's numerics, a KV cache
    for path in ("dense/fp32", "dense/fp8"):
        assert calibration[path]["routing_flip_rate"] == 0.0  # no router at all
    assert calibration["dense/fp32"]["exact_kl_mu_pi_token_mean"] == approx(0.0, "mismatch.fp32_kl", F32)
    assert calibration["dense/fp8"]["exact_kl_mu_pi_token_mean"] > 0.0
    # a float32 router on the served bf16 activations still flips some routes (docs/study.md): measured, not assumed
    assert "routing_flip_rate" in calibration["moe/fp8_router32"]
    for name, arm in collapse["arms"].items():
        flips = arm["seeds"][0]["routing_flip_rate"]
        served = collapse["arms_config"][name]["sampler"]
        assert (max(flips) > 0.0) == (name.startswith("moe") and served.startswith("fp8")), (name, served, flips)


def test_collapse_causal_arms_run_and_report_their_comparisons(collapse):
    for name in CAUSAL_ARMS:
        assert name in collapse["arms"], name
        assert set(collapse["comparisons"][name]) >= {"vs_moe_bypass_pg_seq_is", "vs_on_policy_bypass_none"}
    rates = collapse["predictor_rates"]
    assert rates["seeds"] == len(collapse["arms"]) * collapse["config"]["seeds"]
    for name in ("ess_fall", "grad_spike", "kl_rise"):
        assert set(rates[name]) == {"leads", "preceded", "false_alarms", "false_alarm_rate"}
    assert collapse["definitions"]["collapse_window"] == 25 and collapse["definitions"]["false_alarm"] == 0.05


def test_welch_test_matches_the_t_table():
    """Two-sided p of Student's t at t = 2.228, df = 10 is 0.05 (the table's critical value); Welch's df for equal
    sizes and variances is 2n - 2."""
    from benchmarks.collapse_study import _betainc, welch_test

    assert _betainc(5.0, 0.5, 10 / (10 + 2.228**2)) == approx(0.05, "study.t_table", F64)
    out = welch_test([1.0, 2.0, 3.0], [0.0, 1.0, 2.0])
    assert out["diff"] == 1.0 and out["df"] == pytest.approx(4.0) and out["t"] == pytest.approx(math.sqrt(1.5))
    assert math.isnan(welch_test([1.0, 1.0], [1.0, 1.0])["p"])  # no spread: no test


def test_collapse_margin_scales_with_the_controls_noise():
    """The margin is a quantile of the criterion's statistic over noise resampled from the control: twice the
    residuals give twice the margin, and a noiseless control none."""
    from benchmarks.collapse_study import margin_from_control

    g = torch.Generator().manual_seed(1)
    noise = torch.randn(2, 120, generator=g) * 0.05
    one = margin_from_control((0.3 + noise).tolist(), 100, trials=500)
    two = margin_from_control((0.3 + 2 * noise).tolist(), 100, trials=500)
    assert two["margin"] == approx(2 * one["margin"], "study.margin", F64) and one["margin"] > 0
    assert margin_from_control([[0.3] * 120] * 2, 100, trials=50)["margin"] == approx(0.0, "study.margin", F64)


def test_served_attention_is_a_flash_kernels_arithmetic():
    """The served copies' attention (`flash_attention_arithmetic`) on bf16 q, k, v: a float64 oracle with the same
    roundings (the probabilities before their product with v, the output once), and keys the mask excludes, whose
    values never count (bit for bit). The CPU's own bf16 attention is no oracle: it rounds scaled inputs to bf16
    (0.06-0.1 apart here, at |v| <= 9), which a GPU flash kernel does not."""
    from benchmarks.study_model import flash_attention_arithmetic, sequence_mask

    g = torch.Generator().manual_seed(3)
    B, H, T, D = 3, 2, 9, 8
    q, k, v = (3 * torch.randn(B, H, T, D, generator=g).bfloat16().float() for _ in range(3))
    mask = sequence_mask(torch.rand(B, T, generator=g) > 0.3)
    out = flash_attention_arithmetic(q, k, v, mask, torch.bfloat16)
    assert out.dtype == torch.bfloat16
    scores = (q.double() @ k.double().transpose(-1, -2) / math.sqrt(D)).masked_fill(~mask, -math.inf)
    p = torch.exp(scores - scores.amax(-1, keepdim=True))
    oracle = ((p.bfloat16().double() @ v.double()) / p.sum(-1, keepdim=True)).bfloat16()
    within = tol("study.served_kernel", BF16, scale=float(v.abs().max()))
    torch.testing.assert_close(out.double(), oracle.double(), **within)
    # decoding: one query over a cache whose excluded keys hold anything at all
    keys_valid = torch.rand(B, 1, 1, T, generator=g) > 0.4
    keys_valid[..., -1] = True
    junk, kept = torch.full_like(k, 1e4), keys_valid[:, :, 0, :, None]  # [B, 1, T, 1]
    one = flash_attention_arithmetic(q[:, :, -1:], k, v, keys_valid, torch.bfloat16)
    same = flash_attention_arithmetic(q[:, :, -1:], torch.where(kept, k, junk), torch.where(kept, v, junk),
                                      keys_valid, torch.bfloat16)
    assert one.shape == (B, H, 1, D)
    assert torch.equal(one, same)


def test_served_copies_keep_the_served_values_and_round_each_gemm_once():
    """`served_model`'s float32 arithmetic: its parameters hold exactly the values the CPU's own bf16 copy holds
    (FP8-quantised block weights, bf16 embeddings, head and router; a float32 router on _router32), each GEMM rounds
    its float32 result once to bf16, and a float32 path is the trainer's arithmetic, unchanged."""
    from benchmarks import collapse_study as cs

    cfg = cs.CollapseConfig(**cs.SMOKE)
    torch.manual_seed(0)
    model = cs.build(cfg, "moe")
    for path in ("fp8", "fp8" + cs.ROUTER32):
        served, native = cs.served_model(model, path), cs.served_model(model, path, float32_arithmetic=False)
        for (name, a), (_, b) in zip(served.named_parameters(), native.named_parameters(), strict=True):
            assert torch.equal(a.float(), b.float()), (path, name)
        assert served.blocks[0].router.weight.dtype == torch.float32
        assert getattr(served.blocks[0].router, "served_dtype", torch.float32) == native.blocks[0].router.weight.dtype
    qkv = served.blocks[0].qkv
    x = torch.randn(5, cfg.d_model, generator=torch.Generator().manual_seed(4)).bfloat16()
    out = qkv(x)
    assert out.dtype == torch.bfloat16
    oracle = (x.double() @ qkv.weight.double().T + qkv.bias.double()).bfloat16()
    torch.testing.assert_close(out.double(), oracle.double(),
                               **tol("study.served_kernel", BF16, scale=float(oracle.abs().max())))
    plain = cs.served_model(model, "fp32")
    assert not any(hasattr(m, "served_dtype") or getattr(m, "float32_attention", False) for m in plain.modules())
