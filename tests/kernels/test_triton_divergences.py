"""The Triton kernels of the full-form divergences (kernels/triton/divergences.py) against the float64 oracle.

Runs under TRITON_INTERPRET=1 on CPU tensors. Vocabularies in three tiers: 37 and 300 (one masked block) and 8197
(two unmasked 4096-wide blocks and a masked tail, the streaming loops). Rows of every kind: ordinary, a common offset
of +-1e4 on either side, entries of π with no μ (KL(π||μ) and χ² infinite) and of μ with no π (KL(μ||π) infinite),
a row without a finite entry and an inactive row (zeros). Tolerances: ("divergence", fp32) of cases.TOL.
"""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlkernels.kernels.triton.divergences import full_divergences_bwd, full_divergences_fwd
from rlkernels.reference import divergences as reference

from ..cases import assert_close, make_logits, scaled, tol

pytestmark = [
    pytest.mark.interpret,
    pytest.mark.filterwarnings("ignore:(divide by zero|invalid value|overflow) encountered:RuntimeWarning"),
]

T, T_R = 0.8, 1.1
KINDS = ("normal", "offset_z", "offset_r", "pi_without_mu", "mu_without_pi", "empty", "inactive")


def make_pair(V, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(len(KINDS), V, generator=g, dtype=torch.float64) * 2
    r = z + 0.3 * torch.randn(len(KINDS), V, generator=g, dtype=torch.float64)
    half = torch.rand(V, generator=g) < 0.5
    for i, kind in enumerate(KINDS):
        if kind == "offset_z":
            z[i] += 1e4
        elif kind == "offset_r":
            r[i] -= 1e4
        elif kind == "pi_without_mu":
            r[i, half] = float("-inf")
        elif kind == "mu_without_pi":
            z[i, half] = float("-inf")
        elif kind == "empty":
            z[i], r[i] = float("-inf"), float("-inf")
    active = torch.tensor([kind != "inactive" for kind in KINDS])
    return z.to(dtype), r.to(dtype), active


def oracle(z, r):
    out = reference.token_divergences(z.double(), reference_logits=r.double(), temperature=T,
                                      reference_temperature=T_R)
    pi = torch.softmax(z.double() / T, -1)
    mu = torch.softmax(r.double() / T_R, -1)
    out["s_bar"] = (pi * torch.sign(pi - mu)).sum(-1)
    return out


@pytest.mark.parametrize("V", [37, 300, 8197])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_forward_matches_the_oracle_on_every_kind_of_row(V, dtype):
    z, r, active = make_pair(V, dtype, seed=V)
    stats = full_divergences_fwd(z, r, active, T, T_R).stats
    expected = oracle(z, r)
    live = torch.tensor([kind not in ("empty", "inactive") for kind in KINDS])
    assert torch.equal(stats[~live], torch.zeros_like(stats[~live]))  # no distribution, or not asked: zeros
    for column, name in enumerate(("kl", "reverse_kl", "chi2", "tv", "s_bar")):
        got, want = stats[live, column].double(), expected[name][live]
        assert torch.equal(torch.isinf(got), torch.isinf(want)), (name, got, want)
        finite = torch.isfinite(want)
        assert_close(got[finite], want[finite], **tol("divergence", torch.float32, scale=max(1.0, float(
            want[finite].abs().max()))), name=name)
    # the two-part normalisers: the raw max exactly, max / T + log-norm the log-sum-exp
    for (mx, norm), x, t in (((5, 6), z, T), ((7, 8), r, T_R)):
        assert torch.equal(stats[live, mx], x[live].float().amax(1))
        lse = torch.logsumexp(x[live].double() / t, 1)
        assert_close(stats[live, mx].double() / t + stats[live, norm].double(), lse, **tol("kernel.stats"),
                     name="lse")


@pytest.mark.parametrize("V", [300, 8197])
def test_backward_from_the_forwards_normalisers_matches_autograd(V):
    z, r, active = make_pair(V, torch.float32, seed=V + 1)
    finite_rows = [i for i, kind in enumerate(KINDS) if kind in ("normal", "offset_z", "offset_r")]
    coef = torch.zeros(len(KINDS), 4)
    coef[finite_rows] = torch.randn(len(finite_rows), 4, generator=torch.Generator().manual_seed(V))
    coef[:, 2] *= 1e-2  # chi2 is the largest of the four
    stats = full_divergences_fwd(z, r, active, T, T_R).stats
    grad = full_divergences_bwd(z, r, stats, coef, T, T_R)
    leaf = z.double().requires_grad_(True)
    out = reference.token_divergences(leaf, reference_logits=r.double(), temperature=T, reference_temperature=T_R)
    values = torch.stack([out["kl"], out["reverse_kl"], out["chi2"], out["tv"]], -1)
    loss = torch.where(coef != 0, coef.double() * values, torch.zeros((), dtype=torch.float64)).sum()
    (expected,) = torch.autograd.grad(loss, leaf)
    scale = max(1e-3, float(expected[finite_rows].abs().max()))
    assert_close(grad[finite_rows].double(), expected[finite_rows], **tol("divergence.dlogits", torch.float32,
                                                                           scale=scale), name="dlogits")
    assert not grad[[i for i in range(len(KINDS)) if i not in finite_rows]].any()
    assert math.isfinite(float(grad.abs().max()))


def _compare(stats, expected, rows, columns=("kl", "reverse_kl", "chi2")):
    for column, name in enumerate(("kl", "reverse_kl", "chi2", "tv", "s_bar")):
        if name not in columns:
            continue
        got, want = stats[rows, column].double(), expected[name][rows]
        # a float32 statistic beyond float32's range is +inf (the ramp row's χ² is 3.6e118 in float64)
        want = torch.where(want > torch.finfo(torch.float32).max, float("inf"), want)
        assert torch.equal(torch.isinf(got), torch.isinf(want)), (name, got, want)
        finite = torch.isfinite(want)
        if finite.any():
            assert_close(got[finite], want[finite], **tol("divergence", torch.float32, scale=max(1.0, float(
                want[finite].abs().max()))), name=name)


def test_one_read_without_tv_gives_the_same_columns_and_leaves_tv_zero():
    # with_tv=False is the one-read form: the same kernel minus the second loop, so every other column is equal bit
    # for bit, and TV's two columns stay 0 (the op then reports no TV)
    z, r, active = make_pair(8197, torch.bfloat16, seed=5)
    both = full_divergences_fwd(z, r, active, T, T_R).stats
    one = full_divergences_fwd(z, r, active, T, T_R, with_tv=False).stats
    kept = [0, 1, 2, 5, 6, 7, 8]
    assert torch.equal(one[:, kept], both[:, kept])
    assert not one[:, 3:5].any()
    assert both[0, 3] > 0  # the row with TV computed does have one


def test_online_sums_follow_maxima_that_move_every_block():
    # The one-read sums are carried from one running max to the next: rows whose maxima rise (or fall) across the
    # 4096-wide blocks of V = 8197 move every shift, by up to 300 nats (the carried sums underflow to 0 and must
    # stay 0, not NaN); a row whose first blocks give π no mass where μ has some (KL(μ||π) = +inf from the start);
    # and the mirror (KL(π||μ), χ² = +inf)
    V = 8197
    ramp = torch.linspace(-150.0, 150.0, V, dtype=torch.float64)
    g = torch.Generator().manual_seed(3)
    noise = torch.randn(6, V, generator=g, dtype=torch.float64)
    z = torch.stack([ramp, -ramp, ramp + noise[2], noise[3] * 3, noise[4] * 3, ramp * 0.01 + noise[5]])
    r = torch.stack([ramp + 0.5 * noise[0], ramp.flip(0), -ramp, noise[3] * 3 + 1, noise[4] * 3, ramp * 0.02])
    z[3, :5000] = float("-inf")  # μ has mass where π has none, in the first blocks only
    r[4, :5000] = float("-inf")  # π has mass where μ has none
    active = torch.ones(6, dtype=torch.bool)
    stats = full_divergences_fwd(z.float(), r.float(), active, T, T_R, with_tv=False).stats
    assert not torch.isnan(stats).any()
    expected = oracle(z.float(), r.float())
    assert math.isinf(expected["kl"][3]) and math.isinf(expected["reverse_kl"][4])
    _compare(stats, expected, torch.arange(6))


LOGIT_KINDS = ("normal", "offset_pos", "offset_neg", "neg_inf", "one_hot")


@settings(max_examples=scaled(25), deadline=None)
@given(V=st.sampled_from([3, 37, 300, 4099, 8197]), rows=st.integers(1, 3), z_kind=st.sampled_from(LOGIT_KINDS),
       r_kind=st.sampled_from(LOGIT_KINDS), spread=st.sampled_from([0.0, 0.05, 3.0]),
       temperatures=st.sampled_from([(1.0, 1.0), (0.7, 1.3), (2.0, 0.5)]), with_tv=st.booleans(),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]), seed=st.integers(0, 2**31 - 1))
def test_one_read_forward_matches_the_oracle_on_drawn_rows(V, rows, z_kind, r_kind, spread, temperatures, with_tv,
                                                             dtype, seed):
    """The forward against the float64 oracle on drawn pairs: odd V in every tier (one block, two blocks and a
    tail), huge common offsets on either side, -inf entries on either side (mass against none: +inf), near
    one-hot rows, μ near π (spread 0: the same logits) or far from it, temperatures apart."""
    g = torch.Generator().manual_seed(seed)
    z = make_logits(g, (rows, V), z_kind, torch.float64)
    r = z + spread * torch.randn(rows, V, generator=g, dtype=torch.float64) if r_kind == z_kind else \
        make_logits(g, (rows, V), r_kind, torch.float64)
    z, r = z.to(dtype), r.to(dtype)
    t, t_r = temperatures
    active = torch.ones(rows, dtype=torch.bool)
    stats = full_divergences_fwd(z, r, active, t, t_r, with_tv=with_tv).stats
    assert not torch.isnan(stats).any()
    out = reference.token_divergences(z.double(), reference_logits=r.double(), temperature=t,
                                      reference_temperature=t_r)
    pi, mu = torch.softmax(z.double() / t, -1), torch.softmax(r.double() / t_r, -1)
    expected = dict(out, s_bar=(pi * torch.sign(pi - mu)).sum(-1))
    columns = ("kl", "reverse_kl", "chi2") + (("tv",) if with_tv else ())
    _compare(stats, expected, torch.arange(rows), columns)


def _torch_backend_stats(z, r, t, t_r):
    from rlkernels.backends.temperature import Temperature
    from rlkernels.backends.torch_backend import TorchBackend

    active = torch.ones(z.shape[0], dtype=torch.bool)
    return TorchBackend().full_divergences_fwd(z, r, active, Temperature.of(t), Temperature.of(t_r))


def test_mass_against_none_is_decided_against_the_final_maxima_whatever_the_order():
    """π's mass where μ = 0 makes KL(π||μ) and χ² +inf when it is real in float32, and is dropped when it is below
    float32's range against the row's final max (as in the torch and C++ backends), wherever the entry sits: an
    entry 200 nats under the max that is its slot's running max when it is read once gave +inf, and the same row
    with its columns swapped a finite value (found in review)."""
    V = 16
    z = torch.tensor([[0.0] * 8 + [-200.0] + [-300.0] * 7])
    r = torch.zeros(1, V)
    r[0, 8] = float("-inf")
    swapped = [0, 8] + list(range(2, 8)) + [1] + list(range(9, V))
    expected = _torch_backend_stats(z, r, 1.0, 1.0)
    assert torch.isfinite(expected[0, :3]).all()
    for order in (list(range(V)), swapped):
        stats = full_divergences_fwd(z[:, order], r[:, order], torch.ones(1, dtype=torch.bool), 1.0, 1.0,
                                     with_tv=False).stats
        assert_close(stats[0, :3].double(), expected[0, :3].double(), **tol("divergence", torch.float32),
                     name="divergences")
    z[0, 8] = -20.0  # real mass against none: +inf either way
    for order in (list(range(V)), swapped):
        stats = full_divergences_fwd(z[:, order], r[:, order], torch.ones(1, dtype=torch.bool), 1.0, 1.0).stats
        assert math.isinf(stats[0, 1]) and math.isinf(stats[0, 2]) and math.isfinite(stats[0, 0])


def test_chi2_terms_never_overflow_against_a_max_that_comes_later():
    """χ²'s sum is a log-sum-exp per slot: π²/μ of an early entry, 2^130 against the maxima read so far, is tiny
    against the row's final ones (found in review: the plain running sum overflowed to +inf, χ² = 1 here)."""
    V = 40
    z = torch.full((1, V), float("-inf"))
    r = torch.full((1, V), float("-inf"))
    r[0, 0] = 0.0
    z[0, 1], r[0, 1] = 0.0, -90.0
    z[0, 32], r[0, 32] = 100.0, 0.0
    stats = full_divergences_fwd(z, r, torch.ones(1, dtype=torch.bool), 1.0, 1.0, with_tv=False).stats
    expected = reference.token_divergences(z.double(), reference_logits=r.double(), temperature=1.0)
    assert float(expected["chi2"][0]) == pytest.approx(1.0)
    _compare(stats, expected, torch.arange(1))
    # T_r = 0.3: float64 has χ² = 5.4e43 from entry 1, whose π = e^-100 is below float32's normal range: dropped
    # there, as the C++ kernel drops it, which leaves the χ² of the other entries, 1
    stats = full_divergences_fwd(z, r, torch.ones(1, dtype=torch.bool), 1.0, 0.3, with_tv=False).stats
    assert_close(stats[0, 2:3].double(), torch.ones(1, dtype=torch.float64), **tol("divergence", torch.float32),
                 name="chi2")


def test_chi2_past_2_to_128_in_its_shift_but_not_in_value_stays_finite():
    """χ² + 1 = Σ 2^(w - shift) s_r / s_z² · 2^shift: the shift passes 128 (μ below 2^-128 under π's mass) where the
    product does not, so 2^shift is applied in two halves (found in review: +inf where float64 has 1.5e38)."""
    for z, r in ((torch.zeros(1, 8), torch.zeros(1, 8)), (torch.zeros(1, 2), torch.tensor([[0.0, 0.0]]))):
        r[0, 1] = -(130.0 if z.shape[1] == 8 else 129.2) * math.log(2)
        stats = full_divergences_fwd(z, r, torch.ones(1, dtype=torch.bool), 1.0, 1.0, with_tv=False).stats
        _compare(stats, reference.token_divergences(z.double(), reference_logits=r.double()), torch.arange(1))
        assert math.isfinite(stats[0, 2])


def test_chi2_drops_the_terms_of_a_pi_below_float32s_range_as_the_other_backends():
    """A χ² term whose π is below float32's normal range adds nothing, as in the torch and C++ backends (found in
    review: 7.39 where they give 0 at T = 0.05; +inf for a reference masked with -60000 instead of -inf)."""
    cases = [(torch.tensor([[0.0, -5.5]]), torch.tensor([[0.0, -11.1]]), 0.05),
             (torch.tensor([[496.5, 332.5, 165.25, 1.48, -170.25, -337.75, -498.75]]),
              torch.tensor([[499.5, 330.75, 160.9, -4.9, -60000.0, -334.0, -499.0]]), 0.7)]
    for z, r, t in cases:
        for dtype in (torch.float32, torch.float16):
            zz, rr = z.to(dtype), r.to(dtype)
            stats = full_divergences_fwd(zz, rr, torch.ones(1, dtype=torch.bool), t, t, with_tv=False).stats
            expected = _torch_backend_stats(zz.float(), rr.float(), t, t)
            assert_close(stats[0, :3].double(), expected[0, :3].double(), **tol("divergence", torch.float32,
                         scale=max(1.0, float(expected[0, :3].abs().max()))), name=str(dtype))
