"""The Triton token-statistics forward (kernels/triton/token_stats.py) against the float64 oracle.

Runs under TRITON_INTERPRET=1 on CPU tensors (set by tests/conftest.py), so shapes stay small: the
interpreter is 200-600x slower than torch. Odd vocabularies, forced multi-block loops (block_v < V)
and multi-row tiles (block_n > 1) cover the masking paths that large shapes would on a GPU.

Tolerances: the ("kernel.stats", fp32) row of cases.TOL, atol = rtol = 1e-5. bf16/fp16 logits are
upcast exactly, so the same row applies to every input dtype; a blocked fp32 exp-sum errs by about
(V/BLOCK + log2 BLOCK) * 2^-24 relative (< 1e-6 here), and log / division add a few ulps more.
"""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlkernels import reference
from rlkernels.backends.torch_backend import TorchBackend
from rlkernels.kernels.triton.tl_math import vocab_config
from rlkernels.kernels.triton.token_stats import token_stats_fwd

from ..cases import assert_close, scaled, tol

pytestmark = [
    pytest.mark.interpret,
    # the interpreter evaluates both sides of every tl.where in numpy: log(0), 0 * -inf and 0 / 0 on
    # lanes the kernel then discards warn there (a GPU computes them silently); results are checked
    pytest.mark.filterwarnings("ignore:(divide by zero|invalid value) encountered:RuntimeWarning"),
]

DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def dtype_id(dtype):
    return str(dtype).replace("torch.", "")
# every adversarial row kind appears in every batch (rows cycle through them)
ROW_KINDS = ("normal", "offset_pos", "offset_neg", "neg_inf", "one_finite", "one_hot", "peaked", "skip_neg", "skip_big")


def make_rows(N, V, dtype, seed, kinds=ROW_KINDS):
    """(logits [N, V] dtype, labels [N] int64): row i is of kind kinds[i % len(kinds)]."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(N, V, generator=gen, dtype=torch.float64) * 2
    labels = torch.randint(0, V, (N,), generator=gen)
    for i in range(N):
        kind = kinds[i % len(kinds)]
        y = int(labels[i])
        if kind == "offset_pos":
            x[i] += 1e4  # a huge common offset: z - row_max stays exact, nothing may change
        elif kind == "offset_neg":
            x[i] -= 1e4  # every entry far below 0: a max identity of 0 would give lse ~ -inf (verl #2656)
        elif kind == "neg_inf" and V > 1:
            drop = torch.rand(V, generator=gen) < 0.5
            drop[y] = False
            x[i] = x[i].masked_fill(drop, float("-inf"))
        elif kind == "one_finite":
            x[i] = float("-inf")
            x[i, y] = 3.0  # p = one-hot exactly: H = 0, sum p^2 = 1, (-inf) - (-inf) must not appear
        elif kind == "one_hot":
            x[i] = 0.0
            x[i, y] = 40.0  # p_y = 1 - (V-1) e^-40
        elif kind == "peaked" and V > 1:
            x[i] = 0.0
            x[i, y] = math.log(0.995 * (V - 1) / 0.005)  # p_y = 0.995: the p_y -> 1 regime of Liger's bug
        elif kind == "skip_neg":
            labels[i] = -1
        elif kind == "skip_big":
            labels[i] = V  # out of range: skipped, never read out of bounds
    return x.to(dtype), labels


def oracle(logits, labels, temperature):
    """float64 (logprobs, entropy, sum_pi_squared, lse) with lse = 0 on skipped rows."""
    lp, ent, s2 = reference.token_stats(logits, labels, temperature=temperature)
    valid = (labels >= 0) & (labels < logits.shape[1])
    lse = torch.logsumexp(logits.double() / temperature, dim=1)
    return lp, ent, s2, torch.where(valid, lse, torch.zeros_like(lse))


def check_stats(logits, labels, temperature, *, block_v=None, block_n=None, entropy=True, s2=True):
    out = token_stats_fwd(logits, labels, temperature, entropy, s2, block_v=block_v, block_n=block_n)
    lp, ent, sps, lse = oracle(logits, labels, temperature)
    for t in out:
        assert t is None or t.dtype == torch.float32
    valid = (labels >= 0) & (labels < logits.shape[1])
    # row_max is the exact max of the raw logits (0 on skipped rows): no arithmetic touches it
    expected_max = torch.where(valid, logits.float().amax(1), torch.zeros(()))
    assert torch.equal(out.row_max, expected_max)
    assert_close(out.row_max / temperature + out.log_norm, lse, **tol("kernel.stats"), name="lse")
    assert_close(out.logprobs, lp, **tol("kernel.stats"), name="logprobs")
    if entropy:
        assert_close(out.entropy, ent, **tol("kernel.stats"), name="entropy")
    else:
        assert out.entropy is None
    if s2:
        assert_close(out.sum_pi_squared, sps, **tol("kernel.stats"), name="sum_pi_squared")
    else:
        assert out.sum_pi_squared is None
    for t in out:  # skipped rows: exactly 0 in every output
        if t is not None:
            assert torch.equal(t[~valid], torch.zeros_like(t[~valid]))
    return out


# V: 1 (degenerate), 7 (< 16), 64 (exactly a tier's BLOCK_V), 129 and 300 (off powers of two, 2 tiers)
@pytest.mark.parametrize("V", [1, 7, 64, 129, 300])
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_adversarial_rows(V, dtype):
    logits, labels = make_rows(18, V, dtype, seed=V)
    check_stats(logits, labels, 1.0)


# multi-block loop (BLOCK_V < V) with one row and with several rows per program, and a temperature
@pytest.mark.parametrize("block_v,block_n", [(16, 1), (32, 4), (128, 2)])
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_multi_block(block_v, block_n, dtype):
    logits, labels = make_rows(11, 203, dtype, seed=block_v)
    check_stats(logits, labels, 0.7, block_v=block_v, block_n=block_n)


@pytest.mark.parametrize("entropy,s2", [(False, False), (True, False), (False, True)])
def test_optional_outputs_compiled_out(entropy, s2):
    logits, labels = make_rows(9, 50, torch.float32, seed=3)
    check_stats(logits, labels, 1.3, entropy=entropy, s2=s2)


def test_non_contiguous_rows():
    logits, labels = make_rows(10, 77, torch.float32, seed=5)
    wide = torch.full((10, 77 + 21), float("nan"))
    wide[:, 9:86] = logits
    strided = wide[:, 9:86]  # row stride 98, unit V stride: used as is, padding never read
    assert strided.stride() == (98, 1)
    check_stats(strided, labels, 0.9, block_v=32)
    transposed = logits.t().contiguous().t()  # V stride 10: copied by the launcher
    assert transposed.stride(1) != 1
    check_stats(transposed, labels, 0.9)


def test_skipped_rows_are_not_read():
    logits, labels = make_rows(8, 40, torch.float32, seed=7)
    labels[::2] = -1
    logits[::2] = float("nan")  # a read of a skipped row would leak NaN into its outputs
    out = check_stats(logits, labels, 1.0)
    for t in out:
        assert not torch.isnan(t).any()


def test_all_skipped_and_empty():
    logits = torch.randn(5, 33)
    out = token_stats_fwd(logits, torch.full((5,), -1), 1.0, True, True)
    assert all(torch.equal(t, torch.zeros(5)) for t in out)
    empty = token_stats_fwd(torch.randn(0, 33), torch.zeros(0, dtype=torch.long), 1.0, True, True)
    assert all(t.shape == (0,) for t in empty)


@pytest.mark.parametrize("block_v", [None, 8])
def test_all_neg_inf_row(block_v):
    # no distribution at all: the shift must stay finite ((-inf) - (-inf) is NaN), and the row reads
    # row_max 0, log_norm -inf, logprob -inf, entropy 0, sum p^2 0: never NaN
    logits = torch.randn(3, 20)
    logits[1] = float("-inf")
    labels = torch.tensor([2, 3, 4])
    out = token_stats_fwd(logits, labels, 0.7, True, True, block_v=block_v)
    assert [float(t[1]) for t in out] == [0.0, float("-inf"), float("-inf"), 0.0, 0.0]
    ref = TorchBackend().token_stats_fwd(logits, labels, 0.7, True, True)
    for a, e, name in zip(out, ref, ref._fields):  # the other rows: as the torch backend
        assert_close(a[[0, 2]], e[[0, 2]], **tol("kernel.stats"), name=name)


def test_temperature_is_a_runtime_scalar():
    # T = 0.7 and T = 1.3 must reuse one compiled kernel (no constexpr): here, equal logits / T
    logits, labels = make_rows(6, 30, torch.float32, seed=11, kinds=("normal",))
    for T in (0.7, 1.3):
        a = token_stats_fwd(logits, labels, T, True, True)
        b = token_stats_fwd(logits / T, labels, 1.0, True, True)
        for x, y, name in zip(a[2:], b[2:], a._fields[2:]):
            assert_close(x, y, **tol("kernel.stats"), name=f"{name} T={T}")


def test_launch_heuristic():
    # the tiers of tl_math.VOCAB_TIERS: BLOCK_V >= next_power_of_2(V) up to 8192, 16 elements per thread
    for V, bv, bn in [(1, 64, 32), (64, 64, 32), (65, 256, 8), (1000, 1024, 2), (4096, 4096, 1), (151936, 8192, 1),
                      (262144, 8192, 1)]:
        cfg = vocab_config(V)
        assert (cfg.BLOCK_V, cfg.BLOCK_N) == (bv, bn), V
        assert cfg.BLOCK_V * cfg.BLOCK_N == 16 * 32 * cfg.num_warps
    with pytest.raises(ValueError, match="block_v"):
        vocab_config(100, block_v=48)


@settings(max_examples=scaled(20), deadline=None)
@given(
    N=st.integers(1, 12), V=st.integers(1, 260), dtype=st.sampled_from(DTYPES),
    temperature=st.sampled_from([1.0, 0.7, 2.5]), block=st.sampled_from([(None, None), (16, 1), (32, 4)]),
    seed=st.integers(0, 2**31 - 1),
)
def test_matches_oracle_property(N, V, dtype, temperature, block, seed):
    gen = torch.Generator().manual_seed(seed)
    kinds = tuple(ROW_KINDS[i] for i in torch.randperm(len(ROW_KINDS), generator=gen).tolist())
    logits, labels = make_rows(N, V, dtype, seed, kinds=kinds)
    check_stats(logits, labels, temperature, block_v=block[0], block_n=block[1])


@pytest.mark.parametrize("block_v", [None, 8])
def test_a_nan_or_inf_logit_poisons_its_row_only(block_v):
    # a NaN or +inf logit has no softmax: NaN in every statistic of its row (a per-thread max that drops NaN must
    # not hide it: the exponent of a NaN is NaN), and the other rows as the torch backend computes them
    logits = torch.randn(4, 37)
    labels = torch.tensor([1, 2, 3, 4])
    logits[1, 30] = float("nan")
    logits[2, 5] = float("inf")
    out = token_stats_fwd(logits, labels, 0.7, True, True, block_v=block_v)
    for t, name in zip(out[1:], out._fields[1:]):
        assert torch.isnan(t[1:3]).all(), name
    ref = TorchBackend().token_stats_fwd(logits, labels, 0.7, True, True)
    for a, e, name in zip(out, ref, ref._fields):
        assert_close(a[[0, 3]], e[[0, 3]], **tol("kernel.stats"), name=name)
