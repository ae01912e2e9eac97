"""`logprob_parity`, the trainer-against-engine report, on hand-worked batches: which tokens match bit for bit,
each sequence's first divergence, the buckets of the rollout probability, in both layouts, the edge cases of a
bitwise comparison (-0.0, -inf, NaN, one bf16 ulp), the errors, and no host read."""

import math
import sys

import pytest
import torch

import rlkernels

from .cases import approx

# two sequences of four positions; the last position of the first is not a response token
TRAINER = torch.tensor([[-1.0, -2.0, -0.5, 0.0], [-3.0, -0.1, -0.2, -7.0]])
MASK = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]], dtype=torch.bool)


def assert_same(actual, expected):
    """Equal values, NaN where NaN is expected (a statistic of nothing)."""
    expected = torch.as_tensor(expected, dtype=actual.dtype)
    torch.testing.assert_close(actual, expected, rtol=0, atol=0, equal_nan=True)


def _rollout():
    rollout = TRAINER.clone()
    rollout[0, 2] = torch.nextafter(torch.tensor(-0.5), torch.tensor(0.0))  # one float32 ulp above: 2^-25
    rollout[1, 3] = -6.0  # 1.0 away, at p = e^-6 = 0.0025
    rollout[0, 3] = -9.0  # differs, but off the response: not counted
    return rollout


def test_a_padded_batch_by_hand():
    report = rlkernels.logprob_parity(TRAINER, _rollout(), MASK)
    assert int(report.tokens) == 7 and int(report.matched) == 5
    assert float(report.match_rate) == 5 / 7
    assert report.first_divergence.tolist() == [2, 3]
    # default edges 0, 1e-4, 1e-3, 1e-2, 0.1, 0.5, 0.9, 1: the rollout p of the seven response tokens are
    # e^-1 .37, e^-2 .14, ~e^-.5 .61 | e^-3 .050, e^-.1 .90, e^-.2 .82, e^-6 .0025
    assert report.bucket_tokens.tolist() == [0, 0, 1, 1, 2, 2, 1]
    nan = math.nan  # the two empty buckets: a statistic of nothing
    assert_same(report.bucket_max_abs_diff, [nan, nan, 1.0, 0.0, 0.0, 2.0**-25, 0.0])
    assert_same(report.bucket_mean_abs_diff, [nan, nan, 1.0, 0.0, 0.0, 2.0**-26, 0.0])
    floats = rlkernels.metrics_to_floats(report.metrics)
    assert floats["logprob_parity/max_abs_diff"] == 1.0
    assert floats["logprob_parity/mean_abs_diff"] == approx((1.0 + 2.0**-25) / 7, "by_hand.relative")
    assert floats["logprob_parity/diverged_sequence_fraction"] == 1.0
    assert floats["logprob_parity/p[0.001,0.01)/max_abs_diff"] == 1.0
    assert floats["logprob_parity/p[0.9,1]/tokens"] == 1.0  # e^-0.1 = 0.905: the last bucket, closed at 1


def test_the_packed_layout_gives_the_same_report():
    rollout = _rollout()
    # packed: the two sequences, then one with no response token and an empty one
    trainer = torch.cat([TRAINER.reshape(-1), torch.tensor([-1.0, -1.0])])
    packed_rollout = torch.cat([rollout.reshape(-1), torch.tensor([-2.0, -2.0])])
    mask = torch.cat([MASK.reshape(-1), torch.tensor([False, False])])
    cu = torch.tensor([0, 4, 8, 10, 10])
    report = rlkernels.logprob_parity(trainer, packed_rollout, mask, cu_seqlens=cu)
    padded = rlkernels.logprob_parity(TRAINER, rollout, MASK)
    assert report.first_divergence.tolist() == [2, 3, -1, -1]
    for name in ("match_rate", "matched", "tokens", "bucket_tokens", "bucket_mean_abs_diff", "bucket_max_abs_diff"):
        assert_same(getattr(report, name), getattr(padded, name))
    # of the sequences with a response token: both diverge, as in the padded batch
    assert float(report.metrics["logprob_parity/diverged_sequence_fraction"]) == 1.0
    with pytest.raises(ValueError, match="cu_seqlens: expected cu_seqlens\\[-1\\] == N = 10"):
        rlkernels.logprob_parity(trainer, packed_rollout, mask, cu_seqlens=torch.tensor([0, 4, 8]))
    with pytest.raises(ValueError, match="cu_seqlens: expected cu_seqlens\\[0\\] == 0"):
        rlkernels.logprob_parity(trainer, packed_rollout, mask, cu_seqlens=torch.tensor([2, 5, 10]))


def test_bits_not_values():
    inf = math.inf
    trainer = torch.tensor([[0.0, -inf, math.nan, -1.0]])
    rollout = torch.tensor([[-0.0, -inf, math.nan, -1.0]])
    # validate=False: a NaN log-prob is refused by the checks, as the loss refuses it; without them its bits compare
    report = rlkernels.logprob_parity(trainer, rollout, torch.ones(1, 4, dtype=torch.bool), validate=False)
    # -0.0 has other bits than 0.0 (a different operation order, not a different value); two -inf agree (their
    # difference would be NaN); the same NaN agrees with itself
    assert int(report.matched) == 3 and report.first_divergence.tolist() == [0]
    assert float(report.metrics["logprob_parity/max_abs_diff"]) == 0.0


def test_one_bf16_ulp_is_a_divergence():
    trainer = torch.tensor([-0.75, -2.0], dtype=torch.bfloat16)
    rollout = torch.tensor([-0.75, -2.0], dtype=torch.bfloat16)
    rollout[1] = -2.0 + 2.0**-7  # the next bf16 towards 0: 8 bits of mantissa in [1, 2)
    assert rollout[1] != trainer[1] and rollout[1].float() == -1.9921875
    report = rlkernels.logprob_parity(trainer, rollout, torch.ones(2, dtype=torch.bool))
    assert int(report.matched) == 1 and report.first_divergence.tolist() == [1]
    assert float(report.metrics["logprob_parity/max_abs_diff"]) == 2.0**-7  # a bf16 ulp in [1, 2)


def test_nothing_compared_reads_as_none_not_as_no_match():
    """An all-masked or empty batch: 0 tokens, and every statistic of them NaN (a fraction or a gap of nothing);
    never match_rate 0, which reads as "nothing matched", nor a gap of 0, which reads as "no difference"."""
    for report in (rlkernels.logprob_parity(TRAINER, _rollout(), torch.zeros_like(MASK)),
                   rlkernels.logprob_parity(torch.zeros(3, 0), torch.zeros(3, 0), torch.zeros(3, 0, dtype=torch.bool)),
                   rlkernels.logprob_parity(torch.zeros(0), torch.zeros(0), torch.zeros(0),
                                            cu_seqlens=torch.tensor([0]))):
        assert int(report.tokens) == 0 and math.isnan(float(report.match_rate))
        assert set(report.first_divergence.tolist()) <= {-1}
        values = rlkernels.metrics_to_floats(report.metrics)
        counts = [name for name in values if name.endswith("/tokens")]
        assert len(counts) == 8 and all(values[name] == 0.0 for name in counts)
        assert all(math.isnan(v) for name, v in values.items() if name not in counts)
    # one sequence answered, the other not: the fraction runs over the one
    mask = torch.zeros_like(MASK)
    mask[1, 0] = True
    report = rlkernels.logprob_parity(TRAINER, _rollout(), mask)
    assert float(report.match_rate) == 1.0
    assert float(report.metrics["logprob_parity/diverged_sequence_fraction"]) == 0.0


@pytest.mark.parametrize("name, bad", [("trainer_logprobs", "nan"), ("rollout_logprobs", "nan"),
                                       ("response_mask", 0.5), ("response_mask", 2.0), ("response_mask", "nan")])
def test_degenerate_values_are_refused_as_the_loss_refuses_them(name, bad):
    """validate=True (the default) checks what decoupled_ppo_loss checks: no NaN log-prob on a response token, a mask
    of 0/1 or bool (0.5 and 2 would be read as true). Off the mask a NaN is padding and passes."""
    args = dict(trainer_logprobs=TRAINER.clone(), rollout_logprobs=_rollout(), response_mask=MASK.float())
    args[name][0, 1] = float(bad)
    with pytest.raises(ValueError, match=f"{name}: expected"):
        rlkernels.logprob_parity(*args.values())
    loss_name = {"trainer_logprobs": "logprobs"}.get(name, name)  # policy_loss's name of the trainer's log-probs
    with pytest.raises(ValueError, match=f"^{loss_name}: expected"):  # the loss says the same of the same tensor
        lp = args["trainer_logprobs"].requires_grad_(name != "trainer_logprobs")
        rlkernels.policy_loss(lp, torch.ones_like(TRAINER), args["response_mask"],
                              rollout_logprobs=args["rollout_logprobs"])
    args[name][0, 1] = 1.0 if name == "response_mask" else -1.0
    args["trainer_logprobs"] = args["trainer_logprobs"].detach()
    off_mask = torch.nonzero(MASK == 0)[0].tolist()
    args["trainer_logprobs"][tuple(off_mask)] = math.nan
    assert int(rlkernels.logprob_parity(*args.values()).tokens) == int(MASK.sum())


@pytest.mark.parametrize("kwargs, match", [
    (dict(rollout_logprobs=TRAINER.double()), "rollout_logprobs: a bitwise comparison needs"),
    (dict(response_mask=MASK[:, :3]), "response_mask: expected shape"),
    (dict(bucket_edges=(0.0, 0.5, 0.4, 1.0)), "bucket_edges: expected increasing"),
    (dict(bucket_edges=(0.1, 1.0)), "bucket_edges"),
    (dict(trainer_logprobs=TRAINER[None]), "trainer_logprobs: expected"),
])
def test_bad_arguments_are_named(kwargs, match):
    args = dict(trainer_logprobs=TRAINER, rollout_logprobs=_rollout(), response_mask=MASK) | kwargs
    with pytest.raises((TypeError, ValueError), match=match):
        rlkernels.logprob_parity(args.pop("trainer_logprobs"), args.pop("rollout_logprobs"),
                                 args.pop("response_mask"), **args)


def test_no_host_read(monkeypatch):
    def forbidden(*_a, **_k):
        raise AssertionError(f"host synchronisation in {sys._getframe(1).f_code.co_name}")

    for name in ("item", "tolist", "__bool__", "__float__", "__int__", "nonzero", "cpu", "numpy"):
        monkeypatch.setattr(torch.Tensor, name, forbidden)
    report = rlkernels.logprob_parity(TRAINER, _rollout(), MASK, validate=False)  # no value checks: no sync
    monkeypatch.undo()
    assert int(report.matched) == 5


@pytest.mark.gpu
def test_on_a_gpu_the_report_is_the_cpus():
    cpu = rlkernels.logprob_parity(TRAINER, _rollout(), MASK)
    gpu = rlkernels.logprob_parity(TRAINER.cuda(), _rollout().cuda(), MASK.cuda())
    for name in ("match_rate", "matched", "tokens", "first_divergence", "bucket_tokens", "bucket_mean_abs_diff",
                 "bucket_max_abs_diff"):
        assert_same(getattr(gpu, name).cpu(), getattr(cpu, name))
