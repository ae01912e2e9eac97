"""Σπ² for verl's optimal token baseline through the plugin's routes: verl 0.9.1's π_old forward
(`engine.infer_batch(..., loss_function=None)` with `calculate_sum_pi_squared=True`, as verl's
`compute_log_prob` calls it) on verl's own engine code on CPU, around the tiny Qwen2 of examples/verl_actor.py.

On a run that takes a route (declared by RLKERNELS_VERL_ROUTES=linear|logits, or seen in one of the engine's
training micro-batches), the pass's log-probs, entropy and sum_pi_squared come from rlkernels' fused vocabulary
pass: from the logits (logits route), or from the last hidden states and the LM head without forming the logits
(linear route: also where verl's own fused kernels raise for Σπ²). They equal verl's unfused values
(`calculate_sum_pi_squared_from_logits` on the temperature-scaled logits) in float32 to 1e-5: both are O(1)
quantities over a 96-token vocabulary, a few float32 roundings apart (~1e-7 observed); the log-probs reach ~-6
(TOL "verl.sum_pi_squared").
"""

import os
from collections import Counter

import pytest
import torch

from rlkernels.testing.spawn import spawn

from ..cases import F32, assert_close, tol
from ..verl_import import import_verl_or_skip

import_verl_or_skip()
try:
    from verl.workers.engine.fsdp import transformer_impl  # noqa: E402,F401
except ImportError as exc:  # pragma: no cover - reported by the skip
    pytest.skip(f"verl's FSDP engine does not import here ({exc}); the peers extra installs what it imports",
                allow_module_level=True)
from verl.utils import tensordict_utils as tu  # noqa: E402

from rlkernels.integrations import verl as rlk_verl  # noqa: E402
from rlkernels.integrations.verl import routes as rlk_routes  # noqa: E402
from rlkernels.testing.peers import load_example  # noqa: E402

example = load_example("verl_actor.py")
rlk_verl.install_routes()
B = 8
PER_SEQUENCE_T = torch.linspace(0.7, 1.2, B)
LIBRARY = ("token_logprobs", "linear_token_logprobs")  # the plugin's vocabulary passes, counted per call


def _infer(engine, fields, temperature, entropy, fused=False):
    td = example.actor_batch(fields, temperature, entropy, global_batch_size=B, micro_batch_size=B // 2)
    tu.assign_non_tensor(td, calculate_sum_pi_squared=True, use_fused_kernels=fused)
    out = engine.infer_batch(td, loss_function=None)["model_output"]
    return {k: (v.values() if v.is_nested else v) for k, v in out.items()}


def _instrument(model):
    """Counts of the plugin's library calls, and the widths of the LM head's tensor outputs (the logits)."""
    calls, head_widths = Counter(), []
    for name in LIBRARY:
        fn = getattr(rlk_routes, name)

        def counted(*args, _fn=fn, _name=name, **kwargs):
            calls[_name] += 1
            return _fn(*args, **kwargs)
        setattr(rlk_routes, name, counted)
    model.lm_head.register_forward_hook(
        lambda module, args, out: head_widths.append(out.shape[-1]) if torch.is_tensor(out) else None)
    return calls, head_widths


def _scale(want: torch.Tensor) -> float:
    return max(1.0, float(want.abs().max()))


def _check_routes(rank, world):
    model = example.tiny_model()
    calls, head_widths = _instrument(model)
    engine = example.cpu_engine(model)
    for i, (temperature, entropy) in enumerate([(0.8, True), (1.0, False), (PER_SEQUENCE_T, True)]):
        fields = example.rollout_batch(model, temperature, seed=i)
        engine._rlkernels_route_kind = None  # no route seen: verl's own path
        before = dict(calls)
        want = _infer(engine, fields, temperature, entropy)
        assert dict(calls) == before, "verl's own path ran the library"
        assert set(want) == {"log_probs", "sum_pi_squared"} | ({"entropy"} if entropy else set())
        for kind, name in (("logits", "token_logprobs"), ("linear", "linear_token_logprobs")):
            engine._rlkernels_route_kind = kind  # as forward_step records it from a route's training micro-batch
            head_widths.clear()
            before = Counter(calls)
            got = _infer(engine, fields, temperature, entropy)
            assert calls - before == Counter({name: 2}), (kind, calls - before)  # one per micro-batch
            if kind == "linear":
                assert head_widths == [], f"the linear route formed logits of widths {head_widths}"
            assert set(got) == set(want), (kind, set(got))
            for key in want:
                assert_close(got[key], want[key], **tol("verl.sum_pi_squared", F32, scale=_scale(want[key])),
                             name=f"{kind} {temperature} {key}")


def test_the_routes_give_verls_sum_pi_squared_log_probs_and_entropy():
    """Scalar and per-sequence temperatures, entropy on and off, two micro-batches; the library's pass runs
    once per micro-batch, and the linear route's LM head returns no logits."""
    spawn(1, _check_routes)


def _check_fused_kernels(rank, world):
    model = example.tiny_model()
    engine = example.cpu_engine(model)
    fields = example.rollout_batch(model, 0.8, seed=3)
    want = _infer(engine, fields, 0.8, True)  # verl's unfused path, fused kernels off
    with pytest.raises(NotImplementedError, match="fused kernels"):
        _infer(engine, fields, 0.8, True, fused=True)  # verl's own answer with its fused LM head
    engine._rlkernels_route_kind = "logits"  # the logits route needs the logits verl's fused head never forms
    with pytest.raises(NotImplementedError, match="fused kernels"):
        _infer(engine, fields, 0.8, True, fused=True)
    engine._rlkernels_route_kind = "linear"
    got = _infer(engine, fields, 0.8, True, fused=True)
    for key in want:
        assert_close(got[key], want[key], **tol("verl.sum_pi_squared", F32, scale=_scale(want[key])), name=key)


def test_the_linear_route_gives_sum_pi_squared_where_verls_fused_kernels_raise():
    spawn(1, _check_fused_kernels)


def _check_declared(rank, world, declared):
    """A fresh engine (no training micro-batch seen) in a worker whose environment declares the route."""
    os.environ[rlk_verl.ROUTES_ENV] = declared
    model = example.tiny_model()
    calls, _ = _instrument(model)
    engine = example.cpu_engine(model)
    _infer(engine, example.rollout_batch(model, 0.8, seed=4), 0.8, True)
    expected = {"1": Counter(), "logits": Counter(token_logprobs=2), "linear": Counter(linear_token_logprobs=2)}
    assert calls == expected[declared], (declared, calls)


@pytest.mark.parametrize("declared", ["1", "logits", "linear"])
def test_the_first_log_prob_pass_takes_the_declared_route(declared):
    """verl's trainer runs the π_old forward before the first update: only the declared route (linear / logits)
    reaches it; "1" installs the routes without naming one, and the pass stays verl's until a route's training
    micro-batch has run."""
    spawn(1, _check_declared, declared)


def _check_training_step_records_the_route(rank, world):
    from functools import partial

    from verl.workers.config import FSDPActorConfig
    from verl.workers.config.actor import PolicyLossConfig
    from verl.workers.utils import losses as verl_losses

    model = example.tiny_model()
    calls, _ = _instrument(model)
    engine = example.cpu_engine(model)
    fields = example.rollout_batch(model, 0.8, seed=5)
    actor = FSDPActorConfig(strategy="fsdp", rollout_n=1, ppo_mini_batch_size=B, ppo_micro_batch_size_per_gpu=B // 2,
                            policy_loss=PolicyLossConfig(loss_mode="rlkernels_linear"))
    td = example.actor_batch(fields, 0.8, False, global_batch_size=B, micro_batch_size=B // 2)
    engine.forward_backward_batch(td, loss_function=partial(verl_losses.ppo_loss, config=actor), forward_only=False)
    _infer(engine, fields, 0.8, False)
    assert calls == Counter(linear_token_logprobs=2), calls  # the training step runs the linear loss, not these


def test_a_routes_training_step_sends_later_log_prob_passes_down_the_route():
    spawn(1, _check_training_step_records_the_route)
