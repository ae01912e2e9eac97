"""The oracle (and the public API) against values computed by hand from docs/spec.md."""

import math

import pytest
import torch

import rlkernels
from rlkernels import PolicyLossConfig, RolloutCorrection, reference
from rlkernels.config import LOSS_AGG_MODES
from rlkernels.stage.loss import aggregation_weights
from rlkernels.stage.segments import Segments

from ..cases import approx, assert_close, tol

# SPEC §8: (rho, k1, k3) with k1 = -log rho, k3 = rho - 1 - log rho
K_VECTORS = [(0.5, 0.693, 0.193), (2.0, -0.693, 0.307), (10.0, -2.303, 6.697), (100.0, -4.605, 94.395)]


@pytest.mark.parametrize("rho,k1,k3", K_VECTORS)
@pytest.mark.parametrize("impl", ["reference", "api"])
def test_k_statistics_closed_form(rho, k1, k3, impl):
    train = torch.tensor([math.log(rho) - 1.0], dtype=torch.float64)
    rollout = torch.tensor([-1.0], dtype=torch.float64)
    mask = torch.tensor([True])
    rc = RolloutCorrection(rs={"token_k1": 1e3, "token_k3": 1e3})
    if impl == "api":
        metrics = rlkernels.rollout_correction(train, rollout, mask, config=rc).metrics
    else:
        _, info = reference.rejection(train - rollout, mask, [torch.arange(1)], rc, train, rollout)
        metrics = {f"rollout_corr/rollout_rs_{k}_mean": v["values"].mean() for k, v in info.items()}
    assert metrics["rollout_corr/rollout_rs_token_k1_mean"].item() == approx(k1, "spec_decimals")
    assert metrics["rollout_corr/rollout_rs_token_k3_mean"].item() == approx(k3, "spec_decimals")


@pytest.mark.parametrize("T", [1, 10, 1000])
def test_geometric_mean_vs_sequence_ratio(T):
    # per-token ratio 1.001: sequence ratio 1.001^T (2.72 at T = 1000), geometric mean 1.001 at every T
    train = torch.full((1, T), math.log(1.001), dtype=torch.float64)
    rollout = torch.zeros(1, T, dtype=torch.float64)
    mask = torch.ones(1, T, dtype=torch.bool)
    seq = rlkernels.rollout_correction(train, rollout, mask, config=RolloutCorrection.seq_tis(threshold=10.0))
    assert seq.weights[0, 0].item() == approx(1.001**T, "closed_form")
    if T == 1000:
        assert seq.weights[0, 0].item() == approx(2.717, "spec_decimals")
    geo = rlkernels.rollout_correction(train, rollout, mask, config=RolloutCorrection.geo_rs(bounds=(0.9995, 1.0015)))
    assert math.exp(-geo.metrics["rollout_corr/rollout_rs_seq_mean_k1_mean"].item()) == approx(1.001, "closed_form")
    assert bool(geo.mask.all())  # 1.001 lies inside (0.9995, 1.0015) whatever T is
    ref_mask, _ = reference.rejection(train.reshape(-1) - rollout.reshape(-1), mask.reshape(-1), [torch.arange(T)],
                                      RolloutCorrection.geo_rs(bounds=(0.9995, 1.0015)), train.reshape(-1),
                                      rollout.reshape(-1))
    assert bool(ref_mask.all())


def test_k1_bounds_follow_the_docs_not_verls_code():
    # SPEC §5: keep lo <= rho <= hi. With bounds (0.8, 2.0) verl's code keeps 1/hi <= rho <= 1/lo,
    # i.e. 0.5 <= rho <= 1.25: rho = 1.9 is kept here and dropped there; rho = 0.7 the other way.
    train = torch.tensor([math.log(1.9)], dtype=torch.float64)
    out = rlkernels.rollout_correction(train, torch.zeros(1, dtype=torch.float64), torch.tensor([True]),
                                       config=RolloutCorrection(rs={"token_k1": (0.8, 2.0)}))
    assert bool(out.mask[0])
    out = rlkernels.rollout_correction(torch.tensor([math.log(0.7)], dtype=torch.float64),
                                       torch.zeros(1, dtype=torch.float64), torch.tensor([True]),
                                       config=RolloutCorrection(rs={"token_k1": (0.8, 2.0)}))
    assert not bool(out.mask[0])


def test_uniform_logits():
    V = 7
    logits = torch.zeros(3, V, dtype=torch.float64)
    stats = rlkernels.token_logprobs(logits, torch.tensor([0, 3, 6]), compute_entropy=True, compute_sum_pi_squared=True)
    q = tol("by_hand", torch.float64)
    assert_close(stats.logprobs, torch.full((3,), -math.log(V), dtype=torch.float64), **q, name="logprobs")
    assert_close(stats.entropy, torch.full((3,), math.log(V), dtype=torch.float64), **q, name="entropy")
    assert_close(stats.sum_pi_squared, torch.full((3,), 1.0 / V, dtype=torch.float64), **q, name="sum_pi_squared")


def _two_token_batch(old_ratio, adv, rollout_ratio=None):
    """V = 2 uniform logits (lp = log 0.5); old chosen so that r_t = old_ratio[t]."""
    logits = torch.zeros(1, 2, 2, dtype=torch.float64, requires_grad=True)
    labels = torch.zeros(1, 2, dtype=torch.long)
    lp = math.log(0.5)
    old = torch.tensor([[lp - math.log(r) for r in old_ratio]], dtype=torch.float64)
    rollout = None
    if rollout_ratio is not None:  # w_t = pi_old / mu
        rollout = torch.tensor([[o - math.log(w) for o, w in zip(old[0].tolist(), rollout_ratio)]], dtype=torch.float64)
    return logits, labels, torch.tensor([adv], dtype=torch.float64), torch.ones(1, 2, dtype=torch.bool), old, rollout


@pytest.mark.parametrize("impl", ["reference", "api"])
def test_ppo_clip_by_hand(impl):
    # token 1: A = 1, r = 1.5 -> L1 = -1.5, L2 = -1.2 -> clipped, -1.2, no gradient
    # token 2: A = -1, r = 0.5 -> L1 = 0.5, L2 = 0.8 -> clipped, 0.8, no gradient
    logits, labels, adv, mask, old, _ = _two_token_batch([1.5, 0.5], [1.0, -1.0])
    fn = reference.decoupled_ppo_loss if impl == "reference" else rlkernels.decoupled_ppo_loss
    out = fn(logits, labels, adv, mask, old_logprobs=old, config=PolicyLossConfig())
    assert out.loss.item() == approx((-1.2 + 0.8) / 2, "by_hand")
    assert out.metrics["actor/pg_clipfrac"].item() == pytest.approx(1.0)
    (g,) = torch.autograd.grad(out.loss, logits)
    assert torch.count_nonzero(g) == 0


@pytest.mark.parametrize("impl", ["reference", "api"])
def test_truncated_is_by_hand(impl):
    # same tokens with IS: w = min(3, 2) = 2 and w = 0.5: loss = (-1.2 * 2 + 0.8 * 0.5) / 2 = -1.0
    logits, labels, adv, mask, old, rollout = _two_token_batch([1.5, 0.5], [1.0, -1.0], rollout_ratio=[3.0, 0.5])
    fn = reference.decoupled_ppo_loss if impl == "reference" else rlkernels.decoupled_ppo_loss
    out = fn(logits, labels, adv, mask, old_logprobs=old, rollout_logprobs=rollout,
             config=PolicyLossConfig(rollout_correction=RolloutCorrection.token_tis()))
    assert out.loss.item() == approx(-1.0, "by_hand")
    assert out.is_weights[0].tolist() == pytest.approx([2.0, 0.5])


@pytest.mark.parametrize("impl", ["reference", "api"])
def test_dual_clip_and_unclipped_gradient_by_hand(impl):
    # token 1: A = -1, r = 4 -> Lc = 4 > -A c = 3: dual clip gives 3, no gradient
    # token 2: A = 1, r = 1.1 -> unclipped, L = -1.1, dL/dlp = -A r = -1.1; token-mean a = 1/2
    logits, labels, adv, mask, old, _ = _two_token_batch([4.0, 1.1], [-1.0, 1.0])
    fn = reference.decoupled_ppo_loss if impl == "reference" else rlkernels.decoupled_ppo_loss
    out = fn(logits, labels, adv, mask, old_logprobs=old, config=PolicyLossConfig())
    assert out.loss.item() == approx((3.0 - 1.1) / 2, "by_hand")
    assert out.metrics["actor/pg_clipfrac_lower"].item() == pytest.approx(0.5)
    (g,) = torch.autograd.grad(out.loss, logits)
    c = -1.1 / 2  # dLoss/dlp for token 2; dlp/dz = onehot - p = [0.5, -0.5]
    expected = torch.tensor([[[0.0, 0.0], [c * 0.5, -c * 0.5]]], dtype=torch.float64)
    assert_close(g, expected, **tol("by_hand", torch.float64), name="dlogits")


@pytest.mark.parametrize("impl", ["reference", "api"])
def test_on_policy_and_reinforce_by_hand(impl):
    fn = reference.decoupled_ppo_loss if impl == "reference" else rlkernels.decoupled_ppo_loss
    logits, labels, adv, mask, _, _ = _two_token_batch([1.0, 1.0], [2.0, -1.0])
    out = fn(logits, labels, adv, mask, config=PolicyLossConfig())
    assert out.loss.item() == approx(-(2.0 - 1.0) / 2, "by_hand")  # ratio 1: L = -A
    # bypass REINFORCE with token TIS: L = -A * w * lp, w = min(exp(lp - mu), 2)
    rollout = torch.tensor([[math.log(0.5) - math.log(3.0), math.log(0.5) - math.log(0.5)]], dtype=torch.float64)
    out = fn(logits, labels, adv, mask, rollout_logprobs=rollout,
             config=PolicyLossConfig(loss_type="reinforce", rollout_correction=RolloutCorrection.token_tis()))
    lp = math.log(0.5)
    assert out.loss.item() == approx((-2.0 * 2.0 * lp + 1.0 * 0.5 * lp) / 2, "by_hand")


LENGTHS = [1, 3]  # two packed sequences, per-token values 1 | 2 3 4
AGGREGATES = [
    ("token-mean", 10 / 4), ("token-sum", 10.0), ("seq-mean-token-sum", (1 + 9) / 2),
    ("seq-mean-token-mean", (1 + 3) / 2), ("seq-mean-token-sum-norm", (1 + 9) / 2 / 3),
]
assert [mode for mode, _ in AGGREGATES] == list(LOSS_AGG_MODES), "a closed form for every agg mode of the package"


@pytest.mark.parametrize("mode,expected", AGGREGATES)
def test_aggregation_closed_form(mode, expected):
    values = torch.tensor([1.0, 2.0, 3.0, 4.0], dtype=torch.float64)
    mask = torch.ones(4, dtype=torch.bool)
    cu = torch.tensor([0, 1, 4])
    seqs = [torch.arange(0, 1), torch.arange(1, 4)]
    assert reference.aggregate(values, mask, seqs, mode, K=3).item() == pytest.approx(expected)
    a = aggregation_weights(mask, Segments.packed(cu, 4, "cpu"), PolicyLossConfig(loss_agg_mode=mode), torch.float64)
    assert (a * values).sum().item() == pytest.approx(expected)


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_aggregation_of_nothing_is_zero(mode):
    values = torch.tensor([5.0, float("nan")], dtype=torch.float64)
    mask = torch.zeros(2, dtype=torch.bool)
    assert reference.aggregate(values, mask, [torch.arange(2)], mode, K=2).item() == 0.0
    a = aggregation_weights(mask, Segments.padded(1, 2, "cpu"), PolicyLossConfig(loss_agg_mode=mode), torch.float64)
    assert torch.count_nonzero(a) == 0
