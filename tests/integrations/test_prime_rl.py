"""prime-rl (559b4477): the custom losses, selected as prime-rl selects one (`CustomLossConfig` through
`setup_rl_loss_fn`, summed over samples by `compute_loss`), against prime-rl's own `default_loss_fn` and
`ipo_loss_fn`.

prime-rl is not on the package index (a uv workspace with vLLM and flash-attn), so its functions are float64
TRANSCRIPTIONS of its source at that commit (tests/integrations/transcribed/prime_rl.py), not its installed code.
Both compute in float64 from the same inputs: values and gradients agree to 1e-10 relative. Probability gaps within
1e-6 of a threshold are redrawn.
"""

import itertools
import random

import pytest
import torch

from rlkernels.integrations import prime_rl as rlk_prime

from ..cases import F64, approx, assert_close, tol
from .transcribed import prime_rl as prime

LOSSES = {"default": (prime.DefaultLossConfig, rlk_prime.default_loss_fn),
          "ipo": (prime.IPOLossConfig, rlk_prime.ipo_loss_fn)}


def _samples(seed, weighted):
    g = torch.Generator().manual_seed(seed)
    samples = []
    for _ in range(4):
        n = int(torch.randint(1, 12, (1,), generator=g))
        q = -torch.rand(n, generator=g, dtype=torch.float64) * 2
        p = q + 0.4 * torch.randn(n, generator=g, dtype=torch.float64)
        p = p.clamp(max=-1e-3)
        mask = torch.rand(n, generator=g) > 0.2
        adv = torch.randn(n, generator=g, dtype=torch.float64)
        if seed % 2:
            adv[0] = 0.0  # A = 0 takes the low side in prime-rl's default
        w = torch.rand(n, generator=g, dtype=torch.float64) if weighted else None
        samples.append(prime.LossInputs(p, q, None, adv, mask, w))
    return samples


def _clear(samples, thresholds):
    for s in samples:
        gap = s.trainer_logprobs.exp() - s.inference_logprobs.exp()
        for t in thresholds:
            if bool(((gap.abs() - t).abs() < 1e-6).any()):
                return False
    return True


CASES = list(itertools.product(["default", "ipo"], range(6), [False, True]))


@pytest.mark.parametrize("loss, seed, weighted", CASES)
def test_matches_prime_rls_own_loss(loss, seed, weighted):
    rng = random.Random(f"{loss}-{seed}-{weighted}")
    config_cls, ours = LOSSES[loss]
    if loss == "default":
        kwargs = dict(dppo_mask_low=rng.choice([0.2, 0.05]), dppo_mask_high=rng.choice([0.2, 0.1]),
                      adv_tau=rng.choice([1.0, 0.5]), kl_tau=rng.choice([1e-3, 0.0, 0.1]))
        thresholds = (kwargs["dppo_mask_low"], kwargs["dppo_mask_high"])
    else:
        kwargs = dict(ipo_threshold=rng.choice([0.1, 0.3]), adv_tau=rng.choice([1.0, 2.0]),
                      kl_tau=rng.choice([1e-3, 0.0]))
        thresholds = (kwargs["ipo_threshold"],)
    draw = seed
    while not _clear(samples := _samples(draw, weighted), thresholds):
        draw += 100
    rl_scale = sum(int(s.loss_mask.sum()) for s in samples) + 3

    def run(rl_fn):
        leaves = [s.trainer_logprobs.clone().requires_grad_(True) for s in samples]
        inputs = [prime.LossInputs(lp, s.inference_logprobs, None, s.advantages, s.loss_mask, s.loss_weights)
                  for lp, s in zip(leaves, samples)]
        loss_value, _ = prime.compute_loss(inputs, rl_scale, rl_loss_fn=rl_fn)
        return loss_value.detach(), torch.autograd.grad(loss_value, leaves)

    theirs = run(prime.setup_rl_loss_fn(config_cls(**kwargs)))
    mine = run(prime.setup_rl_loss_fn(prime.CustomLossConfig(fn=ours, kwargs=kwargs)))  # prime-rl's custom hook
    assert_close(mine[0], theirs[0], **tol("transcribed", F64), name="loss")
    for a, b in zip(mine[1], theirs[1]):
        assert_close(a, b, **tol("transcribed", F64), name="dtrainer_logprobs")


def test_is_masked_metric():
    sample = _samples(3, weighted=False)[0]
    theirs = prime.default_loss_fn(sample)
    assert float(rlk_prime.default_loss_fn(sample).metrics["is_masked"]) == approx(
        float(theirs.metrics["is_masked"]), "metric")
