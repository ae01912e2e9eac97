"""The compiled per-sequence stage (the CUDA default, forced here with compile_stage=True) against the
eager one over the option product: the same torch code through Inductor must give the same loss,
weights, mask, metrics and gradient, on every layout including empty batches and empty sequences.

Each new option set compiles (seconds on a CPU), so the example budget is small; HYPOTHESIS_SCALE
raises it.
"""

import torch
import torch._dynamo
from hypothesis import given, settings

import rlkernels

from ..cases import F32, assert_close, problems, scaled, tol


@settings(max_examples=scaled(10))
@given(problem=problems(dtype=F32))
def test_compiled_stage_matches_the_eager_stage(problem):
    batch, mode, config = problem
    results = []
    for compile_stage in (False, True):
        logits = batch.logits.clone().requires_grad_(True)
        out = rlkernels.decoupled_ppo_loss(logits, batch.labels, batch.advantages, batch.response_mask, config=config,
                                           compile_stage=compile_stage, **batch.kwargs(mode))
        (grad,) = torch.autograd.grad(out.loss, logits)
        results.append((out, grad))
    (want, want_grad), (got, got_grad) = results
    scale = max(1.0, float(want.loss.detach().abs()))
    assert_close(got.loss, want.loss, **tol("reordered", F32, scale=scale), name="loss")
    assert_close(got.is_weights, want.is_weights, **tol("reordered", F32), name="is_weights")
    assert torch.equal(got.mask, want.mask), "final mask differs"
    assert set(got.metrics) == set(want.metrics)
    for name, value in want.metrics.items():
        m_scale = max(1.0, float(value.abs())) if torch.isfinite(value) else 1.0
        assert_close(got.metrics[name], value, **tol("reordered", F32, scale=m_scale), name=name)
    g_scale = max(1e-3, float(want_grad.abs().max())) if want_grad.numel() else 1.0
    assert_close(got_grad, want_grad, **tol("reordered.dlogits", F32, scale=g_scale), name="dlogits")


def teardown_module():
    torch._dynamo.reset()
