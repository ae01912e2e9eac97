"""Non-finite logits and hidden states (SPEC §11, §13): a row holding a NaN or +inf logit has a NaN log-prob, entropy
and Σπ² in every backend (a row of -inf logits keeps its legal -inf / 0), and `validate=True` refuses such a row of the
loss from those [N] values, naming the argument and the first offending row, after the pass and before any loss."""

import math

import pytest
import torch

import rlkernels
from rlkernels import PolicyLossConfig, RolloutCorrection, backends, reference
from rlkernels.backends.temperature import Temperature
from rlkernels.ops.vocab_parallel import _merge

from .cases import TRITON_DEVICE, approx, interpreted, triton_here

NAN, INF = math.nan, math.inf
V, LABEL = 9, 3
# row -> (what its logits hold, whether the row is poisoned)
ROWS = {
    "finite": (None, False),
    "nan elsewhere": ((0, NAN), True),
    "nan at the label": ((LABEL, NAN), True),
    "+inf elsewhere": ((0, INF), True),
    "+inf at the label": ((LABEL, INF), True),
    "-inf at the label": ((LABEL, -INF), False),
    "all -inf": ("all", False),
    "nan among -inf": ("nan among -inf", True),
}
BACKENDS = {
    "cpu": ("cpu", pytest.mark.skipif(not backends.available()["cpu"], reason="the CPU kernels could not be built")),
    "torch": ("cpu", ()),
    "triton": (TRITON_DEVICE, [triton_here, pytest.mark.skipif(not backends.available()["triton"],
                                                                reason="Triton is not importable here")]),
    "cuda": ("cuda", pytest.mark.gpu),
}


def _logits(dtype, device):
    gen = torch.Generator().manual_seed(0)
    z = torch.randn(len(ROWS), V, generator=gen)
    for i, (hold, _) in enumerate(ROWS.values()):
        if hold == "all":
            z[i] = -INF
        elif hold == "nan among -inf":
            z[i], z[i, 5] = -INF, NAN
        elif hold is not None:
            z[i, hold[0]] = hold[1]
    return z.to(device=device, dtype=dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("backend", [pytest.param(b, marks=m) for b, (_, m) in BACKENDS.items()])
def test_every_backend_keeps_a_poisoned_row_nan(backend, dtype):
    """The pass's statistics of each kind of row, on every backend, against the float64 oracle where they are
    finite: NaN wherever the row holds a NaN or +inf (never the -inf of an empty row, which a ratio clamp would
    turn into a finite loss), and a -inf log-prob with entropy 0 where the row has no finite logit."""
    device = BACKENDS[backend][0]
    logits = _logits(dtype, device)
    labels = torch.full((len(ROWS),), LABEL, device=device)
    impl = backends.select(backend, logits, None)
    stats = impl.token_stats_fwd(logits, labels, Temperature.of(1.0), True, True)
    oracle = reference.token_stats(logits.double().cpu(), labels.cpu())
    for i, (name, (_, poisoned)) in enumerate(ROWS.items()):
        lp, h, s2 = (float(t[i]) for t in (stats.logprobs, stats.entropy, stats.sum_pi_squared))
        if poisoned:
            assert math.isnan(lp) and math.isnan(h) and math.isnan(s2), (name, lp, h, s2)
            assert math.isnan(float(stats.log_norm[i])), name
        elif name == "all -inf":
            assert (lp, h, s2) == (-INF, 0.0, 0.0), (name, lp, h, s2)
        elif name == "-inf at the label":
            assert lp == -INF and h == approx(float(oracle[1][i]), "value", torch.float32), (name, lp, h)
        else:  # bf16 logits upcast exactly: the statistics' float32 row applies to both dtypes
            assert lp == approx(float(oracle[0][i]), "value", torch.float32), (name, lp)


def test_a_poisoned_shard_poisons_the_row_under_tp():
    """The vocabulary-parallel merge: a shard whose normaliser is NaN makes the row's statistics NaN (its mass must
    not be dropped as if the shard had none), while a shard without a finite logit (-inf) is merged as empty."""
    # [world 2, (row max, log_norm, logprob, owner, entropy, sum p^2), N 2]: row 0 NaN on rank 1, row 1 empty there
    parts = torch.tensor([[[0.5, 0.5], [1.0, 1.0], [-1.5, -1.5], [1.0, 1.0], [0.8, 0.8], [0.4, 0.4]],
                          [[0.2, 0.0], [NAN, -INF], [0.0, 0.0], [0.0, 0.0], [NAN, 0.0], [NAN, 0.0]]],
                         dtype=torch.float64)
    logprob, entropy, sum_pi_squared, _ = _merge(parts, 1.0)
    assert all(math.isnan(float(t[0])) for t in (logprob, entropy, sum_pi_squared))
    # rank 1 holds no mass on row 1: the merge is rank 0's statistics, to float64 rounding
    assert float(logprob[1]) == approx(-1.5, "value") and float(entropy[1]) == approx(0.8, "value")


B, T, H = 2, 5, 8


def _loss_batch():
    gen = torch.Generator().manual_seed(1)
    labels = torch.randint(0, V, (B, T), generator=gen)
    mask = torch.ones(B, T, dtype=torch.bool)
    mask[0, 4] = False  # a prompt token: never read by the pass
    old = -torch.rand(B, T, generator=gen)
    return labels, torch.randn(B, T, generator=gen), mask, old


def _call(entry, backend, bad_row, value, **kw):
    """One public entry point on a batch whose flat row `bad_row` holds `value` in its logits (or its hidden
    state), with validate as given in kw."""
    labels, adv, mask, old = _loss_batch()
    gen = torch.Generator().manual_seed(2)
    if entry.startswith("linear"):
        hidden = torch.randn(B * T, H, generator=gen)
        hidden[bad_row, 1] = value
        weight = torch.randn(V, H, generator=gen, requires_grad=True)
        if entry == "linear_token_logprobs":
            return rlkernels.linear_token_logprobs(hidden, weight, labels.reshape(-1), backend=backend, **kw)
        return rlkernels.linear_decoupled_ppo_loss(hidden.requires_grad_(), weight, labels.reshape(-1),
                                                   adv.reshape(-1), mask.reshape(-1), old_logprobs=old.reshape(-1),
                                                   rollout_logprobs=old.reshape(-1), backend=backend,
                                                   linear_one_pass=entry.endswith("one_pass"), **kw)
    logits = torch.randn(B, T, V, generator=gen)
    logits.view(-1, V)[bad_row, 2] = value
    if entry == "token_logprobs":
        return rlkernels.token_logprobs(logits, labels, backend=backend, **kw)
    extra = {}
    if entry == "decoupled_ppo_loss with the sampler's top-k":
        ids = torch.stack([labels, (labels + 1) % V], -1)
        extra = dict(sampler_topk_ids=ids, sampler_topk_logprobs=torch.full(ids.shape, -3.0))
    return rlkernels.decoupled_ppo_loss(logits.requires_grad_(), labels, adv, mask, old_logprobs=old,
                                        rollout_logprobs=old, backend=backend,
                                        config=PolicyLossConfig(rollout_correction=RolloutCorrection.token_tis()),
                                        **extra, **kw)


ENTRIES = ["decoupled_ppo_loss", "decoupled_ppo_loss with the sampler's top-k", "token_logprobs",
           "linear_decoupled_ppo_loss one_pass", "linear_decoupled_ppo_loss two_pass", "linear_token_logprobs"]


@pytest.mark.parametrize("backend", ["cpu", "torch"])
@pytest.mark.parametrize("value", [NAN, INF, -INF], ids=["nan", "+inf", "-inf"])
@pytest.mark.parametrize("entry", ENTRIES)
def test_validate_refuses_a_poisoned_row_naming_it(entry, value, backend):
    source = "hidden" if entry.startswith("linear") else "logits"
    if value == -INF and source == "logits":  # one -inf logit is legal: the row keeps a distribution
        out = _call(entry, backend, 7, value)
        assert torch.isfinite(out.loss if hasattr(out, "loss") else out.logprobs).all()
        return
    # a -inf hidden entry gives logits of both signs of infinity (the weight has both signs): poisoned. Flat row 7
    # is (1, 2) of the padded [2, 5] logits, row 7 of the packed [10] hidden states
    row = r"7 " if source == "hidden" else r"\(1, 2\)"
    with pytest.raises(ValueError, match=rf"^{source}: expected finite .* in row {row}"):
        _call(entry, backend, 7, value)
    # validate=False: nothing refused, and the NaN reaches what the row feeds (never a silent finite value)
    out = _call(entry, backend, 7, value, validate=False)
    values = out.logprobs.reshape(-1) if not hasattr(out, "loss") else out.loss.reshape(1)
    assert torch.isnan(values).any()


@pytest.mark.parametrize("entry", ["decoupled_ppo_loss", "linear_decoupled_ppo_loss two_pass"])
def test_a_poisoned_row_outside_the_loss_is_never_read(entry):
    """Row (0, 4) is a prompt token (response mask 0): its logits are not read, so a NaN there is padding."""
    out = _call(entry, "cpu", 4, NAN)
    assert torch.isfinite(out.loss) and all(torch.isfinite(v) for v in out.metrics.values())


def test_the_first_offending_row_is_named_in_packed_and_any_rank_shapes():
    logits = torch.randn(3, 4, 2, V)
    logits[2, 1, 0, 0] = NAN
    logits[2, 3, 1, 5] = INF
    with pytest.raises(ValueError, match=r"row \(2, 1, 0\)"):
        rlkernels.token_logprobs(logits, torch.zeros(3, 4, 2, dtype=torch.long))
    labels, adv, _, old = _loss_batch()
    packed = torch.randn(B * T, V)
    packed[6, 0] = NAN
    with pytest.raises(ValueError, match=r"row 6\b"):
        rlkernels.decoupled_ppo_loss(packed, labels.reshape(-1), adv.reshape(-1), torch.ones(B * T),
                                     old_logprobs=old.reshape(-1), cu_seqlens=torch.tensor([0, 4, 10]))


@pytest.mark.parametrize("backend", ["torch", pytest.param("cpu", marks=pytest.mark.skipif(
    not backends.is_available("cpu"), reason="the CPU kernels are not built here")), pytest.param(
    "triton", marks=[pytest.mark.interpret, pytest.mark.skipif(not interpreted(), reason="needs TRITON_INTERPRET=1")])])
def test_a_rejected_row_holding_a_nan_logit_leaves_no_nan_in_the_gradient(backend):
    """validate=False, the sampler's top-k, and a sequence the rollout correction rejects whose row holds a NaN logit:
    the loss is finite and the row carries no coefficient, so its gradient is 0, the head's columns included (the
    head's column writes once put 0 - 0 * NaN there on the torch and Triton backends; found by review)."""
    gen = torch.Generator().manual_seed(0)
    B, T, V = 2, 3, 11
    labels = torch.randint(0, V, (B, T), generator=gen)
    logits = torch.randn(B, T, V, generator=gen)
    logits[0, 1, 4] = float("nan")
    ids = torch.tensor([[[1, 2]] * T] * B)
    old = torch.full((B, T), -3.0)
    rollout = old.clone()
    rollout[0] = -9.0  # sequence 0 far outside geo_rs's band: rejected
    leaf = logits.clone().requires_grad_(True)
    out = rlkernels.decoupled_ppo_loss(
        leaf, labels, torch.ones(B), torch.ones(B, T), old_logprobs=old, rollout_logprobs=rollout,
        sampler_topk_ids=ids, sampler_topk_logprobs=torch.full((B, T, 2), -3.0),
        config=PolicyLossConfig(validate=False, backend=backend,
                                rollout_correction=RolloutCorrection.geo_rs((0.999, 1.001))))
    out.loss.backward()
    assert not bool(out.mask[0].any()) and bool(torch.isfinite(out.loss))
    assert bool(torch.isfinite(leaf.grad).all()) and not bool(leaf.grad[0].any())
