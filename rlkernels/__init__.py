"""rlkernels: fused off-policy policy-gradient losses for LLM RL (the contract: docs/spec.md)."""

from . import schedules
from .api import (
    decoupled_ppo_loss,
    linear_decoupled_ppo_loss,
    linear_token_logprobs,
    logprob_parity,
    metrics_to_floats,
    optimal_token_baseline,
    policy_loss,
    rollout_correction,
    token_divergences,
    token_logprobs,
    topk_distillation_loss,
    variance_proxy_metrics,
)
from .config import PolicyLossConfig, RolloutCorrection
from .outputs import (
    CorrectionOutput,
    DistillationOutput,
    LogprobParity,
    PolicyLossOutput,
    TokenBaseline,
    TokenDivergences,
    TokenStats,
)

__version__ = "0.1.0"

__all__ = [
    "CorrectionOutput", "DistillationOutput", "LogprobParity", "PolicyLossConfig", "PolicyLossOutput",
    "RolloutCorrection", "TokenBaseline", "TokenDivergences", "TokenStats", "decoupled_ppo_loss",
    "linear_decoupled_ppo_loss", "linear_token_logprobs", "logprob_parity", "metrics_to_floats",
    "optimal_token_baseline", "policy_loss", "rollout_correction", "schedules", "token_divergences",
    "token_logprobs", "topk_distillation_loss", "variance_proxy_metrics", "__version__",
]
