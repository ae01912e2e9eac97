"""Warnings a step's device values call for, raised once per process without a host synchronisation.

One today: a rollout correction that rejected every response token of a step (its bounds narrower than the
batch's train-inference mismatch), which leaves a loss and a gradient of exactly 0 and nothing else to show for it.
The metric `rollout_corr/rollout_rs_all_rejected` (1.0 or 0.0) is there to alert on; the warning is for the user
who reads neither. Where it is read:

- `metrics_to_floats`: the values are on the host already (that call is the user's one synchronisation).
- CPU tensors with validation on: the flag is computed by the time the call returns, and reading it costs nothing
  a GPU would wait for (with `validate=False` nothing is read: that contract is "no read at all").
- CUDA tensors: a non-blocking copy into pinned memory and an event; a later call (or `metrics_to_floats`) reads
  the copies whose event has completed (`Event.query`, which never waits).
- Under torch.compile: nothing (a traced region has no side effects to spare).
- Metrics computed when first read (`stage.metrics.DeferredMetrics`, the fused stage's): the flag, which the call
  computed with the loss (`known`), as above, whether or not the rest is ever read.
"""

import warnings
from collections import deque
from typing import Deque, Dict, Tuple

import torch

ALL_REJECTED = "rollout_corr/rollout_rs_all_rejected"
MESSAGE = (
    "rlkernels: the rollout correction rejected every response token of this step (" + ALL_REJECTED + " = 1), so "
    "the policy loss and its gradient are 0. Its bounds are likely narrower than the batch's train-inference "
    "mismatch: verl's geo_rs band (0.999, 1.001), for one, rejects most sequences of a bf16 or FP8 sampler. Set "
    "them from the measured mismatch (the rollout_corr/* metrics; docs/guide.md, 'Presets'). Shown once per process."
)
_PENDING_LIMIT = 8  # copies in flight; the oldest are dropped beyond it (one rejecting step is enough to warn)

_warned = False
_pending: Deque[Tuple[torch.cuda.Event, torch.Tensor]] = deque(maxlen=_PENDING_LIMIT)


def _warn() -> None:
    global _warned
    if not _warned:
        _warned = True
        _pending.clear()
        warnings.warn(MESSAGE, UserWarning, stacklevel=4)


def _poll() -> None:
    """Read the pending copies whose events have completed (none is waited for)."""
    while _pending and _pending[0][0].query():
        _, host = _pending.popleft()
        if host.item() == 1.0:
            _warn()


def watch(metrics: Dict[str, torch.Tensor], validate: bool) -> None:
    """After a step that produced `metrics` (device tensors): warn now, or once its flag reaches the host."""
    if _warned or torch.compiler.is_compiling():
        return
    deferred = not getattr(metrics, "ready", True)  # a DeferredMetrics not read yet: its known values only
    flag = (metrics.known if deferred else metrics).get(ALL_REJECTED)
    if flag is not None and flag.device.type == "cuda" and not torch.cuda.is_current_stream_capturing():
        host = torch.empty((), dtype=flag.dtype, pin_memory=True)
        host.copy_(flag.detach(), non_blocking=True)
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(flag.device))  # the stream the copy was queued on
        _pending.append((event, host))
    elif flag is not None and flag.device.type == "cpu" and validate and flag.item() == 1.0:
        _warn()
    if _pending:
        _poll()


def read(values: Dict[str, float]) -> None:
    """`metrics_to_floats`' host values: warn if they hold the flag set."""
    if not _warned and values.get(ALL_REJECTED) == 1.0:
        _warn()
    elif not _warned and _pending:
        _poll()
