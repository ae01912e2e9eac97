"""Each policy loss against verl 0.9.1's own registered function (`core_algos.get_policy_loss_fn`),
on hypothesis-generated padded batches (verl takes [B, T]): the loss value, its gradient w.r.t. the
log-probs (autograd through verl's function against rlkernels' closed-form coefficients) and the
actor/* metrics verl reports.

verl runs in float64 here, as does rlkernels' `policy_loss`, so the comparison is float64 against
float64: 2e-8 relative (the "verl" row of cases.TOL: verl's means divide by n + 1e-8). verl's metrics
are Python floats (`.item()`); ours are device tensors. With no token in the mask verl's token-mean
loss is 0/0 = NaN; ours is 0 (docs/spec.md, SPEC §7), which the test asserts instead.

Needs verl (`pip install --no-deps verl==0.9.1` + packaging omegaconf codetiming tensordict==0.10.0;
ray and transformers are stood in for during the import only, as the benchmarks do).
"""

import os
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import rlkernels
from rlkernels import PolicyLossConfig

from ..cases import assert_close, scaled, tol

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

try:
    from benchmarks.providers import import_verl

    _, core_algos, ActorConfig = import_verl()
    from verl.workers.config.actor import PolicyLossConfig as VerlPolicyLossConfig
except ImportError as exc:  # pragma: no cover - reported by the skip
    pytest.skip(f"verl 0.9.1 is not importable here ({exc}); see the module docstring", allow_module_level=True)

LOSSES = ("vanilla", "gpg", "sapo", "gspo")
AGG_MODES = ("token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")


@st.composite
def batches(draw):
    B, T = draw(st.integers(1, 4)), draw(st.integers(1, 7))
    seed = draw(st.integers(0, 2**31 - 1))
    spread = draw(st.sampled_from([0.01, 0.3, 2.0, 30.0]))  # log-ratios up to past the +-20 clamp
    gen = torch.Generator().manual_seed(seed)
    old = -torch.rand(B, T, generator=gen, dtype=torch.float64) * 4
    lp = old + torch.randn(B, T, generator=gen, dtype=torch.float64) * spread
    adv = torch.randn(B, T, generator=gen, dtype=torch.float64)
    mask = torch.rand(B, T, generator=gen) < draw(st.sampled_from([1.0, 0.7]))
    if draw(st.booleans()):
        mask[0] = False  # an empty sequence
    return lp, old, adv, mask


def _verl(loss, lp, old, adv, mask, agg, clip_c, tau):
    config = ActorConfig(strategy="fsdp", rollout_n=1, ppo_micro_batch_size_per_gpu=1, clip_ratio_low=0.2,
                         clip_ratio_high=0.28, clip_ratio_c=clip_c, loss_agg_mode=agg, tau_pos=tau[0],
                         tau_neg=tau[1], policy_loss=VerlPolicyLossConfig(loss_mode=loss))
    leaf = lp.clone().requires_grad_(True)
    value, metrics = core_algos.get_policy_loss_fn(loss)(old, leaf, adv, mask.double(), agg, config, None)
    (grad,) = torch.autograd.grad(value, leaf, allow_unused=True)
    return value.detach(), torch.zeros_like(lp) if grad is None else grad, metrics


@pytest.mark.parametrize("loss", LOSSES)
@settings(max_examples=scaled(60))
@given(batch=batches(), agg=st.sampled_from(AGG_MODES), clip_c=st.sampled_from([3.0, 10.0]),
       tau=st.sampled_from([(1.0, 1.05), (2.0, 0.5)]))
def test_policy_loss_matches_verl(loss, batch, agg, clip_c, tau):
    lp, old, adv, mask = batch
    # verl's sapo always aggregates seq-mean-token-mean (docs/spec.md, "Deliberate differences")
    ours_agg = "seq-mean-token-mean" if loss == "sapo" else agg
    want, want_grad, want_metrics = _verl(loss, lp, old, adv, mask, agg, clip_c, tau)
    if not mask.any():  # nothing to average: verl divides 0 by 0
        out = rlkernels.policy_loss(lp, adv, mask, old_logprobs=old, loss_type=loss, loss_agg_mode=ours_agg)
        assert float(out.loss) == 0.0
        return
    config = PolicyLossConfig(loss_type=loss, clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=clip_c,
                              loss_agg_mode=ours_agg, tau_pos=tau[0], tau_neg=tau[1])
    leaf = lp.clone().requires_grad_(True)
    out = rlkernels.policy_loss(leaf, adv, mask, old_logprobs=old, config=config)
    (grad,) = torch.autograd.grad(out.loss, leaf)
    q = tol("verl", torch.float64, scale=max(1.0, float(want.abs())))
    assert_close(out.loss.detach(), want, **q, name=f"{loss} loss")
    assert_close(grad, want_grad, **tol("verl", torch.float64, scale=max(1e-3, float(want_grad.abs().max()))),
                 name=f"{loss} d loss / d logprobs")
    for name, value in want_metrics.items():
        got = float(out.metrics[name])
        assert abs(got - value) <= 2e-8 * max(1.0, abs(value)), f"{loss} {name}: {got} vs verl {value}"
