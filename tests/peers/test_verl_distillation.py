"""Top-k distillation against verl 0.9.1's own `compute_forward_kl_topk` (verl/trainer/distillation/fsdp/losses.py:
the student's log-softmax gathered at the teacher's top-k ids, both log-probs clamped at log_prob_min_clamp, the
forward KL over the head), and its loss_max_clamp as verl's `distillation_loss` applies it (both sides).

verl is given float64 logits but casts both log-probs to float32 inside its `kl_divergence`: the "verl.distillation"
row of cases.TOL says what that costs. Its teacher inputs are jagged nested tensors ([1, nnz, k]), as its rollout
stores them; its student_mass is compared too.
"""

import types

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import rlkernels

from ..cases import F64, assert_close, scaled, tol
from ..verl_import import import_verl_or_skip

import_verl_or_skip()
from verl.trainer.distillation.fsdp import losses as verl_losses  # noqa: E402


@settings(max_examples=scaled(40), deadline=None)
@given(N=st.integers(1, 12), V=st.integers(2, 40), k=st.integers(1, 8), seed=st.integers(0, 2**31 - 1),
       spread=st.sampled_from([0.5, 3.0, 12.0]), min_clamp=st.sampled_from([None, -10.0, -3.0]),
       max_clamp=st.sampled_from([None, 10.0, 0.5]))
def test_forward_kl_topk_matches_verl(N, V, k, seed, spread, min_clamp, max_clamp):
    gen = torch.Generator().manual_seed(seed)
    k = min(k, V)
    student = torch.randn(N, V, generator=gen, dtype=F64) * spread
    teacher = torch.log_softmax(torch.randn(N, V, generator=gen, dtype=F64) * spread, -1)
    ids = teacher.topk(k, -1).indices
    t_lp = teacher.gather(-1, ids)
    config = types.SimpleNamespace(distillation_loss=types.SimpleNamespace(use_chunked_topk=False,
                                                                           log_prob_min_clamp=min_clamp))
    verl_logits = student[None].clone().requires_grad_(True)
    nested = lambda t: torch.nested.as_nested_tensor([t], layout=torch.jagged)  # noqa: E731
    out = verl_losses.compute_forward_kl_topk(verl_logits, nested(t_lp), nested(ids), config, "thd")
    verl_loss = out["distillation_losses"][0]
    if max_clamp is not None:  # verl's distillation_loss: "clamping min is for k1 loss which can be negative"
        verl_loss = verl_loss.clamp(min=-max_clamp, max=max_clamp)
    logits = student.clone().requires_grad_(True)
    mine = rlkernels.topk_distillation_loss(logits, ids, t_lp, log_prob_min_clamp=min_clamp, loss_max_clamp=max_clamp,
                                            loss_agg_mode="token-sum")
    q = tol("verl.distillation", F64, scale=max(1.0, float(verl_loss.detach().abs().max())))
    assert_close(mine.losses, verl_loss, **q, name="losses")
    assert_close(mine.student_mass, out["student_mass"][0], **tol("verl.distillation", F64), name="student_mass")
    (g_verl,) = torch.autograd.grad(verl_loss.sum(), verl_logits)
    (g_mine,) = torch.autograd.grad(mine.loss, logits)
    assert_close(g_mine, g_verl[0], **tol("verl.distillation", F64, scale=max(1.0, float(g_verl.abs().max()))),
                 name="dlogits")


def test_verl_is_what_was_run():
    assert hasattr(verl_losses, "compute_forward_kl_topk"), "verl 0.9.1 ships compute_forward_kl_topk"
    with pytest.raises(ValueError, match="kind: expected one of"):
        rlkernels.topk_distillation_loss(torch.zeros(1, 3), torch.zeros(1, 1, dtype=torch.long),
                                         torch.zeros(1, 1), kind="jsd")
