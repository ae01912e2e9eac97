"""NeMo-RL (7ea279ab): the `LossFunction` against NeMo-RL's own `ClippedPGLossFn` on seeded float64 batches over
its config's options, from log-probs (input_type LOGPROB, as NeMo-RL's wrapper calls it) and from logits.

NeMo-RL needs Python >= 3.13.14 and does not install here, so its loss is a float64 TRANSCRIPTION of its source at
that commit (tests/integrations/transcribed/nemo_rl.py), not its installed code. Its masked means divide by
`norm + 1e-8` (a relative 1e-8 / norm rlkernels does not add): rtol 1e-8. Ratios within 1e-6 of a bound redrawn.
"""

import itertools
import math
import random

import pytest
import torch

from rlkernels.integrations import nemo_rl as rlk_nemo
from rlkernels.testing.spawn import spawn

from ..cases import F64, approx, assert_close, tol
from .transcribed import nemo_rl as nemo

B, T, V = 5, 9, 23


def _batch(seed):
    g = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, V, (B, T), generator=g)
    logits = torch.randn(B, T, V, generator=g, dtype=torch.float64)
    lp = torch.log_softmax(logits, -1)[:, :-1].gather(-1, input_ids[:, 1:, None])[..., 0]
    pad = torch.zeros(B, 1, dtype=torch.float64)
    prev = torch.cat([pad, lp + 0.1 * torch.randn(B, T - 1, generator=g, dtype=torch.float64)], 1)
    gen = prev + torch.cat([pad, 0.2 * torch.randn(B, T - 1, generator=g, dtype=torch.float64)], 1)
    ref = prev + torch.cat([pad, 0.3 * torch.randn(B, T - 1, generator=g, dtype=torch.float64)], 1)
    token_mask = (torch.rand(B, T, generator=g) > 0.2).to(torch.float64)
    sample_mask = torch.ones(B, dtype=torch.float64)
    sample_mask[-1] = 0.0
    adv = torch.randn(B, 1, generator=g, dtype=torch.float64).expand(B, T).clone()
    data = {"input_ids": input_ids, "advantages": adv, "prev_logprobs": prev, "generation_logprobs": gen,
            "reference_policy_logprobs": ref, "token_mask": token_mask, "sample_mask": sample_mask}
    return logits, lp, data


def _clear(data, cfg) -> bool:
    lo, hi = cfg.get("truncated_importance_sampling_ratio_min"), cfg.get("truncated_importance_sampling_ratio")
    bounds = [math.log(b) for b in (lo, hi) if b]
    mask = data["token_mask"][:, 1:] * data["sample_mask"][:, None]
    d = (data["prev_logprobs"] - data["generation_logprobs"])[:, 1:]
    values = torch.cat([d[mask > 0], (d * mask).sum(-1), (d * mask).sum(-1) / mask.sum(-1).clamp(min=1)])
    return all(bool(((values - b).abs() > 1e-6).all()) for b in bounds)


CONFIGS = [dict(),
           dict(ratio_clip_min=0.1, ratio_clip_max=0.28, ratio_clip_c=3.0, reference_policy_kl_penalty=0.0),
           dict(token_level_loss=False, reference_policy_kl_type="k1"),
           dict(token_level_loss=False, sequence_level_importance_ratios=True, ratio_clip_min=3e-3,
                ratio_clip_max=4e-3, reference_policy_kl_type="k2"),
           dict(use_importance_sampling_correction=True),
           dict(use_importance_sampling_correction=True, truncated_importance_sampling_type="tis",
                truncated_importance_sampling_ratio=1.2, truncated_importance_sampling_ratio_min=0.9),
           dict(use_importance_sampling_correction=True, truncated_importance_sampling_type="icepop",
                truncated_importance_sampling_ratio=1.25, truncated_importance_sampling_ratio_min=0.8),
           dict(use_importance_sampling_correction=True, truncated_importance_sampling_type="seq-mask-tis",
                truncated_importance_sampling_ratio=1.1, truncated_importance_sampling_ratio_min=0.9,
                token_level_loss=False),
           dict(use_importance_sampling_correction=True, sequence_level_importance_ratios=True,
                token_level_loss=False, truncated_importance_sampling_type="tis",
                truncated_importance_sampling_ratio=2.0),
           dict(use_cispo=True, ratio_clip_min=0.5, ratio_clip_max=0.3),
           dict(disable_ppo_ratio=True, use_importance_sampling_correction=True),
           dict(force_on_policy_ratio=True, reference_policy_kl_penalty=0.1),
           dict(use_kl_in_reward=True, reference_policy_kl_penalty=0.5)]
# force_on_policy_ratio (the ratio to a detached current pass) is taken from log-probs only
CASES = [(c, s, kind) for c, s, kind in itertools.product(range(len(CONFIGS)), range(3), ["logprob", "logit"])
         if not (kind == "logit" and CONFIGS[c].get("force_on_policy_ratio"))]


@pytest.mark.parametrize("case, seed, input_type", CASES)
def test_matches_nemo_rls_own_clipped_pg_loss(case, seed, input_type):
    cfg = CONFIGS[case]
    draw = seed
    while not _clear(data := _batch(draw)[2], cfg):
        draw += 100
    logits, lp, data = _batch(draw)
    mask = data["token_mask"][:, 1:] * data["sample_mask"][:, None]
    gvs, gvt = data["sample_mask"].sum() + random.Random(seed).choice([0, 2]), mask.sum() + 3

    theirs_lp = lp.clone().requires_grad_(True)
    theirs, their_metrics = nemo.ClippedPGLossFn(cfg)(data, gvs, gvt, next_token_logprobs=theirs_lp)
    (their_grad,) = torch.autograd.grad(theirs, theirs_lp)
    if input_type == "logprob":
        mine_lp = lp.clone().requires_grad_(True)
        mine, metrics = rlk_nemo.ClippedPGLossFn(cfg)(data, gvs, gvt, next_token_logprobs=mine_lp)
        (my_grad,) = torch.autograd.grad(mine, mine_lp)
    else:  # from the logits: the gradient to the log-probs is the one to the logits' label column, chained
        x = logits.clone().requires_grad_(True) * 1.0  # a computed tensor, as a model's output
        mine, metrics = rlk_nemo.ClippedPGLossFn(cfg, input_type="logit")(data, gvs, gvt, logits=x)
        (grad_logits,) = torch.autograd.grad(mine, x)
        assert grad_logits.data_ptr() == x.data_ptr()  # the gradient took the logits' storage (inplace_backward)
        ref_x = logits.clone().requires_grad_(True)  # NeMo-RL's log-probs of these logits, its gradient chained
        ref_lp = torch.log_softmax(ref_x, -1)[:, :-1].gather(-1, data["input_ids"][:, 1:, None])[..., 0]
        (their_grad_logits,) = torch.autograd.grad((ref_lp * their_grad).sum(), ref_x)
        my_grad, their_grad = grad_logits, their_grad_logits
    assert_close(mine.detach(), theirs.detach(), **tol("nemo_rl", F64), name="loss")
    assert_close(my_grad, their_grad, **tol("nemo_rl", F64, scale=max(1.0, float(their_grad.abs().max()))),
                 name="grad")
    assert isinstance(metrics["loss"], float)
    for name, value in their_metrics.items():  # every metric NeMo-RL logs, under its name, with its value
        scale = max(1.0, abs(float(value))) if math.isfinite(value) else 1.0
        assert metrics[name] == approx(float(value), "nemo_rl", F64, scale=scale), (name, metrics[name], value)


@pytest.mark.parametrize("cfg, match", [
    (dict(use_on_policy_kl_approximation=True), "use_on_policy_kl_approximation"),
    (dict(positive_example_nll_weight=0.1), "positive_example_nll_weight"),
    (dict(kl_input_clamp_value=5.0), "kl_input_clamp_value"),
    (dict(disable_ppo_ratio=True, ratio_clip_c=3.0), "ratio_clip_c"),
])
def test_refusals_name_nemo_rls_option(cfg, match):
    with pytest.raises(ValueError, match=match):
        rlk_nemo.ClippedPGLossFn(cfg)


def test_logit_gradient_in_place_only_where_the_logits_own_their_storage():
    """In place, not in place and per-sequence slices of one packed tensor (NeMo-RL's SequencePackingLossWrapper
    calls the loss once per slice) give the same gradient bit for bit: the same kernels write it, into the logits'
    storage or a new tensor. The slices take new tensors, so the packed logits are left intact and their shared
    version counter never trips autograd."""
    cfg = CONFIGS[5]
    logits, _, data = _batch(7)
    mask = data["token_mask"][:, 1:] * data["sample_mask"][:, None]
    gvs, gvt = data["sample_mask"].sum(), mask.sum()
    grads = {}
    for inplace in (True, False):
        x = logits.clone().requires_grad_(True) * 1.0
        loss, _ = rlk_nemo.ClippedPGLossFn(cfg, input_type="logit", inplace_backward=inplace)(data, gvs, gvt,
                                                                                              logits=x)
        (grads[inplace],) = torch.autograd.grad(loss, x)
        assert (grads[inplace].data_ptr() == x.data_ptr()) == inplace
        assert inplace or torch.equal(x.detach(), logits)
    assert torch.equal(grads[True], grads[False])

    leaf = logits.clone().requires_grad_(True)  # the caller's own tensor: never written
    loss, _ = rlk_nemo.ClippedPGLossFn(cfg, input_type="logit")(data, gvs, gvt, logits=leaf)
    (grad,) = torch.autograd.grad(loss, leaf)
    assert torch.equal(leaf.detach(), logits) and torch.equal(grad, grads[False])

    packed = torch.cat([logits, logits], 1).requires_grad_(True)  # two copies of the batch, one after the other
    work = packed * 1.0  # a non-leaf, as a model's output
    halves = [work.narrow(1, 0, T), work.narrow(1, T, T)]
    loss_fn = rlk_nemo.ClippedPGLossFn(cfg, input_type="logit")
    total = sum(loss_fn(data, gvs, gvt, logits=half)[0] for half in halves)
    (grad,) = torch.autograd.grad(total, packed)
    assert torch.equal(work.detach(), torch.cat([logits, logits], 1))
    assert torch.equal(grad, torch.cat([grads[False], grads[False]], 1))


def _check_vocabulary_parallel(rank, world):
    """Each rank's half of the vocabulary with `tp_group`: the single-process loss on every rank, and this rank's
    slice of its gradient (the gradient is a new tensor: rlkernels' in-place backward is per process)."""
    import torch.distributed as dist

    _, _, data = _batch(3)
    g = torch.Generator().manual_seed(4)
    vocab = 24
    logits = torch.randn(B, T, vocab, generator=g, dtype=torch.float64)
    data["input_ids"] = torch.randint(0, vocab, (B, T), generator=g)
    mask = data["token_mask"][:, 1:] * data["sample_mask"][:, None]
    gvs, gvt = data["sample_mask"].sum(), mask.sum()
    x = logits.clone().requires_grad_(True)
    whole, whole_metrics = rlk_nemo.ClippedPGLossFn(CONFIGS[5], input_type="logit")(data, gvs, gvt, logits=x)
    (whole_grad,) = torch.autograd.grad(whole, x)
    part = slice(rank * vocab // world, (rank + 1) * vocab // world)
    shard = logits[..., part].clone().requires_grad_(True)
    loss_fn = rlk_nemo.ClippedPGLossFn(CONFIGS[5], input_type="logit", tp_group=dist.group.WORLD)
    loss, metrics = loss_fn(data, gvs, gvt, logits=shard)
    (grad,) = torch.autograd.grad(loss, shard)
    assert grad.data_ptr() != shard.data_ptr()
    assert_close(loss.detach(), whole.detach(), **tol("value", F64), name="loss")
    assert_close(grad, whole_grad[..., part], **tol("value", F64), name="grad")
    assert metrics["probs_ratio"] == approx(whole_metrics["probs_ratio"], "value", F64)


def test_logit_route_over_vocabulary_parallel_ranks():
    """Two gloo ranks, the vocabulary split in half: the loss and gradient of the whole logits (float64 on both
    sides, a different summation order: the ('value', fp64) row)."""
    spawn(2, _check_vocabulary_parallel)
