"""response_length/* (SPEC §8.1) on hand-worked batches: lengths (5, 3, 0) give mean 8/3, max 5 and p90 4.6
(sorted 0, 3, 5; q = 0.9 * 2 = 1.8: 3 + 0.8 * (5 - 3)), in both layouts and both entry points, with and
without a rollout; an empty batch gives zeros; a compiled step gives the same (fullgraph: no graph break).
The oracle computes them too: every parity test compares them."""

import pytest
import torch

import rlkernels
from rlkernels import RolloutCorrection, reference

from ..cases import approx, assert_close, tol

V = 7
WANT = {"response_length/mean": 8 / 3, "response_length/max": 5.0, "response_length/p90": 4.6}


def _batch(packed: bool):
    g = torch.Generator().manual_seed(0)
    if packed:
        cu = torch.tensor([0, 5, 8, 10])
        mask = torch.ones(10, dtype=torch.bool)
        mask[8:] = False  # the third sequence has 2 tokens, none in the response
        shape = (10,)
    else:
        cu = None
        mask = torch.zeros(3, 6, dtype=torch.bool)
        mask[0, :5] = True
        mask[1, [0, 2, 4]] = True  # holes: 3 tokens
        shape = (3, 6)
    logits = torch.randn(*shape, V, generator=g, dtype=torch.float64)
    labels = torch.randint(0, V, shape, generator=g)
    return logits, labels, torch.randn(shape, generator=g, dtype=torch.float64), mask, cu


def _lengths(metrics):
    return {k: float(v) for k, v in metrics.items() if k.startswith("response_length/")}


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("rollout", [False, True])
def test_the_loss_and_the_correction_report_the_lengths(packed, rollout):
    logits, labels, adv, mask, cu = _batch(packed)
    old = -torch.rand(labels.shape, dtype=torch.float64)
    kw = dict(rollout_logprobs=old - 0.1) if rollout else {}
    out = rlkernels.decoupled_ppo_loss(logits, labels, adv, mask, old_logprobs=old, cu_seqlens=cu, **kw)
    assert _lengths(out.metrics) == approx(WANT, "by_hand.relative")
    corrected = rlkernels.rollout_correction(old, old - 0.1, mask, cu_seqlens=cu, config=RolloutCorrection.seq_tis())
    assert _lengths(corrected.metrics) == approx(WANT, "by_hand.relative")
    seqs = [torch.arange(0, 6), torch.arange(6, 12), torch.arange(12, 18)] if not packed else \
        [torch.arange(0, 5), torch.arange(5, 8), torch.arange(8, 10)]
    assert _lengths(reference.response_length_metrics(mask.reshape(-1), seqs)) == approx(WANT, "by_hand.relative")


def test_an_empty_batch_gives_zeros():
    out = rlkernels.policy_loss(torch.zeros(0, 4), torch.zeros(0, 4), torch.zeros(0, 4, dtype=torch.bool))
    assert _lengths(out.metrics) == {k: 0.0 for k in WANT}


def test_one_sequence_has_its_length_everywhere():
    out = rlkernels.policy_loss(torch.zeros(1, 4), torch.zeros(1, 4), torch.tensor([[True, True, False, True]]))
    assert _lengths(out.metrics) == {k: 3.0 for k in WANT}


def test_the_compiled_step_reports_the_same_lengths():
    logits, labels, adv, mask, _ = _batch(False)

    def step(logits, labels, adv, mask):
        return rlkernels.decoupled_ppo_loss(logits, labels, adv, mask, validate=False).metrics

    compiled = torch.compile(step, fullgraph=True, dynamic=True)
    assert _lengths(compiled(logits, labels, adv, mask)) == approx(WANT, "by_hand.relative")
    torch._dynamo.reset()


def test_the_quantile_is_torch_quantile_without_reading_numel(monkeypatch):
    """The stage's p90 (stage/correction.py::_quantile) is torch.quantile bit for bit, and traces with a symbolic
    length. torch.quantile reads numel() in C++ and does not trace so before torch 2.13: on 2.11 (an H200 run)
    every compiled stage with this metric stopped there, which the compiled test above cannot show on 2.13."""
    from rlkernels.stage.correction import _quantile

    gen = torch.Generator().manual_seed(0)
    for n in [1, 2, 3, 10, 11, 101, 4097]:
        for dtype in (torch.float32, torch.float64):
            x = torch.randint(0, 5000, (n,), generator=gen).to(dtype)
            assert torch.equal(_quantile(x, 0.9), torch.quantile(x, 0.9)), (n, dtype)
    monkeypatch.setattr(torch, "quantile", lambda *a, **k: pytest.fail("the stage called torch.quantile"))
    logits, labels, adv, mask, _ = _batch(False)
    out = rlkernels.decoupled_ppo_loss(logits, labels, adv, mask, validate=False)
    assert _lengths(out.metrics) == approx(WANT, "by_hand.relative")
    monkeypatch.undo()
    compiled = torch.compile(lambda x: _quantile(x, 0.9), fullgraph=True, dynamic=True)
    for n in (5, 17):
        x = torch.rand(n, generator=gen) * 100
        assert_close(compiled(x), torch.quantile(x, 0.9), **tol("compiled_lerp"), name="p90")
    torch._dynamo.reset()
