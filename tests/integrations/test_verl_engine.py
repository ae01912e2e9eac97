"""The verl plugin's logits route (`loss_mode=rlkernels_logits[_<type>]`), driven through verl 0.9.1's own
engine code on CPU: verl's `FSDPEngineWithLMHead.forward_backward_batch` (global token counts all-reduced
over the data-parallel group, micro-batching) -> `forward_step` -> `prepare_model_inputs` (packing, rolled
labels, per-token temperatures) -> `prepare_model_outputs` -> actor loss, on a batch converted by verl's
`left_right_2_no_padding`, around a tiny randomly initialised Qwen2 built in code. The engine is built
without its FSDP setup (`object.__new__`), which the loss path does not touch.

Compared on every configuration: verl's own path (logits -> verl's log-probs and entropy -> verl's
`ppo_loss` with verl's loss of the same type) against the logits route (logits -> `decoupled_ppo_loss`)
and against the plugin's registered loss on verl's log-probs (`rlkernels_<type>`), the summed loss of
two micro-batches and every parameter's gradient. Both run in float32 over at most ~150
tokens of O(1) terms, in different summation orders: differences are a few float32 roundings of O(1)
quantities (~1e-6 of the larger of 1 and the loss, whose token-sum reaches ~20); the issue's 1e-5 is
asserted (TOL "verl.engine"), on the loss relative to max(1, |loss|) and on the gradient relative to its largest entry.
Ranks are real gloo process groups (rlkernels/testing/spawn.py): one rank for the option product, two for the
data-parallel mapping (verl's dp_size and all-reduced token count).
"""

import itertools
import warnings
from functools import partial
from types import SimpleNamespace

import pytest
import torch

from rlkernels.testing.spawn import spawn

from ..cases import F32, TOL, approx
from ..verl_import import import_verl_or_skip

import_verl_or_skip()
try:
    from verl.workers.engine.fsdp import transformer_impl as ti  # noqa: E402
except ImportError as exc:  # pragma: no cover - reported by the skip
    pytest.skip(f"verl's FSDP engine does not import here ({exc}); the peers extra installs what it imports",
                allow_module_level=True)
from tensordict import TensorDict  # noqa: E402
from verl.protocol import DataProto  # noqa: E402
from verl.utils import tensordict_utils as tu  # noqa: E402
from verl.workers.config import FSDPActorConfig  # noqa: E402
from verl.workers.config.actor import PolicyLossConfig as VerlPolicyLossConfig  # noqa: E402
from verl.workers.utils import losses as verl_losses  # noqa: E402

from rlkernels.integrations import verl as rlk_verl  # noqa: E402
from rlkernels.integrations.verl import routes as rlk_routes  # noqa: E402
from rlkernels.testing.peers import load_example  # noqa: E402

example = load_example("verl_actor.py")  # its tiny model (and batches) serve these tests too
# these tests drive the routes: the explicit opt-in (a run that selects a route without it installs the hooks at the
# first lookup of its loss; tests/integrations/test_verl_first_contact.py drives that in a fresh process)
rlk_verl.install_routes()
B = 8


def _batch(model, temperature, seed, rows):
    return {k: v[rows] for k, v in example.rollout_batch(model, temperature, seed, batch_size=B).items()}


def _corrected(fields, correction):
    """The driver-side rollout correction (the plugin's, the opt-in RLKERNELS_VERL_CORRECTION=1): mask and IS
    weights."""
    if correction is None:
        return dict(fields)
    batch = DataProto.from_dict(tensors={k: fields[k] for k in ("old_log_probs", "rollout_log_probs",
                                                                 "response_mask")})
    batch, _ = rlk_verl.compute_rollout_correction_and_add_to_batch(batch, correction)
    out = dict(fields, response_mask=batch.batch["response_mask"])
    if "rollout_is_weights" in batch.batch.keys():
        out["rollout_is_weights"] = batch.batch["rollout_is_weights"]
    return out


def _run(engine, td, loss_function):
    engine.module.zero_grad(set_to_none=True)
    out = engine.forward_backward_batch(td, loss_function=loss_function, forward_only=False)
    loss = out["loss"]
    loss = sum(loss) if isinstance(loss, list) else loss
    grads = torch.cat([(p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).reshape(-1)
                       for p in engine.module.parameters() if p.grad is not None])  # FSDP2: DTensor shards
    return float(loss), grads, out.get("metrics", {})


def _counting(fn, calls, name):
    def counted(*args, **kwargs):
        calls[name] += 1
        return fn(*args, **kwargs)
    return counted


def _shard(model, world, wrapper):
    """The model wrapped as verl's FSDP strategies wrap it, by verl's own functions: "fsdp2" is
    `apply_fsdp2` (each decoder layer and, the embeddings being untied, the embeddings and the LM head as
    their own units, then the root); "fsdp1" is FSDP with verl's `get_fsdp_wrap_policy`."""
    import torch.distributed.fsdp as fsdp
    from torch.distributed.device_mesh import init_device_mesh
    from verl.utils.fsdp_utils import apply_fsdp2, get_fsdp_wrap_policy

    if wrapper == "fsdp2":
        apply_fsdp2(model, {"mesh": init_device_mesh("cpu", (world,))}, {})
        return model
    return fsdp.FullyShardedDataParallel(model, auto_wrap_policy=get_fsdp_wrap_policy(model, config={}, is_lora=False),
                                         device_id=torch.device("cpu"), sync_module_states=False,
                                         sharding_strategy=fsdp.ShardingStrategy.FULL_SHARD)


def _compare(rank, world, cases, wrapper=None):
    """verl's own path against the logits route, and against the registered loss of the same type on
    verl's log-probs (`rlkernels_<type>`), on each case; returns the worst differences."""
    model = example.tiny_model()
    batch_model = example.tiny_model()  # the same weights (seeded; nothing steps): the batches' log-probs
    if wrapper is not None:
        # FSDP2 leaves the root unsharded after a no-grad forward, and the next step's root gradients are then
        # not reduced (verl's eval context reshards it, EngineEvalModeCtx): the batches come from the copy
        model = _shard(model, world, wrapper)
    worst = {path: [0.0, 0.0] for path in PATHS}
    calls = {"decoupled_ppo_loss": 0, "linear_decoupled_ppo_loss": 0}  # which of the library's losses ran
    for name in calls:
        setattr(rlk_routes, name, _counting(getattr(rlk_routes, name), calls, name))
    for i, (loss_type, agg, temperature, correction, extras, pad) in enumerate(cases):
        engine = example.cpu_engine(model, pad)
        fields = _batch(batch_model, temperature, seed=i, rows=slice(rank, None, world))
        fields = _corrected(fields, correction)
        entropy = bool(extras)
        results = []
        suffix = "" if loss_type == "vanilla" else f"_{loss_type}"
        # every path binds verl's own ppo_loss, as verl's engine worker does; the engine hook runs the route's
        # actor loss in its place for the routes' loss modes
        for prefix, mode in [(None, loss_type)] + [(prefix, prefix + suffix) for prefix in PATHS.values()]:
            loss_fn = verl_losses.ppo_loss
            actor = FSDPActorConfig(strategy="fsdp", rollout_n=1, ppo_mini_batch_size=B,
                                    ppo_micro_batch_size_per_gpu=B // 2, loss_agg_mode=agg,
                                    policy_loss=VerlPolicyLossConfig(loss_mode=mode), **extras)
            td = example.actor_batch(fields, temperature, entropy, global_batch_size=B,
                                     micro_batch_size=B // world // 2)  # two micro-batches per rank
            before = dict(calls)
            with warnings.catch_warnings():
                warnings.simplefilter("error", UserWarning)  # a fallback to verl's log-probs fails the test
                results.append(_run(engine, td, partial(loss_fn, config=actor)))
            ran = {name: calls[name] - before[name] for name in calls}
            expected = {"rlkernels_logits": {"decoupled_ppo_loss": 2, "linear_decoupled_ppo_loss": 0},
                        "rlkernels_linear": {"decoupled_ppo_loss": 0, "linear_decoupled_ppo_loss": 2}}
            assert ran == expected.get(prefix, {k: 0 for k in calls}), (mode, ran)  # two micro-batches
        (want, want_grad, want_metrics) = results[0]
        for path, (got, got_grad, got_metrics) in zip(PATHS, results[1:]):
            dl = abs(got - want) / max(1.0, abs(want))
            dg = float((got_grad - want_grad).abs().max()) / max(float(want_grad.abs().max()), 1e-12)
            case = f"rank {rank}/{world} {path} {cases[i]}"
            bound = TOL["verl.engine", F32].rtol  # dl and dg are relative already
            assert dl <= bound and dg <= bound, f"{case}: loss {got} vs verl {want} (|d| {dl:.1e}), grad rel {dg:.1e}"
            for key in ("actor/pg_loss", "actor/pg_clipfrac", "actor/ppo_kl", "actor/entropy_loss", "kl_loss"):
                if key in want_metrics:
                    w, o = (m[key].aggregate() for m in (want_metrics, got_metrics))  # verl's Metric
                    assert want_metrics[key].aggregation == got_metrics[key].aggregation, f"{case}: {key}"
                    assert o == approx(w, "verl.engine", F32), f"{case}: metric {key} {o} vs verl {w}"
            worst[path] = [max(worst[path][0], dl), max(worst[path][1], dg)]
    return worst


# the plugin's paths, each against verl's own: its loss mode prefix
PATHS = {"logits route": "rlkernels_logits", "linear route": "rlkernels_linear", "registered loss": "rlkernels"}


ENTROPY_KL = {"entropy_coeff": 0.01, "use_kl_loss": True, "kl_loss_coef": 0.05}
TIS_GEO_RS = {"rollout_is": "token", "rollout_is_threshold": 2.0, "rollout_rs": "seq_mean_k1",
              "rollout_rs_threshold": f"{1 / 1.05}_1.05"}
SEQ_MIS = {"rollout_is": "sequence", "rollout_is_threshold": 2.0, "rollout_rs": "seq_sum_k1",
           "rollout_rs_threshold": "0.5_2.0"}
AGG = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm", "token-sum")
PER_SEQUENCE_T = torch.linspace(0.7, 1.2, B)

# the option product on PPO clip, then the other loss types and the extras on a few of its rows
CASES = [("vanilla", agg, t, corr, {}, 0) for agg, t, corr in itertools.product(
    AGG, (1.0, 0.8, PER_SEQUENCE_T), (None, TIS_GEO_RS, SEQ_MIS))]
CASES += [("vanilla", agg, 0.8, TIS_GEO_RS, ENTROPY_KL, 0) for agg in AGG]
CASES += [(loss, "token-mean", 0.8, TIS_GEO_RS, ENTROPY_KL, 0) for loss in ("cispo", "gspo", "dppo_tv", "gpg")]
CASES += [("vanilla", "token-mean", PER_SEQUENCE_T, TIS_GEO_RS, ENTROPY_KL, 64)]  # pad_to_length's static pad


def _check_product(rank, world):
    for path, (loss, grad) in _compare(rank, world, CASES).items():
        print(f"{path} vs verl, {len(CASES)} cases: worst loss {loss:.1e}, grad {grad:.1e} (relative)")


def _check_data_parallel(rank, world):
    cases = [("vanilla", agg, 0.8, TIS_GEO_RS, ENTROPY_KL, 0) for agg in AGG]
    _compare(rank, world, cases)


def _check_sharded(rank, world, wrapper):
    cases = [("vanilla", "token-mean", t, TIS_GEO_RS, ENTROPY_KL, 0) for t in (0.8, PER_SEQUENCE_T)]
    cases += [("vanilla", "seq-mean-token-sum", 1.0, SEQ_MIS, {}, 0)]
    _compare(rank, world, cases, wrapper=wrapper)


@pytest.mark.parametrize("wrapper", ["fsdp1", "fsdp2"])
def test_routes_match_verl_with_the_model_sharded_as_verl_shards_it(wrapper):
    """Two gloo ranks, the model wrapped by verl's own FSDP functions (FSDP2: the untied LM head is its own
    unit). The linear route's loss runs inside the LM head's call, so FSDP gathers the head before it and
    before its backward and reduces the head's gradient after; every gradient (the reduced shards,
    gathered to compare) equals verl's own path's."""
    spawn(2, _check_sharded, wrapper)


def test_logits_route_matches_verl_over_the_option_product():
    spawn(1, _check_product)


def test_logits_route_matches_verl_on_two_data_parallel_ranks():
    """Each rank holds half the sequences; verl all-reduces the token count and sets dp_size = 2."""
    spawn(2, _check_data_parallel)


def _check_everything_rejected(rank, world):
    """A rejection that removes every token: verl's token-mean divides 0 by a global count of 0 (NaN); the
    route's loss is 0 with zero gradients (docs/spec.md)."""
    model = example.tiny_model()
    engine = example.cpu_engine(model)
    fields = _corrected(_batch(model, 0.8, seed=0, rows=slice(None)),
                        {"rollout_rs": "seq_mean_k1", "rollout_rs_threshold": "0.9999999_1.0000001"})
    assert not fields["response_mask"].any()
    results = []
    for mode, loss_fn in (("vanilla", rlk_verl.verl_ppo_loss), ("rlkernels_logits", rlk_verl.ppo_loss)):
        actor = FSDPActorConfig(strategy="fsdp", rollout_n=1, ppo_mini_batch_size=B,
                                ppo_micro_batch_size_per_gpu=B // 2, policy_loss=VerlPolicyLossConfig(loss_mode=mode))
        td = example.actor_batch(fields, 0.8, False, global_batch_size=B, micro_batch_size=B // 2)
        results.append(_run(engine, td, partial(loss_fn, config=actor)))
    (verl_loss, _, _), (loss, grads, _) = results
    assert verl_loss != verl_loss, verl_loss  # NaN
    assert loss == 0.0 and not grads.any(), (loss, float(grads.abs().max()))


def test_a_fully_rejected_mini_batch_gives_zero_loss_and_gradient():
    spawn(1, _check_everything_rejected)


def test_unsupported_engine_settings_fall_back_with_a_warning_naming_the_setting():
    """use_fused_kernels (verl's own fused head: no logits) keeps verl's log-prob path: the same loss,
    computed by the registered `rlkernels_logits` loss, and one warning saying why."""
    rlk_routes._warned.clear()
    actor = FSDPActorConfig(strategy="fsdp", rollout_n=1, ppo_mini_batch_size=B, ppo_micro_batch_size_per_gpu=B,
                            policy_loss=VerlPolicyLossConfig(loss_mode="rlkernels_logits"))
    td = TensorDict({}, batch_size=[])
    tu.assign_non_tensor(td, use_fused_kernels=True)
    output = SimpleNamespace(logits=torch.zeros(1, 3, example.VOCAB))
    engine = example.cpu_engine(None)
    assert "use_fused_kernels=True" in rlk_routes._route_blocker(engine, output, td)
    plain = TensorDict({}, batch_size=[])
    assert rlk_routes._route_blocker(engine, output, plain) is None
    tu.assign_non_tensor(plain, return_model_output=True)  # verl's Tinker worker reads every position's log-prob
    assert "return_model_output=True" in rlk_routes._route_blocker(engine, output, plain)

    def distillation_ppo_loss(config, model_output, data, dp_group=None):  # another actor loss bound by verl
        raise AssertionError("not called")
    assert rlk_routes._route_actor_config(partial(rlk_verl.ppo_loss, config=actor)) == (actor, "logits", None)
    _, kind, blocker = rlk_routes._route_actor_config(partial(distillation_ppo_loss, config=actor))
    assert kind == "logits" and "'distillation_ppo_loss'" in blocker
    calls = []
    verl_ppo_loss = verl_losses.ppo_loss
    verl_losses.ppo_loss = lambda *args: calls.append(args) or (torch.zeros(()), {})
    try:
        with pytest.warns(UserWarning, match="use_fused_kernels=True"):
            rlk_verl.ppo_loss(actor, {rlk_routes._BLOCKER: rlk_routes._route_blocker(engine, output, td)}, td)
    finally:
        verl_losses.ppo_loss = verl_ppo_loss
    assert len(calls) == 1 and rlk_routes._BLOCKER not in calls[0][1]


def test_installed_routes_wrap_the_engine_and_leave_verls_actor_loss():
    """install_routes() wraps the engine's three methods; verl's ppo_loss stays verl's: the forward_step hook runs
    the route's actor loss in its place for the routes' loss modes only."""
    assert verl_losses.ppo_loss.__module__ == "verl.workers.utils.losses"
    assert ti.FSDPEngineWithLMHead.prepare_model_outputs is rlk_routes._prepare_model_outputs
    actor = FSDPActorConfig(strategy="fsdp", rollout_n=1, ppo_mini_batch_size=B, ppo_micro_batch_size_per_gpu=B,
                            policy_loss=VerlPolicyLossConfig(loss_mode="rlkernels_linear_cispo"))
    swapped = rlk_routes._route_loss_function(partial(verl_losses.ppo_loss, config=actor))
    assert swapped.func is rlk_verl.ppo_loss and swapped.keywords == {"config": actor}
    plain = partial(verl_losses.ppo_loss, config=FSDPActorConfig(strategy="fsdp", rollout_n=1, ppo_mini_batch_size=B,
                                                                  ppo_micro_batch_size_per_gpu=B))
    assert rlk_routes._route_loss_function(plain) is plain  # verl's own loss mode: verl's function
    from verl.trainer.ppo import core_algos

    for name in ("rlkernels_logits", "rlkernels_logits_cispo", "rlkernels_linear_gspo"):
        assert name in core_algos.POLICY_LOSS_REGISTRY


def _run_example(rank, world):
    calls = []
    route_loss = rlk_routes.linear_decoupled_ppo_loss
    rlk_routes.linear_decoupled_ppo_loss = lambda *args, **kwargs: calls.append(1) or route_loss(*args, **kwargs)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # a fallback to verl's log-probs fails the test
        history = example.main(steps=3)
    assert len(calls) == 3 * 2, calls  # every micro-batch of every step took the linear route
    losses = [loss for loss, _, _ in history]
    assert all(torch.isfinite(torch.tensor(losses))) and len(set(losses)) == 3, losses
    assert all(0 < m["actor/pg_clipfrac"] < 1 for _, m, _ in history)
    assert all(0 < c["rollout_corr/rollout_rs_masked_fraction"] < 1 for _, _, c in history)


def test_the_example_runs_as_written():
    """examples/verl_actor.py, as a user runs it: three actor steps, every micro-batch through the route."""
    spawn(1, _run_example)


def _run_benchmark(rank, world, out):
    from benchmarks import verl_engine

    results = verl_engine.main(["--V", "256", "--sequences", "4", "--prompt", "4", "--response", "6", "--reps", "1",
                                "--json", out])["results"]
    assert set(results) == {"verl", "logits", "linear"} and results["verl"]["vs_verl"] == 1.0
    assert all(r["ms"] > 0 for r in results.values())


def test_the_benchmark_runs_both_paths(tmp_path):
    """benchmarks/verl_engine.py at a tiny size: verl's actor step and the two routes', each timed and
    its peak memory taken (figures not checked: timing is not a unit test)."""
    spawn(1, _run_benchmark, str(tmp_path / "verl_engine.json"))
    assert (tmp_path / "verl_engine.json").exists()


def test_linear_route_leaves_vision_inputs_to_the_models_own_forward(monkeypatch):
    """A vision-language model's inputs (pixel_values, ...) are merged by its own forward before the decoder:
    the linear route, which runs the decoder alone, is not taken, and the reason names the inputs."""
    engine = example.cpu_engine(example.tiny_model())
    actor = FSDPActorConfig(strategy="fsdp", rollout_n=1, ppo_mini_batch_size=B, ppo_micro_batch_size_per_gpu=B,
                            policy_loss=VerlPolicyLossConfig(loss_mode="rlkernels_linear"))
    engine._rlkernels_loss_function = partial(rlk_verl.ppo_loss, config=actor)
    inputs = {"input_ids": torch.zeros(1, 4, dtype=torch.long), "position_ids": torch.arange(4)[None],
              "pixel_values": torch.zeros(1, 3)}
    monkeypatch.setattr(ti.FSDPEngineWithLMHead, "_verl_prepare_model_inputs",
                        lambda self, micro_batch: (dict(inputs), {}))
    td = TensorDict({}, batch_size=[])
    model_inputs, _ = rlk_routes._prepare_model_inputs(engine, td)
    assert "rlkernels_loss" not in model_inputs
    assert "pixel_values" in engine._rlkernels_linear_blocker
    monkeypatch.setattr(ti.FSDPEngineWithLMHead, "_verl_prepare_model_inputs",
                        lambda self, micro_batch: ({k: v for k, v in inputs.items() if k != "pixel_values"},
                                                   {"input_ids_rmpad_rolled": torch.zeros(4, dtype=torch.long)}))
    model_inputs, _ = rlk_routes._prepare_model_inputs(engine, td)
    assert "rlkernels_loss" in model_inputs and engine._rlkernels_linear_blocker is None
