"""Top-k distillation (SPEC §9.3) against the float64 oracle: the tail-aware forward KL and the reverse KL are the
partition divergences of rlkernels.reference.divergences (teacher as μ, student as π), the forward KL over the
head is written out here in float64 (verl's own function: tests/peers/test_verl_distillation.py); every backend,
a response mask, padded ids, the clamps' zero gradients."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import rlkernels
from rlkernels import backends
from rlkernels.reference import divergences as oracle

from ..cases import F32, F64, approx, assert_close, scaled, tol

NEEDS_CPU = pytest.mark.skipif(not backends.available()["cpu"], reason="the CPU kernels could not be built here")
BACKENDS = [pytest.param("torch", F64, id="torch-f64"), pytest.param("torch", F32, id="torch-f32"),
            pytest.param("cpu", F32, id="cpu-f32", marks=NEEDS_CPU)]


def _forward_kl(student, ids, t_lp, min_clamp):
    s = oracle.head_logprobs(student, ids)
    t = t_lp.double()
    slots = ids >= 0
    if min_clamp is not None:
        s, t = s.clamp_min(min_clamp), t.clamp_min(min_clamp)
    s = torch.where(slots, s, torch.zeros_like(s))
    t = torch.where(slots, t, torch.zeros_like(t))
    return torch.where(slots, t.exp() * (t - s), torch.zeros_like(t)).sum(-1)


@pytest.mark.parametrize("backend,dtype", BACKENDS)
@pytest.mark.parametrize("kind", ["forward_kl", "forward_kl_tail", "reverse_kl"])
@settings(max_examples=scaled(30), deadline=None)
@given(N=st.integers(0, 10), V=st.integers(2, 40), k=st.integers(1, 8), seed=st.integers(0, 2**31 - 1),
       min_clamp=st.sampled_from([None, -6.0]), max_clamp=st.sampled_from([None, 0.3]), masked=st.booleans())
def test_distillation_losses_match_the_oracle(backend, dtype, kind, N, V, k, seed, min_clamp, max_clamp, masked):
    gen = torch.Generator().manual_seed(seed)
    k = min(k, V)
    student = (torch.randn(N, V, generator=gen, dtype=F64) * 2).to(dtype)
    teacher = torch.log_softmax(torch.randn(N, V, generator=gen, dtype=F64) * 2, -1)
    ids = teacher.topk(k, -1).indices
    ids = torch.where(torch.rand(N, k, generator=gen) < 0.2, torch.full_like(ids, -1), ids)
    t_lp = torch.where(ids >= 0, teacher.gather(-1, ids.clamp_min(0)), torch.zeros(N, k, dtype=F64)).to(F32)
    mask = torch.rand(N, generator=gen) < 0.7 if masked else torch.ones(N, dtype=torch.bool)
    logits = student.clone().requires_grad_(True)
    out = rlkernels.topk_distillation_loss(logits, ids, t_lp, mask, kind=kind, log_prob_min_clamp=min_clamp,
                                           loss_max_clamp=max_clamp, backend=backend)
    ref_logits = student.detach().double().clone().requires_grad_(True)
    if kind == "forward_kl":
        want = _forward_kl(ref_logits, ids, t_lp, min_clamp)
    else:
        div = oracle.token_divergences(ref_logits, reference_topk_ids=ids, reference_topk_logprobs=t_lp)
        want = div["kl" if kind == "forward_kl_tail" else "reverse_kl"]
    if max_clamp is not None:
        want = want.clamp(-max_clamp, max_clamp)
    want = torch.where(mask, want, torch.zeros_like(want))
    # rows whose tail is within rounding of empty (tail_mass) may be +inf on one side only: not compared
    finite = torch.isfinite(want.detach()) & (want.detach().abs() < 1e5)
    stat = F64 if dtype == F64 else F32
    scale = max(1.0, float(want.detach()[finite].abs().max())) if finite.any() else 1.0
    assert_close(out.losses[finite], want[finite], **tol("divergence", stat, scale=scale), name="losses")
    if N and bool(finite.all()):
        (grad,) = torch.autograd.grad(out.loss, logits)
        ref_loss = want.sum() / max(1, int(mask.sum()))
        (ref_grad,) = torch.autograd.grad(ref_loss, ref_logits)
        q = tol("divergence.dlogits", dtype, scale=max(1e-3, float(ref_grad.abs().max())))
        assert_close(grad, ref_grad, **q, name="dlogits")
        assert not bool(grad[~mask].any()), "a gradient on a row outside the mask"
    n = max(1, int(mask.sum()))
    mass = oracle.head_logprobs(student.detach().double(), ids).exp().sum(-1)
    mass = torch.where(mask, mass, torch.zeros(N, dtype=F64))
    # the fp32 row for every dtype
    assert float(out.metrics["distillation/student_mass"]) == approx(float(mass.sum()) / n, "head_mass", F32)


def test_distillation_arguments_are_checked():
    logits = torch.randn(4, 10)
    ids = torch.tensor([[0, 1]] * 4)
    lp = torch.full((4, 2), -2.0)
    with pytest.raises(ValueError, match="loss_agg_mode"):
        rlkernels.topk_distillation_loss(logits, ids, lp, loss_agg_mode="seq-mean-token-mean")
    with pytest.raises(ValueError, match="loss_max_clamp: expected a value > 0"):
        rlkernels.topk_distillation_loss(logits, ids, lp, loss_max_clamp=0.0)
    with pytest.raises(ValueError, match="teacher_topk_ids: an id appears twice"):
        rlkernels.topk_distillation_loss(logits, torch.tensor([[0, 0]] * 4), lp)
    with pytest.raises(ValueError, match="teacher_topk_logprobs: expected full-vocabulary log-probs"):
        rlkernels.topk_distillation_loss(logits, ids, torch.full((4, 2), -0.1))
    with pytest.raises(ValueError, match="response_mask: expected shape"):
        rlkernels.topk_distillation_loss(logits, ids, lp, torch.ones(3))
