"""What installing rlkernels does to verl, seen from a fresh interpreter (test_verl_first_contact.py).

    python -m tests.support.verl_first_contact <scenario> [<scenario> ...]     # from the repository root

runs the scenarios in turn in this one interpreter and prints one line `RESULT <scenario> <JSON>` for each. The
test orders them so that none changes what a later one sees (verl's own modes install nothing; the one route
that installs its hooks runs last). Scenarios:
- snapshot: `import verl` (the entry point loads the plugin unless VERL_USE_EXTERNAL_PLUGINS=none), then
  verl's modules that rlkernels touches; for each, every function and class (and each class's methods) as
  (defining module, qualified name), and verl's registries' keys;
- correction: verl's driver-side `compute_rollout_correction_and_add_to_batch`, as the trainer looks it up
  after `import verl`, on a batch with asymmetric k1 bounds (where rlkernels' convention differs from verl's
  code): which function it is and the mask and weights it gives;
- routes:<loss_mode>: verl's actor step (the example's CPU engine, verl's own forward_backward_batch, the
  actor loss bound as verl's engine worker binds it) for two steps of two micro-batches: which of
  rlkernels' losses ran in each micro-batch, the warnings, the losses, and whether the engine methods are
  verl's own afterwards.
"""

import json
import sys
import warnings
from functools import partial

from rlkernels.testing.peers import inert_ray_transformers, load_example

MODULES = ("verl.trainer.ppo.core_algos", "verl.trainer.ppo.rollout_corr_helper", "verl.workers.utils.losses",
           "verl.workers.engine.fsdp.transformer_impl", "verl.utils.metric", "verl.protocol")


def _import_verl():
    with inert_ray_transformers():
        import verl  # noqa: F401  (the entry point)
        for name in MODULES:
            __import__(name)


def _describe(obj):
    return [getattr(obj, "__module__", None), getattr(obj, "__qualname__", None)]


def snapshot():
    _import_verl()
    out = {}
    for name in MODULES:
        module = sys.modules[name]
        entries = {}
        for attr, value in sorted(vars(module).items()):
            if callable(value) and not isinstance(value, type(sys)):
                entries[attr] = _describe(value)
                if isinstance(value, type) and value.__module__ == name:
                    for method, fn in sorted(vars(value).items()):
                        if callable(fn) or isinstance(fn, (staticmethod, classmethod)):
                            entries[f"{attr}.{method}"] = _describe(getattr(fn, "__func__", fn))
        out[name] = entries
    core_algos = sys.modules["verl.trainer.ppo.core_algos"]
    registries = {k: sorted(v) for k, v in vars(core_algos).items() if k.endswith("_REGISTRY") and isinstance(v, dict)}
    return {"modules": out, "registries": registries, "plugin": "rlkernels.integrations.verl" in sys.modules}


def correction():
    import torch

    _import_verl()
    from verl.protocol import DataProto
    from verl.trainer.ppo import rollout_corr_helper

    g = torch.Generator().manual_seed(0)
    old = -torch.rand(16, 12, generator=g, dtype=torch.float64) * 2
    rollout = old + torch.randn(16, 12, generator=g, dtype=torch.float64) * 0.05
    mask = torch.ones(16, 12, dtype=torch.float64)
    batch = DataProto.from_dict(tensors={"old_log_probs": old, "rollout_log_probs": rollout, "response_mask": mask})
    # asymmetric bounds: verl's code keeps 1/hi <= rho <= 1/lo, its docs (and rlkernels) lo <= rho <= hi
    config = {"rollout_is": "token", "rollout_is_threshold": 2.0, "rollout_rs": "seq_mean_k1",
              "rollout_rs_threshold": "0.99_1.02"}
    fn = rollout_corr_helper.compute_rollout_correction_and_add_to_batch
    out, metrics = fn(batch, config)
    return {"function": _describe(fn), "mask": out.batch["response_mask"].sum(1).tolist(),
            "weights": out.batch["rollout_is_weights"].sum(1).tolist(),
            "masked_fraction": metrics["rollout_corr/rollout_rs_masked_fraction"]}


class _Calls(list):
    counting = False


CALLS = _Calls()  # the names of rlkernels' losses called, in order, in the current micro-batch


def routes(loss_mode):

    _import_verl()
    from verl.workers.config import FSDPActorConfig
    from verl.workers.config.actor import PolicyLossConfig as VerlPolicyLossConfig
    from verl.workers.engine.fsdp import transformer_impl as ti
    from verl.workers.utils import losses as verl_losses

    example = load_example("verl_actor.py")
    from rlkernels.integrations import verl as rlk_verl
    from rlkernels.integrations.verl import losses as rlk_losses
    from rlkernels.integrations.verl import routes as rlk_routes

    calls = CALLS
    if not calls.counting:  # once per process: a later scenario reuses the counting wrappers
        for module, name in ((rlk_routes, "decoupled_ppo_loss"), (rlk_routes, "linear_decoupled_ppo_loss"),
                             (rlk_losses, "policy_loss")):
            fn = getattr(module, name)
            setattr(module, name, lambda *a, _fn=fn, _name=name, **k: calls.append(_name) or _fn(*a, **k))
        calls.counting = True
    model = example.tiny_model()
    engine = example.cpu_engine(model)
    actor = FSDPActorConfig(strategy="fsdp", rollout_n=1, ppo_mini_batch_size=8, ppo_micro_batch_size_per_gpu=4,
                            policy_loss=VerlPolicyLossConfig(loss_mode=loss_mode))
    loss_function = partial(verl_losses.ppo_loss, config=actor)  # as verl's engine worker binds it
    steps = []
    for step in range(2):
        fields = example.rollout_batch(model, 0.8, seed=step)
        td = example.actor_batch(fields, 0.8, False, global_batch_size=8, micro_batch_size=4)
        calls.clear()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out = engine.forward_backward_batch(td, loss_function=loss_function, forward_only=False)
        loss = out["loss"]
        steps.append({"calls": list(calls), "loss": float(sum(loss) if isinstance(loss, list) else loss),
                      "warnings": [str(w.message) for w in caught if "rlkernels" in str(w.message)
                                   or "loss_mode" in str(w.message)]})
    hooks = {name: _describe(vars(ti.FSDPEngineWithLMHead)[name])
             for name in ("forward_step", "prepare_model_inputs", "prepare_model_outputs")}
    return {"steps": steps, "engine": hooks, "ppo_loss": _describe(verl_losses.ppo_loss),
            "installed": rlk_verl.routes_installed()}


if __name__ == "__main__":
    import torch.distributed as dist

    scenarios = sys.argv[1:]
    if any(s.startswith("routes") for s in scenarios) and not dist.is_initialized():  # verl's engine all-reduces
        import os

        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(29600 + os.getpid() % 1000))
        dist.init_process_group("gloo", rank=0, world_size=1)
    for scenario in scenarios:
        name, *args = scenario.split(":")
        result = {"snapshot": snapshot, "correction": correction, "routes": routes}[name](*args)
        print(f"RESULT {scenario} " + json.dumps(result), flush=True)
