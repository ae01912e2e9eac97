"""Installing rlkernels leaves verl as shipped, in fresh interpreters with the `verl.plugins` entry point installed
(`pip install -e .`): an in-process suite has long since loaded the plugin and cannot see what `import verl` alone
does. tests/support/verl_first_contact.py runs scenarios and prints what it saw; one interpreter per environment
runs all of that environment's scenarios in turn (three in all, rather than one per scenario: each starts by
importing verl, ~5-10 s).

- `import verl`: every function, class and method of the verl modules rlkernels touches is verl's own, compared
  with a process where verl loads no plugin (VERL_USE_EXTERNAL_PLUGINS=none); the registries differ by
  rlkernels' names only.
- verl's driver-side rollout correction, on asymmetric k1 bounds (where rlkernels' convention differs from
  verl's code), gives verl's values unless RLKERNELS_VERL_CORRECTION=1 asks for rlkernels'.
- Selecting a route installs its engine hooks at the first lookup of the loss (that micro-batch on verl's path,
  with a warning), or from the first micro-batch with RLKERNELS_VERL_ROUTES=1; verl's own loss modes and
  `rlkernels` on verl's log-probs leave the engine as it is. Losses agree with verl's within the engine tests'
  1e-5 (float32, tests/integrations/test_verl_engine.py: TOL "verl.engine").
"""

import functools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ..cases import F32, approx
from ..verl_import import import_verl_or_skip

import_verl_or_skip()

SCRIPT = Path(__file__).resolve().parents[1] / "support" / "verl_first_contact.py"


# Each environment's scenarios, in the order one interpreter runs them. snapshot comes first (nothing but
# `import verl` before it); verl's own loss modes install nothing, so the route that installs its hooks at
# its first lookup (rlkernels_linear) runs after them and last. The two opt-ins share an interpreter: the
# driver-side correction and the engine's routes are separate hooks.
ENVIRONMENTS = {
    "no plugin": (dict(VERL_USE_EXTERNAL_PLUGINS="none"), ["snapshot", "correction"]),
    "installed": ({}, ["snapshot", "correction", "routes:vanilla", "routes:rlkernels", "routes:rlkernels_linear"]),
    "opted in": (dict(RLKERNELS_VERL_CORRECTION="1", RLKERNELS_VERL_ROUTES="1"),
                 ["correction", "routes:rlkernels_logits"]),
}


def _run(environment):
    env, scenarios = ENVIRONMENTS[environment]
    base = {k: v for k, v in os.environ.items() if not k.startswith(("RLKERNELS_VERL_", "VERL_USE_EXTERNAL"))}
    run = subprocess.run([sys.executable, "-m", "tests.support.verl_first_contact", *scenarios], capture_output=True,
                         text=True, timeout=600, env={**base, **env}, cwd=str(SCRIPT.parents[2]))
    assert run.returncode == 0, run.stderr[-4000:]
    results = {}
    for line in run.stdout.splitlines():
        if line.startswith("RESULT "):
            scenario, payload = line[len("RESULT "):].split(" ", 1)
            results[scenario] = json.loads(payload)
    assert list(results) == scenarios, f"{environment}: ran {list(results)} of {scenarios}"
    return results


@pytest.fixture(scope="module")
def seen():
    """seen(environment)[scenario]: each environment's interpreter runs once, when a test first asks for it."""
    return functools.cache(_run)


def test_import_verl_adds_rlkernels_names_to_verls_registries_and_nothing_else(seen):
    plain = seen("no plugin")["snapshot"]
    with_plugin = seen("installed")["snapshot"]
    assert not plain["plugin"] and with_plugin["plugin"], "the entry point did not load the plugin"
    assert with_plugin["modules"] == plain["modules"]
    for name, keys in with_plugin["registries"].items():
        added = set(keys) - set(plain["registries"][name])
        assert set(plain["registries"][name]) <= set(keys) and all(k.startswith("rlkernels") for k in added), name
    assert {"rlkernels", "rlkernels_linear", "rlkernels_logits_cispo"} <= set(with_plugin["registries"]
                                                                             ["POLICY_LOSS_REGISTRY"])


def test_verls_rollout_correction_stays_verls_unless_asked_for(seen):
    plain = seen("no plugin")["correction"]
    installed = seen("installed")["correction"]
    assert installed == plain  # the same function, the same mask and weights
    assert plain["function"] == ["verl.trainer.ppo.rollout_corr_helper", "compute_rollout_correction_and_add_to_batch"]
    opted_in = seen("opted in")["correction"]
    assert opted_in["function"][0] == "rlkernels.integrations.verl.correction"
    # asymmetric k1 bounds: rlkernels keeps lo <= rho <= hi (verl's docs), verl's code 1/hi <= rho <= 1/lo
    assert opted_in["mask"] != plain["mask"] and opted_in["weights"] == pytest.approx(plain["weights"])


def _verl_losses(seen):
    """verl's own path's losses of the two steps."""
    return [s["loss"] for s in seen("installed")["routes:vanilla"]["steps"]]


def test_verls_own_loss_modes_leave_the_engine_as_shipped(seen):
    for mode, ran in (("vanilla", []), ("rlkernels", ["policy_loss", "policy_loss"])):
        result = seen("installed")[f"routes:{mode}"]
        assert [s["calls"] for s in result["steps"]] == [ran, ran] and not result["installed"]
        assert all(module.startswith("verl.") for module, _ in result["engine"].values())
        assert result["ppo_loss"] == ["verl.workers.utils.losses", "ppo_loss"]


def test_a_route_installs_its_hooks_when_verl_first_looks_its_loss_up(seen):
    result = seen("installed")["routes:rlkernels_linear"]
    first, second = result["steps"]
    # the first micro-batch ran verl's path (the registered loss on verl's log-probs), the route took the rest
    assert first["calls"] == ["policy_loss", "linear_decoupled_ppo_loss"]
    assert second["calls"] == ["linear_decoupled_ppo_loss"] * 2 and not second["warnings"]
    assert len(first["warnings"]) == 1 and "RLKERNELS_VERL_ROUTES=1" in first["warnings"][0]
    assert result["installed"] and all(module == "rlkernels.integrations.verl.routes" for module, _ in
                                       result["engine"].values())
    assert result["ppo_loss"] == ["verl.workers.utils.losses", "ppo_loss"]  # replaced per call, not in verl
    for got, want in zip((s["loss"] for s in result["steps"]), _verl_losses(seen)):
        assert got == approx(want, "verl.engine", F32)


def test_the_routes_opt_in_takes_the_route_from_the_first_micro_batch(seen):
    result = seen("opted in")["routes:rlkernels_logits"]
    assert [s["calls"] for s in result["steps"]] == [["decoupled_ppo_loss"] * 2] * 2
    assert not any(s["warnings"] for s in result["steps"])
    for got, want in zip((s["loss"] for s in result["steps"]), _verl_losses(seen)):
        assert got == approx(want, "verl.engine", F32)
