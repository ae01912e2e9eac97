"""torch.compile: a small training step compiles with fullgraph=True on the CPU path and matches eager."""

import pytest
import torch

import rlkernels
from rlkernels import PolicyLossConfig, RolloutCorrection

from .cases import assert_close, make_batch, tol

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
    D, V = 8, 33
    b = make_batch("packed", [5, 7], V, dtype=torch.float32, mask_p=0.8)
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(b.labels.shape[0], D, generator=gen)
    head_eager = torch.randn(D, V, generator=gen, requires_grad=True)
    batch = (hidden, b.labels, b.advantages, b.response_mask, b.old_logprobs, b.rollout_logprobs, b.ref_logprobs,
             b.cu_seqlens)
    eager = step(forward, head_eager, *batch)

    head = head_eager.detach().clone().requires_grad_(True)
    got = step(torch.compile(forward, fullgraph=True, backend=compile_backend), head, *batch)
    for name, a, e in zip(("loss", "kl", "clipfrac"), got, eager):
        assert_close(a, e, **tol("reordered"), name=name)
    assert_close(head.grad, head_eager.grad, **tol("reordered"), name="d loss / d head")
