"""The per-sequence stage is deterministic on a GPU: no floating-point atomics in its reductions.

CUDA's index_add_ / scatter_add_ / scatter_reduce_ / index_put_(accumulate=True) accumulate with
atomics, so a segmented sum built on them changes in its last bits from run to run. There is no GPU
here, so the test records every ATen op the stage runs (tests/cases.py::aten_ops) over the whole option
product, both layouts, and checks that none of those ops appears.
"""

import itertools

import pytest
import torch

from rlkernels import PolicyLossConfig, RolloutCorrection
from rlkernels.config import IS_LEVELS, LOG_RATIO_RS_OPTIONS, LOSS_AGG_MODES
from rlkernels.stage.segments import Segments
from rlkernels.testing.stage import run_stage

from ..cases import ATOMIC_OPS, aten_ops


def _bounds(option):
    return (0.5, 2.0) if option.endswith("k1") else 1.0


@pytest.mark.parametrize("layout", ["padded", "packed", "one_sequence"])
@pytest.mark.parametrize("is_level, agg", list(itertools.product([lv for lv in IS_LEVELS if lv], LOSS_AGG_MODES)))
def test_stage_uses_no_atomic_reduction(layout, is_level, agg):
    N = 12
    g = torch.Generator().manual_seed(0)
    lp, old, roll, ref = (-torch.rand(N, generator=g) for _ in range(4))
    ent, adv = torch.rand(N, generator=g), torch.randn(N, generator=g)
    mask = torch.rand(N, generator=g) > 0.2
    rc = RolloutCorrection(is_level=is_level, is_batch_normalize=True, rs={o: _bounds(o) for o in LOG_RATIO_RS_OPTIONS})
    config = PolicyLossConfig(rollout_correction=rc, loss_agg_mode=agg, kl_coef=0.1, entropy_coeff=0.01)

    def stage(lp, ent, adv, mask, old, roll, ref):
        if layout == "padded":
            seg = Segments.padded(3, 4, lp.device)
        else:
            cu = torch.tensor([0, 5, 5, 12]) if layout == "packed" else None
            seg = Segments.packed(cu, N, lp.device)
        out = run_stage(lp, ent, adv, mask, old, roll, ref, seg, config)
        return out.loss, out.coef_logprob, out.coef_entropy, out.metrics

    ops = aten_ops(stage, lp, ent, adv, mask, old, roll, ref)
    found = set(ops) & ATOMIC_OPS
    assert not found, f"atomic (nondeterministic on CUDA) ops in the stage: {sorted(found)}"
    assert "segment_reduce" in ops or layout == "padded"  # the fixed-order reduction is what runs
