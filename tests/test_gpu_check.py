"""benchmarks/gpu_check.sh, the one script a GPU session runs, checked here where it cannot run: it parses, its
step limits fit the 10 minutes a session may spend, and every benchmark it calls accepts the flags it passes
(each module's own argument parser, stopped right after parsing), so a renamed flag fails here and not on the
few minutes of a lent GPU."""

import argparse
import importlib
import os
import re
import shlex
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "benchmarks", "gpu_check.sh")
BUDGET_S = 600


def _steps():
    """(name, limit_s, argv) of each `step` line, continuations joined and the script's variables filled in."""
    text = open(SCRIPT).read().replace("\\\n", " ")
    values = {"$PY": "python", '"$OUT"': "/tmp/out", "$OUT": "/tmp/out", '"$PEAK_GBPS"': "4800",
              '"${MAX_JOBS:-16}"': "16"}
    steps = []
    for line in text.splitlines():
        match = re.match(r"\s*step (\w+) (\d+) (.*)", line)
        if match:
            command = match.group(3)
            for variable, value in values.items():
                command = command.replace(variable, value)
            steps.append((match.group(1), int(match.group(2)), shlex.split(command)))
    return steps


class _Parsed(Exception):
    pass


def test_the_script_parses_and_its_limits_fit_ten_minutes():
    subprocess.run(["bash", "-n", SCRIPT], check=True)
    steps = _steps()
    assert len(steps) >= 10, [name for name, _, _ in steps]
    total = sum(limit for _, limit, _ in steps)
    assert total <= BUDGET_S - 5, f"step limits add up to {total} s"  # the versions and the summary: seconds
    claimed = re.search(r"step limits ([\d + ]+) s", open(SCRIPT).read()).group(1)
    assert sum(int(x) for x in claimed.split("+")) == total, "the header's sum is not the steps' limits"


@pytest.mark.parametrize("name,argv", [(name, argv) for name, _, argv in _steps()
                                       if argv[:2] == ["python", "-m"] and argv[2].startswith("benchmarks.")])
def test_each_benchmark_accepts_the_flags_the_script_passes(name, argv, monkeypatch):
    module = importlib.import_module(argv[2])
    original = argparse.ArgumentParser.parse_args

    def parse_then_stop(self, args=None, namespace=None):
        original(self, args, namespace)  # an unknown flag or a bad value exits here (SystemExit 2)
        raise _Parsed

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse_then_stop)
    with pytest.raises(_Parsed):
        module.main(argv[3:])


def test_the_summary_names_every_failed_gpu_test(tmp_path):
    """The summary's Python, run on a JUnit file with one pass, one failure and one error: both failures by id and
    message (the last GPU run lost the ids of 7 failures in a cut log)."""
    body = re.search(r"<<'PYEOF'\n(.*?)\nPYEOF", open(SCRIPT).read(), re.S).group(1)
    (tmp_path / "gpu-tests.xml").write_text(
        '<testsuites><testsuite name="pytest" tests="3">'
        '<testcase classname="tests.kernels.test_gpu_kernels" name="test_ok"/>'
        '<testcase classname="tests.kernels.test_gpu_kernels" name="test_tier[bf16]">'
        '<failure message="AssertionError: dlogits differ&#10;more">trace</failure></testcase>'
        '<testcase classname="tests.backends.test_cuda_backend" name="test_message"><error message="SIGSEGV">t</error>'
        '</testcase></testsuite></testsuites>')
    script = tmp_path / "summary.py"
    script.write_text(body)
    done = subprocess.run([sys.executable, str(script), str(tmp_path), "4800"], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    assert "gpu tests: 1 of 3 passed or skipped" in done.stdout
    assert "FAILED tests.kernels.test_gpu_kernels::test_tier[bf16]: AssertionError: dlogits differ" in done.stdout
    assert "FAILED tests.backends.test_cuda_backend::test_message: SIGSEGV" in done.stdout
