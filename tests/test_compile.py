"""torch.compile: a small training step compiles with fullgraph=True on the CPU path and matches eager."""

import pytest
import torch

import rlkernels
from rlkernels import PolicyLossConfig, RolloutCorrection

# validate=False: value checks read device memory (one sync), which a fullgraph step cannot contain
CONFIG = PolicyLossConfig(rollout_correction=RolloutCorrection.geo_rs_token_tis(bounds=(0.5, 2.0)), entropy_coeff=0.01,
                          kl_coef=0.05, validate=False)


def forward(head, hidden, labels, adv, mask, old, rollout, ref, cu):
    logits = hidden @ head  # [N, V]: an lm_head in front of the fused loss
    out = rlkernels.decoupled_ppo_loss(logits, labels, adv, mask, old_logprobs=old, rollout_logprobs=rollout,
                                       ref_logprobs=ref, cu_seqlens=cu, config=CONFIG)
    return out.loss, out.metrics["rollout_corr/kl"], out.metrics["actor/pg_clipfrac"]


def step(fwd, head, *batch):
    """One training step: the compiled forward, then its (AOT-compiled) backward."""
    loss, kl, clipfrac = fwd(head, *batch)
    loss.backward()
    return loss.detach(), kl, clipfrac


# aot_eager traces forward and backward through AOTAutograd (what fullgraph needs); inductor also
# generates C++ for the surrounding ops, which needs a compiler toolchain at test time
@pytest.mark.parametrize("compile_backend", ["aot_eager", "inductor"])
def test_training_step_compiles_fullgraph(compile_backend):
    torch.manual_seed(0)
    N, D, V = 12, 8, 33
    hidden = torch.randn(N, D)
    labels = torch.randint(0, V, (N,))
    adv, mask = torch.randn(N), torch.rand(N) > 0.2
    old = -torch.rand(N)
    rollout, ref = old - 0.1 * torch.rand(N), old - 0.05
    cu = torch.tensor([0, 5, 12])

    head_eager = torch.randn(D, V, requires_grad=True)
    batch = (hidden, labels, adv, mask, old, rollout, ref, cu)
    eager = step(forward, head_eager, *batch)

    head = head_eager.detach().clone().requires_grad_(True)
    got = step(torch.compile(forward, fullgraph=True, backend=compile_backend), head, *batch)
    for a, b in zip(got, eager):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-6)
    assert torch.allclose(head.grad, head_eager.grad, rtol=1e-5, atol=1e-6)
