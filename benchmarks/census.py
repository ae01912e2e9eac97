"""Which stage calls take the fused stage: a pytest plugin that records `stage.fused.blocker`'s answer for every
call a test suite makes, and sums them up at the end.

    python -m pytest -p benchmarks.census tests/integrations     # the nine trainers' own losses and configs

Each call is recorded twice: with its statistics' own dtype (the answer the call got), and as if they were float32
(what the family covers; the float64 calls are parity tests, which the kernels never take). The summary counts both
and lists the reasons that kept calls out; RLKERNELS_CENSUS names a JSON-lines file for the calls themselves.
"""

import collections
import json
import os

import torch

from rlkernels.stage import fused

_calls = []


def _recording(blocker):
    def recorded(batch, config, dtype):
        reason = blocker(batch, config, dtype)
        _calls.append(dict(dtype=str(dtype), reason=reason, as_float32=blocker(batch, config, torch.float32),
                           loss_type=config.loss_type, test=os.environ.get("PYTEST_CURRENT_TEST", "")))
        return reason
    return recorded


def pytest_configure(config):
    fused.blocker = _recording(fused.blocker)  # stage.choose reads it through the module at each call


def pytest_terminal_summary(terminalreporter):
    float32 = [call for call in _calls if call["dtype"] == "torch.float32"]
    terminalreporter.section("fused-stage census")
    terminalreporter.write_line(f"float32 calls taking the fused stage: {sum(c['reason'] is None for c in float32)} "
                                f"of {len(float32)}")
    terminalreporter.write_line(f"every call, were its statistics float32: "
                                f"{sum(c['as_float32'] is None for c in _calls)} of {len(_calls)}")
    held = collections.Counter(c["as_float32"] for c in _calls if c["as_float32"] is not None)
    for reason, count in held.most_common():
        terminalreporter.write_line(f"  {count:4d}  {reason}")
    path = os.environ.get("RLKERNELS_CENSUS")
    if path:
        with open(path, "w") as out:
            out.writelines(json.dumps(call) + "\n" for call in _calls)
