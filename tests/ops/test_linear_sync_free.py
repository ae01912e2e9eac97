"""validate=False on the fused-linear path (linear.loss_rows): no host synchronisation, so every row goes through the
head and the rows outside the loss come out as zeros. Its results against the row-selecting form (validate=True,
one sync) over every fused-linear route, and its statistics off the loss exactly 0, as when those rows are skipped.

Both forms accumulate the same rows in the same order (rows outside contribute exact zeros to every sum), but
their GEMMs see chunks of other shapes, and a GEMM's blocking (so its last bits) may follow the shape: they agree to
the float64 "value" tolerance, not bit for bit."""

import pytest
import torch

import rlkernels
from rlkernels import PolicyLossConfig, RolloutCorrection

from ..cases import F64, assert_close, make_batch, tol
from .test_linear import make_head

N, V, H, K = 60, 97, 12, 5
ROUTES = {
    "one_pass": dict(),
    "one_pass_rejecting": dict(rollout_correction=RolloutCorrection.seq_mis(), entropy_coeff=0.01),
    "two_pass": dict(loss_type="gspo", rollout_correction=RolloutCorrection.seq_mis()),
    "sampler_topk": dict(topk=True),
    "sampler_logits": dict(sampler_logits=True),
    "kept_set": dict(support=True),
}


def _inputs(seed=0):
    batch = make_batch("packed", [20, 0, 25, 15], V, dtype=F64, seed=seed, mask_p=0.6)
    hidden, weight, bias = make_head(torch.Generator().manual_seed(seed), (N,), V, H, F64, bias=True)
    g = torch.Generator().manual_seed(seed + 1)
    ids = torch.stack([torch.randperm(V, generator=g)[:K] for _ in range(N)])
    topk_lp = torch.log_softmax(torch.randn(N, K, generator=g, dtype=F64), -1) - 0.3
    support = torch.stack([torch.cat([lab.reshape(1), torch.randperm(V, generator=g)[:K]]) for lab in
                           batch.labels.clamp_min(0)])
    support = torch.where(support[:, :1] == support[:, 1:], -1, support[:, 1:])  # no duplicate of the label
    support = torch.cat([batch.labels.clamp_min(0)[:, None], support], 1)
    return batch, (hidden, weight, bias), dict(ids=ids, topk_lp=topk_lp, support=support,
                                              sampler_logits=torch.randn(N, V, generator=g, dtype=F64))


def _loss(route, validate, poison=False):
    batch, head, extra = _inputs()
    if poison:  # padding rows outside the loss holding NaN and inf hidden states (a fully masked attention row)
        outside = torch.nonzero(~batch.response_mask.bool()).squeeze(1)
        hidden = head[0].clone()
        hidden[outside[0]], hidden[outside[-1]] = float("nan"), float("inf")
        head = (hidden, *head[1:])
    options = dict(ROUTES[route])
    kw = {}
    if options.pop("topk", False):
        kw.update(sampler_topk_ids=extra["ids"], sampler_topk_logprobs=extra["topk_lp"])
    if options.pop("sampler_logits", False):
        kw.update(sampler_logits=extra["sampler_logits"])
    if options.pop("support", False):
        kw.update(sampling_support=extra["support"])
    leaves = [t.detach().clone().requires_grad_(True) for t in head]
    out = rlkernels.linear_decoupled_ppo_loss(
        leaves[0], leaves[1], batch.labels, batch.advantages, batch.response_mask, bias=leaves[2],
        **batch.kwargs("decoupled"), config=PolicyLossConfig(validate=validate, **options), **kw)
    out.loss.backward()
    return out, [t.grad for t in leaves]


@pytest.mark.parametrize("route", list(ROUTES))
def test_sync_free_fused_linear_matches_the_row_selecting_form(route):
    (free, free_grads), (selecting, grads) = _loss(route, False), _loss(route, True)
    assert free.path == selecting.path, "both forms take the same route"
    assert_close(free.loss, selecting.loss, **tol("value", F64), name="loss")
    assert_close(free.logprobs, selecting.logprobs, **tol("value", F64), name="logprobs")
    for name, value in selecting.metrics.items():
        assert_close(free.metrics[name], value, **tol("value", F64, scale=max(1.0, abs(float(value)))), name=name)
    for name, got, want in zip(("hidden", "weight", "bias"), free_grads, grads):
        assert_close(got, want, **tol("value", F64), name=f"d_{name}")


@pytest.mark.parametrize("route", list(ROUTES))
def test_non_finite_hidden_states_off_the_loss_never_reach_a_gradient(route):
    """Every row goes through the head GEMMs in the sync-free form, and a zero coefficient times a NaN hidden state
    is NaN: the rows that carry nothing are zeroed before the weight's GEMM, so both forms give the same finite
    gradients (found by review: the weight gradient was NaN on four routes)."""
    (free, free_grads), (selecting, grads) = _loss(route, False, poison=True), _loss(route, True, poison=True)
    assert_close(free.loss, selecting.loss, **tol("value", F64), name="loss")
    for name, got, want in zip(("hidden", "weight", "bias"), free_grads, grads):
        assert bool(torch.isfinite(want).all()), f"d_{name}: the row-selecting form stays finite"
        assert_close(got, want, **tol("value", F64), name=f"d_{name}")


def test_sync_free_token_statistics_are_zero_off_the_loss():
    batch, (hidden, weight, bias), _ = _inputs(seed=3)
    labels = torch.where(batch.response_mask.bool(), batch.labels, torch.full_like(batch.labels, -100))
    free, selecting = (rlkernels.linear_token_logprobs(hidden, weight, labels, bias=bias, compute_entropy=True,
                                                       compute_sum_pi_squared=True, validate=v) for v in (False, True))
    outside = labels == -100
    assert bool(outside.any()) and bool((~outside).any())
    for name in ("logprobs", "entropy", "sum_pi_squared"):
        got, want = getattr(free, name), getattr(selecting, name)
        assert torch.equal(got[outside], torch.zeros_like(got[outside])), f"{name}: rows outside the loss are 0"
        assert_close(got, want, **tol("value", F64), name=name)


def test_sync_free_head_ops_give_zeros_off_the_loss():
    """The fused-linear ops behind the sampler's top-k, the sampler's logits and a small kept set promise 0 on the
    rows outside the loss (the loss masks them anyway, so only the ops themselves can show it)."""
    from types import SimpleNamespace

    from rlkernels import ops
    from rlkernels.backends.temperature import Temperature
    from rlkernels.ops.divergences import linear_full_divergence_values
    from rlkernels.ops.head import HeadRows, linear_head_logprobs
    from rlkernels.ops.linear import HeadOptions

    batch, (hidden, weight, bias), extra = _inputs(seed=5)
    labels = torch.where(batch.response_mask.bool(), batch.labels, torch.full_like(batch.labels, -1))
    outside, T = labels < 0, Temperature.of(1.0)
    lp = torch.randn(N, dtype=F64)

    def both(fn):
        free, selecting = fn(False), fn(True)
        assert torch.equal(free[outside], torch.zeros_like(free[outside]))
        assert_close(free, selecting, **tol("value", F64), name=fn.__name__)

    def head(select):
        return linear_head_logprobs(hidden, weight, bias, HeadRows(labels, extra["ids"], lp), T, 1 << 20, select)

    def divergences(select):
        return linear_full_divergence_values(hidden, weight, bias, extra["sampler_logits"], ~outside, T,
                                             HeadOptions("torch", 16, select_rows=select))

    def kept_set(select):
        rows = SimpleNamespace(row_labels=labels, support=extra["support"], temperature=T)
        options = ops.PassOptions(entropy=True, backend="torch", select_rows=select)
        return torch.stack([t for t in ops._linear_kept_set_stats(hidden, weight, bias, rows, options)
                            if t is not None], 1)

    for fn in (head, divergences, kept_set):
        both(fn)


@pytest.mark.parametrize("K", [2, 20])  # a small kept set (gathered rows of the head) and a large one (masked logits)
def test_sync_free_reads_no_kept_id_off_the_loss(K):
    """With validate=False nothing checks the kept ids, and a row outside the loss may hold any: the sync-free form
    runs that row through the head but must read none of its ids (an id past V raised in the large kept set's
    mask; found by review), and gives the row-selecting form's loss."""
    gen = torch.Generator().manual_seed(K)
    B, T, H, V = 2, 3, 8, 32
    labels = torch.tensor([[1, 2, -100], [3, 4, 5]])
    support = torch.stack([torch.randperm(V, generator=gen)[:K] for _ in range(B * T)]).view(B, T, K)
    support[..., 0] = labels.clamp_min(0)
    support[0, 2, 1] = V + 50  # on the row outside the loss
    hidden, weight = torch.randn(B, T, H, generator=gen, dtype=F64), torch.randn(V, H, generator=gen, dtype=F64)
    losses = [rlkernels.linear_decoupled_ppo_loss(
        hidden, weight, labels, torch.ones(B, dtype=F64), labels != -100, old_logprobs=torch.full((B, T), -3.0,
                                                                                                  dtype=F64),
        sampling_support=support, config=PolicyLossConfig(validate=False, select_loss_rows=select)).loss
        for select in (False, True)]
    assert_close(losses[0], losses[1], **tol("value", F64), name="loss")
