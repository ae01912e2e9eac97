"""The fused per-sequence stage (Triton, interpreted on the CPU) against the torch stage `loss.sequence_stage`.

Every output is compared: loss, c_t, e_t, IS weights, the final mask (exactly) and every metric (same
keys, same order). Option coverage: IS level x threshold kind x batch normalisation x rejection
options (each alone and random subsets) x loss type x mode x agg mode x layout x dual clip x KL x
entropy, drawn by hypothesis (small shapes: the interpreter is ~500x slower than torch), plus the
edge cases of SPEC §7-§8 (nothing to average, empty sequences, |Δ| up to 50, ±inf rollout log-probs).

Tolerance: atol = rtol = 1e-5 in float32. Both sides compute the same fp32 formulas; they differ only
in summation order (a block tree in the kernel, torch's vectorised or sequential sums) and in the
last ulp of exp(), i.e. a few 2^-24 relative per term; the largest terms are exp(±20)-sized, so the
relative part dominates there, and the 1e-5 absolute floor covers means of O(1) terms that cancel.
NaN must match NaN (a sequence whose rollout holds both +inf and -inf has a NaN log-ratio sum in both).
"""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlkernels.config import RS_OPTIONS, PolicyLossConfig, RolloutCorrection
from rlkernels.kernels.triton.seq_stage import aot_specs, sequence_stage_triton
from rlkernels.loss import sequence_stage
from rlkernels.segments import Segments

from ..cases import scaled

pytestmark = [
    pytest.mark.interpret,
    # the interpreter runs numpy on the NaN/inf junk off the mask before `where` drops it
    pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning"),
    pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning"),
]

# CPU tensors through the interpreter here; CUDA tensors and compiled kernels on a GPU machine
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = dict(atol=1e-5, rtol=1e-5, equal_nan=True)
AGG_MODES = ("token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
K1_BOUNDS = ((0.5, 2.0), 1.5, (0.9, 1.3), (0.999, 1.001))  # a single hi means (1/hi, hi)
K23_BOUNDS = (0.01, 0.05, 0.5, 3.0)


# ---------------------------------------------------------------------------------------------
# inputs
# ---------------------------------------------------------------------------------------------
def make_batch(seed, layout, shape, mask_p, scale, inf_rollout=False):
    """Per-token scalars on a 1/16 grid (sums of few of them are exact in fp32, so rejection
    decisions cannot flip on summation order), plus a segments object for the layout."""
    g = torch.Generator().manual_seed(seed)
    if layout == "padded":
        B, T = shape
        N = B * T
        seg = Segments.padded(B, T, DEVICE)
    else:
        lengths = list(shape)
        N = sum(lengths)
        cu = torch.tensor([0] + lengths).cumsum(0)
        seg = Segments.packed(cu.to(DEVICE), N, DEVICE)

    def grid(lo, hi):
        return torch.randint(int(lo * 16), int(hi * 16) + 1, (N,), generator=g).float() / 16

    lp = grid(-5, 0)
    old = lp + grid(-1, 1) * scale
    roll = old + grid(-1, 1) * scale
    ref = lp + grid(-1, 1)
    adv = grid(-3, 3)
    ent = grid(0, 4)
    mask = torch.rand(N, generator=g) < mask_p
    if inf_rollout and N:
        pick = torch.rand(N, generator=g)
        roll = torch.where(pick < 0.15, torch.full_like(roll, -math.inf), roll)
        roll = torch.where(pick > 0.9, torch.full_like(roll, math.inf), roll)
    # values off the mask are junk the stage must ignore
    junk = torch.full((N,), math.nan)
    lp, old, roll, ref = (torch.where(mask, x, junk) for x in (lp, old, roll, ref))
    batch = dict(lp=lp, entropy=ent, advantages=adv, mask=mask, old=old, rollout=roll, ref=ref)
    return {k: v.to(DEVICE) for k, v in batch.items()}, seg


def stage_args(batch, seg, mode, kl, ent, cfg):
    """mode: decoupled (old + rollout), bypass (rollout only), onpolicy (neither), old_only (plain PPO on old)."""
    return (
        batch["lp"], batch["entropy"] if ent else None, batch["advantages"], batch["mask"],
        batch["old"] if mode in ("decoupled", "old_only") else None,
        batch["rollout"] if mode in ("decoupled", "bypass") else None,
        batch["ref"] if kl else None, seg, cfg,
    )


def assert_same(args):
    got = sequence_stage_triton(*args)
    want = sequence_stage(*args)
    assert list(got.metrics) == list(want.metrics)
    torch.testing.assert_close(got.loss, want.loss, **TOL, msg="loss")
    torch.testing.assert_close(got.coef_logprob, want.coef_logprob, **TOL, msg="coef_logprob")
    for name in ("coef_entropy", "is_weights"):
        g, w = getattr(got, name), getattr(want, name)
        assert (g is None) == (w is None), name
        if w is not None:
            torch.testing.assert_close(g, w, **TOL, msg=name)
    assert got.mask.dtype == torch.bool and torch.equal(got.mask, want.mask)
    for key, w in want.metrics.items():
        g = got.metrics[key]
        assert g.shape == () and g.dtype == w.dtype, key
        torch.testing.assert_close(g, w, **TOL, msg=key)
    return got, want


# ---------------------------------------------------------------------------------------------
# strategies
# ---------------------------------------------------------------------------------------------
shapes = st.one_of(
    st.tuples(st.just("padded"), st.tuples(st.integers(1, 5), st.integers(1, 12))),
    st.tuples(st.just("packed"), st.lists(st.integers(0, 12), min_size=0, max_size=6).map(tuple)),
)


@st.composite
def rs_options(draw, only=None):
    names = [only] if only else draw(st.lists(st.sampled_from(RS_OPTIONS), max_size=4, unique=True))
    return {n: draw(st.sampled_from(K1_BOUNDS if n.endswith("k1") else K23_BOUNDS)) for n in names}


@st.composite
def configs(draw, mode, rs_only=None):
    is_level = draw(st.sampled_from((None, "token", "sequence")))
    threshold = draw(st.sampled_from((2.0, 1.5, 5.0, (0.5, 5.0), (0.8, 1.25))))  # TIS C or IcePop (lo, hi)
    rc = RolloutCorrection(is_level=is_level, is_threshold=threshold, is_batch_normalize=draw(st.booleans()),
                           rs=draw(rs_options(rs_only)) if (rs_only or draw(st.booleans())) else {})
    kl = draw(st.sampled_from((None, "k1", "k2", "k3")))
    ent = draw(st.booleans())
    agg = draw(st.sampled_from(AGG_MODES))
    extra = draw(st.sampled_from(({}, {"global_num_tokens": 7.0, "global_num_seqs": 3.0}, {"loss_scale_factor": 5.0})))
    cfg = PolicyLossConfig(
        loss_type="reinforce" if mode == "bypass" and draw(st.booleans()) else "ppo_clip",
        clip_ratio_low=0.2, clip_ratio_high=draw(st.sampled_from((0.2, 0.28))),
        clip_ratio_c=draw(st.sampled_from((None, 3.0))), loss_agg_mode=agg,
        kl_coef=draw(st.sampled_from((0.0, 0.1))) if kl else 0.0, kl_type=kl or "k3",
        entropy_coeff=draw(st.sampled_from((0.0, 0.01))) if ent else 0.0,
        rollout_correction=rc if (rc.enabled or draw(st.booleans())) else None, **extra,
    )
    return cfg, kl is not None, ent


@st.composite
def cases(draw, rs_only=None, modes=("decoupled", "bypass", "onpolicy", "old_only"), extreme=False):
    layout, shape = draw(shapes)
    mode = draw(st.sampled_from(modes))
    cfg, kl, ent = draw(configs(mode, rs_only))
    scale = draw(st.sampled_from((50.0, 8.0) if extreme else (0.0, 0.05, 0.5, 2.0)))
    batch, seg = make_batch(draw(st.integers(0, 2**31 - 1)), layout, shape,
                            draw(st.sampled_from((0.0, 0.5, 0.85, 1.0))), scale,
                            inf_rollout=extreme and draw(st.booleans()))
    return stage_args(batch, seg, mode, kl, ent, cfg)


# ---------------------------------------------------------------------------------------------
# tests
# ---------------------------------------------------------------------------------------------
@settings(max_examples=scaled(150))
@given(cases())
def test_matches_torch_stage_over_the_option_product(args):
    assert_same(args)


@pytest.mark.parametrize("option", RS_OPTIONS)  # each of the 11 options alone, in the two modes that reject
@settings(max_examples=scaled(4))
@given(data=st.data())
def test_each_rejection_option_alone(option, data):
    assert_same(data.draw(cases(rs_only=option, modes=("decoupled", "bypass"))))


@settings(max_examples=scaled(40))
@given(cases(modes=("decoupled", "bypass"), extreme=True))
def test_extreme_ratios_and_infinite_rollout(args):
    # |Δ| up to 50 (past the ±20 clamp) and ±inf rollout log-probs on valid tokens
    assert_same(args)


ALL_RS = {n: ((0.5, 2.0) if n.endswith("k1") else 0.5) for n in RS_OPTIONS}


def _full_config(agg, is_level="sequence", threshold=2.0, rs=ALL_RS, **kw):
    rc = RolloutCorrection(is_level=is_level, is_threshold=threshold, is_batch_normalize=True, rs=rs)
    return PolicyLossConfig(loss_agg_mode=agg, rollout_correction=rc, kl_coef=0.1, entropy_coeff=0.01, **kw)


@pytest.mark.parametrize("agg", AGG_MODES)
def test_nothing_to_average_gives_zero(agg):
    # SPEC §7: an all-masked batch, N = 0 (no sequences, and only empty ones): loss 0, c_t 0, no NaN
    cfg = _full_config(agg)
    for layout, shape in (("padded", (3, 5)), ("packed", (0, 4, 0)), ("packed", ()), ("packed", (0, 0)),
                          ("padded", (2, 0))):
        batch, seg = make_batch(1, layout, shape, 0.0, 1.0)
        for mode in ("decoupled", "bypass", "onpolicy"):
            got, _ = assert_same(stage_args(batch, seg, mode, True, True, cfg))
            assert got.loss.item() == 0.0 and not got.coef_logprob.ne(0).any()
            assert all(not torch.isnan(v) for v in got.metrics.values())


@pytest.mark.parametrize("mode", ("decoupled", "bypass"))
def test_every_option_at_once_packed_with_empty_sequences(mode):
    # every rejection option ANDed together, sequence IS with batch normalisation, KL, entropy
    for agg, threshold in zip(AGG_MODES, (2.0, (0.5, 5.0), 1.5, (0.8, 1.25), 5.0)):
        batch, seg = make_batch(7, "packed", (3, 0, 12, 1, 0, 7), 0.8, 0.05)
        assert_same(stage_args(batch, seg, mode, True, True, _full_config(agg, threshold=threshold)))


def test_all_rejected_keeps_metrics_finite():
    # every token rejected (k2 <= 1e-6 with |Δ| >= 1/16): empty final mask but a non-empty original one
    rc = RolloutCorrection(is_level="token", rs={"token_k2": 1e-6, "seq_max_k3": 1e-6})
    batch, seg = make_batch(3, "padded", (3, 6), 1.0, 1.0)
    batch["rollout"] = batch["old"] + 0.25
    for agg in AGG_MODES:
        got, _ = assert_same(stage_args(batch, seg, "decoupled", True, True,
                                        PolicyLossConfig(loss_agg_mode=agg, rollout_correction=rc)))
        assert not got.mask.any() and got.loss.item() == 0.0


def test_extreme_ratio_closed_form():
    # Δ = ±50 is clamped to ±20 before exp: the IS weight is C, k3_kl = e^20 - 21 on the +50 token
    lp = torch.tensor([-1.0, -1.0], device=DEVICE)
    mask = torch.tensor([True, True], device=DEVICE)
    rc = RolloutCorrection(is_level="token", is_threshold=2.0)
    cfg = PolicyLossConfig(rollout_correction=rc)
    seg = Segments.packed(torch.tensor([0, 1, 2], device=DEVICE), 2, DEVICE)
    args = (lp, None, torch.tensor([1.0, -1.0], device=DEVICE), mask, lp,
            lp - torch.tensor([50.0, -50.0], device=DEVICE), None, seg, cfg)
    got, _ = assert_same(args)
    torch.testing.assert_close(got.is_weights.cpu(), torch.tensor([2.0, math.exp(-20)]))
    want_k3 = ((math.exp(20) - 21) + (math.exp(-20) + 19)) / 2
    torch.testing.assert_close(got.metrics["rollout_corr/k3_kl"].cpu(), torch.tensor(want_k3), rtol=1e-5, atol=0)


def test_deterministic_and_sync_free_outputs():
    batch, seg = make_batch(11, "packed", (5, 0, 9, 3), 0.8, 0.5)
    args = stage_args(batch, seg, "decoupled", True, True, _full_config("seq-mean-token-mean"))
    a, b = sequence_stage_triton(*args), sequence_stage_triton(*args)
    assert torch.equal(a.loss, b.loss) and torch.equal(a.coef_logprob, b.coef_logprob)
    assert all(torch.equal(a.metrics[k], b.metrics[k]) for k in a.metrics)
    assert all(v.device == batch["lp"].device and v.dim() == 0 for v in a.metrics.values())


def test_aot_specs_are_well_formed():
    specs = aot_specs()
    names = [s.name for s in specs]
    assert len(names) == len(set(names))
    for s in specs:
        assert set(s.signature) == set(s.fn.arg_names), s.name
        assert {k for k, v in s.signature.items() if v == "constexpr"} == set(s.constexprs), s.name
