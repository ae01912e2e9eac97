"""The fused-linear log-probs against Liger-Kernel's own fused-linear PPO head (liger-kernel 0.8.5,
`LigerFusedLinearScaledCrossEntropyFunction`: verl's default output head since verl #7461, and the kernel
benchmarks/linear.py's `liger[ppo-logprobs]` provider times on a GPU). On a CPU Liger runs its chunked fallback, the
same function its GPU path computes: per-token NLL (so -log p) and entropy of softmax(hidden @ weight.T / T), 0 on
ignored rows, with autograd to hidden and weight.

float32 on both sides (Liger's fallback computes its log-softmax in float32 whatever the inputs' dtype, so float64
inputs would only measure its rounding): the same quantities summed in other orders, to the float32 "value"
tolerance.
Needs `pip install --no-deps liger-kernel==0.8.5` (README's test command)."""

import pytest
import torch

import rlkernels

from ..cases import F32, assert_close, tol

liger = pytest.importorskip("liger_kernel.ops.fused_linear_scaled_cross_entropy",
                            reason="liger-kernel is not installed (pip install --no-deps liger-kernel==0.8.5)")


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_fused_linear_logprobs_and_entropy_match_liger(temperature):
    g = torch.Generator().manual_seed(0)
    N, H, V = 70, 24, 301
    hidden = torch.randn(N, H, generator=g, dtype=F32)
    weight = torch.randn(V, H, generator=g, dtype=F32) / H ** 0.5
    labels = torch.randint(0, V, (N,), generator=g)
    labels[::5] = -100
    coef_lp, coef_ent = torch.randn(N, generator=g, dtype=F32), torch.randn(N, generator=g, dtype=F32)

    def run(fn):
        h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
        logprobs, entropy = fn(h, w)
        ((coef_lp * logprobs).sum() + (coef_ent * entropy).sum()).backward()
        return logprobs.detach(), entropy.detach(), h.grad, w.grad

    def ours(h, w):
        out = rlkernels.linear_token_logprobs(h, w, labels, temperature=temperature, compute_entropy=True)
        return out.logprobs, out.entropy

    def theirs(h, w):
        nll, entropy = liger.LigerFusedLinearScaledCrossEntropyFunction.apply(h, w, labels, temperature, -100, 1, True)
        return -nll, entropy

    mine, peer = run(ours), run(theirs)
    ignored = labels == -100
    assert torch.equal(mine[0][ignored], torch.zeros_like(mine[0][ignored]))
    for name, a, b in zip(("logprobs", "entropy", "d_hidden", "d_weight"), mine, peer):
        if name == "entropy":  # Liger's entropy of an ignored row is 0; ours is the row's (it is computed there)
            a, b = a[~ignored], b[~ignored]
        assert_close(a, b, **tol("value", F32), name=name)
