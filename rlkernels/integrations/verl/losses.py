"""rlkernels' policy losses in verl's registry (`actor.policy_loss.loss_mode=rlkernels[_<loss_type>]`, and the
routes' names `rlkernels_logits[_<loss_type>]` / `rlkernels_linear[_<loss_type>]`): `rlkernels.policy_loss` on verl's
log-probs with verl's registered-loss signature, configured from the actor config by
`PolicyLossConfig.from_verl_actor` and taking verl's `rollout_is_weights` and global counts. Each equals verl's
registered function of the same name (tests/integrations/test_verl_plugin.py).
"""

from typing import Optional

from verl.trainer.ppo import core_algos

from ...api import metrics_to_floats, policy_loss
from ...config import PolicyLossConfig
from ..configs import plugin_loss_modes, verl_global_counts
from .routes import install_routes_at_first_lookup, routes_installed


def make_policy_loss(loss_type: str, route: Optional[str] = None):
    """verl's registered-loss signature around `rlkernels.policy_loss` with this loss type. `route`: the
    function registered under a route's name ("logits" / "linear"), which verl calls where the route was not
    taken; its first call installs the routes (routes.install_routes_at_first_lookup)."""

    def compute_policy_loss_rlkernels(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean",
                                      config=None, rollout_is_weights=None):
        if config is None:
            raise ValueError("config: verl's actor config is required by the rlkernels policy loss")
        if route is not None and not routes_installed():
            install_routes_at_first_lookup(config)
        info = dict(getattr(config, "global_batch_info", None) or {})
        dp = info.get("dp_size", 1) or 1
        # the aggregation is the actor's (verl passes config.loss_agg_mode), or the one verl's function of this
        # loss type fixes (from_verl_actor)
        rl_config = PolicyLossConfig.from_verl_actor(config, loss_type=loss_type, validate=False,
                                                     **verl_global_counts(info)).with_overrides(
            kl_coef=0.0, entropy_coeff=0.0)  # verl adds its KL and entropy terms outside the policy loss
        out = policy_loss(log_prob, advantages, response_mask.bool(), old_logprobs=old_log_prob,
                          is_weights=rollout_is_weights, config=rl_config)
        loss = out.loss * dp if rl_config.loss_agg_mode == "token-sum" else out.loss  # verl's token-sum is x dp_size
        metrics = {k: v for k, v in metrics_to_floats(out.metrics).items() if k.startswith("actor/")}
        metrics.pop("actor/pg_loss", None)  # verl logs the loss it returns itself
        return loss, metrics

    compute_policy_loss_rlkernels.__name__ = f"compute_policy_loss_rlkernels_{loss_type}"
    return compute_policy_loss_rlkernels


def register_losses() -> None:
    """rlkernels' names in verl's policy-loss registry (idempotent); nothing else of verl is touched."""
    for name, route, loss_type in plugin_loss_modes():
        if name not in core_algos.POLICY_LOSS_REGISTRY:
            core_algos.register_policy_loss(name)(make_policy_loss(loss_type, route))
