"""The adapters in the processes a trainer starts (rlkernels/integrations/activation.py), for real: a local Ray
cluster whose actors compute the trainer's loss the way the trainer's worker builds it, with and without the one
line, and a worker launched as AReaL's scheduler launches one.

Each case runs a fresh driver process (nothing imported, no Ray running), which starts its own Ray cluster; the
trainer's values to compare with are computed in that driver by the trainer's own code. Tolerances: those of each
adapter's parity tests (tests/cases.py), since a Ray worker runs the same code on one thread.
"""

import json
import os
import pathlib
import subprocess
import sys
import textwrap

import pytest

from ..cases import F64, tol
from .trainer_imports import trainer_or_skip, write_stand_in

ray = pytest.importorskip("ray", reason="Ray is not installed here (rlkernels[peers] installs it)")

ROOT = pathlib.Path(__file__).resolve().parents[2]
RAY_INIT = """
import json, os, sys
import ray
import torch
hook = {hook!r}
ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False, object_store_memory=80 * 2**20,
         runtime_env={{"worker_process_setup_hook": hook}} if hook else None)
"""


def _driver(code: str, hook=None, env=None) -> dict:
    """Run `code` (after RAY_INIT with `hook`) in a fresh interpreter; the JSON object its last line prints."""
    script = textwrap.dedent(RAY_INIT.format(hook=hook)) + textwrap.dedent(code)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, cwd=ROOT,
                          env={**os.environ, **(env or {})})
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def _close(ours, theirs, quantity):
    t = tol(quantity, F64)
    for a, b in zip(ours, theirs):
        assert abs(a - b) <= t["atol"] + t["rtol"] * abs(b), (ours, theirs, t)


OPENRLHF = """
from rlkernels.testing.trainers import openrlhf_loss

KW = dict(clip_eps_low=0.2, clip_eps_high=0.28, dual_clip=3.0, is_correction_level="token",
          is_correction_mode="mask", is_correction_threshold=(0.7, 1.3))

def batch():
    g = torch.Generator().manual_seed(0)
    old = -torch.rand(4, 9, generator=g, dtype=torch.float64) * 2
    return dict(log_probs=old + 0.2 * torch.randn(4, 9, generator=g, dtype=torch.float64), old_log_probs=old,
                advantages=torch.randn(4, 9, generator=g, dtype=torch.float64),
                action_mask=torch.rand(4, 9, generator=g) < 0.8,
                rollout_log_probs=old + 0.2 * torch.randn(4, 9, generator=g, dtype=torch.float64))

@ray.remote
class PolicyModelActor:  # OpenRLHF's ppo_actor.py imports the class from openrlhf.models(.loss) and builds it
    def policy_loss(self, data):
        from rlkernels.testing.trainers import openrlhf_actor

        openrlhf_loss()
        import openrlhf.models.loss as loss
        fn = loss.PolicyLoss(**KW)
        forward = openrlhf_actor().Actor.forward  # the log-prob passes
        return [type(fn).__module__, forward.__module__], os.getpid(), [float(v) for v in fn(**data)[:3]]

(module, forward), pid, values = ray.get(PolicyModelActor.remote().policy_loss.remote(batch()))
theirs = [float(v) for v in openrlhf_loss().PolicyLoss(**KW)(**batch())[:3]]
print(json.dumps(dict(module=module, forward=forward, remote=pid != os.getpid(), values=values, theirs=theirs)))
"""


def test_openrlhf_actor_builds_the_adapter_with_the_setup_hook():
    trainer_or_skip("openrlhf_loss", "OpenRLHF 0.11.2")
    on = _driver(OPENRLHF, hook="rlkernels.integrations.openrlhf.install")
    off = _driver(OPENRLHF)
    assert on["remote"] and off["remote"]
    assert on["module"] == on["forward"] == "rlkernels.integrations.openrlhf"
    assert off["module"] == "openrlhf.models.loss"  # without the line, OpenRLHF's own class and forward
    assert off["forward"] == "openrlhf.models.actor"
    _close(on["values"], on["theirs"], "openrlhf")  # loss, clip_ratio, ppo_kl
    assert off["values"] == off["theirs"]


AREAL = """
from rlkernels.testing.trainers import AReaLImports, areal_functional

def batch():
    g = torch.Generator().manual_seed(1)
    prox = -torch.rand(3, 8, generator=g, dtype=torch.float64) * 2
    return (prox + 0.1 * torch.randn(3, 8, generator=g, dtype=torch.float64), prox,
            prox + 0.1 * torch.randn(3, 8, generator=g, dtype=torch.float64),
            torch.randn(3, 8, generator=g, dtype=torch.float64), 0.2, torch.rand(3, 8, generator=g) < 0.8)

def loss(fn):
    logprobs, prox, behave, adv, eps, mask = batch()
    return float(fn(logprobs, prox, behave, adv, eps, mask, eps_clip_higher=0.28, c_clip=3.0)[0])

@ray.remote
class ActorWorker:  # AReaL's actor module binds the name when it is imported, and its grpo_loss_fn calls it
    def policy_loss(self):
        AReaLImports.install()
        import areal.engine.fsdp_engine as engine  # its forwards' log-prob passes
        import areal.trainer.ppo.actor as actor
        modules = [actor.ppo_actor_loss_fn.__module__, engine.gather_logprobs_entropy.__module__]
        return modules, os.getpid(), loss(actor.ppo_actor_loss_fn)

(module, engine), pid, value = ray.get(ActorWorker.remote().policy_loss.remote())
theirs = loss(areal_functional().ppo_actor_loss_fn)
print(json.dumps(dict(module=module, engine=engine, remote=pid != os.getpid(), values=[value], theirs=[theirs])))
"""


def test_areal_ray_worker_calls_the_adapter_with_the_setup_hook():
    trainer_or_skip("areal_functional", "AReaL 1.0.4")
    on = _driver(AREAL, hook="rlkernels.integrations.areal.install")
    off = _driver(AREAL)
    assert on["remote"] and off["remote"]
    assert on["module"] == on["engine"] == "rlkernels.integrations.areal"
    assert off["module"] == "areal.utils.functional.functional"
    assert off["engine"] == "areal.utils.functional.vocab_parallel"
    _close(on["values"], on["theirs"], "areal")
    assert off["values"] == off["theirs"]


AREAL_WORKER = """
import json, sys
import torch
from rlkernels.testing.trainers import AReaLImports

AReaLImports.install()
import areal.trainer.ppo.actor as actor

g = torch.Generator().manual_seed(2)
lp = -torch.rand(2, 5, generator=g, dtype=torch.float64)
loss, _ = actor.ppo_actor_loss_fn(lp, lp.detach() - 0.1, lp.detach(), torch.ones(2, 5, dtype=torch.float64), 0.2,
                                  torch.ones(2, 5, dtype=torch.bool))
print(json.dumps(dict(module=actor.ppo_actor_loss_fn.__module__, argv=sys.argv[1:], name=__name__,
                      loss=float(loss))))
"""


def test_areal_scheduler_command_launches_the_worker_with_the_adapter(tmp_path):
    """`python -m rlkernels.integrations.launch areal MODULE ARGS` as AReaL's `scheduling_spec.cmd`: the worker
    module runs as __main__ with the arguments the scheduler appends, its actor module's name rebound."""
    trainer_or_skip("areal_functional", "AReaL 1.0.4")
    (tmp_path / "probe_worker.py").write_text(textwrap.dedent(AREAL_WORKER))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    runs = {}
    for cmd in (["-m", "rlkernels.integrations.launch", "areal", "probe_worker"], ["-m", "probe_worker"]):
        done = subprocess.run([sys.executable, *cmd, "--role", "actor", "--worker-index", "3"], capture_output=True,
                              text=True, timeout=240, cwd=ROOT, env=env)
        assert done.returncode == 0, done.stderr[-4000:]
        runs[cmd[1]] = json.loads(done.stdout.strip().splitlines()[-1])
    on, off = runs["rlkernels.integrations.launch"], runs["probe_worker"]
    assert on["module"] == "rlkernels.integrations.areal" and off["module"] == "areal.utils.functional.functional"
    assert on["argv"] == off["argv"] == ["--role", "actor", "--worker-index", "3"] and on["name"] == "__main__"
    _close([on["loss"]], [off["loss"]], "areal")


def test_launch_names_an_unknown_adapter():
    done = subprocess.run([sys.executable, "-m", "rlkernels.integrations.launch", "nosuch", "json.tool"],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert done.returncode != 0 and "no adapter named 'nosuch'" in done.stderr


SKYRL = """
import rlkernels.integrations.skyrl as rlk_skyrl
from rlkernels.testing.trainers import skyrl_ppo_utils

register, routes = {register!r}, {routes!r}
sk = skyrl_ppo_utils()  # Ray is running: SkyRL's registry mirrors itself into its named Ray actor
if register:
    rlk_skyrl.register(routes=routes)

def batch():
    g = torch.Generator().manual_seed(3)
    old = -torch.rand(3, 7, generator=g, dtype=torch.float64) * 2
    return (old + 0.1 * torch.randn(3, 7, generator=g, dtype=torch.float64), old,
            torch.randn(3, 7, generator=g, dtype=torch.float64))

def loss(fn):
    lp, old, adv = batch()
    cfg = skyrl_ppo_utils().AlgorithmConfig(policy_loss_type="dual_clip")  # not `sk`: pickled by value
    return float(fn(lp, old, adv, cfg, loss_mask=torch.ones_like(lp))[0])

def wrapper_route():  # the log-prob function SkyRL's FSDP model wrapper module then binds
    from rlkernels.testing.trainers import SkyRLWrapperImports

    SkyRLWrapperImports.install()
    import skyrl.backends.skyrl_train.workers.model_wrapper as wrapper
    return wrapper.logprobs_from_logits.__module__

@ray.remote
class PolicyWorker:  # SkyRL's PolicyWorkerBase.__init__: PolicyLossRegistry.get(...), then init_model
    def policy_loss(self, name):
        registry = skyrl_ppo_utils().PolicyLossRegistry
        try:
            fn = registry.get(name)
        except ValueError as exc:
            return str(exc), os.getpid(), None, wrapper_route()
        return type(fn).__module__, os.getpid(), loss(fn), wrapper_route()

module, pid, value, route = ray.get(PolicyWorker.remote().policy_loss.remote("rlkernels_dual_clip"))
theirs = loss(sk.PolicyLossRegistry.get("dual_clip"))
print(json.dumps(dict(module=module, remote=pid != os.getpid(), values=[value], theirs=[theirs], route=route)))
"""


def test_skyrl_worker_finds_the_registered_loss_through_skyrls_registry():
    """register() in the driver: the worker's registry lookup unpickles rlkernels' loss and, with routes (the
    default), installs the log-prob route before the worker builds its model wrapper."""
    trainer_or_skip("skyrl_ppo_utils", "SkyRL 0.4.0")
    on = _driver(SKYRL.format(register=True, routes=True))
    loss_only = _driver(SKYRL.format(register=True, routes=False))
    off = _driver(SKYRL.format(register=False, routes=False))
    assert on["remote"] and off["remote"]
    assert on["module"] == loss_only["module"] == "rlkernels.integrations.skyrl"
    _close(on["values"], on["theirs"], "skyrl")
    assert on["route"] == "rlkernels.integrations.skyrl"
    assert loss_only["route"] == off["route"] == "skyrl.backends.skyrl_train.utils.torch_utils"
    assert "Unknown policy loss 'rlkernels_dual_clip'" in off["module"] and off["values"] == [None]


SEAMS = """
import importlib
from rlkernels.integrations.nemo_rl import ClippedPGLossFn

def data():
    g = torch.Generator().manual_seed(4)
    prev = -torch.rand(3, 6, generator=g, dtype=torch.float64)
    return {"advantages": torch.randn(3, 6, generator=g, dtype=torch.float64), "prev_logprobs": prev,
            "generation_logprobs": prev + 0.05, "reference_policy_logprobs": prev - 0.05,
            "token_mask": torch.ones(3, 6, dtype=torch.float64), "sample_mask": torch.ones(3, dtype=torch.float64)
            }, prev[:, 1:] + 0.1

@ray.remote
class PolicyWorker:
    def nemo_rl(self, loss_fn):  # NeMo-RL pickles the loss object grpo.setup() returned to its workers
        batch, lp = data()
        value = float(loss_fn(batch, 3.0, 15.0, next_token_logprobs=lp)[0])
        sys.path.insert(0, os.environ["RLK_NEMO_RL_STAND_IN"])  # then the worker imports NeMo-RL's model code
        import nemo_rl.models.automodel.train as train
        return type(loss_fn).__module__, value, train.LogprobsPostProcessor._compute_local_logprobs.__module__

    def slime(self, path):  # slime's Megatron actor: load_function(args.custom_loss_function_path)
        module, name = path.rsplit(".", 1)
        return getattr(importlib.import_module(module), name).__module__

loss_fn = ClippedPGLossFn({"use_importance_sampling_correction": True})
module, value, route = ray.get(PolicyWorker.remote().nemo_rl.remote(loss_fn))
without = ray.get(PolicyWorker.remote().nemo_rl.remote(ClippedPGLossFn({}, routes=False)))[2]
worker = PolicyWorker.remote()
batch, lp = data()
slime_module = ray.get(worker.slime.remote("rlkernels.integrations.slime.policy_loss_function"))
here = float(loss_fn(batch, 3.0, 15.0, next_token_logprobs=lp)[0])  # the same object in the driver
print(json.dumps(dict(module=module, values=[value], driver=[here], slime=slime_module, route=route,
                      without=without)))
"""


def test_nemo_rl_and_slime_seams_carry_the_adapter_to_a_worker(tmp_path):
    """NeMo-RL's pickled loss object and slime's import path reach a Ray worker with nothing else: the worker
    computes NeMo-RL's loss with rlkernels' object, and slime's path names rlkernels' function there. The loss
    object installs the log-prob route in the worker, where NeMo-RL's model code (the stand-in package of
    test_nemo_rl_routes.py) is imported after it; with `routes=False`, another worker keeps NeMo-RL's own."""
    write_stand_in(tmp_path)
    out = _driver(SEAMS, env={"RLK_NEMO_RL_STAND_IN": str(tmp_path)})
    assert out["module"] == "rlkernels.integrations.nemo_rl" and out["slime"] == "rlkernels.integrations.slime"
    assert out["route"] == "rlkernels.integrations.nemo_rl" and out["without"] == "nemo_rl.models.automodel.train"
    _close(out["values"], out["driver"], "nemo_rl")
