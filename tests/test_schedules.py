"""rlkernels.schedules.ResponseLengthLR (SPEC §8.1): its baseline, triggers, cooldown, floor and state, each
against values worked out by hand from the rule (baseline_k = ema * baseline_{k-1} + (1 - ema) * length_k, a
decay when length > surge_ratio * baseline_{k-1}), and on a real torch optimizer and scheduler."""

import pytest
import torch

from rlkernels.schedules import ResponseLengthLR


def _optimizer(lr=1e-3, groups=2):
    params = [torch.nn.Parameter(torch.zeros(2)) for _ in range(groups)]
    return torch.optim.SGD([{"params": [p], "lr": lr * (i + 1)} for i, p in enumerate(params)])


def test_the_baseline_is_an_ema_of_the_lengths_before_the_step():
    control = ResponseLengthLR(surge_ratio=10.0, ema=0.5)
    for length, baseline in ((100, 100.0), (200, 150.0), (50, 100.0), (100, 100.0)):
        control.step(length)
        assert control.baseline == baseline
    assert control.scale == 1.0 and control.decays == 0


def test_a_surge_decays_every_group_once_then_the_cooldown_holds():
    opt = _optimizer()
    control = ResponseLengthLR(opt, surge_ratio=1.2, decay=0.5, ema=0.9, cooldown=2)
    assert control.step(100) == 1.0  # the first length is the baseline
    assert control.step(119) == 1.0  # 119 <= 1.2 * 100
    base = control.baseline  # 0.9 * 100 + 0.1 * 119 = 101.9
    assert base == pytest.approx(101.9)
    assert control.step(130) == 0.5 and control.last_decayed  # 130 > 122.28
    assert [g["lr"] for g in opt.param_groups] == pytest.approx([5e-4, 1e-3])
    assert control.step(400) == 0.5 and not control.last_decayed  # cooldown: 2 steps
    assert control.step(400) == 0.5
    assert control.step(1000) == 0.25 and control.decays == 2  # the cooldown is over
    assert [g["lr"] for g in opt.param_groups] == pytest.approx([2.5e-4, 5e-4])
    assert control.metrics()["lr_control/decays"] == 2.0


def test_the_scale_stops_at_the_floor():
    opt = _optimizer(groups=1)
    control = ResponseLengthLR(opt, surge_ratio=1.01, decay=0.5, ema=0.0, cooldown=0, min_scale=0.3)
    lengths = [10, 20, 40, 80, 160, 320]
    scales = [control.step(n) for n in lengths]
    assert scales == [1.0, 0.5, 0.3, 0.3, 0.3, 0.3]  # 0.25 clamps to 0.3, then nothing fires
    assert opt.param_groups[0]["lr"] == pytest.approx(1e-3 * 0.3)
    assert control.decays == 2


def test_warmup_steps_only_build_the_baseline():
    control = ResponseLengthLR(surge_ratio=1.1, warmup_steps=3, ema=0.0, cooldown=0)
    assert [control.step(n) for n in (10, 100, 1000, 10000)] == [1.0, 1.0, 1.0, 0.5]


def test_a_device_scalar_is_read_once():
    control = ResponseLengthLR(ema=0.0)
    control.step(torch.tensor(50.0))
    assert control.step(torch.tensor(100.0, dtype=torch.float64)) == 0.5


def test_state_dict_resumes_the_same_trajectory():
    lengths = [100, 130, 90, 95, 300, 310, 320, 500, 80, 600]
    full = ResponseLengthLR(surge_ratio=1.2, decay=0.7, ema=0.8, cooldown=1)
    want = [full.step(n) for n in lengths]
    first = ResponseLengthLR(surge_ratio=1.2, decay=0.7, ema=0.8, cooldown=1)
    got = [first.step(n) for n in lengths[:5]]
    resumed = ResponseLengthLR(surge_ratio=1.2, decay=0.7, ema=0.8, cooldown=1)
    resumed.load_state_dict(first.state_dict())
    got += [resumed.step(n) for n in lengths[5:]]
    assert got == want and resumed.state_dict() == full.state_dict()
    assert full.decays >= 2  # the trajectory decays more than once


def test_composes_with_a_lambda_schedule_through_scale():
    opt = _optimizer(groups=1)
    control = ResponseLengthLR(surge_ratio=1.1, decay=0.5, ema=0.0, cooldown=0)
    schedule = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: (1 - 0.1 * step) * control.scale)
    for n in (10, 20):
        control.step(n)
        opt.step()
        schedule.step()
    assert opt.param_groups[0]["lr"] == pytest.approx(1e-3 * 0.8 * 0.5)


@pytest.mark.parametrize("kwargs,match", [
    (dict(surge_ratio=1.0), "surge_ratio"), (dict(decay=1.0), "decay"), (dict(decay=0.0), "decay"),
    (dict(ema=1.0), "ema"), (dict(min_scale=0.0), "min_scale"), (dict(cooldown=-1), "cooldown"),
    (dict(warmup_steps=0), "warmup_steps"), (dict(optimizer=object()), "optimizer"),
])
def test_bad_settings_name_the_argument(kwargs, match):
    with pytest.raises((TypeError, ValueError), match=match):
        ResponseLengthLR(**kwargs)


def test_a_bad_length_names_the_argument():
    with pytest.raises(ValueError, match="mean_length"):
        ResponseLengthLR().step(float("nan"))
