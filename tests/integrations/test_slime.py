"""slime (624b824a): the custom loss, dispatched as slime dispatches `--loss-type custom_loss` (its `loss_function`,
Megatron rescaling included), against slime's own `policy_loss_function` on packed logits.

slime and Megatron are not on the package index, so slime's functions are float64 TRANSCRIPTIONS of its source at
that commit (tests/integrations/transcribed/slime.py), not its installed code; slime itself asserts float32 logits
and would agree to float32's rounding only. In float64 both take the same log-softmax of the same rows: values and
gradients agree to 1e-9 relative (two log-softmax implementations, a sum of per-sample means). Statistics within
1e-6 of a threshold are redrawn.
"""

import itertools
import random

import pytest
import torch

from rlkernels.integrations import slime as rlk_slime

from ..cases import F64, assert_close, tol
from .transcribed import slime

V = 29


def _batch(seed, n_samples=4):
    g = torch.Generator().manual_seed(seed)
    tokens, totals, responses, masks, adv, old, rollout, ref = [], [], [], [], [], [], [], []
    for _ in range(n_samples):
        prompt = int(torch.randint(1, 5, (1,), generator=g))
        response = int(torch.randint(1, 8, (1,), generator=g))
        tokens.append(torch.randint(0, V, (prompt + response,), generator=g))
        totals.append(prompt + response)
        responses.append(response)
        mask = (torch.rand(response, generator=g) > 0.2).to(torch.int64)
        masks.append(mask)
        adv.append(torch.randn(1, generator=g, dtype=torch.float64).expand(response).clone())
        old.append(-torch.rand(response, generator=g, dtype=torch.float64) * 3)
        rollout.append(old[-1] + 0.2 * torch.randn(response, generator=g, dtype=torch.float64))
        ref.append(old[-1] + 0.3 * torch.randn(response, generator=g, dtype=torch.float64))
    logits = torch.randn(1, sum(totals), V, generator=g, dtype=torch.float64) * 2
    batch = {"unconcat_tokens": tokens, "total_lengths": totals, "response_lengths": responses, "loss_masks": masks,
             "advantages": adv, "log_probs": old, "rollout_log_probs": rollout, "ref_log_probs": ref,
             "rollout_mask_sums": [m.sum().to(torch.float32) for m in masks]}
    return logits, batch


ARGS = [dict(),
        dict(eps_clip=0.1, eps_clip_high=0.28, eps_clip_c=3.0),
        dict(use_tis=True, tis_clip=1.5, tis_clip_low=0.5),
        dict(use_tis=True, tis_clip=1.3, tis_clip_low=0.8, custom_tis_function_path=slime.icepop_function),
        dict(use_rollout_logprobs=True, eps_clip_c=2.0),
        dict(advantage_estimator="cispo", eps_clip=0.2, eps_clip_high=0.5),
        dict(advantage_estimator="gspo", eps_clip=3e-4, eps_clip_high=4e-4),
        dict(use_kl_loss=True, kl_loss_coef=0.1, kl_loss_type="k1"),
        dict(use_kl_loss=True, kl_loss_coef=0.1, kl_loss_type="k3", use_unbiased_kl=True),
        dict(use_kl_loss=True, kl_loss_coef=0.1, kl_loss_type="low_var_kl"),
        dict(use_kl_loss=True, kl_loss_coef=0.05, kl_loss_type="k3", entropy_coef=0.01),
        dict(use_kl_loss=True, kl_loss_coef=0.05, kl_loss_type="k2"),
        dict(entropy_coef=0.01, rollout_temperature=0.7),
        dict(use_opsm=True, opsm_delta=0.05),
        dict(calculate_per_token_loss=True, use_tis=True, tis_clip=2.0)]
CASES = list(itertools.product(range(len(ARGS)), range(2)))


@pytest.mark.parametrize("case, seed", CASES)
def test_matches_slimes_own_policy_loss(case, seed):
    rng = random.Random(f"{case}-{seed}")
    over = dict(ARGS[case])
    if rng.random() < 0.3 and "rollout_temperature" not in over:
        over["rollout_temperature"] = 0.9
    logits, batch = _batch(seed * 10 + case)
    if over.get("use_rollout_logprobs") or rng.random() < 0.2:
        batch["log_probs"] = [] if not over.get("use_tis") else batch["log_probs"]

    def run(args):
        x = logits.clone().requires_grad_(True)
        loss, _, report = slime.loss_function(args, batch, num_microbatches=2, step_global_batch_size=8, logits=x)
        return loss.detach(), torch.autograd.grad(loss, x)[0], dict(zip(report["keys"], report["values"][1:]))

    theirs = run(slime.default_args(**over))
    ours = run(slime.default_args(**over, loss_type="custom_loss",
                                  custom_loss_function_path=rlk_slime.policy_loss_function))
    assert_close(ours[0], theirs[0], **tol("transcribed", F64), name="loss")
    assert_close(ours[1], theirs[1], **tol("transcribed", F64, scale=max(1.0, float(theirs[1].abs().max()))),
                 name="dlogits")
    for key in ("pg_loss", "entropy_loss", "ppo_kl") + (("kl_loss",) if over.get("use_kl_loss") else ()):
        assert_close(ours[2][key], theirs[2][key], **tol("transcribed", F64), name=key)
    # slime counts its clipped tokens in float32 (`.float()`) and divides by float32 totals
    assert_close(ours[2]["pg_clipfrac"], theirs[2]["pg_clipfrac"].to(torch.float64), **tol("metric", torch.float32),
                 name="pg_clipfrac")


def test_refusals_name_slimes_option():
    logits, batch = _batch(3)
    batch["rollout_mask_sums"] = [torch.tensor(99.0)] * len(batch["loss_masks"])  # a rollout of several samples
    with pytest.raises(ValueError, match="rollout_mask_sums"):
        rlk_slime.policy_loss_function(slime.default_args(), batch, logits, None)
    with pytest.raises(ValueError, match="use_opsm"):
        rlk_slime.config_from_slime(slime.default_args(use_opsm=True, use_tis=True))
    with pytest.raises(ValueError, match="use_unbiased_kl"):
        rlk_slime.config_from_slime(slime.default_args(use_kl_loss=True, kl_loss_coef=0.1, kl_loss_type="low_var_kl",
                                                       use_unbiased_kl=True))
    with pytest.raises(ValueError, match="rollout_top_p"):
        rlk_slime.config_from_slime(slime.default_args(rollout_top_p=0.9))


@pytest.mark.parametrize("temperature, entropy_coef", [(1.0, 0.0), (0.8, 0.01)])
def test_log_prob_route_matches_slimes_get_log_probs_and_entropy(temperature, entropy_coef):
    """The old / ref log-prob passes: rlkernels' `get_log_probs_and_entropy` against slime's (transcribed: a new
    tensor divided by the temperature, its fused vocab-parallel function over every row), per-sample log-probs and
    entropy, and the gradient of both to the packed logits. Float64 logits: the transcription's tolerance."""
    logits, batch = _batch(21)
    args = slime.default_args(rollout_temperature=temperature, entropy_coef=entropy_coef)
    kw = dict(args=args, unconcat_tokens=batch["unconcat_tokens"], total_lengths=batch["total_lengths"],
              response_lengths=batch["response_lengths"], with_entropy=True)
    results = []
    for fn in (slime.get_log_probs_and_entropy, rlk_slime.get_log_probs_and_entropy):
        x = logits.clone().requires_grad_(True)
        empty, res = fn(x, **kw)
        assert empty.numel() == 0 and len(res["log_probs"]) == len(batch["response_lengths"])
        lp, ent = torch.cat(res["log_probs"]), torch.cat(res["entropy"])
        assert ent.requires_grad == (entropy_coef != 0)
        objective = lp.sum() + (ent.sum() if ent.requires_grad else 0.0)
        results.append((lp.detach(), ent.detach(), torch.autograd.grad(objective, x)[0]))
    theirs, ours = results
    for i, name in enumerate(("log_probs", "entropy", "dlogits")):
        assert_close(ours[i], theirs[i], **tol("transcribed", F64), name=name)


def test_install_rebinds_slimes_log_prob_function(tmp_path, monkeypatch):
    """install() (slime's --custom-megatron-init-path hook, called with slime's args) before slime's modules are
    imported: they bind rlkernels' function when they are; uninstall() restores slime's. slime does not install
    here: a package on disk under slime's module names, laid out as slime's (the loss module defines the function,
    here the transcription's; the actor module imports it from there), imported through the import system."""
    import sys

    root = tmp_path / "slime" / "backends" / "megatron_utils"
    root.mkdir(parents=True)
    for package in (tmp_path / "slime", tmp_path / "slime" / "backends", root):
        (package / "__init__.py").write_text("")
    (root / "loss.py").write_text("from tests.integrations.transcribed.slime import get_log_probs_and_entropy\n")
    (root / "actor.py").write_text("from .loss import get_log_probs_and_entropy\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        rlk_slime.install(slime.default_args())
        from slime.backends.megatron_utils import actor, loss

        assert loss.get_log_probs_and_entropy is rlk_slime.get_log_probs_and_entropy
        assert actor.get_log_probs_and_entropy is rlk_slime.get_log_probs_and_entropy
        rlk_slime.uninstall()
        assert loss.get_log_probs_and_entropy is actor.get_log_probs_and_entropy is slime.get_log_probs_and_entropy
    finally:
        rlk_slime.uninstall()
        for name in [m for m in sys.modules if m == "slime" or m.startswith("slime.")]:
            del sys.modules[name]


def test_top_p_replay_calls_go_to_slimes_own_function():
    """slime passes top_p_token_ids / top_p_token_offsets with --rollout-top-p < 1: the route hands such a call to
    the function it replaced, and without one refuses it by name."""
    import types

    logits, batch = _batch(22)
    kw = dict(args=slime.default_args(), unconcat_tokens=batch["unconcat_tokens"],
              total_lengths=batch["total_lengths"], response_lengths=batch["response_lengths"])
    with pytest.raises(ValueError, match="^rollout_top_p"):
        rlk_slime.get_log_probs_and_entropy(logits, top_p_token_ids=torch.zeros(1), top_p_token_offsets=None, **kw)
    calls = []

    def slimes_own(logits, **kwargs):
        calls.append(sorted(kwargs))
        return torch.empty(0), {}

    module = types.ModuleType("slime.backends.megatron_utils.loss")
    module.get_log_probs_and_entropy = slimes_own
    rlk_slime._LOG_PROBS.patch(module)
    try:
        rlk_slime.get_log_probs_and_entropy(logits, top_p_token_ids=torch.zeros(1), top_p_token_offsets=None, **kw)
        assert calls and "top_p_token_ids" in calls[0]
        _, res = rlk_slime.get_log_probs_and_entropy(logits, top_p_token_ids=None, top_p_token_offsets=None, **kw)
        assert len(calls) == 1 and len(res["log_probs"]) == len(batch["response_lengths"])  # no top-p: the route
    finally:
        rlk_slime.uninstall()
    assert module.get_log_probs_and_entropy is slimes_own
