"""The per-sequence stage on [N] scalars (SPEC §4-§8): `run(stats, batch, config)` -> `StageOutput`.

One torch implementation, run eagerly or compiled (`select`). Layout: loss.py builds the loss
(inputs -> correction -> ratio -> the loss type's term -> weights and masks -> aggregation -> KL ->
entropy -> scale); policy_terms.py holds one function per loss type behind the LOSS_TERMS table;
correction.py the IS weights, rejection and rollout_corr/* metrics; segments.py the sequence structure;
split.py the data- and context-parallel combines; metrics.py the combinable metric records; fused.py the common
PPO family in two kernel launches (kernels/triton/stage.py), which `choose` takes where it covers a call.
"""

import contextlib
from typing import Optional

import torch

from . import fused
from .loss import (
    SamplerEvidence,
    StageOutput,
    correct,
    correction_reads_current_policy,
    forward_gradient_blocker,
    kept_mask,
    run,
)

__all__ = ["SamplerEvidence", "StageOutput", "check_fused", "choose", "correct", "correction_reads_current_policy",
           "forward_gradient_blocker", "kept_mask", "run", "select"]

# Graphs the compiled stage may hold: Dynamo specialises sizes 0 and 1 even with dynamic=True, so one
# option set can take ~5 graphs (padded B > 1, B = 1, T = 1, packed, one sequence); the default limit
# of 8 would send a second option set back to eager without a word.
STAGE_RECOMPILE_LIMIT = 64
_COMPILED: list = []  # the one compiled stage of this process, built on first use


def _compiled():
    """`run` under torch.compile(dynamic=True). Dynamo keeps one compiled graph per static option set
    (loss type, aggregation, IS level, rejection options, which inputs are present) and per size
    specialisation, guarded on those; every float hyperparameter stays a run-time input (see
    segments.hyper), so a new clip ratio, threshold, coefficient or global count reuses the graph."""
    if _COMPILED:
        return _COMPILED[0]
    compiled = torch.compile(run, dynamic=True)

    def compiled_run(stats, batch, config, metrics=True, evidence=None):
        # no_grad: the stage's inputs are detached anyway, and Dynamo guards on grad mode (one graph
        # for training steps and one for evaluation otherwise)
        with torch.no_grad(), torch._dynamo.config.patch(recompile_limit=STAGE_RECOMPILE_LIMIT), \
                _leaves_no_float_specialisations():
            return compiled(stats, batch, config, metrics=metrics, evidence=evidence)

    _COMPILED.append(compiled_run)
    return compiled_run


@contextlib.contextmanager
def _leaves_no_float_specialisations():
    """Takes back the float specialisations the stage's compilation leaves for other frames.

    When Dynamo meets a float input it cannot keep symbolic, it restarts the frame's analysis with that
    float specialised, recording its symbol's name (zf<n>) in a process-wide set, which a successful
    compilation does not clear (torch 2.13, `TensorifyState`: only `torch._dynamo.reset()` and a failed analysis
    clear it). The next frame compiled anywhere in the process then specialises whichever of its floats
    carry those names: a user's compiled step recompiled at every new global_num_tokens (found by
    tests/regressions/test_trainer_defects.py run after a compiled score-centering stage). The stage's
    own configuration floats are such inputs, so its compilations leave names behind; this removes the
    ones they added, once the compilation is over."""
    state = getattr(getattr(torch._dynamo, "symbolic_convert", None), "TensorifyState", None)
    names = getattr(state, "force_specializations", None)
    before = set(names) if isinstance(names, set) else None
    try:
        yield
    finally:
        if before is not None:
            names.intersection_update(before)


def select(tensor: torch.Tensor, compile_stage: Optional[bool]):
    """`run`, eager or compiled. `compile_stage=None` compiles on CUDA, where its ~100 small ops would
    otherwise be as many kernel launches; on the CPU they cost less than compilation saves. Inside a
    caller's torch.compile region the eager function is returned, to be traced into the caller's graph."""
    if torch.compiler.is_compiling():
        return run
    if compile_stage is None:  # Inductor generates Triton code for CUDA: without Triton, stay eager
        from .. import backends

        compile_stage = tensor.is_cuda and backends.is_available("triton")
    return _compiled() if compile_stage else run


def check_fused(batch, config, dtype: torch.dtype, device: torch.device) -> None:
    """fused_stage=True on a call the fused kernels cannot run: a ValueError naming why, before any pass runs."""
    if config.fused_stage is not True or torch.compiler.is_compiling():
        return
    if fused.implementation(config, device) is None:
        raise ValueError(f"fused_stage: True needs Triton on CUDA tensors, or the CPU kernels (backend 'auto' or "
                         f"'cpu') or Triton's interpreter (backend 'triton', TRITON_INTERPRET=1) on CPU tensors; got "
                         f"{device} with backend={config.backend!r}")
    reason = fused.blocker(batch, config, dtype)
    if reason is not None:
        raise ValueError(f"fused_stage: True, but this call is outside the fused stage's family: {reason} "
                         "(fused_stage=None takes it where it can)")


def choose(tensor: torch.Tensor, batch, config, fallback=None):
    """The stage of one call on statistics like `tensor`: the fused kernels (fused.run) where config.fused_stage
    allows and they cover the call, else `fallback` (None: `select`'s eager or compiled `run`)."""
    if fused.implementation(config, tensor.device) is not None and fused.blocker(batch, config, tensor.dtype) is None:
        return fused.run
    return select(tensor, config.compile_stage) if fallback is None else fallback
