"""The oracle: docs/spec.md written out in plain float64 PyTorch, unfused, one module per topic.

Slow on purpose: sequences are Python loops and every gradient comes from autograd. Nothing here
imports the fast paths, so a bug there cannot hide in here.
"""

from .baseline import optimal_token_baseline, variance_proxy_metrics
from .correction import diagnostics, is_weights, rejection, response_length_metrics
from .loss import ReferenceOutput, aggregate, decoupled_ppo_loss, per_token_kl, policy_loss
from .token_stats import token_stats

__all__ = [
    "ReferenceOutput", "aggregate", "decoupled_ppo_loss", "diagnostics", "is_weights", "per_token_kl",
    "optimal_token_baseline", "policy_loss", "rejection", "response_length_metrics", "token_stats",
    "variance_proxy_metrics",
]
