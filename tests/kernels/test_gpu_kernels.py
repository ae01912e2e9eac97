"""The kernels compiled for the GPU at the shapes the CPU interpreter is too slow to try: vocabularies that are
not a multiple of the block (151,936, 50,257) and 262,144-id ones (Gemma-4, Qwen3.5), rows past 2^31 elements,
the causal-shift view, a partial last block of rows, -1 pads in the head ids. Each against the float64
reference on the rows it checks. The Triton kernels' small-shape tests (test_triton_token_*.py) run through the
interpreter on the CPU; these run compiled, and only on a GPU (skipped elsewhere; benchmarks/gpu_check.sh runs
them). The CUDA kernels' own GPU tests are tests/backends/test_cuda_backend.py; the two are compared here at the
vocabularies that file does not reach.

Tolerances: the kernel rows of cases.TOL, as on the interpreter (the same fp32 blocked sums; a GPU rounds bf16
the way the reference does, so no "@interpreter" row applies).
"""

import pytest
import torch

import rlkernels
from rlkernels import backends, reference

from ..cases import assert_close, make_coefficients, tol
from .test_triton_token_grad import oracle_grad
from .test_triton_token_stats import make_rows, oracle

pytestmark = pytest.mark.gpu

KERNELS = ["triton", pytest.param("cuda", marks=pytest.mark.skipif(
    not backends.is_available("cuda"), reason="the CUDA extension is not built (RLKERNELS_BUILD_CUDA=1)"))]


# V: 151,936 and 50,257 (a partial last block of 8192 columns), 262,144 (a whole number of blocks, 2^18);
# 1000 and 65 with 77 rows: several rows per program (BLOCK_N 2 and 8) and a partial last block of rows
@pytest.mark.parametrize("backend", KERNELS)
@pytest.mark.parametrize("V,N", [(151_936, 27), (262_144, 18), (50_257, 27), (1000, 77), (65, 77)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_stats_and_gradient_at_real_vocabularies(backend, V, N, dtype):
    logits, labels = make_rows(N, V, dtype, seed=V)  # every adversarial row kind, -1 and V labels among them
    T = 0.7
    lp, ent, s2, _ = oracle(logits, labels, T)
    kernels = backends.instance(backend)
    x, y = logits.cuda(), labels.cuda()
    stats = kernels.token_stats_fwd(x, y, T, True, True)
    for name, got, want in (("logprobs", stats.logprobs, lp), ("entropy", stats.entropy, ent),
                            ("sum_pi_squared", stats.sum_pi_squared, s2)):
        assert_close(got, want, **tol("kernel.stats"), name=name)
    c, e = make_coefficients(N, seed=V, zero_rows=(0, 5))
    expected = oracle_grad(logits, labels, T, c, e)
    g = kernels.token_grad_bwd(x, y, stats.row_max, stats.log_norm, stats.entropy, c.cuda(), e.cuda(), T, False)
    scale = max(1.0, float(expected.abs().max()))
    assert_close(g, expected, **tol("kernel.dlogits", dtype, scale=scale), name="dlogits")


@pytest.mark.parametrize("backend", KERNELS)
def test_rows_past_two_to_the_31_elements(backend):
    # N * V > 2^31 (bf16, 4.3 GB): a 32-bit row offset would wrap. Only the first two rows and the last four
    # (each starting past 2^31 elements, or crossing it) are in the loss: the others are never read.
    V = 151_936
    N = 2**31 // V + 3
    assert (N - 3) * V > 2**31
    logits = torch.randn(N, V, device="cuda", dtype=torch.bfloat16)
    rows = torch.tensor([0, 1, N - 4, N - 3, N - 2, N - 1], device="cuda")
    labels = torch.full((N,), -1, device="cuda")
    labels[rows] = torch.randint(0, V, (6,), device="cuda")
    kernels = backends.instance(backend)
    stats = kernels.token_stats_fwd(logits, labels, 1.0, True, False)
    picked = logits[rows].double().requires_grad_(True)
    lp, H, _ = reference.token_stats(picked, labels[rows])
    (ref,) = torch.autograd.grad(lp.sum() + 0.5 * H.sum(), picked)
    assert_close(stats.logprobs[rows], lp, **tol("kernel.stats"), name="logprobs")
    assert_close(stats.entropy[rows], H, **tol("kernel.stats"), name="entropy")
    ones = torch.ones(N, device="cuda")
    g = kernels.token_grad_bwd(logits, labels, stats.row_max, stats.log_norm, stats.entropy, ones, 0.5 * ones, 1.0,
                               False)
    assert_close(g[rows], ref, **tol("kernel.dlogits", torch.bfloat16, scale=max(1.0, float(ref.abs().max()))),
                 name="dlogits")
    assert int(torch.count_nonzero(g[2:N - 4])) == 0  # skipped rows: exactly zero


@pytest.mark.parametrize("backend", KERNELS)
def test_the_causal_shift_view_at_a_real_vocabulary(backend):
    # model_out[:, :-1] read where it lies (row stride V, batch stride (T + 1) V), through the public API
    B, T, V = 3, 17, 151_936
    gen = torch.Generator().manual_seed(1)
    whole = (torch.randn(B, T + 1, V, generator=gen) * 2).to(torch.bfloat16)
    labels = torch.randint(0, V, (B, T), generator=gen)
    labels[0, :4] = -100
    labels[2, -1] = -100
    leaf = whole.cuda().requires_grad_(True)
    out = rlkernels.token_logprobs(leaf[:, :-1], labels.cuda(), temperature=0.8, compute_entropy=True,
                                   backend=backend)
    w = torch.randn(B, T, generator=gen)
    (out.logprobs.cpu() * w + out.entropy.cpu()).sum().backward()
    x = whole[:, :-1].double().reshape(-1, V).requires_grad_(True)
    flat = labels.reshape(-1).clone()
    flat[flat < 0] = -1
    lp, H, _ = reference.token_stats(x, flat, temperature=0.8)
    valid = flat >= 0
    (ref,) = torch.autograd.grad((lp * w.reshape(-1).double()).sum() + (H * valid).sum(), x)
    assert_close(out.logprobs.reshape(-1), lp, **tol("kernel.stats"), name="logprobs")
    assert_close(out.entropy.reshape(-1)[valid], H[valid], **tol("kernel.stats"), name="entropy")
    grad = leaf.grad.cpu()
    assert not bool(grad[:, -1].any())  # the row the shift leaves out
    scale = max(1.0, float(ref.abs().max()))
    assert_close(grad[:, :-1].reshape(-1, V), ref, **tol("kernel.dlogits", torch.bfloat16, scale=scale),
                 name="dlogits")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_full_form_divergences_at_a_real_vocabulary(dtype):
    # kernels/triton/divergences.py (two reads forward, one backward) against the chunked PyTorch pass, on the
    # causal-shift view, 151,936 ids, one row with -inf entries
    B, T, V = 2, 9, 151_936
    gen = torch.Generator().manual_seed(2)
    whole = (torch.randn(B, T + 1, V, generator=gen) * 3).to(dtype).cuda()
    whole[0, 1, :50_000] = float("-inf")
    ref_logits = (torch.randn(B, T, V, generator=gen) * 3).to(dtype).cuda()
    results = {}
    for backend in ("triton", "torch"):
        leaf = whole.clone().requires_grad_(True)
        out = rlkernels.token_divergences(leaf[:, :-1], reference_logits=ref_logits, temperature=0.9, backend=backend)
        (out.kl.sum() + out.reverse_kl.sum() + 1e-3 * out.chi2.sum() + out.tv.sum()).backward()
        results[backend] = (out, leaf.grad)
    (a, ga), (b, gb) = results["triton"], results["torch"]
    for name in ("kl", "reverse_kl", "chi2", "tv"):
        want = getattr(b, name)
        scale = max(1.0, float(want.abs().max()))
        assert_close(getattr(a, name), want, **tol("divergence", torch.float32, scale=scale), name=name)
    assert_close(ga.float(), gb.float(), **tol("divergence.dlogits", dtype, scale=max(1e-3, float(gb.abs().max()))),
                 name="dlogits")


@pytest.mark.parametrize("backend", KERNELS)
def test_sampler_top_k_with_pads_at_a_real_vocabulary(backend):
    # the head ids' pass after the kernels' normaliser: -1 pads, k = 20, 151,936 ids, against backend="torch"
    N, V, k = 40, 151_936, 20
    gen = torch.Generator().manual_seed(3)
    logits = (torch.randn(N, V, generator=gen) * 2).to(torch.bfloat16).cuda()
    ids = torch.stack([torch.randperm(V, generator=gen)[:k] for _ in range(N)])
    labels = ids[:, 0].clone()  # the sampled token among the candidates
    ids[::3, k - 5:] = -1
    head = torch.log_softmax(torch.randn(N, V, generator=gen, dtype=torch.float64), -1).gather(1, ids.clamp(min=0))
    head = head.masked_fill(ids < 0, 0.0).float()
    results = {}
    for name in (backend, "torch"):
        leaf = logits.clone().requires_grad_(True)
        out = rlkernels.token_divergences(leaf, labels.cuda(), reference_topk_ids=ids.cuda(),
                                          reference_topk_logprobs=head.cuda(), backend=name)
        (out.kl.sum() + out.tv.sum()).backward()
        results[name] = (out, leaf.grad)
    (a, ga), (b, gb) = results[backend], results["torch"]
    for name in ("kl", "reverse_kl", "chi2", "tv"):
        want = getattr(b, name)
        scale = max(1.0, float(want.detach().abs().max()))
        assert_close(getattr(a, name), want, **tol("backends", scale=scale), name=name)
    assert_close(ga.float(), gb.float(), **tol("backends.dlogits", torch.bfloat16,
                                               scale=max(1.0, float(gb.float().abs().max()))), name="dlogits")
