"""float64 gradcheck of the oracle and of the torch backend's autograd Functions."""

import pytest
import torch

import rlkernels
from rlkernels import PolicyLossConfig, RolloutCorrection, reference

from ..cases import make_batch, tol

B, T, V = 2, 3, 5
GRADCHECK = dict(eps=1e-6, **tol("gradcheck", torch.float64))


def _inputs(seed=0):
    batch = make_batch("padded", [T] * B, V, dtype=torch.float64, seed=seed)
    logits, labels, adv = batch.logits, batch.labels, batch.advantages
    mask = torch.tensor([[True, True, False], [True, True, True]])
    # old close to the current log-probs so that most tokens sit inside the clip range (where the
    # loss is smooth); gradcheck's finite differences are meaningless across a clip kink
    g = torch.Generator().manual_seed(seed)
    lp, _, _ = reference.token_stats(logits, labels)
    old = lp.detach() + 0.01 * torch.randn(B, T, generator=g, dtype=torch.float64)
    rollout = old + 0.05 * torch.randn(B, T, generator=g, dtype=torch.float64)
    ref = old - 0.1
    return logits, labels, adv, mask, old, rollout, ref


CONFIGS = [
    PolicyLossConfig(),
    PolicyLossConfig(rollout_correction=RolloutCorrection.token_tis(5.0), kl_coef=0.1, kl_type="k3",
                     entropy_coeff=0.05),
    PolicyLossConfig(rollout_correction=RolloutCorrection.seq_tis(5.0), loss_agg_mode="seq-mean-token-mean",
                     kl_coef=0.1, kl_type="k2", temperature=0.7, entropy_coeff=-0.02),
    PolicyLossConfig(loss_agg_mode="seq-mean-token-sum-norm", kl_coef=0.2, kl_type="k1", entropy_coeff=0.01),
]


@pytest.mark.parametrize("config", CONFIGS, ids=range(len(CONFIGS)))
@pytest.mark.parametrize("impl", ["reference", "torch"])
def test_gradcheck_decoupled(config, impl):
    logits, labels, adv, mask, old, rollout, ref = _inputs()

    def f(z):
        if impl == "reference":
            return reference.decoupled_ppo_loss(z, labels, adv, mask, old_logprobs=old, rollout_logprobs=rollout,
                                                ref_logprobs=ref, config=config).loss
        return rlkernels.decoupled_ppo_loss(z, labels, adv, mask, old_logprobs=old, rollout_logprobs=rollout,
                                            ref_logprobs=ref, config=config, backend="torch", chunk_rows=2).loss

    assert torch.autograd.gradcheck(f, (logits.requires_grad_(True),), **GRADCHECK)


@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_gradcheck_token_stats(temperature):
    logits, labels, *_ = _inputs(1)
    labels[0, 1] = -100

    def f(z):
        s = rlkernels.token_logprobs(z, labels, temperature=temperature, compute_entropy=True)
        return s.logprobs, s.entropy

    assert torch.autograd.gradcheck(f, (logits.requires_grad_(True),), **GRADCHECK)


def test_gradcheck_policy_loss():
    logits, labels, adv, mask, old, rollout, ref = _inputs(2)
    lp, ent, _ = reference.token_stats(logits, labels)
    cfg = PolicyLossConfig(rollout_correction=RolloutCorrection.token_tis(5.0), entropy_coeff=0.1, kl_coef=0.1)

    def f(lp_, ent_):
        return rlkernels.policy_loss(lp_, adv, mask, entropy=ent_, old_logprobs=old, rollout_logprobs=rollout,
                                     ref_logprobs=ref, config=cfg).loss

    inputs = (lp.detach().requires_grad_(True), ent.detach().requires_grad_(True))
    assert torch.autograd.gradcheck(f, inputs, **GRADCHECK)
