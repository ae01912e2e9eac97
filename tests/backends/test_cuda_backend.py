"""The CUDA backend (csrc/) against the float64 oracle and the torch backend; needs a GPU and a build.

Skipped here (conftest skips `gpu` tests without CUDA); on a GPU machine build first
(`RLKERNELS_BUILD_CUDA=1 pip install -e . --no-build-isolation`, or set RLKERNELS_CUDA_JIT=1).

Tolerances: the "cuda.*" rows of cases.TOL. bf16/fp16 logits upcast exactly to fp32, so every
statistic carries only fp32 summation error; dlogits is rounded once to the logits dtype (within one
ulp of the float64 truth: 2^-7 bf16, 2^-10 fp16), plus an absolute floor of 1e-5 of the row's largest
gradient.
"""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import rlkernels
from rlkernels.backends import select
from rlkernels.reference import token_stats

from ..cases import LOGIT_KINDS, assert_close, make_coefficients, make_logits, problems, scaled, tol

pytestmark = pytest.mark.gpu

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# V = 1 (one entry: p = 1), 7 and 129 (warp rows, odd: scalar head/tail), 32000 and 151936 (block rows)
VOCABS = [1, 7, 129, 32000, 151936]


@pytest.fixture(scope="module")
def cuda():
    from rlkernels.backends.cuda_backend import CudaBackend

    backend = CudaBackend()
    if not backend.is_built():
        pytest.fail("GPU present but the CUDA extension is not built (RLKERNELS_BUILD_CUDA=1 or RLKERNELS_CUDA_JIT=1)")
    return backend


def _rows(V):
    return 6 if V > 100_000 else 23  # enough rows for skipped and zero-coefficient ones, small for big V


def _problem(V, dtype, kind, seed=0, row_stride_pad=0, col_offset=0):
    """CUDA logits [N, V] (a strided view when padded/offset) and labels with two skipped rows."""
    gen = torch.Generator().manual_seed(seed)
    N = _rows(V)
    wide = make_logits(gen, (N, V + row_stride_pad + col_offset), kind, torch.float64).to(dtype).cuda()
    logits = wide[:, col_offset:col_offset + V]  # the view is kept: any row stride / start alignment
    labels = torch.randint(0, V, (N,), generator=gen)
    if kind == "neg_inf":
        labels.zero_()  # column 0 stays finite (make_logits)
    labels[1], labels[4] = -1, V  # skipped: ignored, and out of range (never read)
    return logits, labels.cuda()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("V", VOCABS)
@pytest.mark.parametrize("kind", LOGIT_KINDS)
@pytest.mark.parametrize("T", [1.0, 0.7])
def test_forward_matches_reference(cuda, dtype, V, kind, T):
    logits, labels = _problem(V, dtype, kind)
    stats = cuda.token_stats_fwd(logits, labels, T, True, True)
    lp, H, sq = token_stats(logits.double(), labels, temperature=T, ignore_index=-1)
    valid = (labels >= 0) & (labels < V)
    assert_close(stats.logprobs, lp, **tol("cuda.stats"), name="logprobs")
    assert_close(stats.entropy, H, **tol("cuda.stats"), name="entropy")
    assert_close(stats.sum_pi_squared, sq, **tol("cuda.stats"), name="sum_pi_squared")
    # row_max is the exact max of the (upcast) logits; log_norm = log sum exp((z - row_max) / T)
    z = logits.double()
    row_max = z.amax(1)
    assert torch.equal(stats.row_max[valid].double(), row_max[valid])
    log_norm = torch.logsumexp((z - row_max[:, None]) / T, 1)
    assert_close(stats.log_norm[valid], log_norm[valid], **tol("cuda.stats"), name="log_norm")
    for t in stats:
        assert torch.all(t[~valid] == 0), "skipped rows must be exactly 0"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("V", VOCABS)
@pytest.mark.parametrize("kind", LOGIT_KINDS)
@pytest.mark.parametrize("T", [1.0, 0.7])
@pytest.mark.parametrize("with_entropy", [False, True])
def test_backward_matches_reference(cuda, dtype, V, kind, T, with_entropy):
    logits, labels = _problem(V, dtype, kind, seed=1)
    N = logits.shape[0]
    # row 2: both coefficients zero, an all-zero row, never read (rows 1 and 4 are skipped)
    c, e = make_coefficients(N, seed=2, zero_rows=(2,), entropy=with_entropy, dtype=torch.float64)
    if e is None:
        e = torch.zeros(N, dtype=torch.float64)
    stats = cuda.token_stats_fwd(logits, labels, T, with_entropy, False)
    grad = cuda.token_grad_bwd(
        logits, labels, stats.row_max, stats.log_norm, stats.entropy, c.float().cuda(),
        e.float().cuda() if with_entropy else None, T, False,
    )
    assert grad.dtype == dtype and grad.shape == logits.shape

    z = logits.double().detach().requires_grad_(True)
    lp, H, _ = token_stats(z, labels, temperature=T, ignore_index=-1)
    (ref,) = torch.autograd.grad((lp * c.cuda()).sum() + (H * e.cuda()).sum(), z)
    scale = ref.abs().amax(1, keepdim=True).clamp_min(1e-3)
    assert_close(grad / scale, ref / scale, **tol("cuda.dlogits", dtype), name="dlogits")
    dead = (labels < 0) | (labels >= V)
    dead[2] = True
    assert torch.all(grad[dead] == 0), "skipped and zero-coefficient rows must be exactly 0"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("V", [7, 129, 32000])
def test_strided_and_misaligned_rows(cuda, dtype, V):
    # row stride V + 3 and a start one element in: no row is 16-byte aligned, so the head/tail
    # peeling is exercised; the backward output (contiguous) then differs in alignment from the input
    logits, labels = _problem(V, dtype, "normal", seed=3, row_stride_pad=3, col_offset=1)
    assert not logits.is_contiguous()
    dense = logits.contiguous()
    a = cuda.token_stats_fwd(logits, labels, 0.7, True, True)
    b = cuda.token_stats_fwd(dense, labels, 0.7, True, True)
    for x, y in zip(a, b):
        assert_close(x, y, **tol("cuda.layout"))
    c = torch.randn(logits.shape[0], device="cuda")
    e = torch.randn(logits.shape[0], device="cuda")
    g_view = cuda.token_grad_bwd(logits, labels, a.row_max, a.log_norm, a.entropy, c, e, 0.7, False)
    g_dense = cuda.token_grad_bwd(dense, labels, b.row_max, b.log_norm, b.entropy, c, e, 0.7, False)
    assert_close(g_view.float(), g_dense.float(), **tol("cuda.layout.dlogits", dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("V", [129, 32000])
def test_inplace_equals_out_of_place(cuda, dtype, V):
    logits, labels = _problem(V, dtype, "normal", seed=4)
    s = cuda.token_stats_fwd(logits, labels, 1.0, True, False)
    c = torch.randn(logits.shape[0], device="cuda")
    e = torch.randn(logits.shape[0], device="cuda")
    expected = cuda.token_grad_bwd(logits, labels, s.row_max, s.log_norm, s.entropy, c, e, 1.0, False)
    buf = logits.clone()
    out = cuda.token_grad_bwd(buf, labels, s.row_max, s.log_norm, s.entropy, c, e, 1.0, True)
    assert out.data_ptr() == buf.data_ptr()
    assert torch.equal(out, expected)


def test_all_neg_inf_row_has_no_nan(cuda):
    logits = torch.full((3, 300), float("-inf"), device="cuda")
    logits[1] = torch.randn(300, device="cuda")
    labels = torch.tensor([5, 5, 5], device="cuda")
    s = cuda.token_stats_fwd(logits, labels, 1.0, True, True)
    for t in (s.row_max, s.log_norm, s.entropy, s.sum_pi_squared):
        assert not torch.isnan(t).any()
    assert s.logprobs[0] == -math.inf and s.entropy[0] == 0 and s.sum_pi_squared[0] == 0
    g = cuda.token_grad_bwd(logits, labels, s.row_max, s.log_norm, s.entropy, torch.ones(3, device="cuda"),
                            torch.ones(3, device="cuda"), 1.0, False)
    assert not torch.isnan(g).any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_target_gradient_near_one_hot(cuda, dtype):
    # p_y -> 1: c * (1 - p_y) must come from fp32 (expm1 of log p_y), not from p_y rounded to the
    # logits dtype first (Liger), which gives 0 for all four rows in bf16. The remaining error is
    # fp32's: log_norm = log(1 + rest) carries ~6e-8 absolute error when rest < 1e-6 (the atol of
    # the "cuda.near_one_hot" rows).
    V = 4096
    logits = torch.zeros(4, V, device="cuda", dtype=dtype)
    labels = torch.tensor([3, 100, 2000, 4095], device="cuda")
    logits[torch.arange(4), labels] = torch.tensor([8.0, 12.0, 14.0, 16.0], device="cuda", dtype=dtype)
    s = cuda.token_stats_fwd(logits, labels, 1.0, False, False)
    c = torch.ones(4, device="cuda")
    g = cuda.token_grad_bwd(logits, labels, s.row_max, s.log_norm, None, c, None, 1.0, False)
    z = logits.double()
    expected = -torch.expm1(torch.log_softmax(z, 1).gather(1, labels[:, None]).squeeze(1))  # 1 - p_y, exact
    got = g.double().gather(1, labels[:, None]).squeeze(1)
    assert bool((expected > 1e-5).all())
    assert_close(got, expected, **tol("cuda.near_one_hot", dtype), name="c*(1-p_y)")


def test_many_rows_on_grid_x(cuda):
    # more than 65,535 rows (grid y/z cap, Liger #1294), warp rows and block rows
    for V in (7, 2048):
        logits = torch.randn(70_001, V, device="cuda")
        labels = torch.randint(0, V, (70_001,), device="cuda")
        s = cuda.token_stats_fwd(logits, labels, 1.0, False, False)
        lp, _, _ = token_stats(logits[-50:].double(), labels[-50:])
        assert_close(s.logprobs[-50:], lp, **tol("cuda.stats"))


def test_more_than_2_31_elements(cuda):
    # N * V > 2^31: 32-bit offsets would wrap (bf16, 4.3 GB, in-place backward); checked on the last rows
    N, V = 16_400, 131_072
    logits = torch.randn(N, V, device="cuda", dtype=torch.bfloat16)
    labels = torch.randint(0, V, (N,), device="cuda")
    tail = logits[-3:].double().requires_grad_(True)
    lp, H, _ = token_stats(tail, labels[-3:])
    (ref,) = torch.autograd.grad(lp.sum(), tail)
    s = cuda.token_stats_fwd(logits, labels, 1.0, True, False)
    assert_close(s.logprobs[-3:], lp, **tol("cuda.stats"), name="logprobs")
    assert_close(s.entropy[-3:], H, **tol("cuda.stats"), name="entropy")
    g = cuda.token_grad_bwd(logits, labels, s.row_max, s.log_norm, None, torch.ones(N, device="cuda"), None, 1.0, True)
    assert_close(g[-3:], ref, **tol("cuda.wide_offsets", torch.bfloat16), name="dlogits")


def test_ops_check_inputs(cuda):
    # the messages' numbers too: on the first lent H200 the checks that streamed a number crashed the process
    # (csrc/bindings.cpp, text())
    logits = torch.randn(4, 9, device="cuda")
    labels = torch.zeros(4, dtype=torch.int64, device="cuda")
    ops = torch.ops.rlkernels_cuda
    with pytest.raises(RuntimeError, match="labels"):
        ops.token_stats_fwd(logits, labels.int(), 1.0, False, False)
    with pytest.raises(RuntimeError, match=r"logits must have unit stride along V \(dim 1\), got strides \[1, 4\]"):
        ops.token_stats_fwd(logits.t().contiguous().t(), labels[:4], 1.0, False, False)
    with pytest.raises(RuntimeError, match="temperature must be a finite float > 0, got 0"):
        ops.token_stats_fwd(logits, labels, 0.0, False, False)
    with pytest.raises(RuntimeError, match=r"labels must have shape \[N\] = \[4\], got \[3\]"):
        ops.token_stats_fwd(logits, labels[:3], 1.0, False, False)
    with pytest.raises(RuntimeError, match="logits"):
        ops.token_stats_fwd(logits.double(), labels, 1.0, False, False)


def test_opcheck_and_compile(cuda):
    logits = torch.randn(5, 300, device="cuda", dtype=torch.bfloat16)
    labels = torch.tensor([0, -1, 7, 299, 3], device="cuda")
    ops = torch.ops.rlkernels_cuda
    torch.library.opcheck(ops.token_stats_fwd.default, (logits, labels, 0.7, True, True))
    s = ops.token_stats_fwd(logits, labels, 0.7, True, False)
    c = torch.randn(5, device="cuda")
    torch.library.opcheck(ops.token_grad_bwd.default, (logits, labels, s[0], s[1], s[3], c, c, 0.7))
    torch.library.opcheck(ops.token_grad_bwd_inplace.default, (logits.clone(), labels, s[0], s[1], s[3], c, c, 0.7))

    def f(x, y):
        return ops.token_stats_fwd(x, y, 0.7, True, False)[2]

    assert torch.equal(torch.compile(f, fullgraph=True)(logits, labels), f(logits, labels))


def test_select_returns_cuda_backend(cuda):
    assert select("cuda", torch.zeros(2, 3, device="cuda")).name == "cuda"
    assert rlkernels.backends.available()["cuda"]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("inplace", [False, True])
@settings(max_examples=scaled(30))
@given(data=st.data())
def test_public_api_matches_torch_backend(cuda, dtype, inplace, data):
    batch, mode, config = data.draw(problems(dtype, max_vocab=300))
    kw = {k: (None if v is None else v.cuda()) for k, v in batch.kwargs(mode).items()}
    args = (batch.labels.cuda(), batch.advantages.cuda(), batch.response_mask.cuda())
    outs, grads = [], []
    for backend in ("torch", "cuda"):
        leaf = batch.logits.cuda().clone().requires_grad_(True)
        x = leaf * 1  # a non-leaf, so that an in-place backward may reuse its storage
        out = rlkernels.decoupled_ppo_loss(
            x, *args, config=config, backend=backend, inplace_backward=inplace and backend == "cuda", **kw
        )
        (g,) = torch.autograd.grad(out.loss, leaf)
        outs.append(out)
        grads.append(g)
    ref, got = outs
    scale = max(1.0, float(ref.loss.detach().abs()))
    assert_close(got.loss, ref.loss, **tol("value", torch.float32, scale=scale), name="loss")
    assert_close(got.logprobs, ref.logprobs, **tol("value", torch.float32), name="logprobs")
    g_scale = max(1e-3, float(grads[0].abs().max())) if grads[0].numel() else 1.0
    assert_close(grads[1], grads[0], **tol("cuda.api.dlogits", dtype, scale=g_scale), name="dlogits")
