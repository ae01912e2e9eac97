"""The adapters' opt-in parity report: `rlkernels.logprob_parity` of the trainer's log-probs against the rollout
engine's, in the trainer's own metrics (`logprob_parity/match_rate`, `logprob_parity/p[0.1,0.5)/max_abs_diff`, ...).

Off by default: it costs a few reductions and, in trainers whose metrics are floats, their read-back. On with
`RLKERNELS_LOGPROB_PARITY=1` in the environment of the processes that compute the loss (a Ray job's
`runtime_env={"env_vars": ...}`, AReaL's `scheduling_spec.env_vars`, or the shell for a local run), read at each
call, so a run can turn it on without touching its config.

The trainer's side is the log-probs the trainer computed with the sampler's weights where it has them (π_old: the
engine-exact certificate of NeMo-RL RFC #4039 compares those), else the loss's own (bypass mode: TorchTitan,
prime-rl). Each adapter says which and where the report goes.
"""

import os
from typing import Dict, Optional

import torch

from ..api import logprob_parity

PARITY_ENV = "RLKERNELS_LOGPROB_PARITY"


def parity_requested() -> bool:
    """Whether RLKERNELS_LOGPROB_PARITY asks for the report (1 / true / yes)."""
    return os.environ.get(PARITY_ENV, "0").strip().lower() in ("1", "true", "yes")


def parity_metrics(trainer_logprobs: torch.Tensor, rollout_logprobs: Optional[torch.Tensor], mask: torch.Tensor,
                   cu_seqlens: Optional[torch.Tensor] = None) -> Dict[str, torch.Tensor]:
    """`logprob_parity(...).metrics` (device tensors) when requested and both sides exist, else {}. The two sides
    are compared in the wider of their dtypes (a bf16 trainer against a float32 engine compares the bf16 values
    exactly); no value checks (`validate=False`: no synchronisation)."""
    if rollout_logprobs is None or not parity_requested():
        return {}
    dtype = torch.promote_types(trainer_logprobs.dtype, rollout_logprobs.dtype)
    report = logprob_parity(trainer_logprobs.detach().to(dtype), rollout_logprobs.detach().to(dtype), mask.bool(),
                            cu_seqlens=cu_seqlens, validate=False)
    return report.metrics
