"""One named test per bug class that peers shipped (each names the peer's issue or pull request), so none comes
back here."""

import math

import pytest
import torch

import rlkernels
from rlkernels import RolloutCorrection, reference

from ..cases import approx, assert_close, make_batch, tol


def test_max_identity_is_minus_inf_for_all_negative_rows():
    # verl #2656: a max accumulator starting at 0 gives log-probs > 0 when every logit is negative
    logits = -1000.0 - torch.rand(4, 33, dtype=torch.float32) * 5
    labels = torch.randint(0, 33, (4,))
    stats = rlkernels.token_logprobs(logits, labels, compute_entropy=True)
    assert bool((stats.logprobs <= 0).all())
    lp, ent, _ = reference.token_stats(logits.double(), labels)
    assert_close(stats.logprobs.double(), lp, **tol("kernel.stats"), name="logprobs")
    assert_close(stats.entropy.double(), ent, **tol("kernel.stats"), name="entropy")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_target_column_formed_in_fp32(dtype):
    # Liger: p_y - 1 rounded to bf16 before subtracting cancels to 0 as p_y -> 1. Here the target
    # column c * (1 - p_y) keeps its relative accuracy up to the final rounding to the logits dtype.
    V = 64
    logits = torch.zeros(1, V, dtype=dtype)
    logits[0, 3] = 12.0  # p_y = 1 / (1 + 63 e^-12) ~ 1 - 3.9e-4
    logits.requires_grad_(True)
    stats = rlkernels.token_logprobs(logits, torch.tensor([3]))
    (g,) = torch.autograd.grad(stats.logprobs.sum(), logits)
    z = logits.detach().double()
    expected = 1.0 - torch.softmax(z, -1)[0, 3].item()
    assert g[0, 3].item() == approx(expected, "one_ulp", torch.bfloat16)


def test_inplace_gradient_bumps_the_version_counter():
    # Liger #272, Unsloth, Megatron #1594: a kernel overwrote saved logits silently
    leaf = torch.randn(3, 11, requires_grad=True)
    logits = leaf * 2.0
    saved_elsewhere = torch.exp(logits).sum()  # exp saves its output; logits feed it
    kept = logits.sin().sum()  # sin saves its input: the logits themselves
    stats = rlkernels.token_logprobs(logits, torch.randint(0, 11, (3,)), inplace_backward=True)
    before = logits._version
    stats.logprobs.sum().backward(retain_graph=True)
    assert logits._version > before
    with pytest.raises(RuntimeError, match="inplace"):
        kept.backward()
    del saved_elsewhere


def test_more_than_65535_rows():
    # Liger #1294: the token index on a grid's y axis crashes at 65,536 rows
    N, V = 70_000, 3
    logits = torch.randn(N, V, requires_grad=True)
    labels = torch.randint(0, V, (N,))
    out = rlkernels.decoupled_ppo_loss(logits, labels, torch.randn(N), torch.ones(N),
                                       cu_seqlens=torch.tensor([0, 40_000, N]))
    out.loss.backward()
    assert torch.isfinite(logits.grad).all() and logits.grad[-1].abs().sum() > 0


@pytest.mark.gpu
def test_row_offsets_beyond_int32():
    # 32-bit offsets with N * V > 2^31 give silent wrong results: the last rows must be right
    N, V = 16_384, 151_936  # N * V = 2.49e9 > 2^31
    logits = torch.randn(N, V, device="cuda", dtype=torch.bfloat16)
    labels = torch.randint(0, V, (N,), device="cuda")
    stats = rlkernels.token_logprobs(logits, labels)
    tail = slice(N - 4, N)
    expected = torch.log_softmax(logits[tail].float(), -1).gather(1, labels[tail, None]).squeeze(1)
    assert_close(stats.logprobs[tail], expected, **tol("gpu.wide_offsets.logprobs"), name="logprobs")


def test_metrics_are_device_tensors_not_python_floats():
    # verl calls .item() once per metric: a host sync each. Metrics here are 0-d tensors; the
    # no-sync guarantee itself is tests/test_api.py::test_no_host_sync_with_validation_off.
    b = make_batch("padded", [4, 4], 5, dtype=torch.float32)
    out = rlkernels.decoupled_ppo_loss(b.logits, b.labels, b.advantages, b.response_mask, old_logprobs=b.old_logprobs,
                                       rollout_logprobs=b.old_logprobs, rollout_correction=RolloutCorrection.seq_mis())
    assert out.metrics and all(isinstance(v, torch.Tensor) and v.dim() == 0 for v in out.metrics.values())


def test_is_weights_and_loss_type_are_never_silently_ignored():
    # Liger vs TRL (~100x grad norm): a fused path that forgot the IS ratio or ignored loss_type
    batch = make_batch("padded", [4, 4], 7, dtype=torch.float64, seed=3)
    logits, labels, adv, mask = batch.logits, batch.labels, batch.advantages, batch.response_mask
    lp = reference.token_stats(logits, labels)[0]
    roll = lp - 0.5
    plain = rlkernels.decoupled_ppo_loss(logits, labels, adv, mask, old_logprobs=lp, rollout_logprobs=roll)
    tis = rlkernels.decoupled_ppo_loss(logits, labels, adv, mask, old_logprobs=lp, rollout_logprobs=roll,
                                       rollout_correction=RolloutCorrection.token_tis())
    assert tis.loss.item() == approx(plain.loss.item() * math.exp(0.5), "closed_form")  # w = e^0.5 < 2
    rf = rlkernels.decoupled_ppo_loss(logits, labels, adv, mask, rollout_logprobs=roll, loss_type="reinforce")
    assert rf.loss.item() == approx(-(adv * lp).mean().item(), "closed_form")


def test_is_weights_are_detached():
    # every weight and mask is stop-gradient (SPEC §1): in bypass REINFORCE, w = exp(lp - mu)
    # depends on lp, but dLoss/dlp must be -A * w only, with no dw/dlp term
    lp = torch.tensor([-1.0, -2.0], dtype=torch.float64, requires_grad=True)
    adv = torch.tensor([1.0, -0.5], dtype=torch.float64)
    roll = torch.tensor([-1.3, -1.8], dtype=torch.float64)
    out = rlkernels.policy_loss(lp, adv, torch.ones(2), rollout_logprobs=roll, loss_type="reinforce",
                                rollout_correction=RolloutCorrection.token_tis(10.0), loss_agg_mode="token-sum")
    (g,) = torch.autograd.grad(out.loss, lp)
    w = torch.exp(lp.detach() - roll)
    assert_close(g, -adv * w, **tol("by_hand", torch.float64), name="d loss / d lp")


def test_mask_times_overflowed_ratio_is_not_nan():
    # OpenRLHF: inf * 0 = NaN when a mask multiplies an overflowed ratio. Clamp first, select with where.
    lp = torch.tensor([-1.0, -1.0, -1.0], dtype=torch.float32, requires_grad=True)
    old = torch.tensor([-200.0, -1.0, float("-inf")])  # exp(lp - old) overflows on the first and third
    roll = torch.tensor([float("-inf"), -1.0, 5.0])
    mask = torch.tensor([False, True, False])
    adv = torch.tensor([float("nan"), 1.0, float("inf")])
    out = rlkernels.policy_loss(lp, adv, mask, old_logprobs=old, rollout_logprobs=roll,
                                rollout_correction=RolloutCorrection.seq_tis())
    out.loss.backward()
    assert torch.isfinite(out.loss) and torch.isfinite(lp.grad).all()
    assert all(torch.isfinite(v) for v in out.metrics.values())
    # an unmasked ratio of e^50 is clamped to e^20 before exp, not inf
    lp2 = torch.tensor([0.0], requires_grad=True)
    out = rlkernels.policy_loss(lp2, torch.tensor([-1.0]), torch.ones(1), old_logprobs=torch.tensor([-50.0]),
                                clip_ratio_c=None)
    assert out.loss.item() == approx(math.exp(20.0), "closed_form", torch.float32)  # L1 = -A * e^20 beats L2 = 1.2
    out.loss.backward()
    assert lp2.grad.item() == 0.0  # outside the clamp no gradient passes, as through torch.clamp
