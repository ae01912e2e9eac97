"""`python -m rlkernels.demo` as a newcomer runs it, in a fresh interpreter: it names the bad responses it injected,
prints the batch's mismatch once, says what each preset did to the bad responses and how much of the batch it kept
(tokens and sequences), shows the bounds it set itself, and refuses bad arguments with a clear message."""

import re
import subprocess
import sys

import pytest
import torch

from rlkernels.demo import DRIFT, PRESETS, synthetic_batch

ARGS = ["--sequences", "48", "--vocab", "512", "--repeats", "1"]


@pytest.fixture(scope="module")
def output():
    run = subprocess.run([sys.executable, "-m", "rlkernels.demo", *ARGS], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    return run.stdout


def test_it_names_the_bad_responses_it_injected(output):
    """The responses it names are those whose reported log-probs sit DRIFT nats below the proximal policy's
    (checked on the batch itself, not on what the demo says of it)."""
    named = [int(i) for i in re.findall(r"response #(\d+)", output)]
    batch = synthetic_batch(48, 512, "cpu")
    x = batch.inputs
    cu, gap = x["cu_seqlens"], (x["old_logprobs"] - x["rollout_logprobs"])
    mean_gap = [float(gap[cu[i] + 1:cu[i + 1]].mean()) for i in range(48)]  # the first token of each is prompt
    drifted = [i for i, g in enumerate(mean_gap) if g > DRIFT / 2]
    assert named == drifted and len(named) >= 1
    assert all(mean_gap[i] < 0.5 for i in range(48) if i not in named)


def test_the_batch_diagnostics_are_printed_once_apart_from_the_presets(output):
    head, table = output.split("The corrections:")
    assert head.count("k1 estimate (may be < 0)") == 1 and "k3 estimate (>= 0)" in head
    assert "(high)" not in head  # a flag says which bound a value is outside of
    assert "k1" not in table and "chi2" not in table.split("timing:")[0]
    assert "all responses" in head and "without the bad ones" in head


def test_each_preset_says_what_it_did_to_the_bad_responses(output):
    table = output.split("The corrections:")[1].split("timing:")[0]
    rows = {name: line for name, _, _ in PRESETS for line in table.splitlines()
            if line.startswith(name + "  ") and re.search(r"\d+/\d+", line)}
    assert set(rows) == {name for name, _, _ in PRESETS}
    assert "tokens kept" in table and "sequences kept" in table
    assert "lets the bad responses through" in rows["none (plain PPO)"]
    assert "catches the bad responses" in rows["seq-MIS"] and "rejected" in rows["seq-MIS"]
    assert "bounds too narrow" in rows["Geo-RS + token-TIS"]  # verl's band: most sequences gone
    assert "catches the bad responses" in rows["Geo-RS + token-TIS, wide"]
    assert "bounds the bad responses' weight" in rows["token-TIS"]
    # the bounds the demo sets itself are printed, beside the preset's own
    assert "[0.9, 1.1] (set here; the preset's default: bounds=(0.999, 1.001))" in table
    assert table.count("set here") == sum(bool(overrides) for _, _, overrides in PRESETS) == 1
    assert "catches the bad responses" in rows["K3-RS"]
    # what the two columns of weights mean, and that the bad responses' raw weight is what the drift makes it
    assert "before rejection" in table and f"e^{DRIFT} = {2.718281828 ** DRIFT:.1f}" in table


@pytest.mark.parametrize("args, message", [
    (["--sequences", "0"], "--sequences must be at least 2"),
    (["--vocab", "1"], "--vocab must be at least 2"),
    (["--device", "tpu"], "--device: expected cpu or cuda"),
    (["--device", "cpu:1"], "--device: expected cpu or cuda"),
    (["--repeats", "0"], "--repeats must be at least 1"),
    pytest.param(["--device", "cuda"], "no CUDA device is available", marks=pytest.mark.skipif(
        torch.cuda.is_available(), reason="this machine has a CUDA device")),
])
def test_bad_arguments_get_a_clear_error(args, message):
    run = subprocess.run([sys.executable, "-m", "rlkernels.demo", *args], capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and message in run.stderr, run.stderr[-2000:]
    assert "Traceback" not in run.stderr
