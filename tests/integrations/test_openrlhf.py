"""OpenRLHF 0.11.2: the drop-in `PolicyLoss`, installed where OpenRLHF reads it, against OpenRLHF's own class on
seeded float64 batches over every constructor option and the trainer's global counts.

OpenRLHF computes in the inputs' dtype, so the two agree to float64 rounding, except for its per-sample mean's
`count + 1e-8` denominator (a relative 1e-8 / count that rlkernels does not add): rtol 1e-7. Gate statistics
within 1e-6 of a threshold are redrawn, so that rounding cannot flip a drop.
"""

import itertools
import math
import random

import pytest
import torch

from rlkernels.integrations import openrlhf as rlk_openrlhf

from ..cases import F64, assert_close, tol
from .trainer_imports import trainer_or_skip

OPENRLHF = trainer_or_skip("openrlhf_loss", "OpenRLHF 0.11.2")
CORRECTIONS = [("off", "mask", "ratio", (0.5, 5.0)),
               ("token", "clip", "ratio", (0.8, 1.25)), ("token", "mask", "ratio", (0.0, 1.5)),
               ("token", "mask", "ratio", (0.7, 1.3)), ("seq", "mask", "ratio", (0.9, 1.1)),
               ("token", "mask", "binary_kl", (0.0, 0.01)), ("seq", "mask", "binary_kl", (0.0, 0.005)),
               ("token", "mask", "tv", (0.0, 0.05)), ("seq", "mask", "tv", (0.0, 0.03))]


def _batch(seed):
    g = torch.Generator().manual_seed(seed)
    B, T = 6, 10
    old = -torch.rand(B, T, generator=g, dtype=torch.float64) * 2.5
    log_probs = old + 0.15 * torch.randn(B, T, generator=g, dtype=torch.float64)
    rollout = old + 0.25 * torch.randn(B, T, generator=g, dtype=torch.float64)
    lengths = torch.randint(0, T + 1, (B,), generator=g)
    lengths[0] = T  # at least one non-empty sequence
    mask = (torch.arange(T)[None, :] < lengths[:, None]).to(torch.float64)
    advantages = torch.randn(B, 1, generator=g, dtype=torch.float64).expand(B, T).clone()
    return log_probs, old, rollout, mask, advantages


def _gate_statistics(old, rollout, mask):
    """Every statistic a gate may compare, token and sequence level (OpenRLHF's formulas)."""
    p, q = rollout.exp().clamp(1e-6, 1 - 1e-6), old.exp().clamp(1e-6, 1 - 1e-6)
    tokens = {"ratio": (old - rollout).exp(), "binary_kl": p * (p / q).log() + (1 - p) * ((1 - p) / (1 - q)).log(),
              "tv": (p - q).abs()}
    n = mask.sum(-1).clamp(min=1)
    seqs = {"ratio": ((old - rollout) * mask).sum(-1).div(n).exp(),
            "binary_kl": (tokens["binary_kl"] * mask).sum(-1) / n, "tv": (tokens["tv"] * mask).sum(-1) / n}
    return tokens, seqs


def _clear_of_thresholds(old, rollout, mask, level, gating, threshold) -> bool:
    if level == "off":
        return True
    tokens, seqs = _gate_statistics(old, rollout, mask)
    values = tokens[gating][mask > 0] if level == "token" else seqs[gating][mask.sum(-1) > 0]
    bounds = torch.tensor([b for b in threshold if 0 < b < math.inf], dtype=torch.float64)
    return not bool(((values[:, None] - bounds[None, :]).abs() < 1e-6 * bounds.clamp(min=1)).any())


CASES = list(itertools.product(["ppo", "gspo"], range(len(CORRECTIONS)), [True, False], [False, True]))


@pytest.mark.parametrize("loss_type, correction, token_level, global_counts", CASES)
def test_matches_openrlhfs_own_policy_loss(loss_type, correction, token_level, global_counts):
    level, mode, gating, threshold = CORRECTIONS[correction]
    rng = random.Random(f"{loss_type}-{correction}-{token_level}-{global_counts}")
    kwargs = dict(clip_eps_low=rng.choice([0.2, 0.1]), clip_eps_high=rng.choice([0.2, 0.28]),
                  dual_clip=rng.choice([None, 3.0]), token_level_loss=token_level, policy_loss_type=loss_type,
                  is_correction_level=level, is_correction_mode=mode, is_correction_gating=gating,
                  is_correction_threshold=threshold)
    seed = correction
    while True:
        log_probs, old, rollout, mask, advantages = _batch(seed)
        if _clear_of_thresholds(old, rollout, mask, level, gating, threshold):
            break
        seed += 100
    counts = {}
    if global_counts:  # the trainer's get_loss_batch_info: global totals over 2 data-parallel ranks
        counts = dict(dp_size=2, batch_num_tokens=float(mask.sum()) * 2 + 6, global_batch_size=2 * mask.shape[0] + 2)

    def run(cls):
        lp = log_probs.clone().requires_grad_(True)
        out = cls(**kwargs)(lp, old, advantages, action_mask=mask, rollout_log_probs=rollout, **counts)
        (grad,) = torch.autograd.grad(out[0], lp)
        return out, grad

    (theirs, their_grad) = run(OPENRLHF.PolicyLoss)
    rlk_openrlhf.install()
    try:
        import openrlhf.models.loss as installed

        assert installed.PolicyLoss is rlk_openrlhf.PolicyLoss  # what the trainer would build now
        (ours, our_grad) = run(installed.PolicyLoss)
    finally:
        rlk_openrlhf.uninstall()
    assert installed.PolicyLoss is OPENRLHF.PolicyLoss
    scale = max(1.0, float(theirs[0].abs()))
    assert_close(ours[0].detach(), theirs[0].detach(), **tol("openrlhf", F64, scale=scale), name="loss")
    g_scale = max(1e-3, float(their_grad.abs().max()))
    assert_close(our_grad, their_grad, **tol("openrlhf", F64, scale=g_scale), name="dlog_probs")
    if theirs[3] is not None:
        assert_close(ours[3], theirs[3], **tol("metric", F64), name="vllm_kl")
    assert_close(ours[1], theirs[1].to(ours[1].dtype), **tol("metric", F64), name="clip_ratio")  # the action mask
    assert_close(ours[2], theirs[2], **tol("metric", F64), name="ppo_kl")
    if theirs[4] is not None:
        # OpenRLHF counts the dropped units in float32 (`filtered.float()`)
        assert_close(ours[4], theirs[4].to(ours[4].dtype), **tol("metric", torch.float32), name="is_filter_ratio")


def test_ppo_kl_is_of_the_unclamped_log_ratio():
    """A token 30 nats off: OpenRLHF clamps the loss's log-ratio to +-20 but reports ppo_kl of the raw one."""
    log_probs, old, _, mask, advantages = _batch(5)
    log_probs = log_probs.clone()
    log_probs[0, 0] = old[0, 0] - 30.0
    theirs = OPENRLHF.PolicyLoss()(log_probs, old, advantages, action_mask=mask)
    ours = rlk_openrlhf.PolicyLoss()(log_probs, old, advantages, action_mask=mask)
    assert float(theirs[2]) > 30.0 / mask.sum() - 1  # the raw log-ratio counts
    assert_close(ours[2], theirs[2], **tol("metric", F64), name="ppo_kl")


def test_install_is_reversible_and_refusals_name_the_option():
    rlk_openrlhf.install()
    rlk_openrlhf.install()  # idempotent: the original is kept once
    rlk_openrlhf.uninstall()
    import openrlhf.models.loss as module

    assert module.PolicyLoss is OPENRLHF.PolicyLoss
    with pytest.raises(ValueError, match="is_correction_threshold"):
        rlk_openrlhf.PolicyLoss(is_correction_level="seq", is_correction_gating="tv", is_correction_threshold=(0.1, 1))


@pytest.mark.parametrize("temperature, entropy", [(1.0, True), (0.7, True), (0.7, False)])
def test_actor_forward_route_matches_openrlhfs(temperature, entropy):
    """`Actor.forward` (the policy's, reference's and old log-prob passes) on a real OpenRLHF `Actor` around a tiny
    Hugging Face model: OpenRLHF's own (float32 copy of the logits, divided by the temperature, its log-softmax and
    entropy) against `actor_forward` after `install()`; the action log-probs, the entropy, and the gradient of
    both in every parameter. Float32 model: the float32 rows."""
    from rlkernels.testing.peers import load_example
    from rlkernels.testing.trainers import openrlhf_actor

    actor_module = openrlhf_actor()
    example = load_example("trl_grpo.py")
    tok = example.tiny_tokenizer()
    g = torch.Generator().manual_seed(9)
    B, T, A = 3, 10, 6
    sequences = torch.randint(3, example.VOCAB, (B, T), generator=g)
    attention = torch.ones(B, T, dtype=torch.long)
    attention[0, :2] = 0  # left padding
    action_mask = torch.ones(B, A, dtype=torch.bool)
    action_mask[1, 4:] = False
    a, b = torch.randn(B, A, generator=g), torch.randn(B, T - 1, generator=g)
    results = []
    for ours in (False, True):
        actor = actor_module.Actor(example.tiny_model(tok), temperature=temperature)  # seeded: the same weights
        actor.packing_samples = False  # OpenRLHF sets it only when it loads the model from a path itself
        if ours:
            rlk_openrlhf.install()
        try:
            assert (actor_module.Actor.forward is rlk_openrlhf.actor_forward) == ours
            lp, output = actor(sequences, action_mask, attention, return_output=True, return_entropy=entropy)
        finally:
            rlk_openrlhf.uninstall()
        objective = (a * lp).sum() + ((b * output.entropy).sum() if entropy else 0.0)
        objective.backward()
        grads = {n: p.grad.clone() for n, p in actor.named_parameters() if p.grad is not None}
        results.append((lp.detach(), output.entropy.detach() if entropy else None, grads))
    assert actor_module.Actor.forward is not rlk_openrlhf.actor_forward  # uninstall() restored it
    theirs, ours = results
    assert ours[0].dtype == theirs[0].dtype == torch.float32
    assert_close(ours[0], theirs[0], **tol("value", torch.float32), name="action log-probs")
    if entropy:
        assert_close(ours[1], theirs[1], **tol("value", torch.float32), name="entropy")
    assert ours[2].keys() == theirs[2].keys()
    for name in theirs[2]:
        scale = max(1e-3, float(theirs[2][name].abs().max()))
        assert_close(ours[2][name], theirs[2][name], **tol("dlogits", torch.float32, scale=scale), name=name)


def test_actor_forward_hands_logits_only_calls_to_openrlhfs_forward():
    """A call that wants the logits (no action_mask, no return_logprobs) runs OpenRLHF's own forward: installed, and
    on a subclass that defines forward = actor_forward without install() (the plugin running OpenRLHF's tests)."""
    from rlkernels.testing.peers import load_example
    from rlkernels.testing.trainers import openrlhf_actor

    actor_module = openrlhf_actor()
    example = load_example("trl_grpo.py")
    tok = example.tiny_tokenizer()
    sequences = torch.randint(3, example.VOCAB, (2, 7), generator=torch.Generator().manual_seed(3))
    attention = torch.ones(2, 7, dtype=torch.long)
    subclass = type("Actor", (actor_module.Actor,), {"forward": rlk_openrlhf.actor_forward})
    for build in (lambda: subclass(example.tiny_model(tok)), lambda: actor_module.Actor(example.tiny_model(tok))):
        actor = build()
        actor.packing_samples = False
        installed = type(actor) is actor_module.Actor
        if installed:
            rlk_openrlhf.install()
        try:
            output = actor(sequences, attention_mask=attention, return_output=True)
        finally:
            rlk_openrlhf.uninstall()
        assert output["logits"].dtype == torch.float32 and output["logits"].shape == (2, 7, example.VOCAB)


def test_actor_forward_route_with_bf16_logits():
    """The memory case: a bf16 model. OpenRLHF takes its float32 copy of the bf16 logits, the route reads them as
    they are, both computing in float32: the float32 rows for the values; the parameters' gradients are bf16 on
    both sides (OpenRLHF's through its cast's backward), one rounding each: the bf16 row."""
    from rlkernels.testing.peers import load_example
    from rlkernels.testing.trainers import openrlhf_actor

    actor_module = openrlhf_actor()
    example = load_example("trl_grpo.py")
    tok = example.tiny_tokenizer()
    g = torch.Generator().manual_seed(4)
    sequences = torch.randint(3, example.VOCAB, (2, 8), generator=g)
    attention, action_mask = torch.ones(2, 8, dtype=torch.long), torch.ones(2, 5, dtype=torch.bool)
    a = torch.randn(2, 5, generator=g)
    results = []
    for ours in (False, True):
        actor = actor_module.Actor(example.tiny_model(tok).to(torch.bfloat16), temperature=0.8)
        actor.packing_samples = False
        if ours:
            rlk_openrlhf.install()
        try:
            lp, output = actor(sequences, action_mask, attention, return_output=True, return_entropy=True)
        finally:
            rlk_openrlhf.uninstall()
        ((a * lp).sum() + output.entropy.sum()).backward()
        head = actor.model.lm_head.weight.grad.float()
        results.append((lp.detach(), output.entropy.detach(), head))
    theirs, ours = results
    assert_close(ours[0], theirs[0], **tol("value", torch.float32), name="action log-probs")
    assert_close(ours[1], theirs[1], **tol("value", torch.float32), name="entropy")
    scale = float(theirs[2].abs().max())
    assert_close(ours[2], theirs[2], **tol("dlogits", torch.bfloat16, scale=scale), name="lm_head grad")
