"""torch.library.opcheck on every custom op: schema (no undeclared mutation or aliasing), autograd
registration, fake (meta) implementations that match the real outputs, and AOT dispatch with dynamic
shapes -- what torch.compile relies on. Inputs include the causal-shift [B, T, V] view, a skipped row
(label -1), the last vocabulary id, and one-row-per-chunk and single-chunk linear passes."""

import pytest
import torch

from rlkernels.backends.temperature import Temperature
from rlkernels.ops import linear
from rlkernels.ops import vocab as custom_ops

T = Temperature.of(0.7).tensor
LABELS = torch.tensor([0, 3, -1, 10, 2, 5])


def _check(op, args):
    results = torch.library.opcheck(op, args)
    assert all(v == "SUCCESS" for v in results.values()), results


@pytest.mark.parametrize("layout", ["rows", "shifted_view"])
@pytest.mark.parametrize("entropy, sum_pi_squared", [(False, False), (True, True)])
def test_token_stats(layout, entropy, sum_pi_squared):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 11, generator=g) if layout == "rows" else torch.randn(2, 4, 11, generator=g)[:, :3]
    _check(custom_ops.token_stats, (logits.requires_grad_(True), LABELS, T, entropy, sum_pi_squared, False, "torch", 0))


def test_token_grad():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(6, 11, generator=g)
    _, _, lp, ent, _ = custom_ops.token_stats(logits, LABELS, T, True, False, False, "torch", 0)
    row_max, log_norm = custom_ops.token_stats(logits, LABELS, T, False, False, False, "torch", 0)[:2]
    c, e = torch.randn(6, generator=g), torch.randn(6, generator=g)
    _check(custom_ops.token_grad, (logits, LABELS, row_max, log_norm, ent, c, e, T, "torch", 0))


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("chunk_rows", [2, 64])
def test_linear_ops(bias, chunk_rows):
    g = torch.Generator().manual_seed(2)
    h = torch.randn(6, 4, generator=g, requires_grad=True)
    w = torch.randn(11, 4, generator=g, requires_grad=True)
    b = torch.randn(11, generator=g, requires_grad=True) if bias else None
    _check(linear.linear_token_stats, (h, w, b, LABELS, T, True, True, "torch", chunk_rows))
    row_max, log_norm, _, ent, _ = linear.linear_token_stats(h.detach(), w.detach(), None if b is None else b.detach(),
                                                             LABELS, T, True, False, "torch", chunk_rows)
    c, e = torch.randn(6, generator=g), torch.randn(6, generator=g)
    _check(linear.linear_token_grad, (h.detach(), w.detach(), None if b is None else b.detach(), LABELS, row_max,
                                      log_norm, ent, c, e, T, "torch", chunk_rows, True, True, bias))


@pytest.mark.parametrize("backend", ["torch", "cpu"])
@pytest.mark.parametrize("layout", ["rows", "shifted_view"])
def test_full_divergence_ops(backend, layout):
    """The full form's two ops (SPEC §9.2) on the backend's passes, one temperature and one per row."""
    from rlkernels import backends
    from rlkernels.ops import divergences

    if not backends.is_available(backend):
        pytest.skip(f"backend {backend!r} is not available here")
    g = torch.Generator().manual_seed(3)
    z = torch.randn(6, 11, generator=g) if layout == "rows" else torch.randn(2, 4, 11, generator=g)[:, :3]
    r = torch.randn(z.shape, generator=g)
    active = torch.tensor([True, True, False, True, True, True])
    for t in (T, 0.5 + torch.rand(6, generator=g)):
        _check(divergences.full_divergences_op, (z.requires_grad_(True), r, active, t, T, backend, 0))
        stats = divergences.full_divergences_op(z.detach(), r, active, t, T, backend, 0)
        coef = torch.randn(6, 4, generator=g)
        _check(divergences.full_divergences_grad, (z.detach(), r, stats, coef, t, T, backend, 0))
