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
