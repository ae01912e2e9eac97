"""rlkernels inside verl 0.9.1, loaded by verl itself through its `verl.plugins` entry point.

With rlkernels installed, `import verl` imports this package (pyproject: `[project.entry-points."verl.plugins"]`),
which registers rlkernels' policy losses and advantage estimators with verl and does nothing else: a verl run that
selects none of them is verl as shipped (same functions, same numbers). The names:
- `actor.policy_loss.loss_mode=rlkernels` (PPO clip) or `rlkernels_<loss_type>` (any of rlkernels' loss
  types: `rlkernels_cispo`, `rlkernels_gspo`, ...): the loss on verl's log-probs (`losses`);
- `loss_mode=rlkernels_logits[_<loss_type>]` / `rlkernels_linear[_<loss_type>]`, the routes: verl's FSDP
  engine hands the packed logits (logits route) or the model's last hidden states and LM head (linear
  route, no logits formed) of each micro-batch to `decoupled_ppo_loss` / `linear_decoupled_ppo_loss`
  (`routes`);
- `algorithm.adv_estimator=rlkernels_optimal_token_baseline` / `rlkernels_tir_optimal_token_baseline`: verl's OTB
  and TIR-OTB without a loop over groups (`estimators`).

The routes need hooks in verl's engine (`install_routes`: three methods of `FSDPEngineWithLMHead`). They
are installed when a run selects a route, at the moment verl first looks its loss up -- inside verl's
`ppo_loss` after the first micro-batch's forward, which therefore runs verl's path (same loss; a warning
says so) -- or, for the route from the first micro-batch, by the explicit opt-in `RLKERNELS_VERL_ROUTES=1`
in the workers' environment (Ray: `ray_kwargs.ray_init.runtime_env.env_vars`), or a call of
`install_routes()`.

The driver-side rollout correction stays verl's unless asked for (`RLKERNELS_VERL_CORRECTION=1` in the
driver's environment, or `install_correction()`; `correction`).
"""

import os

from .correction import (
    CORRECTION_ENV,
    compute_rollout_correction_and_add_to_batch,
    install_correction,
    uninstall_correction,
    verl_compute_rollout_correction_and_add_to_batch,
)
from .estimators import OTB_ESTIMATORS, make_advantage_estimator, register_advantage_estimators
from .losses import make_policy_loss, register_losses
from .routes import ROUTES_ENV, install_routes, ppo_loss, routes_installed, uninstall_routes, verl_ppo_loss

__all__ = [
    "CORRECTION_ENV", "OTB_ESTIMATORS", "ROUTES_ENV", "compute_rollout_correction_and_add_to_batch",
    "install_correction", "install_routes", "make_advantage_estimator", "make_policy_loss", "ppo_loss",
    "register_advantage_estimators", "register_losses", "routes_installed", "uninstall_correction",
    "uninstall_routes", "verl_compute_rollout_correction_and_add_to_batch", "verl_ppo_loss",
]


def _opted_in(variable: str) -> bool:
    """RLKERNELS_VERL_ROUTES=1 (or linear / logits, which also names the route of the log-prob passes),
    RLKERNELS_VERL_CORRECTION=1."""
    return os.environ.get(variable, "0").strip().lower() in ("1", "true", "yes", "linear", "logits")


register_losses()
register_advantage_estimators()
if _opted_in(ROUTES_ENV):
    install_routes()
if _opted_in(CORRECTION_ENV):
    install_correction()
