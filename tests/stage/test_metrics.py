"""The stage's metrics reduced a kind at a time (rlkernels/stage/metrics.py): each metric is what it is when reduced
alone (bit for bit at sizes one thread reduces: past them a CPU's threads or a GPU's blocks split a row's sum by its
shape, a last-bit difference), in its own dtype beside metrics of another, the stack's order is the same on every rank
of a split batch, and metrics="loss_only" changes nothing but the metrics."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import rlkernels
from rlkernels import PolicyLossConfig, RolloutCorrection
from rlkernels.stage.metrics import MAX, Metrics, _reduce
from rlkernels.stage.split import LOCAL

from ..cases import approx, make_batch, scaled

KINDS = ("mean", "max", "min", "mean_exp", "std", "sample_std", "fraction")


def _record(metrics: Metrics, name: str, kind: str, x, valid, n, per_sequence: bool) -> None:
    if kind == "mean":
        metrics.mean(name, x, valid, n, per_sequence)
    elif kind == "fraction":
        metrics.mean(name, x > 0, valid, n, per_sequence)
    elif kind in ("max", "min"):
        metrics.extreme(name, x, valid, n, largest=kind == "max", per_sequence=per_sequence)
    elif kind == "mean_exp":
        metrics.mean_exp(name, x, valid, n)
    else:
        metrics.std(name, x, valid, per_sequence, bessel=kind == "sample_std")


@st.composite
def records(draw):
    """Records of every kind over a token axis of N and a sequence axis of S (N == S sometimes), with values that
    stress a reduction's order (large, tiny, of both signs), NaN off `valid`, shared and distinct masks and
    counts, empty sets, and float32 / float64 (one dtype for all, or each record its own)."""
    dtypes = draw(st.sampled_from([(torch.float32,), (torch.float64,), (torch.float32, torch.float64)]))
    N = draw(st.integers(0, 40))
    S = draw(st.sampled_from([N, draw(st.integers(0, 12))]))
    seed = draw(st.integers(0, 2**31 - 1))
    g = torch.Generator().manual_seed(seed)
    shared = {False: torch.rand(N, generator=g) > 0.3, True: torch.rand(S, generator=g) > 0.3}
    out = []
    for i in range(draw(st.integers(1, 14))):
        per_sequence = draw(st.booleans())
        L = S if per_sequence else N
        kind = draw(st.sampled_from(KINDS))
        if kind == "mean_exp":
            per_sequence, L = True, S
        dtype = draw(st.sampled_from(dtypes))
        x = (torch.randn(L, generator=g) * 10.0 ** draw(st.integers(-6, 6))).to(dtype)
        valid = shared[per_sequence] if draw(st.booleans()) else torch.rand(L, generator=g) > 0.5
        x = torch.where(valid, x, torch.full_like(x, float("nan")))  # what is off `valid` must not leak in
        n = (valid.sum() + draw(st.integers(0, 3))).to(dtype)  # the global size of `valid`: at least the local one
        out.append((f"m{i}", kind, x, valid, n, per_sequence))
    return out


@settings(max_examples=scaled(150), deadline=None)
@given(recorded=records())
def test_a_stacked_metric_is_the_same_bits_as_the_metric_alone(recorded):
    together = Metrics()
    for name, kind, x, valid, n, per_sequence in recorded:
        _record(together, name, kind, x, valid, n, per_sequence)
    stacked = together.finish(LOCAL)
    assert list(stacked) == [r[0] for r in recorded], "the metrics keep the order they were recorded in"
    for name, kind, x, valid, n, per_sequence in recorded:
        alone = Metrics()
        _record(alone, name, kind, x, valid, n, per_sequence)
        want = alone.finish(LOCAL)[name]
        got = stacked[name]
        assert got.dtype == want.dtype and got.shape == want.shape == ()
        assert torch.equal(got, want) or (torch.isnan(got) and torch.isnan(want)), (name, kind, got, want)


def test_metrics_of_one_value_are_what_they_say():
    """The reductions against values worked out by hand (a stack of two, so the stacked path runs)."""
    x = torch.tensor([1.0, 2.0, 6.0, float("nan")], dtype=torch.float64)
    valid = torch.tensor([True, True, True, False])
    n = torch.tensor(4.0, dtype=torch.float64)
    m = Metrics()
    m.mean("mean", x, valid, n)
    m.mean("fraction", x > 1.5, valid, n)
    m.extreme("max", x, valid, n, largest=True)
    m.extreme("min", x, valid, n, largest=False)
    m.extreme("max_of_nothing", x, torch.zeros(4, dtype=torch.bool), torch.tensor(0.0, dtype=torch.float64), True)
    m.std("std", x, valid)
    m.std("sample_std", x, valid, bessel=True)
    m.mean_exp("mean_exp", torch.log(x), valid, torch.tensor(3.0, dtype=torch.float64))
    out = m.finish(LOCAL)
    assert out["mean"].item() == 9.0 / 4  # n = 4: the global count, not the 3 valid values here
    assert out["fraction"].item() == 2.0 / 4
    assert (out["max"].item(), out["min"].item(), out["max_of_nothing"].item()) == (6.0, 1.0, 0.0)
    assert out["std"].item() == approx((14.0 / 3) ** 0.5, "by_hand.relative")  # mean 3, squares 4 + 1 + 9
    assert out["sample_std"].item() == approx(7.0 ** 0.5, "by_hand.relative")
    assert out["mean_exp"].item() == approx(3.0, "by_hand.relative")  # exp(logsumexp(log x) - log 3)


def test_the_stack_order_does_not_depend_on_the_lengths():
    """On a split batch every rank packs its records in one order, whatever its token count: a rank whose token
    axis happens to be as long as the sequence axis must not group its records differently (it did once, and a
    context-parallel rank's rollout_is_seq_max took another record's value)."""
    def order(N, S):
        records = []
        for i, per_sequence in enumerate([False, True, False, True]):
            L = S if per_sequence else N
            m = Metrics()
            m.extreme(f"r{i}", torch.ones(L), torch.ones(L, dtype=torch.bool), torch.tensor(1.0), True, per_sequence)
            records += m._records[MAX]
        return [name for chunk, _ in _reduce({MAX: records}, torch.zeros(()))[MAX] for name, _ in chunk]

    assert order(5, 3) == order(3, 3) == order(0, 3)


def test_loss_only_gives_the_same_loss_and_gradient_and_no_metrics():
    """The torch stage with and without its metrics: the same bits (fused_stage=False; the fused stage, which
    metrics="loss_only" takes by default where kernels run, is held to the torch stage in test_fused_stage.py)."""
    batch = make_batch("packed", [5, 0, 9, 3], 13, dtype=torch.float32, mask_p=0.8)
    grads, losses, metrics = [], [], []
    for mode in ("all", "loss_only"):
        logits = batch.logits.clone().requires_grad_(True)
        out = rlkernels.decoupled_ppo_loss(
            logits, batch.labels, batch.advantages, batch.response_mask, old_logprobs=batch.old_logprobs,
            rollout_logprobs=batch.old_logprobs - 0.05, ref_logprobs=batch.old_logprobs, cu_seqlens=batch.cu_seqlens,
            config=PolicyLossConfig(rollout_correction=RolloutCorrection.seq_mis(), kl_coef=0.1, entropy_coeff=0.01,
                                    metrics=mode, fused_stage=False))
        out.loss.backward()
        losses.append(out.loss.detach())
        grads.append(logits.grad)
        metrics.append(out.metrics)
    assert torch.equal(losses[0], losses[1]) and torch.equal(grads[0], grads[1])
    assert len(metrics[0]) > 40 and metrics[1] == {}


def test_metrics_mode_is_checked():
    with pytest.raises(ValueError, match="metrics: expected one of"):
        PolicyLossConfig(metrics="some")

