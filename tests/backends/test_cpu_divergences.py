"""The CPU kernels of the full-form divergences (SPEC §9.2), `full_divergences_fwd` / `full_divergences_bwd` of
csrc/cpu/token_passes.cpp, called as ops against the float64 oracle (rlkernels.reference.divergences).

Rows of every kind the kernels branch on sit side by side in one call: -inf entries on both sides, mass against
none either way (infinite divergences, with zero and nonzero coefficients), rows without any finite entry,
inactive rows holding NaN, ±1e4 offsets, peaked and flat rows, a reference whose float32 exponential underflows
under mass (chi2's exact re-sum), identical rows; over widths around the kernels' 16 lanes and 1,024-entry
blocks, fp32 / bf16 / fp16, one temperature or one per row, and row-strided views.

Gradients: torch.autograd on the oracle, one divergence at a time over the rows whose coefficient for it is
nonzero (0 * inf = NaN would otherwise reach every row's gradient), with the coefficients as the incoming
gradient. Where a divergence with a nonzero coefficient is infinite autograd has no answer (NaN); there the
kernels are compared with the closed form of the Triton kernel's docstring evaluated in float64, which the
test first checks against autograd on every row where autograd is finite.
"""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlkernels.backends.cpu_backend import CpuBackend
from rlkernels.reference import divergences as oracle

from ..cases import BF16, F16, F32, F64, TOL, assert_close, scaled, tol

pytestmark = pytest.mark.skipif(not CpuBackend().is_built(), reason="the CPU kernels could not be built here")

STATS = 9  # kl, reverse_kl, chi2, tv, sum pi sign(pi - mu), row max and log-normaliser of z, then of the reference

# ---- tolerances: rows of cases.TOL, and how these kernels meet them ---------------------------------------------
# The statistics, TOL["divergence", fp32] for every input dtype (half logits upcast exactly, the sums are the same
# float32 sums): each entry's log-probability log pi = (z - max) / T - log P carries ~|log pi| 2^-24 absolute error
# (|log pi| up to ~95 in the underflow rows) and the polynomial exp < 2^-23 relative; the kernels add kLanes = 16
# float32 partial sums per block of 1,024 entries (64 terms each) and the block totals in float64, so a sum errs by
# ~64 * 2^-24 relative. chi2's terms pi^2 / mu put ~2 |log pi| + |log mu| ulps (~300 * 6e-8 ~ 2e-5) on a single
# term, hence rtol 1e-4; atol 1e-5 times max(1, |value|) covers KL = B / Q + log P - log Q, a difference of terms of
# size log V ~ 8 (float64 on the kernels' side, but each of B, log P, log Q has float32 inputs).
# dz, TOL["divergence.dlogits", dtype]: in float32 each term is a product of float32 factors with the errors above
# (~|log pi| 2^-24 + a few ulps, below 1e-5 relative), but the four terms (and within c's, pi^2 / mu - pi (chi2 +
# 1)) may cancel: atol is 1e-5 of the sum of the terms' magnitudes at the entry, rtol 1e-4 as for the statistics.
# Half outputs: the float32 value rounded once; assert_close rounds the oracle to the same dtype, so the two may land
# one ulp apart (the bf16 / fp16 rows); fp16 subnormals (< 6.1e-5) are 2^-24 apart, added to atol here since
# atol is relative to the terms' magnitudes.
FP16_SUBNORMAL = 2.0**-24
# The kernels' exponential, like the GPU's, flushes below exp(-87) (~1.6e-38, float32's normal range): an entry
# whose log pi is below that has no mass there (no term), where float64 still gives it a (tiny) one: such entries
# may come back 0.
FLUSH = -86.0
# sign(pi - mu) is discontinuous: where |pi - mu| is within the kernels' float32 error of 0 (TOL
# "divergence.sign_tie") the kernels and the oracle may take opposite signs, which moves sum pi s by 2 pi_v and
# dz_v by |d| pi_v / T; such ties are allowed that much more.


def ops():
    return torch.ops.rlkernels_cpu


# ---- rows ---------------------------------------------------------------------------------------------------
# Each kind: (z, q, active, coefficients) for one row, in float64 before the cast to the tested dtype; T and T_r
# are the row's temperatures (a kind that places an entry at a given log-probability needs them).
def _finite_first(mask):
    mask = mask.clone()
    mask[0] = False  # the first entry keeps mass on both sides
    return mask


def _row(kind, gen, V, T, T_r):
    randn = lambda scale=1.0: torch.randn(V, generator=gen, dtype=F64) * scale  # noqa: E731
    coef = torch.randn(4, generator=gen, dtype=F64)
    ninf = float("-inf")
    z = randn(2.0)
    q = z + randn(0.5)
    active = True
    if kind == "far":
        q = randn(3.0)
    elif kind == "offset":  # exact differences at ±1e4: each row is shifted by its own max first
        z, q = z + 1e4, q - 1e4
    elif kind == "peaked":  # near one-hot pi (others at exp(-40 / T)) against a flat mu
        z = torch.zeros(V, dtype=F64)
        z[int(torch.randint(0, V, (1,), generator=gen))] = 40.0
        q = randn(0.1)
    elif kind == "flat":  # flat pi against a peaked mu: chi2 ~ exp(8 / T_r) / V
        z = torch.zeros(V, dtype=F64)
        q = randn(0.1)
        q[int(torch.randint(0, V, (1,), generator=gen))] = 8.0
    elif kind == "masked_same":  # -inf at the same entries on both sides
        drop = _finite_first(torch.rand(V, generator=gen) < 0.4)
        z, q = z.masked_fill(drop, ninf), q.masked_fill(drop, ninf)
    elif kind in ("mu_zero", "mu_zero_coef"):  # mu = 0 under pi's mass: KL(pi||mu) = chi2 = +inf
        drop = _finite_first(torch.rand(V, generator=gen) < 0.3)
        q = q.masked_fill(drop, ninf)
        if kind == "mu_zero":
            coef[1] = coef[2] = 0.0  # their infinity must not reach dz
    elif kind == "pi_zero":  # pi = 0 under mu's mass: KL(mu||pi) = +inf, its gradient a (pi - mu) stays finite
        drop = _finite_first(torch.rand(V, generator=gen) < 0.3)
        z = z.masked_fill(drop, ninf)
    elif kind == "rising":  # the maxima rise block after block: the running sums are rescaled many times
        ramp = torch.linspace(0.0, 60.0, V, dtype=F64)
        z, q = z + ramp, q + 0.8 * ramp
    elif kind == "late_start" and V > 1:  # the first blocks hold no finite entry on one side, then on the other
        z[:min(V - 1, 1500)] = ninf
        q[:min(V - 1, 1100 if V > 1100 else V // 2)] = ninf
    elif kind == "z_none":  # no finite logit: no distribution, zeros
        z = torch.full((V,), ninf, dtype=F64)
    elif kind == "q_none":
        q = torch.full((V,), ninf, dtype=F64)
    elif kind == "inactive_nan":  # never read: NaN must not leak
        z = torch.full((V,), float("nan"), dtype=F64)
        q = torch.full((V,), float("nan"), dtype=F64)
        active = False
        coef.zero_()
    elif kind == "zero_coef":  # never read by the backward
        coef.zero_()
    elif kind == "identical":  # every divergence exactly 0
        q = z.clone()
    elif kind in ("underflow", "underflow_masked") and V > 1:
        # one entry with pi = exp(-40) against mu = exp(-95): mu underflows in float32 (exp_nonpositive's cutoff
        # is -87) but pi^2 / mu = exp(15) is finite: chi2's sum is redone from exp(2 dz - dq)
        z, q = randn(0.5), randn(0.5)
        j = 1 + int(torch.randint(0, V - 1, (1,), generator=gen))
        z[j] = z.max() - 40.0 * T
        q[j] = q.max() - 95.0 * T_r
        coef[2] *= 1e-6  # dz ~ 2 c pi^2 / mu / T: keep it inside fp16's range
        if kind == "underflow_masked" and V > 2:
            drop = torch.zeros(V, dtype=torch.bool)
            drop[0 if j != 0 else 2] = True
            z, q = z.masked_fill(drop, ninf), q.masked_fill(drop, ninf)
    return z, q, active, coef


KINDS = ("normal", "far", "offset", "peaked", "flat", "masked_same", "mu_zero", "mu_zero_coef", "pi_zero", "z_none",
         "q_none", "inactive_nan", "zero_coef", "identical", "underflow", "underflow_masked", "rising", "late_start")


def make_rows(kinds, V, dtype, seed, temperature, reference_temperature):
    """z, q in `dtype`, active [N] bool, coef [N, 4] float32, and the per-row T, T_r (float64 [N])."""
    gen = torch.Generator().manual_seed(seed)
    N = len(kinds)
    T = _temperatures(temperature, N, gen)
    T_r = _temperatures(reference_temperature, N, gen)
    rows = [_row(kind, gen, V, float(T[i]), float(T_r[i])) for i, kind in enumerate(kinds)]
    z = torch.stack([r[0] for r in rows]).to(dtype)
    q = torch.stack([r[1] for r in rows]).to(dtype)
    active = torch.tensor([r[2] for r in rows])
    coef = torch.stack([r[3] for r in rows]).float()
    return z, q, active, coef, T, T_r


def _temperatures(spec, N, gen):
    if spec == "per_row":
        return 0.5 + torch.rand(N, generator=gen, dtype=F64)
    return torch.full((N,), float(spec), dtype=F64)


def call_fwd(z, q, active, T, T_r, per_row):
    """The op with one temperature each (the float arguments) or per-row 1/T tensors (the floats then ignored)."""
    if per_row:
        return ops().full_divergences_fwd(z, q, active, 1.0, 1.0, (1 / T).float(), (1 / T_r).float())
    return ops().full_divergences_fwd(z, q, active, float(T[0]), float(T_r[0]), None, None)


def call_bwd(z, q, stats, coef, T, T_r, per_row):
    if per_row:
        return ops().full_divergences_bwd(z, q, stats, coef, 1.0, 1.0, (1 / T).float(), (1 / T_r).float())
    return ops().full_divergences_bwd(z, q, stats, coef, float(T[0]), float(T_r[0]), None, None)


# ---- the float64 side ---------------------------------------------------------------------------------------
def _log_softmax(x, T):
    top = x.amax(-1, keepdim=True)
    shifted = x - torch.where(torch.isfinite(top), top, torch.zeros_like(top))
    return torch.log_softmax(shifted / T[:, None], -1)


def _has_mass(z, q):
    return torch.isfinite(z).any(-1) & torch.isfinite(q).any(-1)


def expected_stats(z, q, active, T, T_r):
    """[N, 9] in float64 from the oracle (kl, reverse_kl, chi2, tv) and the same normalisers; zeros off the rows
    that are active and have a distribution on both sides."""
    z64, q64 = z.double(), q.double()
    live = active & _has_mass(z64, q64)
    out = torch.zeros(z.shape[0], STATS, dtype=F64)
    if not live.any():
        return out, live
    zl, ql, Tl, Trl = z64[live], q64[live], T[live], T_r[live]
    div = oracle.token_divergences(zl, reference_logits=ql, temperature=Tl, reference_temperature=Trl)
    lp, lq = _log_softmax(zl, Tl), _log_softmax(ql, Trl)
    pi, mu = lp.exp(), lq.exp()
    s_bar = (pi * torch.sign(pi - mu)).sum(-1)
    zmax, qmax = zl.amax(-1), ql.amax(-1)
    lnz = torch.logsumexp((zl - zmax[:, None]) / Tl[:, None], -1)
    lnq = torch.logsumexp((ql - qmax[:, None]) / Trl[:, None], -1)
    out[live] = torch.stack([div["kl"], div["reverse_kl"], div["chi2"], div["tv"], s_bar, zmax, lnz, qmax, lnq], 1)
    return out, live


def closed_form_grad(z, q, coef, T, T_r):
    """dz of the Triton kernel's docstring in float64, each term only where its coefficient is nonzero, and the sum
    of the terms' magnitudes (what float32 errors scale with)."""
    lp, lq = _log_softmax(z.double(), T), _log_softmax(q.double(), T_r)
    pi, mu = lp.exp(), lq.exp()
    live = pi > 0
    zero = torch.zeros((), dtype=F64)
    log_ratio = torch.where(live, lp, zero) - torch.where(live, lq, zero)  # pi > 0 against mu = 0: +inf
    reverse_kl = torch.where(live, pi * log_ratio, zero).sum(-1, keepdim=True)
    ratio_sq = torch.where(live, torch.exp(2 * torch.where(live, lp, zero) - lq), zero)
    chi2_plus_1 = ratio_sq.sum(-1, keepdim=True)
    sign = torch.sign(pi - mu)
    s_bar = (pi * sign).sum(-1, keepdim=True)
    a, b, c, d = (coef.double()[:, i:i + 1] for i in range(4))
    g = torch.where(a != 0, a * (pi - mu), zero) \
        + torch.where((b != 0) & live, b * pi * (log_ratio - reverse_kl), zero) \
        + torch.where((c != 0) & live, 2 * c * (ratio_sq - pi * chi2_plus_1), zero) \
        + torch.where(d != 0, 0.5 * d * pi * (sign - s_bar), zero)
    log_sizes = torch.where(live, lp.abs() + lq.abs(), zero) + reverse_kl.abs() + 1
    mag = torch.where(a != 0, a.abs() * (pi + mu), zero) \
        + torch.where((b != 0) & live, b.abs() * pi * log_sizes, zero) \
        + torch.where((c != 0) & live, 2 * c.abs() * (ratio_sq + pi * chi2_plus_1), zero) \
        + torch.where(d != 0, d.abs() * pi * (2 + s_bar.abs()), zero)
    return g / T[:, None], mag / T[:, None]


def autograd_grad(z, q, coef, rows, T, T_r):
    """d(sum_i coef_i div_i)/dz on `rows` by autograd on the oracle, one divergence at a time over the rows whose
    coefficient for it is nonzero; NaN where a row's term has no finite gradient."""
    names = ("kl", "reverse_kl", "chi2", "tv")
    grad = torch.zeros(z.shape, dtype=F64)
    for i, name in enumerate(names):
        take = rows & (coef[:, i] != 0)
        if not take.any():
            continue
        leaf = z[take].double().requires_grad_(True)
        div = oracle.token_divergences(leaf, reference_logits=q[take].double(), temperature=T[take],
                                       reference_temperature=T_r[take])[name]
        (g,) = torch.autograd.grad((coef[take, i].double() * div).sum(), leaf)
        grad[take] += g
    return grad


def _ties(z, q, T, T_r):
    """Entries where sign(pi - mu) is within float32 error of flipping, and per row the sum of their pi."""
    lp, lq = _log_softmax(z.double(), T), _log_softmax(q.double(), T_r)
    pi, mu = lp.exp(), lq.exp()
    tie = ((pi - mu).abs() <= TOL["divergence.sign_tie", F32].rtol * (pi + mu)) & (pi != mu)
    return tie, pi, torch.where(tie, pi, torch.zeros((), dtype=F64)).sum(-1)


# ---- the comparisons ----------------------------------------------------------------------------------------
def check_stats(stats, z, q, active, T, T_r):
    assert stats.dtype == F32 and stats.shape == (z.shape[0], STATS)
    want, live = expected_stats(z, q, active, T, T_r)
    assert torch.all(stats[~live] == 0), "inactive rows and rows without a distribution must be all zeros"
    _, _, tie_mass = _ties(z, q, T, T_r)
    for i in range(STATS):
        have, exp = stats[live, i].double(), want[live, i]
        if i in (5, 7):  # the row maxima are the logits themselves
            assert torch.equal(have, exp), f"stats[:, {i}]: row max"
            continue
        bound = TOL["divergence", F32]
        atol = bound.atol * torch.clamp(exp.abs(), min=1.0)
        if i == 4:
            atol = atol + 2 * tie_mass[live]
        for row, (h, e, a) in enumerate(zip(have, exp, atol)):
            assert_close(h[None], e[None], rtol=bound.rtol, atol=float(a), name=f"stats[{row}, {i}]")
    return want, live


def check_grad(grad, z, q, active, stats_want, live, coef, T, T_r):
    """dz against autograd where every nonzero-coefficient divergence of the row is finite, else against the
    closed form; rows outside (inactive, no distribution, zero coefficients) must be exactly zero."""
    assert grad.dtype == z.dtype and grad.shape == z.shape and grad.is_contiguous()
    used = live & (coef != 0).any(1)
    assert torch.all(grad[~used] == 0), "rows that are not read must be written with zeros"
    finite_terms = torch.isfinite(stats_want[:, :4]) | (coef.double() == 0)
    by_autograd = used & finite_terms.all(1)
    auto = autograd_grad(z, q, coef, by_autograd, T, T_r)
    closed, mag = closed_form_grad(z, q, coef, T, T_r)
    # the closed form is autograd's gradient wherever autograd has one
    assert_close(closed[by_autograd], auto[by_autograd], **tol("identity.small", F64), name="closed form vs autograd")
    want = torch.where(by_autograd[:, None], auto, closed)
    tie, pi, tie_mass = _ties(z, q, T, T_r)
    flushed = _log_softmax(z.double(), T) < FLUSH
    d_over_t = coef[:, 3].double().abs() / T
    bound = TOL["divergence.dlogits", z.dtype]
    for row in torch.nonzero(used).flatten().tolist():
        atol = bound.atol * mag[row] + d_over_t[row] * pi[row] * (tie[row] + tie_mass[row])  # sign ties (_ties)
        atol = atol + flushed[row] * (mag[row] + want[row].abs().nan_to_num(0.0))  # see FLUSH
        if z.dtype == F16:
            atol = atol + FP16_SUBNORMAL
        _assert_row(grad[row], want[row], bound.rtol, atol, f"dz[{row}]")


def _assert_row(actual, expected, rtol, atol, name):
    """assert_close with a per-entry atol tensor: the NaN / inf patterns must agree, finite entries be close."""
    a = actual.double()
    e = expected.to(actual.dtype).double()  # the oracle as the output dtype holds it
    assert torch.equal(torch.isnan(a), torch.isnan(e)), f"{name}: NaN pattern differs"
    assert torch.equal(torch.isposinf(a), torch.isposinf(e)) and torch.equal(torch.isneginf(a), torch.isneginf(e)), \
        f"{name}: inf pattern differs"
    fin = torch.isfinite(e)
    err = (a - e).abs()[fin]
    bound = atol[fin] + rtol * e[fin].abs()
    if err.numel():
        worst = int(torch.argmax(err - bound))
        assert bool((err <= bound).all()), (f"{name}: worst entry actual={a[fin][worst].item()!r} "
                                            f"expected={e[fin][worst].item()!r} err={err[worst].item():.3e}")


def run_case(kinds, V, dtype, temperature, reference_temperature, seed):
    per_row = temperature == "per_row"
    z, q, active, coef, T, T_r = make_rows(kinds, V, dtype, seed, temperature, reference_temperature)
    z0, q0, a0, c0 = z.clone(), q.clone(), active.clone(), coef.clone()
    stats = call_fwd(z, q, active, T, T_r, per_row)
    want, live = check_stats(stats, z, q, active, T, T_r)
    grad = call_bwd(z, q, stats, torch.where(active[:, None], coef, torch.zeros(())), T, T_r, per_row)
    check_grad(grad, z, q, active, want, live, torch.where(active[:, None], coef, torch.zeros(())), T, T_r)
    for before, after in ((z0, z), (q0, q), (a0, active), (c0, coef)):  # inputs are read, never written
        assert torch.equal(before.view(torch.uint8) if before.dtype != torch.bool else before,
                           after.view(torch.uint8) if after.dtype != torch.bool else after)


# ---- the tests ------------------------------------------------------------------------------------------------
TEMPERATURES = [(1.0, 1.0), (0.7, 0.7), (0.7, 1.0), ("per_row", "per_row")]
DTYPES = [F32, BF16, F16]
WIDTHS = [1, 7, 33, 1000, 4099]  # not a multiple of any vector width; 4099 spans 5 blocks of 1,024


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("V", WIDTHS)
def test_every_row_kind_against_the_oracle(dtype, V):
    """All row kinds in one call (each row's lanes, blocks and branches are its own), both ops. The temperature
    setting rotates with the width, so that each dtype meets all four (the float64 oracle, not the kernels, is
    what takes the time)."""
    temperatures = TEMPERATURES[(WIDTHS.index(V) + DTYPES.index(dtype)) % len(TEMPERATURES)]
    run_case(KINDS, V, dtype, *temperatures, seed=V)


@settings(max_examples=scaled(25))
@given(kinds=st.lists(st.sampled_from(KINDS), min_size=1, max_size=6),
       V=st.sampled_from(WIDTHS), dtype=st.sampled_from(DTYPES),
       temperatures=st.sampled_from(TEMPERATURES[:2] + [(0.7, 1.3)] + TEMPERATURES[3:]),
       seed=st.integers(0, 2**31 - 1))
def test_random_row_mixtures_against_the_oracle(kinds, V, dtype, temperatures, seed):
    run_case(kinds, V, dtype, *temperatures, seed=seed)


def test_inactive_rows_are_never_read():
    """NaN in inactive rows (forward) and in zero-coefficient rows (backward) stays out: zeros come back."""
    gen = torch.Generator().manual_seed(0)
    z = torch.randn(5, 300, generator=gen)
    q = torch.randn(5, 300, generator=gen)
    z[1], q[3] = float("nan"), float("nan")
    active = torch.tensor([1, 0, 1, 0, 1], dtype=torch.int8)  # int8 as well as bool
    stats = ops().full_divergences_fwd(z, q, active, 0.8, 1.0, None, None)
    assert torch.isfinite(stats).all() and torch.all(stats[[1, 3]] == 0)
    coef = torch.ones(5, 4)
    coef[[1, 3]] = 0.0
    grad = ops().full_divergences_bwd(z, q, stats, coef, 0.8, 1.0, None, None)
    assert torch.isfinite(grad).all() and torch.all(grad[[1, 3]] == 0)
    assert torch.isnan(z[1]).all() and torch.isnan(q[3]).all()  # and the inputs are untouched


@pytest.mark.parametrize("dtype", [F32, BF16])
def test_row_strided_views_are_read_where_they_lie(dtype):
    """The causal-shift view x[:, :-1, :V] of a [B, T+1, V+3] tensor, one batch row at a time (a 2-D view with row
    stride V + 3, starting mid-tensor), against a reference whose rows are a column slice (row stride V + 5): the
    same bits as on contiguous copies, and the oracle's values."""
    gen = torch.Generator().manual_seed(1)
    B, Tn, V = 3, 6, 129
    whole = (torch.randn(B, Tn + 1, V + 3, generator=gen) * 2).to(dtype)  # a padded vocabulary: row stride V + 3
    wide = (torch.randn(B * Tn, V + 5, generator=gen) * 2).to(dtype)
    shifted, reference = whole[:, :-1, :V], wide[:, 2:V + 2]
    T = torch.full((Tn,), 0.7, dtype=F64)
    for b in range(B):
        z, q = shifted[b], reference[b * Tn:(b + 1) * Tn]
        assert z.stride() == (V + 3, 1) and q.stride() == (V + 5, 1) and z.storage_offset() > 0 or b == 0
        active = torch.ones(Tn, dtype=torch.bool)
        active[-1] = False
        stats = ops().full_divergences_fwd(z, q, active, 0.7, 0.7, None, None)
        assert torch.equal(stats, ops().full_divergences_fwd(z.contiguous(), q.contiguous(), active, 0.7, 0.7,
                                                             None, None))
        check_stats(stats, z, q, active, T, T)
        coef = torch.randn(Tn, 4, generator=gen) * active[:, None]
        grad = ops().full_divergences_bwd(z, q, stats, coef, 0.7, 0.7, None, None)
        assert torch.equal(grad, ops().full_divergences_bwd(z.contiguous(), q.contiguous(), stats, coef, 0.7, 0.7,
                                                            None, None))
        want, live = expected_stats(z, q, active, T, T)
        check_grad(grad, z, q, active, want, live, coef, T, T)


def test_per_row_temperature_matches_one_temperature():
    """inv_temperature / inv_reference_temperature filled with one value give the float arguments' result, bit for
    bit (the floats are ignored when the tensors are given)."""
    gen = torch.Generator().manual_seed(2)
    z, q = torch.randn(4, 77, generator=gen), torch.randn(4, 77, generator=gen)
    active = torch.ones(4, dtype=torch.bool)
    inv_t, inv_r = torch.full((4,), 1 / 0.7), torch.full((4,), 1 / 1.3)
    one = ops().full_divergences_fwd(z, q, active, 1 / float(inv_t[0]), 1 / float(inv_r[0]), None, None)
    rows = ops().full_divergences_fwd(z, q, active, 5.0, 9.0, inv_t, inv_r)
    assert torch.equal(one, rows)
    coef = torch.randn(4, 4, generator=gen)
    assert torch.equal(ops().full_divergences_bwd(z, q, one, coef, 1 / float(inv_t[0]), 1 / float(inv_r[0]), None,
                                                  None),
                       ops().full_divergences_bwd(z, q, rows, coef, 5.0, 9.0, inv_t, inv_r))


def test_bad_inputs_are_refused():
    z = torch.randn(3, 8)
    active = torch.ones(3, dtype=torch.bool)
    with pytest.raises(RuntimeError, match="reference must have the logits' dtype"):
        ops().full_divergences_fwd(z, z.double(), active, 1.0, 1.0, None, None)
    with pytest.raises(RuntimeError, match="shaped like logits"):
        ops().full_divergences_fwd(z, z[:2], active, 1.0, 1.0, None, None)
    with pytest.raises(RuntimeError, match="unit stride along V"):
        ops().full_divergences_fwd(z, torch.randn(8, 3).t(), active, 1.0, 1.0, None, None)
    with pytest.raises(RuntimeError, match="active must be"):
        ops().full_divergences_fwd(z, z, active.float(), 1.0, 1.0, None, None)
    stats = ops().full_divergences_fwd(z, z, active, 1.0, 1.0, None, None)
    with pytest.raises(RuntimeError, match="coef must be"):
        ops().full_divergences_bwd(z, z, stats, torch.ones(3, 3), 1.0, 1.0, None, None)
    with pytest.raises(RuntimeError, match="stats must be"):
        ops().full_divergences_bwd(z, z, stats[:, :8].contiguous(), torch.ones(3, 4), 1.0, 1.0, None, None)


def test_empty_inputs():
    out = ops().full_divergences_fwd(torch.zeros(0, 5), torch.zeros(0, 5), torch.zeros(0, dtype=torch.bool), 1.0, 1.0,
                                     None, None)
    assert out.shape == (0, STATS)
    grad = ops().full_divergences_bwd(torch.zeros(0, 5), torch.zeros(0, 5), out, torch.zeros(0, 4), 1.0, 1.0, None,
                                      None)
    assert grad.shape == (0, 5)
