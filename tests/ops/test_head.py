"""Head-id statistics and the divergences of SPEC §9 against the float64 oracle (rlkernels.reference.divergences).

The head primitive (ops.head) is checked on its own, with a loss that gives every coefficient it carries a
random value: c_t on log p_y, e_t on the entropy and the [N, k] matrix C on the head's log-probs, so that the
backward's k + 1 rewritten columns, the pads' donor slots and the shared -sum c p term are all exercised. Logits
come in every kind the suite uses (-inf entries, offsets of +-1e4, near one-hot rows), as [N, V] and as the
causal-shift view [B, T, V], on every backend this machine runs (Triton through its interpreter).
"""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import rlkernels
from rlkernels import RolloutCorrection, backends
from rlkernels.backends.base import FOREIGN_TARGET
from rlkernels.backends.temperature import Temperature
from rlkernels.ops import head as head_ops
from rlkernels.reference import divergences as oracle
from rlkernels.reference import token_stats as oracle_stats

from ..cases import F32, F64, assert_close, at_most, interpreted, make_logits, scaled, tol

BF16 = torch.bfloat16
NEEDS = {
    "cpu": pytest.mark.skipif(not backends.available()["cpu"], reason="the CPU kernels could not be built here"),
    "triton": [pytest.mark.interpret,
               pytest.mark.skipif(not backends.available()["triton"], reason="Triton is not importable here")],
}
BACKEND_DTYPES = [pytest.param(b, d, marks=NEEDS.get(b, ()), id=f"{b}-{str(d)[6:]}") for b, d in
                  [("torch", F64), ("torch", F32), ("torch", BF16), ("cpu", F32), ("cpu", BF16), ("triton", F32),
                   ("triton", BF16)]]
KINDS = ["normal", "offset_pos", "offset_neg", "neg_inf", "one_hot"]


def make_head_ids(gen: torch.Generator, N: int, V: int, k: int, labels: torch.Tensor, with_label: float = 0.5,
                  pad_p: float = 0.2) -> torch.Tensor:
    """[N, k] distinct ids per row (the label among them with probability `with_label`), some slots -1."""
    rows = []
    for y in labels.tolist():
        ids = torch.randperm(V, generator=gen)[:k]
        if 0 <= y < V and float(torch.rand((), generator=gen)) < with_label and y not in ids.tolist():
            ids[0] = y
        ids = torch.where(torch.rand(k, generator=gen) < pad_p, torch.full_like(ids, -1), ids)
        rows.append(ids[torch.randperm(k, generator=gen)])
    return torch.stack(rows) if rows else torch.zeros(0, k, dtype=torch.long)


@st.composite
def head_problems(draw, max_rows=9, max_vocab=60):
    V = draw(st.integers(2, max_vocab))
    N = draw(st.integers(0, max_rows))
    k = draw(st.integers(1, min(V, 8)))
    seed = draw(st.integers(0, 2**31 - 1))
    kind = draw(st.sampled_from(KINDS))
    gen = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, V, (N,), generator=gen)
    labels = torch.where(torch.rand(N, generator=gen) < 0.2, torch.full_like(labels, -100), labels)
    temperature = draw(st.sampled_from([1.0, 0.7, "token"]))
    if temperature == "token":
        temperature = 0.4 + torch.rand(N, generator=gen, dtype=F32)
    return dict(V=V, N=N, k=k, seed=seed, kind=kind, labels=labels, temperature=temperature,
                ids=make_head_ids(gen, N, V, k, labels), shifted=draw(st.booleans()), labelled=draw(st.booleans()))


def _logits(p, dtype):
    """(leaf, the rows the pass reads, the float64 oracle's logits): [N, V] rows, or the causal-shift view
    [1, N, V] of a [1, N + 1, V] leaf (read in place)."""
    gen = torch.Generator().manual_seed(p["seed"] + 1)
    full = make_logits(gen, (p["N"] + 1, p["V"]), p["kind"], F64).to(dtype)
    base = full[:-1].to(F64)  # the oracle reads what the fast path reads (the rounded logits)
    if p["shifted"]:
        leaf = full[None].clone().requires_grad_(True)
        return leaf, leaf[:, :-1], base
    leaf = full[:-1].clone().requires_grad_(True)
    return leaf, leaf, base


@pytest.mark.parametrize("backend,dtype", BACKEND_DTYPES)
@settings(max_examples=scaled(40), deadline=None)
@given(p=head_problems())
def test_head_stats_and_every_coefficient_match_the_oracle(backend, dtype, p):
    leaf, rows_in, base = _logits(p, dtype)
    N, k = p["N"], p["k"]
    labels, ids, T = p["labels"], p["ids"], p["temperature"]
    keep = labels >= 0
    if p["labelled"]:
        row_labels = torch.where(keep, labels, torch.full_like(labels, -1))
    else:
        row_labels, keep = torch.full_like(labels, FOREIGN_TARGET), torch.ones_like(keep)
    t_op = Temperature.of(T)
    out = head_ops.head_token_stats(rows_in, row_labels, ids, t_op, True, True, backend)
    gen = torch.Generator().manual_seed(p["seed"] + 2)
    w_lp, w_h = torch.randn(N, generator=gen, dtype=F64), torch.randn(N, generator=gen, dtype=F64)
    w_head = torch.randn(N, k, generator=gen, dtype=F64)

    ref_logits = base.clone().requires_grad_(True)
    lab_ref = torch.where(keep & (labels >= 0), labels, torch.full_like(labels, -100)) if p["labelled"] else \
        torch.zeros_like(labels)
    lp, H, s2 = oracle_stats(ref_logits, lab_ref, temperature=T)
    if not p["labelled"]:
        lp = torch.zeros_like(lp)  # no label: log p_y is 0 and carries nothing
        _, H, s2 = oracle_stats(ref_logits, torch.zeros_like(labels), temperature=T)
    head = oracle.head_logprobs(ref_logits, ids, T)
    head = torch.where(keep[:, None], head, torch.zeros_like(head))
    stat = F64 if dtype == F64 else F32
    scale = _scale
    assert_close(out.head_logprobs, head, **tol("value", stat, scale=scale(head)), name="head_logprobs")
    assert_close(out.logprobs, lp, **tol("value", stat, scale=scale(lp)), name="logprobs")
    assert_close(out.entropy, torch.where(keep, H, torch.zeros_like(H)), **tol("value", stat, scale=scale(H)),
                 name="entropy")
    assert_close(out.sum_pi_squared, torch.where(keep, s2, torch.zeros_like(s2)), **tol("value", stat), name="s2")

    finite_head = torch.where(torch.isfinite(out.head_logprobs), out.head_logprobs, torch.zeros_like(out.head_logprobs))
    loss = (out.logprobs * w_lp.to(out.logprobs.dtype)).sum() + (out.entropy * w_h.to(out.entropy.dtype)).sum() \
        + (finite_head * w_head.to(finite_head.dtype)).sum()
    (grad,) = torch.autograd.grad(loss, leaf)
    if p["shifted"]:
        assert not bool(grad[:, -1].any()), "a gradient in the row the causal shift leaves out"
        grad = grad[:, :-1]
    ref_head = torch.where(torch.isfinite(head), head, torch.zeros_like(head))
    ref_loss = (lp * w_lp).sum() + (torch.where(keep, H, torch.zeros_like(H)) * w_h).sum() + (ref_head * w_head).sum()
    (ref_grad,) = torch.autograd.grad(ref_loss, ref_logits)
    q = tol("dlogits", dtype, scale=max(1e-3, float(ref_grad.abs().max())) if ref_grad.numel() else 1.0,
            interpreter=backend == "triton" and interpreted())
    # the entropy's -p (log p + H) and the head's columns cancel O(|coef| / T) terms in float32: an absolute
    # 2^-22 sum |coef| / T (as test_kept_set), whatever the size of the result
    if dtype != F64 and N:
        inv_t = 1.0 / (T if isinstance(T, float) else float(T.min()))
        q["atol"] = max(q["atol"], 2.0**-21 * inv_t * (1 + float(w_head.abs().sum(1).max())))
    assert_close(grad.reshape(ref_grad.shape), ref_grad, **q, name="dlogits")


def _scale(t: torch.Tensor) -> float:
    """max(1, the largest finite |t|): the scale of a comparison's absolute tolerance."""
    finite = t.detach()[torch.isfinite(t.detach())]
    return max(1.0, float(finite.abs().max())) if finite.numel() else 1.0


def _topk_of(mu_logp: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    lq = mu_logp.gather(-1, ids.clamp_min(0))
    return torch.where(ids >= 0, lq, torch.zeros_like(lq))  # pads: any value


@pytest.mark.parametrize("backend,dtype", [p for p in BACKEND_DTYPES if p.values[1] != BF16])
@pytest.mark.parametrize("mode", ["selected", "support", "full"])
@settings(max_examples=scaled(25), deadline=None)
@given(p=head_problems())
def test_token_divergences_match_the_oracle(backend, dtype, mode, p):
    leaf, logits, base = _logits(p, dtype)
    N, V = p["N"], p["V"]
    labels, ids, T = p["labels"], p["ids"], p["temperature"]
    gen = torch.Generator().manual_seed(p["seed"] + 3)
    mu_logits = make_logits(gen, (N, V), p["kind"], F64)
    if mode == "support":
        # the sampler's kept set: μ lives on the ids, which hold the sampled token
        ids = torch.where((ids < 0).all(1, keepdim=True) & (labels[:, None] >= 0), ids, ids)
        ids[:, 0] = torch.where(labels >= 0, labels, ids[:, 0])
        ids = _distinct(ids)
    mu_logp = torch.log_softmax(mu_logits, -1)
    lab = labels if p["labelled"] else None
    kw = dict(reference_logits=mu_logits.reshape(logits.shape).to(dtype)) if mode == "full" else \
        dict(reference_topk_ids=ids.reshape(logits.shape[:-1] + (ids.shape[1],)),
             reference_topk_logprobs=_topk_of(mu_logp, ids).to(F32).reshape(logits.shape[:-1] + (ids.shape[1],)),
             mode=mode)
    validate = mode != "selected" or True
    out = rlkernels.token_divergences(logits, None if lab is None else lab.reshape(logits.shape[:-1]), temperature=T
                                      if not isinstance(T, torch.Tensor) else T.reshape(logits.shape[:-1]),
                                      backend=backend, validate=validate, **kw)
    ref_logits = base.clone().requires_grad_(True)
    kw_ref = dict(reference_logits=kw["reference_logits"].double().reshape(N, V)) if mode == "full" else \
        dict(reference_topk_ids=ids, reference_topk_logprobs=kw["reference_topk_logprobs"].reshape(ids.shape),
             mode=mode)
    ref = oracle.token_divergences(ref_logits, labels=lab, temperature=T, **kw_ref)
    rows = torch.ones(N, dtype=torch.bool) if lab is None else labels >= 0
    stat = F64 if dtype == F64 else F32
    # the top-k form's tail bucket is 1 - sum_H p, a subtraction: a tail below its rounding error (k ulps of 1)
    # is noise in both, and one side may see 0 (an infinite KL) where the other sees 1e-16. Such rows, and rows
    # with an infinite divergence (no meaningful gradient), are compared on values only where both agree on it
    if mode == "full":
        clean = torch.ones(N, dtype=torch.bool)
    else:
        floor = 1e-5 if stat == F32 else 1e-12  # above the k-ulp floor of tail_mass (k <= 8)
        tails = [1 - ref["trainer_head_mass"].detach()] + ([] if mode == "support" else
                                                           [1 - ref["sampler_head_mass"].detach()])
        clean = torch.stack([(t > floor) | (t == 0) for t in tails]).all(0)
    for name in ("kl", "reverse_kl", "chi2", "tv"):
        if name in ref and (mode != "support" or name in ("kl", "tv")):
            clean &= torch.isfinite(ref[name].detach()) & (ref[name].detach().abs() < 1e6)
    loss, ref_loss = 0, 0
    weight = torch.linspace(0.5, 1.5, N, dtype=F64)
    for name in ("kl", "reverse_kl", "chi2", "tv"):
        got = getattr(out, name)
        if mode == "support" and name in ("reverse_kl", "chi2"):
            assert got is None
            continue
        want = torch.where(rows, ref[name], torch.zeros_like(ref[name]))
        sel = clean | ~rows
        finite = torch.isfinite(want.detach()) & sel
        scale = max(1.0, float(want.detach()[finite].abs().max())) if finite.any() else 1.0
        assert_close(got.reshape(-1)[sel], want[sel], **tol("divergence", stat, scale=scale), name=name)
        loss = loss + torch.where(clean, got.reshape(-1), torch.zeros_like(got.reshape(-1))).mul(weight).sum()
        ref_loss = ref_loss + torch.where(clean, want, torch.zeros_like(want)).mul(weight).sum()
    if N:
        (grad,) = torch.autograd.grad(loss, leaf)
        (ref_grad,) = torch.autograd.grad(ref_loss, ref_logits)
        grad, ref_grad = grad.reshape(-1, V)[:N][clean], ref_grad[clean]
        q = tol("divergence.dlogits", dtype, scale=max(1e-3, float(ref_grad.abs().max())) if ref_grad.numel() else 1)
        assert_close(grad, ref_grad, **q, name="dlogits")
    if mode != "full":
        assert_close(out.trainer_head_mass.reshape(-1), torch.where(rows, ref["trainer_head_mass"], 0 * rows),
                     **tol("value", stat), name="trainer_head_mass")
        if lab is not None:
            assert torch.equal(out.sampled_in_head.reshape(-1), ref["sampled_in_head"] & rows)
    assert out.form == ("full" if mode == "full" else f"topk_{mode}")


def _distinct(ids: torch.Tensor) -> torch.Tensor:
    """Pads the later duplicates of each row's ids."""
    out = ids.clone()
    for r in range(ids.shape[0]):
        seen = set()
        for j in range(ids.shape[1]):
            v = int(ids[r, j])
            if v >= 0 and v in seen:
                out[r, j] = -1
            seen.add(v)
    return out


@settings(max_examples=scaled(30), deadline=None)
@given(p=head_problems(max_vocab=40))
def test_the_topk_form_bounds_the_full_one_and_support_mode_is_exact(p):
    """Data processing: every divergence of the partition {ids, tail} is at most the full one; with μ living on
    the ids ("support"), KL(μ||π) and TV are the full values."""
    N, V = p["N"], p["V"]
    gen = torch.Generator().manual_seed(p["seed"] + 4)
    logits = make_logits(gen, (N, V), "normal", F64)
    mu_logits = make_logits(gen, (N, V), "normal", F64)
    ids = p["ids"]
    full = rlkernels.token_divergences(logits, reference_logits=mu_logits)
    topk = rlkernels.token_divergences(logits, reference_topk_ids=ids,
                                       reference_topk_logprobs=_topk_of(torch.log_softmax(mu_logits, -1), ids))
    for name in ("kl", "reverse_kl", "chi2", "tv"):
        assert at_most(getattr(topk, name), getattr(full, name), "divergence.topk_bound", F64), name
    on_ids = torch.zeros(N, V + 1, dtype=torch.bool).scatter(1, torch.where(ids >= 0, ids, V), True)[:, :V]
    mu_on_ids = mu_logits.masked_fill(~on_ids, float("-inf"))
    has = on_ids.any(1)
    exact = rlkernels.token_divergences(logits, reference_logits=torch.where(has[:, None], mu_on_ids, mu_logits))
    support = rlkernels.token_divergences(logits, reference_topk_ids=ids, mode="support",
                                          reference_topk_logprobs=_topk_of(torch.log_softmax(mu_logits, -1), ids))
    for name in ("kl", "tv"):
        assert_close(getattr(support, name)[has], getattr(exact, name)[has], **tol("value", F64), name=name)
    assert topk.lower_bounds == ("kl", "reverse_kl", "chi2", "tv") and support.lower_bounds == ()


@pytest.mark.parametrize("dtype", [F64, F32])
@settings(max_examples=scaled(20), deadline=None)
@given(p=head_problems(max_vocab=40))
def test_linear_head_logprobs_match_the_oracle(dtype, p):
    from rlkernels.inputs import PreparedBatch
    from rlkernels.ops import PassOptions, linear_head_stats

    N, V, k = p["N"], p["V"], p["k"]
    gen = torch.Generator().manual_seed(p["seed"] + 5)
    hidden, weight, bias = (torch.randn(N, 5, generator=gen, dtype=F64), torch.randn(V, 5, generator=gen, dtype=F64),
                            torch.randn(V, generator=gen, dtype=F64))
    leaves = [t.to(dtype).requires_grad_(True) for t in (hidden, weight, bias)]
    labels, ids, T = p["labels"], p["ids"], p["temperature"]
    keep = labels >= 0
    row_labels = torch.where(keep, labels, torch.full_like(labels, -1))
    t_op = Temperature.of(T)
    batch = PreparedBatch(token_shape=(N,), mask=keep, row_labels=row_labels, vocab_size=V, temperature=t_op)
    out = linear_head_stats(*leaves, batch, PassOptions(memory_budget_bytes=64), ids)
    refs = [t.clone().requires_grad_(True) for t in (hidden, weight, bias)]
    z = refs[0] @ refs[1].T + refs[2]
    head = torch.where(keep[:, None], oracle.head_logprobs(z, ids, T), torch.zeros(N, k, dtype=F64))
    stat = F64 if dtype == F64 else F32
    assert_close(out.head_logprobs, head, **tol("value", stat, scale=10.0), name="head_logprobs")
    w = torch.randn(N, k, generator=gen, dtype=F64)
    fin = torch.isfinite(head)
    got = (torch.where(fin, out.head_logprobs, 0 * w) * w.to(out.head_logprobs.dtype)).sum()
    grads = torch.autograd.grad(got, leaves)
    ref_grads = torch.autograd.grad((torch.where(fin, head, 0 * w) * w).sum(), refs)
    for name, g, r in zip(("d_hidden", "d_weight", "d_bias"), grads, ref_grads):
        assert_close(g, r, **tol("value", stat, scale=_scale(r)), name=name)


# ---- input checks ------------------------------------------------------------------------------------
def _topk_case():
    logits = torch.randn(2, 3, 10)
    ids = torch.tensor([[[0, 1], [2, 3], [4, -1]], [[5, 6], [7, 8], [9, 0]]])
    lp = torch.full((2, 3, 2), -3.0)
    return logits, ids, lp


@pytest.mark.parametrize("change,message", [
    (lambda ids, lp: (ids.index_fill(2, torch.tensor([1]), 10), lp), "reference_topk_ids: expected token ids in"),
    (lambda ids, lp: (ids.index_fill(2, torch.tensor([1]), -2), lp), "reference_topk_ids: expected token ids in"),
    (lambda ids, lp: (torch.stack([ids[..., 0], ids[..., 0]], -1), lp), "an id appears twice"),
    (lambda ids, lp: (ids, lp.index_fill(2, torch.tensor([0]), 0.5)), "expected log-probs <= 0"),
    (lambda ids, lp: (ids, lp.index_fill(2, torch.tensor([0]), float("nan"))), "expected no NaN"),
    (lambda ids, lp: (ids, torch.full_like(lp, -0.1)), "mass exceeds"),
])
def test_bad_topk_values_raise_naming_the_argument(change, message):
    logits, ids, lp = _topk_case()
    ids, lp = change(ids, lp)
    with pytest.raises(ValueError, match=message):
        rlkernels.token_divergences(logits, reference_topk_ids=ids, reference_topk_logprobs=lp)


def test_bad_topk_structure_raises_before_any_pass():
    logits, ids, lp = _topk_case()
    with pytest.raises(ValueError, match="reference_topk_logprobs: expected a tensor"):
        rlkernels.token_divergences(logits, reference_topk_ids=ids)
    with pytest.raises(ValueError, match="reference_topk_ids: expected shape"):
        rlkernels.token_divergences(logits, reference_topk_ids=ids[0], reference_topk_logprobs=lp[0])
    with pytest.raises(ValueError, match="k <= V"):
        rlkernels.token_divergences(logits[..., :1], reference_topk_ids=ids, reference_topk_logprobs=lp)
    with pytest.raises(TypeError, match="reference_topk_ids: expected an integer dtype"):
        rlkernels.token_divergences(logits, reference_topk_ids=ids.float(), reference_topk_logprobs=lp)
    with pytest.raises(ValueError, match="reference_topk_logprobs: expected shape"):
        rlkernels.token_divergences(logits, reference_topk_ids=ids, reference_topk_logprobs=lp[..., :1])
    with pytest.raises(ValueError, match="reference_logits: given with"):
        rlkernels.token_divergences(logits, reference_logits=logits, reference_topk_ids=ids,
                                    reference_topk_logprobs=lp)
    with pytest.raises(ValueError, match="reference_logits: expected shape"):
        rlkernels.token_divergences(logits, reference_logits=logits[:, :2])
    with pytest.raises(ValueError, match="expected the second distribution"):
        rlkernels.token_divergences(logits)
    with pytest.raises(ValueError, match="mode: expected one of"):
        rlkernels.token_divergences(logits, reference_topk_ids=ids, reference_topk_logprobs=lp, mode="kept")
    with pytest.raises(ValueError, match="reference_temperature: only the full form"):
        rlkernels.token_divergences(logits, reference_topk_ids=ids, reference_topk_logprobs=lp,
                                    reference_temperature=0.5)


def test_support_mode_requires_the_sampled_token():
    logits, ids, lp = _topk_case()
    labels = torch.tensor([[0, 2, 4], [5, 7, 3]])  # 3 is not among row (1, 2)'s ids
    with pytest.raises(ValueError, match="reference_topk_ids: mode='support' but a sampled token"):
        rlkernels.token_divergences(logits, labels, reference_topk_ids=ids, reference_topk_logprobs=lp, mode="support")
    labels[1, 2] = 9
    out = rlkernels.token_divergences(logits, labels, reference_topk_ids=ids, reference_topk_logprobs=lp,
                                      mode="support")
    assert bool(out.sampled_in_head.all())
    assert out.reverse_kl is None and out.chi2 is None


def test_inputs_are_not_modified():
    logits, ids, lp = _topk_case()
    copies = [t.clone() for t in (logits, ids, lp)]
    leaf = logits.requires_grad_(True)
    out = rlkernels.token_divergences(leaf, reference_topk_ids=ids, reference_topk_logprobs=lp)
    out.kl.sum().backward()
    for a, b in zip((logits, ids, lp), copies):
        assert torch.equal(a.detach(), b)


@pytest.mark.interpret
@pytest.mark.skipif(not backends.available()["triton"], reason="Triton is not importable here")
@pytest.mark.parametrize("dtype", [F32, BF16])
def test_the_full_form_runs_the_triton_kernels_and_agrees_with_the_chunked_pass(dtype, monkeypatch):
    """backend="triton" with one temperature takes kernels/triton/divergences.py (one read forward and a second
    for TV, one backward); the chunked PyTorch pass of the other backends is the comparison, on the causal-shift
    view."""
    from rlkernels.kernels.triton import divergences as kernels

    calls = []
    fwd, bwd = kernels.full_divergences_fwd, kernels.full_divergences_bwd
    monkeypatch.setattr(kernels, "full_divergences_fwd", lambda *a: calls.append("fwd") or fwd(*a))
    monkeypatch.setattr(kernels, "full_divergences_bwd", lambda *a: calls.append("bwd") or bwd(*a))
    gen = torch.Generator().manual_seed(0)
    whole = (torch.randn(2, 6, 300, generator=gen) * 3).to(dtype)
    whole[0, 1, :100] = float("-inf")
    reference = (torch.randn(2, 5, 300, generator=gen) * 3).to(dtype)
    results = {}
    for backend in ("triton", "torch"):
        leaf = whole.clone().requires_grad_(True)
        out = rlkernels.token_divergences(leaf[:, :-1], reference_logits=reference, temperature=0.8, backend=backend)
        loss = out.kl.sum() + out.reverse_kl.sum() + 1e-3 * out.chi2.sum() + out.tv.sum()
        (grad,) = torch.autograd.grad(loss, leaf)
        results[backend] = (out, grad)
    assert calls == ["fwd", "bwd"]
    (a, ga), (b, gb) = results["triton"], results["torch"]
    for name in ("kl", "reverse_kl", "chi2", "tv"):
        assert_close(getattr(a, name), getattr(b, name), **tol("divergence", F32, scale=_scale(getattr(b, name))),
                     name=name)
    q = tol("divergence.dlogits", F32, scale=max(1e-3, float(gb.float().abs().max())))
    if dtype == BF16:  # both round the float32 gradient to bf16 once, maybe to neighbouring values
        q = tol("dlogits@interpreter", BF16, scale=max(1e-3, float(gb.float().abs().max())))
    assert_close(ga.float(), gb.float(), **q, name="dlogits")
    assert not bool(ga[:, -1].any())


@pytest.mark.interpret
@pytest.mark.skipif(not backends.available()["triton"], reason="Triton is not importable here")
def test_leaving_tv_out_takes_the_one_read_kernel_and_changes_nothing_else(monkeypatch):
    """divergences= without "tv": the Triton forward runs with with_tv=False (one read of both tensors) and the
    other three divergences and their gradient are those of the default call; tv comes back None."""
    from rlkernels.kernels.triton import divergences as kernels

    seen = []
    fwd = kernels.full_divergences_fwd
    monkeypatch.setattr(kernels, "full_divergences_fwd", lambda *a: seen.append(a[5] if len(a) > 5 else True)
                        or fwd(*a))
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(5, 300, generator=gen) * 3
    reference = torch.randn(5, 300, generator=gen) * 3
    results = []
    for wanted in (("kl", "reverse_kl", "chi2", "tv"), ("kl", "reverse_kl", "chi2")):
        leaf = logits.clone().requires_grad_(True)
        out = rlkernels.token_divergences(leaf, reference_logits=reference, temperature=0.8, backend="triton",
                                          divergences=wanted)
        (grad,) = torch.autograd.grad(out.kl.sum() + out.reverse_kl.sum() + 1e-3 * out.chi2.sum(), leaf)
        results.append((out, grad))
    assert seen == [True, False]
    (a, ga), (b, gb) = results
    assert b.tv is None and a.tv is not None
    for name in ("kl", "reverse_kl", "chi2"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name
    assert torch.equal(ga, gb)


def test_divergences_selects_what_is_reported_and_refuses_unknown_names():
    gen = torch.Generator().manual_seed(2)
    logits, reference = torch.randn(4, 50, generator=gen), torch.randn(4, 50, generator=gen)
    every = rlkernels.token_divergences(logits, reference_logits=reference)
    some = rlkernels.token_divergences(logits, reference_logits=reference, divergences=["chi2", "kl"])
    assert some.reverse_kl is None and some.tv is None
    assert torch.equal(some.kl, every.kl) and torch.equal(some.chi2, every.chi2)
    ids = torch.topk(reference, 5).indices
    lp = torch.log_softmax(reference, -1).gather(1, ids)
    topk = rlkernels.token_divergences(logits, reference_topk_ids=ids, reference_topk_logprobs=lp, divergences="tv")
    assert topk.kl is None and topk.tv is not None
    for bad in ((), ("kl", "js"), "entropy"):
        with pytest.raises(ValueError, match="divergences"):
            rlkernels.token_divergences(logits, reference_logits=reference, divergences=bad)


# ---- regressions found in review -------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [F32, torch.float16, BF16])
def test_half_precision_sampler_logprobs_keep_a_real_tail(dtype):
    """A 12 % sampler tail given as bf16 log-probs is not mistaken for rounding noise: every divergence stays a
    finite lower bound of the exact one (the tail's noise bound counts the log-probs' own rounding)."""
    gen = torch.Generator().manual_seed(0)
    s = torch.randn(1, 1000, generator=gen, dtype=F64) * 4.2
    mu = torch.log_softmax(s, -1)
    ids = mu.topk(20, -1).indices
    z = s + 0.3
    z[0, ids[0, :5]] += 0.5
    top = rlkernels.token_divergences(z.float(), reference_topk_ids=ids, reference_topk_logprobs=mu.gather(-1, ids)
                                      .to(dtype))
    full = rlkernels.token_divergences(z.float(), reference_logits=s.float())
    for name in ("kl", "reverse_kl", "chi2", "tv"):
        value = float(getattr(top, name))
        assert math.isfinite(value) and value >= 0, (name, value)
        # a bound, up to the log-probs' rounding (the bf16 row holds every dtype here)
        assert at_most(value, float(getattr(full, name)), "divergence.topk_bound.rounded_logprobs", BF16), name


def test_a_noise_tail_against_a_real_one_never_rejects_what_the_exact_criterion_keeps():
    """Trainer tail 1e-6 (below k float32 ulps), sampler tail 1e-5: the top-k KL is finite and below the exact
    one, so TRM keeps the tokens the exact form keeps; the reverse-KL distillation has finite gradients."""
    V, k, T = 200, 20, 4
    head = torch.randn(k, dtype=F64, generator=torch.Generator().manual_seed(0)) * 2

    def with_tail(tail):
        r = torch.empty(V, dtype=F64)
        r[:k] = torch.log(torch.softmax(head, 0) * (1 - tail))
        r[k:] = math.log(tail / (V - k))
        return r

    z = torch.stack([with_tail(1e-6)] * T)[None].float()
    s = torch.stack([with_tail(1e-5)] * T)[None]
    mu = torch.log_softmax(s, -1)
    ids, lq = torch.arange(k).expand(1, T, k), mu[..., :k].float()
    full = rlkernels.token_divergences(z, reference_logits=s.float())
    top = rlkernels.token_divergences(z, reference_topk_ids=ids, reference_topk_logprobs=lq)
    assert bool(torch.isfinite(top.kl).all()) and at_most(top.kl, full.kl, "divergence.topk_bound", F32)
    labels, mask = torch.zeros(1, T, dtype=torch.long), torch.ones(1, T, dtype=torch.bool)
    rollout = mu[..., 0].float()
    out = rlkernels.decoupled_ppo_loss(z, labels, torch.ones(1, T), mask, old_logprobs=rollout,
                                       rollout_logprobs=rollout, rollout_correction=RolloutCorrection.trm(0.01),
                                       sampler_topk_ids=ids, sampler_topk_logprobs=lq)
    assert bool(out.mask.all())
    leaf = z.clone().requires_grad_(True)
    dist = rlkernels.topk_distillation_loss(leaf, ids, lq, kind="reverse_kl")
    (grad,) = torch.autograd.grad(dist.loss, leaf)
    assert bool(torch.isfinite(grad).all()) and math.isfinite(float(dist.loss))


def test_out_of_range_ids_on_rows_outside_the_loss_are_never_read():
    logits = torch.randn(2, 3, 11, requires_grad=True)
    labels = torch.tensor([[1, 2, -100], [3, 4, 5]])
    ids = torch.tensor([[[1, 2], [2, 3], [11, 40]], [[3, 0], [4, 1], [5, 2]]])  # row (0, 2) is ignored
    lp = torch.full((2, 3, 2), -3.0)
    out = rlkernels.token_divergences(logits, labels, reference_topk_ids=ids, reference_topk_logprobs=lp)
    assert float(out.kl[0, 2]) == 0.0
    out.kl.sum().backward()
    assert not bool(logits.grad[0, 2].any())
    loss = rlkernels.decoupled_ppo_loss(logits, labels, torch.ones(2), torch.ones(2, 3), sampler_topk_ids=ids,
                                        sampler_topk_logprobs=lp)
    assert math.isfinite(float(loss.loss))


def test_peaked_bf16_sampler_logprobs_pass_the_head_mass_check():
    gen = torch.Generator().manual_seed(0)
    mu = torch.log_softmax(torch.randn(64, 50, generator=gen, dtype=F64) * 12, -1)
    ids = mu.topk(8, -1).indices
    rlkernels.token_divergences(torch.randn(64, 50, generator=gen), reference_topk_ids=ids,
                                reference_topk_logprobs=mu.gather(-1, ids).to(BF16))


@pytest.mark.parametrize("backend", [pytest.param(b, marks=NEEDS[b]) for b in ("cpu", "triton")])
def test_head_coefficients_that_cancel_still_reach_their_columns(backend):
    """A row whose head coefficients sum to 0 with c = e = 0 (score centering: IcePop's f_y = 0, C = [0.5, -0.5])
    has no p term, but C_j / T at each id: the kernels must not skip it as a row without coefficients (the CPU
    kernel did, found by review)."""
    from rlkernels.backends import instance

    gen = torch.Generator().manual_seed(0)
    N, V, k = 4, 40, 3
    logits = torch.randn(N, V, generator=gen)
    labels = torch.randint(0, V, (N,), generator=gen)
    ids = torch.stack([torch.randperm(V, generator=gen)[:k] for _ in range(N)])
    ids = torch.where(ids == labels[:, None], (ids + 1) % V, ids)  # no id is the label here
    T = Temperature.of(0.8)
    c = torch.tensor([0.0, 0.3, 0.0, -0.2])
    C = torch.tensor([[0.5, -0.5, 0.0], [0.2, 0.1, 0.0], [0.25, 0.25, -0.5], [0.0, 0.0, 0.0]])
    grads = {}
    for name in (backend, "torch"):
        impl = instance(name)
        stats, head = impl.head_stats_fwd(logits, labels, ids, T, False, False)
        grads[name] = impl.head_grad_bwd(logits, labels, ids, stats.row_max, stats.log_norm, None, stats.logprobs,
                                         head, c, C, None, T)
    assert bool(grads["torch"][0].ne(0).any()), "the cancelling row has a gradient"
    assert_close(grads[backend], grads["torch"], **tol("value", F32), name="dlogits")
