"""AReaL 1.0.4: the adapter's `ppo_actor_loss_fn` against AReaL's own on seeded batches over every option its
rejection sampling and loss take, and installed under AReaL's own `grpo_loss_fn` (compiled from AReaL's source
text: its module imports AReaL's whole training stack, which does not install here).

Tolerance: AReaL computes its rejection statistics and behaviour weights in float32 (`.float()`), whatever the
inputs' dtype, and multiplies the float64 loss by them: values and gradients agree to 1e-6 relative. Statistics
within 1e-4 of a bound are redrawn, so that float32 rounding cannot flip a rejection.
"""

import ast
import itertools
import math
import os
import random
import types

import pytest
import torch

from rlkernels.integrations import areal as rlk_areal

from ..cases import F64, assert_close, tol
from .trainer_imports import trainer_or_skip

AR = trainer_or_skip("areal_functional", "AReaL 1.0.4")
F = AR.functional
RS = AR.RejectionSamplingConfig

# (level, action, metric, agg, lower, upper); the refused ones are in test_refusals_name_areals_option
REJECTIONS = [None,
              ("token", "mask", "ratio", "mean", 0.7, 1.3), ("token", "mask", "ratio", "mean", None, 1.5),
              ("token", "clamp", "ratio", "mean", 0.8, 1.25), ("token", "clamp", "ratio", "mean", None, 1.2),
              ("sequence", "mask", "ratio", "mean", 0.9, 1.1), ("sequence", "mask", "ratio", "sum", 0.5, 2.0),
              ("sequence", "clamp", "ratio", "mean", 0.95, 1.05),
              ("token", "mask", "kl_k1", "mean", -0.3, 0.3), ("sequence", "mask", "kl_k1", "sum", None, 0.5),
              ("sequence", "mask", "kl_k1", "mean", -0.1, 0.1),
              ("token", "mask", "kl_k2", "mean", None, 0.03), ("sequence", "mask", "kl_k2", "sum", None, 0.2),
              ("sequence", "mask", "kl_k2", "mean", None, 0.02), ("sequence", "mask", "kl_k2", "max", None, 0.05),
              ("token", "mask", "kl_k3", "mean", None, 0.02), ("token", "mask", "kl_k3", "mean", -1.0, 0.05),
              ("sequence", "mask", "kl_k3", "max", None, 0.04)]


def _batch(seed, packed):
    g = torch.Generator().manual_seed(seed)
    B, T = 6, 9
    prox = -torch.rand(B, T, generator=g, dtype=torch.float64) * 2.5
    logprobs = prox + 0.15 * torch.randn(B, T, generator=g, dtype=torch.float64)
    behave = prox + 0.25 * torch.randn(B, T, generator=g, dtype=torch.float64)
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    mask = torch.arange(T)[None, :] < lengths[:, None]
    advantages = torch.randn(B, T, generator=g, dtype=torch.float64)  # per token: GSPO averages them
    if not packed:
        return logprobs, prox, behave, mask, advantages, None
    keep = mask.reshape(-1)  # packed: each sequence's tokens, concatenated
    cu = torch.zeros(B + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(lengths, 0)
    return (logprobs.reshape(-1)[keep], prox.reshape(-1)[keep], behave.reshape(-1)[keep],
            torch.ones(int(keep.sum()), dtype=torch.bool), advantages.reshape(-1)[keep], cu)


def _statistics(prox, behave, mask, cu):
    """Every statistic a rejection may compare (token log-ratios and k2; sequence sums, means, maxima)."""
    d = (prox - behave)
    if cu is not None:
        rows = [d[int(a):int(b)] for a, b in zip(cu[:-1], cu[1:])]
    else:
        rows = [d[i][mask[i]] for i in range(d.shape[0])]
    values = [d[mask], 0.5 * d[mask] ** 2, torch.exp(-d[mask]) - 1 + d[mask]]  # AReaL's k3: exp(-d) - 1 + d
    for r in rows:
        k2, k3 = 0.5 * r ** 2, torch.exp(-r) - 1 + r
        values.append(torch.stack([r.sum(), r.mean(), k2.sum(), k2.mean(), k2.max(), k3.max()]))
    return torch.cat(values)


def _clear(prox, behave, mask, cu, rejection) -> bool:
    if rejection is None:
        return True
    _, _, metric, _, lower, upper = rejection
    bounds = [b for b in (lower, upper) if b is not None]
    if metric == "ratio":
        bounds = [math.log(b) for b in bounds]
    values = _statistics(prox, behave, mask, cu)
    return all(bool(((values - b).abs() > 1e-4).all()) for b in bounds)


CASES = list(itertools.product(range(len(REJECTIONS)), ["token", "sequence"], [False, True], range(2)))


@pytest.mark.parametrize("rejection, is_level, packed, draw", CASES)
def test_matches_areals_own_loss(rejection, is_level, packed, draw):
    spec = REJECTIONS[rejection]
    rng = random.Random(f"{rejection}-{is_level}-{packed}-{draw}")
    seed = rejection * 10 + draw
    while True:
        logprobs, prox, behave, mask, adv, cu = _batch(seed, packed)
        if _clear(prox, behave, mask, cu, spec):
            break
        seed += 1000
    kw = dict(eps_clip=rng.choice([0.2, 0.1]), eps_clip_higher=rng.choice([None, 0.28]),
              c_clip=rng.choice([None, 3.0]), importance_sampling_level=is_level, cu_seqlens=cu,
              rejection_sampling=None if spec is None else RS(level=spec[0], action=spec[1], metric=spec[2],
                                                              agg=spec[3], lower=spec[4], upper=spec[5]))

    def run(fn):
        lp = logprobs.clone().requires_grad_(True)
        loss, stat = fn(logprobs=lp, proximal_logprobs=prox, old_logprobs=behave, advantages=adv, loss_mask=mask, **kw)
        (grad,) = torch.autograd.grad(loss, lp)
        return loss.detach(), grad, stat

    theirs, ours = run(F.ppo_actor_loss_fn), run(rlk_areal.ppo_actor_loss_fn)
    scale = max(1.0, float(theirs[0].abs()))
    assert_close(ours[0], theirs[0], **tol("areal", F64, scale=scale), name="loss")
    assert_close(ours[1], theirs[1], **tol("areal", F64, scale=max(1e-3, float(theirs[1].abs().max()))), name="dlogp")
    for key in ("clip_mask", "dual_clip_mask") + (("behave_mask",) if spec is not None else ()):
        assert torch.equal(ours[2][key], theirs[2][key].bool()), key
    for key in ("importance_weight", "loss") + (("behave_imp_weight",) if spec is not None else ()):
        assert_close(ours[2][key].to(torch.float64), theirs[2][key].to(torch.float64), **tol("areal", F64),
                     name=key)


def _grpo_loss_fn_from_areals_source(ppo_actor_loss_fn, recorded):
    """AReaL's own `grpo_loss_fn` (and `_resolve_proximal_logp`) compiled from areal/trainer/ppo/actor.py into a
    module whose globals hold the names it reads; `stats_tracker` records what it logs."""
    import areal

    path = os.path.join(os.path.dirname(areal.__file__), "trainer", "ppo", "actor.py")
    tree = ast.parse(open(path).read())
    wanted = {"grpo_loss_fn", "_resolve_proximal_logp", "_log_proximal_approximation_stats"}
    nodes = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name in wanted]
    module = types.ModuleType("areal_actor_from_source")
    import contextlib

    tracker = types.SimpleNamespace(denominator=lambda **kw: recorded.update(kw), stat=lambda **kw: recorded.update(kw),
                                    scalar=lambda **kw: recorded.update(kw),
                                    scope=lambda name: contextlib.nullcontext())
    constants = {k: v for k, v in vars(__import__("areal.utils.constants", fromlist=["x"])).items()
                 if k.startswith("PROX_")}
    module.__dict__.update(torch=torch, RejectionSamplingConfig=RS, ppo_actor_loss_fn=ppo_actor_loss_fn,
                           sapo_loss_fn=F.sapo_loss_fn, stats_tracker=tracker,
                           infer_token_denominator=lambda data, mask: mask, logger=types.SimpleNamespace(
                               warning=lambda *a, **k: None, info=lambda *a, **k: None), **constants)
    exec(compile(ast.Module(body=nodes, type_ignores=[]), path, "exec"), module.__dict__)
    return module


def test_installed_under_areals_grpo_loss_fn():
    logprobs, prox, behave, mask, adv, _ = _batch(3, packed=False)
    recorded_theirs, recorded_ours = {}, {}
    theirs_module = _grpo_loss_fn_from_areals_source(F.ppo_actor_loss_fn, recorded_theirs)
    ours_module = _grpo_loss_fn_from_areals_source(F.ppo_actor_loss_fn, recorded_ours)
    rlk_areal.install(ours_module)
    assert ours_module.ppo_actor_loss_fn is rlk_areal.ppo_actor_loss_fn
    data = {"logprobs": behave, "advantages": adv, "loss_mask": mask, "prox_logp": prox}
    rs = RS(level="sequence", action="mask", metric="ratio", agg="mean", lower=0.8, upper=1.25)
    results = []
    for module in (theirs_module, ours_module):
        lp = logprobs.clone().requires_grad_(True)
        loss = module.grpo_loss_fn(lp, torch.zeros_like(lp), data, eps_clip=0.2, eps_clip_higher=0.28, c_clip=3.0,
                                   rejection_sampling=rs, use_decoupled_loss=True)
        results.append((loss.detach(), torch.autograd.grad(loss, lp)[0]))
    rlk_areal.uninstall()
    assert ours_module.ppo_actor_loss_fn is F.ppo_actor_loss_fn
    assert_close(results[1][0], results[0][0], **tol("areal", F64), name="loss")
    assert_close(results[1][1], results[0][1], **tol("areal", F64), name="dlogp")
    assert set(recorded_ours) == set(recorded_theirs)  # every statistic AReaL logs is there


@pytest.mark.parametrize("spec, match", [
    (dict(level="sequence", metric="kl_k3", agg="mean", upper=0.1),
     r"^rejection_sampling.agg='mean' with metric='kl_k3'"),
    (dict(metric="kl_k3", lower=0.01, upper=0.1), r"^rejection_sampling: kl_k3 with .*lower=0.01"),
    (dict(metric="kl_k3", upper=25.0), r"^rejection_sampling.upper=25.0 with metric='kl_k3'"),
    (dict(level="sequence", metric="ratio", agg="max", upper=2.0), "agg='max'"),
    (dict(action="clamp", metric="kl_k2", upper=0.1), "clamp"),
    (dict(level="sequence", action="clamp", metric="ratio", agg="sum", upper=2.0), "clamp"),
])
def test_refusals_name_areals_option(spec, match):
    with pytest.raises(ValueError, match=match):
        rlk_areal.rollout_correction_from_areal(RS(**spec))


def test_packed_token_level_ignores_cu_seqlens_as_areal_does():
    """A context-parallel rank's packed tokens: cu_seqlens end before its token count. AReaL's token-level loss (and
    token-level rejection) never reads them; neither does the adapter."""
    logprobs, prox, behave, mask, adv, cu = _batch(11, packed=True)
    short = cu[:-2]  # the last sequences' tokens are past the end
    rs = RS(level="token", action="mask", metric="ratio", lower=0.7, upper=1.3)
    results = []
    for fn in (F.ppo_actor_loss_fn, rlk_areal.ppo_actor_loss_fn):
        lp = logprobs.clone().requires_grad_(True)
        loss, _ = fn(logprobs=lp, proximal_logprobs=prox, old_logprobs=behave, advantages=adv, eps_clip=0.2,
                     loss_mask=mask, rejection_sampling=rs, cu_seqlens=short)
        results.append((loss.detach(), torch.autograd.grad(loss, lp)[0]))
    assert_close(results[1][0], results[0][0], **tol("areal", F64), name="loss")
    assert_close(results[1][1], results[0][1], **tol("areal", F64), name="dlogp")


@pytest.mark.parametrize("where", ["importance_sampling_level", "rejection_sampling.level"])
def test_packed_sequence_level_names_cu_seqlens(where):
    logprobs, prox, behave, mask, adv, cu = _batch(12, packed=True)
    kw = dict(logprobs=logprobs, proximal_logprobs=prox, old_logprobs=behave, advantages=adv, eps_clip=0.2,
              loss_mask=mask)
    if where == "importance_sampling_level":
        kw["importance_sampling_level"] = "sequence"
    else:
        kw["rejection_sampling"] = RS(level="sequence", action="mask", metric="ratio", lower=0.9, upper=1.1)
    with pytest.raises(ValueError, match=rf"^cu_seqlens: required with packed \(1-D\) input and {where}="):
        rlk_areal.ppo_actor_loss_fn(**kw, cu_seqlens=None)
    with pytest.raises(ValueError, match=rf"^cu_seqlens: with {where}='sequence' the sequences must cover"):
        rlk_areal.ppo_actor_loss_fn(**kw, cu_seqlens=cu[:-1])


@pytest.mark.parametrize("dtype, temperature, shape", [(torch.float32, 1.0, (2, 7)), (torch.float32, 0.7, (13,)),
                                                       (torch.bfloat16, 1.0, (3, 5)), (torch.bfloat16, 0.6, (11,))])
def test_logprob_route_matches_areals_gather(dtype, temperature, shape):
    """The FSDP engine's log-prob passes: rlkernels' gather_logprobs(_entropy) against AReaL's own (a float32 copy
    of the logits, chunked), values and the gradient of a mix of both outputs. AReaL computes in float32 whatever the
    logits' dtype, as rlkernels does: the float32 rows; the gradient of bf16 logits is rounded to bf16 on both sides
    (AReaL's by the .float() cast's backward): the bf16 row. The values' tolerance is scaled by 3, the logits'
    spread (log-probs down to about -10)."""
    from areal.utils import functional as areal_functional

    g = torch.Generator().manual_seed(sum(shape))
    V = 37
    logits = (torch.randn(*shape, V, generator=g) * 3).to(dtype)
    labels = torch.randint(0, V, shape, generator=g)
    a, b = torch.randn(shape, generator=g), torch.randn(shape, generator=g)
    results = []
    for module in (areal_functional, rlk_areal):
        x = logits.clone().requires_grad_(True)
        lp, ent = module.gather_logprobs_entropy(x, labels, temperature=temperature)
        (grad,) = torch.autograd.grad((a * lp + b * ent).sum(), x)
        only = module.gather_logprobs(logits, labels, temperature=temperature)
        results.append((lp.detach(), ent.detach(), grad, only))
    theirs, ours = results
    assert ours[0].dtype == theirs[0].dtype == torch.float32
    for i, name in enumerate(("logprobs", "entropy")):
        assert_close(ours[i], theirs[i], **tol("value", torch.float32, scale=3.0), name=name)
    assert_close(ours[3], theirs[3], **tol("value", torch.float32, scale=3.0), name="gather_logprobs")
    assert_close(ours[2].float(), theirs[2].float(), **tol("dlogits", dtype), name="dlogits")
