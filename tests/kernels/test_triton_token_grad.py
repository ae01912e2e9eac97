"""The Triton token-gradient backward (kernels/triton/token_grad.py) against float64 autograd through
the oracle, and the Triton backend against the torch backend through the public API.

Runs under TRITON_INTERPRET=1 on CPU tensors, on small odd shapes (see test_triton_token_stats.py).
Tolerances: the "kernel.dlogits" rows of cases.TOL, atol relative to the largest expected |g| of the
case (scale): fp32 math (atol = rtol = 1e-5), plus for bf16 / fp16 output one rounding to the output
dtype, half an ulp = 2^-8 (bf16) or 2^-11 (fp16) relative. Under TRITON_INTERPRET=1 the bf16 row is
one full ulp, 2^-7: the interpreter's fp32 -> bf16 cast truncates where the GPU's cvt.rn rounds to
nearest. The public API against the torch backend uses the "backends" rows.
"""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import rlkernels
from rlkernels import reference
from rlkernels.kernels.triton.token_grad import token_grad_bwd
from rlkernels.kernels.triton.token_stats import token_stats_fwd

from ..cases import assert_close, interpreted, make_batch, make_coefficients, scaled, tol
from .test_triton_token_stats import DTYPES, ROW_KINDS, dtype_id, make_rows

pytestmark = [
    pytest.mark.interpret,
    # the interpreter evaluates both sides of every tl.where in numpy: log(0), 0 * -inf and 0 / 0 on
    # lanes the kernel then discards warn there (a GPU computes them silently); results are checked
    pytest.mark.filterwarnings("ignore:(divide by zero|invalid value) encountered:RuntimeWarning"),
]

INTERPRETED = interpreted()  # bf16 is truncated there, see the docstring


def oracle_grad(logits, labels, temperature, c, e):
    """float64 d(sum c*logprob + e*H)/dlogits through the reference (e = None: no entropy term)."""
    x = logits.double().requires_grad_(True)
    lp, ent, _ = reference.token_stats(x, labels, temperature=temperature)
    loss = (c.double() * lp).sum()
    if e is not None:
        loss = loss + (e.double() * ent).sum()
    (g,) = torch.autograd.grad(loss, x)
    return g


def run_grad(logits, labels, temperature, c, e, *, inplace=False, block_v=None, block_n=None, split=None):
    stats = token_stats_fwd(logits, labels, temperature, e is not None, False)
    return token_grad_bwd(
        logits, labels, stats.row_max, stats.log_norm, stats.entropy, c, e, temperature, inplace,
        block_v=block_v, block_n=block_n, split=split,
    )


def check_grad(logits, labels, temperature, c, e, **kw):
    expected = oracle_grad(logits, labels, temperature, c, e)
    g = run_grad(logits.clone(), labels, temperature, c, e, **kw)
    assert g.dtype == logits.dtype and g.shape == logits.shape
    scale = max(1.0, float(expected.abs().max())) if expected.numel() else 1.0
    g_tol = tol("kernel.dlogits", logits.dtype, scale=scale, interpreter=INTERPRETED)
    assert_close(g, expected, **g_tol, name="dlogits")
    # rows with c = e = 0 and skipped rows: exactly zero
    valid = (labels >= 0) & (labels < logits.shape[1])
    dead = ~valid | ((c == 0) & ((e == 0) if e is not None else True))
    assert torch.equal(g[dead].float(), torch.zeros_like(g[dead].float()))
    return g


@pytest.mark.parametrize("V", [1, 7, 129, 300])
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("with_entropy", [True, False])
def test_adversarial_rows(V, dtype, with_entropy):
    logits, labels = make_rows(18, V, dtype, seed=V)
    c, e = make_coefficients(18, seed=V, zero_rows=(0, 10), entropy=with_entropy)
    check_grad(logits, labels, 1.0, c, e)


# split: blocks per program along grid axis 1 (203 columns of 16: 13 blocks, so 7 programs of 2 or 5 of 3 per row,
# the last with a partial block, and 13 of 1)
@pytest.mark.parametrize("block_v,block_n,split", [(16, 1, 1), (16, 1, 2), (16, 1, 3), (32, 4, 1), (32, 4, 2)])
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_multi_block_with_temperature(block_v, block_n, split, dtype):
    logits, labels = make_rows(11, 203, dtype, seed=block_v)
    c, e = make_coefficients(11, seed=1, zero_rows=(4,))
    check_grad(logits, labels, 0.7, c, e, block_v=block_v, block_n=block_n, split=split)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=dtype_id)
def test_target_column_formed_in_fp32(dtype):
    # p_y in (0.9, 0.9999): the target column c (1 - p_y) must carry one output rounding only. With
    # p_y rounded to bf16 first (Liger), 1 - p_y is off by up to 2^-9 / (1 - p_y): 50% at p_y = 0.999.
    V = 50
    labels = torch.arange(8) % V
    logits = torch.zeros(8, V, dtype=torch.float64)
    for i, p in enumerate([0.9, 0.99, 0.995, 0.999, 0.9995, 0.9999, 0.97, 0.93]):
        logits[i, labels[i]] = float(torch.log(torch.tensor(p * (V - 1) / (1 - p), dtype=torch.float64)))
    logits = logits.to(dtype)
    c = torch.ones(8)
    g = run_grad(logits, labels, 1.0, c, None)
    expected = oracle_grad(logits, labels, 1.0, c, None)
    col = torch.arange(8)
    assert_close(g[col, labels].double(), expected[col, labels],
                 **tol("kernel.target_column", dtype, interpreter=INTERPRETED), name="target column")


def test_row_without_distribution():
    # an all -inf row that still has coefficients: p = 0 everywhere, so the gradient is c / T at the
    # target and 0 elsewhere (the torch backend's convention), never NaN
    logits = torch.randn(3, 20)
    logits[1] = float("-inf")
    labels = torch.tensor([2, 3, 4])
    c, e = torch.tensor([0.5, 2.0, -1.0]), torch.tensor([1.0, 3.0, 0.5])
    stats = token_stats_fwd(logits, labels, 0.5, True, False)
    g = token_grad_bwd(logits, labels, stats.row_max, stats.log_norm, stats.entropy, c, e, 0.5, False)
    expected_row = torch.zeros(20)
    expected_row[3] = 2.0 / 0.5
    assert torch.equal(g[1], expected_row)
    ref = oracle_grad(logits[[0, 2]], labels[[0, 2]], 0.5, c[[0, 2]], e[[0, 2]])
    assert_close(g[[0, 2]], ref, **tol("kernel.dlogits"), name="dlogits")


def test_inactive_rows_are_not_read():
    logits, labels = make_rows(8, 40, torch.float32, seed=2, kinds=("normal",))
    c, e = make_coefficients(8, seed=2, zero_rows=(1, 3, 5))
    stats = token_stats_fwd(logits, labels, 1.0, True, False)
    poisoned = logits.clone()
    poisoned[[1, 3, 5]] = float("nan")  # a read of a c = e = 0 row would leak NaN into dlogits
    g = token_grad_bwd(poisoned, labels, stats.row_max, stats.log_norm, stats.entropy, c, e, 1.0, False)
    assert not torch.isnan(g).any()
    assert torch.equal(g[[1, 3, 5]], torch.zeros(3, 40))


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_inplace(dtype):
    logits, labels = make_rows(9, 70, dtype, seed=4)
    c, e = make_coefficients(9, seed=4, zero_rows=(2,))
    expected = run_grad(logits, labels, 0.8, c, e)
    buf = logits.clone()
    g = run_grad(buf, labels, 0.8, c, e, inplace=True)
    assert g is buf and torch.equal(buf, expected)
    split = logits.clone()  # several programs per row, side by side on grid axis 1, each writing what it read
    assert torch.equal(run_grad(split, labels, 0.8, c, e, inplace=True, block_v=16, split=2), expected)


def test_non_contiguous_rows_and_inplace_copy_back():
    logits, labels = make_rows(10, 77, torch.float32, seed=6)
    c, e = make_coefficients(10, seed=6, zero_rows=(3,))
    expected = run_grad(logits, labels, 1.0, c, e)
    wide = torch.full((10, 100), float("nan"))
    strided = wide[:, 9:86]  # row stride 100, unit V stride: no copy
    strided.copy_(logits)
    g = run_grad(strided, labels, 1.0, c, e, inplace=True, block_v=32)
    assert g is strided and torch.equal(strided, expected)
    assert torch.isnan(wide[:, :9]).all() and torch.isnan(wide[:, 86:]).all()  # padding untouched
    transposed = logits.t().contiguous().t()  # V stride 10: computed through a copy, written back
    g = run_grad(transposed, labels, 1.0, c, e, inplace=True)
    assert g is transposed and torch.equal(transposed, expected)
    expanded_c = torch.tensor(0.5).expand(10)  # stride-0 coefficients (the grad of a .sum())
    assert_close(run_grad(logits, labels, 1.0, expanded_c, None), oracle_grad(logits, labels, 1.0, expanded_c, None),
                 **tol("kernel.dlogits"), name="dlogits")


@settings(max_examples=scaled(20), deadline=None)
@given(
    N=st.integers(1, 12), V=st.integers(1, 260), dtype=st.sampled_from(DTYPES),
    temperature=st.sampled_from([1.0, 0.7, 2.5]),
    block=st.sampled_from([(None, None, None), (16, 1, None), (16, 1, 3), (32, 4, None), (32, 4, 2)]),
    with_entropy=st.booleans(), seed=st.integers(0, 2**31 - 1),
)
def test_matches_oracle_property(N, V, dtype, temperature, block, with_entropy, seed):
    gen = torch.Generator().manual_seed(seed)
    kinds = tuple(ROW_KINDS[i] for i in torch.randperm(len(ROW_KINDS), generator=gen).tolist())
    logits, labels = make_rows(N, V, dtype, seed, kinds=kinds)
    c, e = make_coefficients(N, seed, zero_rows=range(0, N, 4), entropy=with_entropy)
    check_grad(logits, labels, temperature, c, e, block_v=block[0], block_n=block[1], split=block[2])


# ---- the public API: backend="triton" against backend="torch" ---------------------------------------

# the two backends differ by fp32 summation order only, so fp32 tolerances apply to the statistics;
# bf16 dlogits may differ by one rounding on each side (2 * 2^-8 relative; 2^-8 + 2^-7 interpreted):
# the "backends" rows of cases.TOL


def _grads(fn, logits, backend, **kw):
    x = logits.clone().requires_grad_(True)
    out = fn(x, backend=backend, **kw)
    return out, x


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=dtype_id)
def test_token_logprobs_api(dtype):
    B, T, V = 2, 5, 37
    batch = make_batch("padded", [T] * B, V, dtype=dtype, seed=0)
    logits, labels = batch.logits, batch.labels.clone()
    labels[0, 1] = -100
    labels[1, 4] = -100
    c, e = (t.reshape(B, T) for t in make_coefficients(B * T, seed=0))
    results = {}
    for backend in ("triton", "torch"):
        x = logits.clone().requires_grad_(True)
        out = rlkernels.token_logprobs(x, labels, temperature=0.8, compute_entropy=True, compute_sum_pi_squared=True,
                                       backend=backend)
        (g,) = torch.autograd.grad((out.logprobs * c + out.entropy * e).sum(), x)
        results[backend] = (out, g)
    (out, g), (ref, ref_g) = results["triton"], results["torch"]
    for name in ("logprobs", "entropy", "sum_pi_squared"):
        assert_close(getattr(out, name), getattr(ref, name), **tol("backends"), name=name)
    assert g.dtype == dtype
    g_tol = tol("backends.dlogits", dtype, scale=max(1.0, float(ref_g.abs().max())), interpreter=INTERPRETED)
    assert_close(g, ref_g, **g_tol, name="dlogits")
    assert torch.equal(g[0, 1], torch.zeros_like(g[0, 1]))  # ignore_index row: no gradient


def _ppo_inputs(dtype, packed):
    # packed: three sequences, the middle one empty
    layout, lengths = ("packed", [3, 0, 7]) if packed else ("padded", [5, 5])
    b = make_batch(layout, lengths, 29, dtype=dtype, seed=1 + packed, mask_p=0.8)
    kw = dict(old_logprobs=b.old_logprobs, rollout_logprobs=b.rollout_logprobs)
    if packed:
        kw["cu_seqlens"] = b.cu_seqlens
    return b.logits, b.labels, b.advantages, b.response_mask, kw


@pytest.mark.parametrize(
    "dtype,packed,overrides",
    [
        (torch.float32, False, dict(entropy_coeff=0.01, temperature=0.7)),
        (torch.float32, True, dict(rollout_correction=rlkernels.RolloutCorrection(is_level="token"))),
        (torch.bfloat16, False, dict(entropy_coeff=0.01, loss_agg_mode="seq-mean-token-mean")),
        (torch.float32, False, dict(entropy_coeff=0.01, inplace_backward=True)),
    ],
    ids=["fp32-entropy-T", "fp32-packed-tis", "bf16-seqmean", "fp32-inplace"],
)
def test_decoupled_ppo_loss_api(dtype, packed, overrides):
    logits, labels, adv, mask, kw = _ppo_inputs(dtype, packed)
    results = {}
    for backend in ("triton", "torch"):
        leaf = logits.clone().requires_grad_(True)
        x = leaf * 1  # a non-leaf, so that an in-place backward has a buffer of its own to write into
        out = rlkernels.decoupled_ppo_loss(x, labels, adv, mask, backend=backend, **kw, **overrides)
        version = x._version
        out.loss.backward()
        if overrides.get("inplace_backward"):
            assert x._version > version  # the autograd wrapper told autograd about the in-place write
        results[backend] = (out, leaf.grad)
    (out, g), (ref, ref_g) = results["triton"], results["torch"]
    assert_close(out.loss, ref.loss, **tol("backends"), name="loss")
    assert_close(out.logprobs, ref.logprobs, **tol("backends"), name="logprobs")
    if ref.entropy is not None:
        assert_close(out.entropy, ref.entropy, **tol("backends"), name="entropy")
    g_tol = tol("backends.dlogits", dtype, scale=max(1.0, float(ref_g.abs().max())), interpreter=INTERPRETED)
    assert_close(g, ref_g, **g_tol, name="dlogits")
