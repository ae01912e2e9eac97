"""Learning-rate control from the batch's own signals (docs/spec.md §8.1).

`ResponseLengthLR` decays the learning rate when the mean response length surges. "Beyond Precision" (Zhang,
Li et al., arXiv 2602.01826) finds the trainer-sampler mismatch and the gradient noise rising together with
the response length, and shrinking the update suppresses both. It compares the latest mean length to an EMA
baseline of the earlier ones, and multiplies the learning rate by `decay` when the latest one exceeds the
baseline by `surge_ratio`. Each decay is persistent, at most one per `cooldown` steps, and it never goes
below `min_scale`. SkyRL PR #1448 has a controller of the same kind.

It works with any optimizer and any other schedule. Given an `optimizer` (anything with `param_groups`),
it multiplies each group's `lr` in place, which composes with constant learning rates and with chainable
schedulers (those that update `group["lr"]` from its current value). A schedule that recomputes the rate
from its base each step (`LambdaLR`) should read `scale` instead:
`LambdaLR(opt, lambda step: base(step) * control.scale)`, with `optimizer=None` here.

    control = rlkernels.schedules.ResponseLengthLR(optimizer, surge_ratio=1.2, decay=0.5)
    ...
    metrics = rlkernels.metrics_to_floats(out.metrics)      # the step's one host read
    control.step(metrics["response_length/mean"])
"""

import math
from typing import Dict, Optional

__all__ = ["ResponseLengthLR"]


def _number(name: str, value, low: float, high: float = math.inf, *, low_open: bool = False,
            high_open: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name}: expected a number, got {value!r}")
    value = float(value)
    below = value <= low if low_open else value < low
    above = value >= high if high_open else value > high
    if not math.isfinite(value) or below or above:
        interval = f"{'(' if low_open else '['}{low}, {high}{')' if high_open or high == math.inf else ']'}"
        raise ValueError(f"{name}: expected a finite number in {interval}, got {value!r}")
    return value


class ResponseLengthLR:
    """Decay the learning rate when the mean response length surges above its EMA baseline.

    Args:
        optimizer: anything with `param_groups` (a torch optimizer); each group's `lr` is multiplied at
            every decay. None: only `scale` is kept (to multiply a schedule of your own).
        surge_ratio: a decay fires when the latest mean length > surge_ratio * baseline (> 1).
        decay: the factor of each decay, in (0, 1).
        ema: the baseline's smoothing, baseline <- ema * baseline + (1 - ema) * length, in [0, 1).
        cooldown: the steps after a decay in which no other fires (>= 0).
        min_scale: the floor of the accumulated scale, in (0, 1].
        warmup_steps: the steps that only build the baseline (>= 1: the first length is the baseline).
    """

    def __init__(self, optimizer=None, *, surge_ratio: float = 1.2, decay: float = 0.5, ema: float = 0.9,
                 cooldown: int = 10, min_scale: float = 0.1, warmup_steps: int = 1):
        if optimizer is not None and not hasattr(optimizer, "param_groups"):
            raise TypeError(f"optimizer: expected an object with param_groups (a torch optimizer) or None, "
                            f"got {type(optimizer).__name__}")
        self.optimizer = optimizer
        self.surge_ratio = _number("surge_ratio", surge_ratio, 1.0, low_open=True)
        self.decay = _number("decay", decay, 0.0, 1.0, low_open=True, high_open=True)
        self.ema = _number("ema", ema, 0.0, 1.0, high_open=True)
        self.min_scale = _number("min_scale", min_scale, 0.0, 1.0, low_open=True)
        for name, value, low in (("cooldown", cooldown, 0), ("warmup_steps", warmup_steps, 1)):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"{name}: expected an integer >= {low}, got {value!r}")
        self.cooldown, self.warmup_steps = cooldown, warmup_steps
        self.scale = 1.0  # the product of the decays so far
        self.baseline: Optional[float] = None
        self.steps = 0
        self.decays = 0
        self._cooldown_left = 0
        self.last_decayed = False

    def step(self, mean_length) -> float:
        """Take the step's mean response length (a number or a 0-d tensor; reading a device tensor is one host
        sync, at the step boundary); returns the scale now in force."""
        if hasattr(mean_length, "item"):
            mean_length = mean_length.item()
        length = _number("mean_length", mean_length, 0.0)
        self.steps += 1
        surged = (self.baseline is not None and self.steps > self.warmup_steps and self._cooldown_left == 0
                  and length > self.surge_ratio * self.baseline and self.scale > self.min_scale)
        self._cooldown_left = max(0, self._cooldown_left - 1)
        self.last_decayed = surged
        if surged:
            new_scale = max(self.scale * self.decay, self.min_scale)
            self._apply(new_scale / self.scale)
            self.scale = new_scale
            self.decays += 1
            self._cooldown_left = self.cooldown
        # the surge is judged against the baseline before it; the baseline then takes the new length in
        self.baseline = length if self.baseline is None else self.ema * self.baseline + (1 - self.ema) * length
        return self.scale

    def _apply(self, factor: float) -> None:
        if self.optimizer is not None:
            for group in self.optimizer.param_groups:
                group["lr"] = group["lr"] * factor

    def metrics(self) -> Dict[str, float]:
        """`lr_control/*`: the scale, the baseline (0 before the first step), decays so far, this step's decay."""
        return {"lr_control/scale": self.scale, "lr_control/length_baseline": self.baseline or 0.0,
                "lr_control/decays": float(self.decays), "lr_control/decayed": float(self.last_decayed)}

    def state_dict(self) -> Dict[str, object]:
        """The controller's state (its settings included, to check on resume). The optimizer's learning rates are
        the optimizer's state: save and restore it with the optimizer."""
        return {"scale": self.scale, "baseline": self.baseline, "steps": self.steps, "decays": self.decays,
                "cooldown_left": self._cooldown_left, "last_decayed": self.last_decayed,
                "settings": {"surge_ratio": self.surge_ratio, "decay": self.decay, "ema": self.ema,
                             "cooldown": self.cooldown, "min_scale": self.min_scale,
                             "warmup_steps": self.warmup_steps}}

    def load_state_dict(self, state: Dict[str, object]) -> None:
        """Resume from `state_dict()`: the scale is taken as already applied to the restored optimizer."""
        missing = {"scale", "baseline", "steps", "decays", "cooldown_left"} - set(state)
        if missing:
            raise KeyError(f"state: missing {sorted(missing)}")
        self.scale = float(state["scale"])
        self.baseline = None if state["baseline"] is None else float(state["baseline"])
        self.steps, self.decays = int(state["steps"]), int(state["decays"])
        self._cooldown_left = int(state["cooldown_left"])
        self.last_decayed = bool(state.get("last_decayed", False))
