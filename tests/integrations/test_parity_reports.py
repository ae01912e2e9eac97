"""The adapters' opt-in parity report (rlkernels/integrations/parity.py): with RLKERNELS_LOGPROB_PARITY=1 each
adapter reports `logprob_parity/...` of the trainer's log-probs against the engine's in the trainer's metric
channel, and without it reports nothing.

The batches copy the trainer's log-prob into the engine's exactly at every other response token and move the others
by DELTA, so the expected values are known without rlkernels: the match rate is the fraction of copied tokens among
those compared, the mean |difference| DELTA times the rest. Tolerance: "metric" (float64 sums in another order); a
float32 trainer side ("trl.trainer.value") where the trainer's log-probs are float32.
"""

import math

import pytest
import torch

from rlkernels.integrations.parity import PARITY_ENV, parity_requested

from ..cases import F32, F64, approx
from .trainer_imports import trainer_or_skip

DELTA = 0.0625  # a power of two: old + DELTA - old is DELTA exactly for |old| < 4


def _engine_side(trainer_logprobs: torch.Tensor) -> torch.Tensor:
    """The trainer's log-probs with every other token (in memory order) moved by DELTA."""
    moved = torch.zeros(trainer_logprobs.numel(), dtype=torch.bool)
    moved[1::2] = True
    return trainer_logprobs + DELTA * moved.reshape(trainer_logprobs.shape).to(trainer_logprobs.dtype)


def _expected(trainer_logprobs, engine_logprobs, mask):
    same = (trainer_logprobs == engine_logprobs)[mask.bool()]
    return float(same.double().mean()), float((trainer_logprobs - engine_logprobs).abs()[mask.bool()].mean())


def _check(metrics, expected, quantity="metric", dtype=F64):
    match_rate, mean_abs_diff = expected
    assert 0 < match_rate < 1  # the batch compares both kinds of token
    assert float(metrics["logprob_parity/match_rate"]) == approx(match_rate, quantity, dtype)
    assert float(metrics["logprob_parity/mean_abs_diff"]) == approx(mean_abs_diff, quantity, dtype)
    assert "logprob_parity/p[0.1,0.5)/max_abs_diff" in metrics


@pytest.fixture
def report_on(monkeypatch):
    monkeypatch.setenv(PARITY_ENV, "1")
    assert parity_requested()


def _batch(seed=0, B=4, T=7):
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(B, T, generator=g, dtype=torch.float64) * 2 - 0.05
    log_probs = old + 0.1 * torch.randn(B, T, generator=g, dtype=torch.float64)
    mask = torch.rand(B, T, generator=g) < 0.8
    mask[:, 0] = True
    return log_probs, old, _engine_side(old), mask, torch.randn(B, T, generator=g, dtype=torch.float64)


def test_the_switch(monkeypatch):
    monkeypatch.delenv(PARITY_ENV, raising=False)
    assert not parity_requested()
    for value, on in (("1", True), ("true", True), ("0", False), ("", False)):
        monkeypatch.setenv(PARITY_ENV, value)
        assert parity_requested() is on


@pytest.mark.parametrize("on", [True, False])
def test_skyrl(on, monkeypatch):
    sk = trainer_or_skip("skyrl_ppo_utils", "SkyRL 0.4.0")
    from rlkernels.integrations import skyrl as rlk_skyrl

    monkeypatch.setenv(PARITY_ENV, "1" if on else "0")
    lp, old, rollout, mask, adv = _batch(1)
    _, metrics = rlk_skyrl.policy_loss_fn("regular")(lp, old, adv, sk.AlgorithmConfig(), mask, rollout)
    if on:
        _check(metrics, _expected(old, rollout, mask))
    else:
        assert not any(name.startswith("logprob_parity/") for name in metrics)


def test_openrlhf(report_on):
    trainer_or_skip("openrlhf_loss", "OpenRLHF 0.11.2")
    from rlkernels.integrations import openrlhf as rlk_openrlhf

    lp, old, rollout, mask, adv = _batch(2)
    loss_fn = rlk_openrlhf.PolicyLoss(is_correction_level="token", is_correction_mode="clip",
                                      is_correction_threshold=(0.5, 2.0))
    loss_fn(lp, old, adv, action_mask=mask, rollout_log_probs=rollout)
    _check(loss_fn.logprob_parity, _expected(old, rollout, mask))


def test_areal_logs_through_stats_tracker(report_on, monkeypatch):
    trainer_or_skip("areal_functional", "AReaL 1.0.4")
    from areal.utils import stats_tracker

    from rlkernels.integrations import areal as rlk_areal

    logged = {}
    monkeypatch.setattr(stats_tracker, "scalar", lambda **values: logged.update(values))
    lp, prox, behave, mask, adv = _batch(3)
    rlk_areal.ppo_actor_loss_fn(lp, prox, behave, adv, 0.2, mask)
    assert all(isinstance(value, float) for value in logged.values())  # AReaL's scalars are floats
    _check(logged, _expected(prox, behave, mask))


def test_torchtitan_sums_over_the_denominator(report_on):
    trainer_or_skip("torchtitan_rl", "torchtitan 0.3.0")
    from rlkernels.integrations import torchtitan as rlk_titan

    g = torch.Generator().manual_seed(4)
    logits = torch.randn(3, 6, 19, generator=g)
    labels = torch.randint(0, 19, (3, 6), generator=g)
    mask = torch.rand(3, 6, generator=g) < 0.8
    exact = torch.log_softmax(logits.double(), -1).gather(-1, labels[..., None])[..., 0]
    generator = (exact + DELTA).float()  # no token equal: the loss's float32 log-probs are off by DELTA
    _, metrics = rlk_titan.GRPOLoss.Config().build()(logits, labels, 2 * int(mask.sum()), generator_logprobs=generator,
                                                     advantages=torch.randn(3, 6, generator=g), loss_mask=mask)
    # TorchTitan sums metrics across ranks: each is a sum over the global token count (here twice the local one)
    assert float(metrics["logprob_parity/match_rate"]) == 0.0
    assert float(metrics["logprob_parity/mean_abs_diff"]) == approx(DELTA / 2, "torchtitan", F32)
    assert not any("/p[" in name for name in metrics)  # bucket values do not sum across ranks


def test_prime_rl(report_on):
    from rlkernels.integrations import prime_rl as rlk_prime

    from .transcribed import prime_rl as prime

    lp, _, _, mask, adv = _batch(5, B=1)
    trainer, engine, mask = lp[0], _engine_side(lp[0]), mask[0]
    out = rlk_prime.default_loss_fn(prime.LossInputs(trainer, engine, None, adv[0], mask, None))
    _check(out.metrics, _expected(trainer, engine, mask))


def test_slime(report_on):
    from rlkernels.integrations import slime as rlk_slime

    from .test_slime import _batch as slime_batch
    from .transcribed import slime

    logits, batch = slime_batch(6)
    batch["rollout_log_probs"] = [_engine_side(old) for old in batch["log_probs"]]
    args = slime.default_args()
    _, log = rlk_slime.policy_loss_function(args, batch, logits)
    _check(log, _expected(torch.cat(batch["log_probs"]), torch.cat(batch["rollout_log_probs"]),
                          torch.cat(batch["loss_masks"])))


def test_nemo_rl(report_on):
    from rlkernels.integrations import nemo_rl as rlk_nemo

    from .test_nemo_rl import _batch as nemo_batch

    _, lp, data = nemo_batch(7)
    data["generation_logprobs"] = _engine_side(data["prev_logprobs"])
    _, metrics = rlk_nemo.ClippedPGLossFn({})(data, 4.0, float(data["token_mask"].sum()), next_token_logprobs=lp)
    mask = data["token_mask"][:, 1:].bool() & data["sample_mask"].bool()[:, None]
    _check(metrics, _expected(data["prev_logprobs"][:, 1:], data["generation_logprobs"][:, 1:], mask))


def test_verl_driver_correction(report_on):
    from ..verl_import import import_verl_or_skip

    import_verl_or_skip()
    from verl.protocol import DataProto

    import rlkernels.integrations.verl as rlk_verl

    _, old, rollout, mask, _ = _batch(8)
    batch = DataProto.from_dict(tensors={"old_log_probs": old, "rollout_log_probs": rollout,
                                         "response_mask": mask.long()})
    _, metrics = rlk_verl.compute_rollout_correction_and_add_to_batch(batch, {"rollout_is": "token"})
    _check(metrics, _expected(old, rollout, mask))
    assert math.isfinite(metrics["rollout_corr/rollout_is_mean"])


def test_trl_logs_it_with_trls_metrics(report_on, tmp_path):
    """TRL's vLLM path: the old log-probs against the sampler's, a token vLLM could not score (NaN) left out."""
    from . import test_trl_trainer as trl_tests

    tok = trl_tests._tokenizer()
    model = trl_tests._model(tok)
    args = trl_tests._args(tmp_path, loss_type="grpo")
    with trl_tests.warnings.catch_warnings():
        trl_tests.warnings.simplefilter("ignore")
        trainer = trl_tests.GRPOTrainer(model=model, reward_funcs=trl_tests._reward, args=args,
                                        train_dataset=trl_tests._dataset(), processing_class=tok)
    args.use_vllm = args.vllm_importance_sampling_correction = True
    trainer.use_vllm = trainer.vllm_importance_sampling_correction = True
    trainer.current_gradient_accumulation_steps = args.gradient_accumulation_steps
    inputs = trl_tests._batch(tok, model, 0.0, "token_truncate")
    old = inputs["old_per_token_logps"].double()
    sampling = _engine_side(old).float()
    inputs["old_per_token_logps"] = old.float()
    sampling[0, 1] = float("nan")
    inputs["sampling_per_token_logps"] = sampling
    model.train()
    trainer._compute_loss(model, inputs)
    logged = {name: values[-1] for name, values in trainer._metrics["train"].items()}
    scored = inputs["completion_mask"].bool() & ~torch.isnan(sampling)
    _check(logged, _expected(old.float(), sampling, scored), "trl.trainer.value", F32)
