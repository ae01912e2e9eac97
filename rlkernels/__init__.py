"""rlkernels: fused off-policy policy-gradient losses for LLM RL (the contract: docs/spec.md)."""

from .api import (
    CorrectionOutput,
    PolicyLossOutput,
    TokenStats,
    decoupled_ppo_loss,
    linear_decoupled_ppo_loss,
    linear_token_logprobs,
    metrics_to_floats,
    policy_loss,
    rollout_correction,
    token_logprobs,
)
from .config import PolicyLossConfig, RolloutCorrection

__version__ = "0.1.0"

__all__ = [
    "CorrectionOutput", "PolicyLossConfig", "PolicyLossOutput", "RolloutCorrection", "TokenStats",
    "decoupled_ppo_loss", "linear_decoupled_ppo_loss", "linear_token_logprobs", "metrics_to_floats", "policy_loss",
    "rollout_correction", "token_logprobs",
    "__version__",
]
