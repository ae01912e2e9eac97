"""Vocabulary parallelism (`tp_group=`) on real gloo process groups, against the single-process result.

Ranks are spawned with torch.multiprocessing (world sizes 2 and 3, uneven vocabulary shards, an
odd V) and rendezvous through a file; every wait has a timeout, so a failing rank fails the test
instead of hanging the suite. Each rank builds the same batch, keeps its contiguous slice of the
vocabulary, and checks against the unsplit computation: log-probs, entropy, sum p^2, loss and every
metric identical on all ranks and equal to the single-process values (float64 to 1e-12, float32
within the tolerance table), and its gradient equal to its slice of the single-process gradient.
torch.distributed.all_gather is wrapped to count collectives: one per call in the forward (plus one,
cached, to learn the shard offsets), none in the backward.
"""

import os

import pytest
import torch
import torch.distributed as dist

from rlkernels.testing.spawn import Collectives


def _shards(V: int, world: int):
    """Uneven contiguous shards: the first V % world ranks get one id more."""
    sizes = [V // world + (1 if r < V % world else 0) for r in range(world)]
    offsets = [sum(sizes[:r]) for r in range(world)]
    return sizes, offsets


def _check_rank(rank, world, dtype, backend):
    if backend == "triton":
        os.environ["TRITON_INTERPRET"] = "1"
    import rlkernels
    from rlkernels import PolicyLossConfig, RolloutCorrection

    from ..cases import assert_close, make_batch, tol

    V = 13  # odd: shards of 7/6 (world 2) and 5/4/4 (world 3)
    sizes, offsets = _shards(V, world)
    lo, hi = offsets[rank], offsets[rank] + sizes[rank]
    batch = make_batch("packed", [5, 0, 4, 6], V, dtype=dtype, seed=7, mask_p=0.8, logit_kind="normal")
    config = PolicyLossConfig(rollout_correction=RolloutCorrection.geo_rs_token_tis(bounds=(0.5, 2.0)),
                              entropy_coeff=0.01, kl_coef=0.05, temperature=0.8, loss_agg_mode="seq-mean-token-mean")
    # a row whose logits are all -inf in rank 0's shard (that shard has no mass there), and a row
    # whose first id of every shard is -inf while its target is elsewhere (a foreign-target row's
    # normaliser must not come from its first column)
    full = batch.logits.clone()
    full[1, : sizes[0]] = float("-inf")
    full[2, offsets] = float("-inf")
    batch.labels[2] = 1
    counter = Collectives("all_gather")
    real_all_gather = counter.real["all_gather"]
    kw = dict(batch.kwargs("decoupled"), config=config)
    stat_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    quantity = "same_path" if dtype == torch.float64 else "reordered"

    reference_logits = full.clone().requires_grad_(True)
    expected = rlkernels.decoupled_ppo_loss(reference_logits, batch.labels, batch.advantages, batch.response_mask,
                                            backend="torch", **kw)
    (expected_grad,) = torch.autograd.grad(expected.loss, reference_logits)

    shard = full[:, lo:hi].clone().requires_grad_(True)
    rlkernels.decoupled_ppo_loss(shard, batch.labels, batch.advantages, batch.response_mask, backend=backend,
                                 tp_group=dist.group.WORLD, **kw)  # warm-up: learns the shard offsets
    counter.reset()
    out = rlkernels.decoupled_ppo_loss(shard, batch.labels, batch.advantages, batch.response_mask, backend=backend,
                                       tp_group=dist.group.WORLD, **kw)
    forward = dict(counter.calls)
    (grad,) = torch.autograd.grad(out.loss, shard)
    assert forward == {("all_gather", "world"): 1}, f"forward collectives: {forward}"
    assert counter.calls == forward, f"backward collectives: {counter.calls}"
    N = batch.labels.numel()
    sent = counter.sent[("all_gather", "world")]
    assert sent == 48 * N, f"bytes sent per rank: {sent}, 48 N = {48 * N}"

    scale = max(1.0, float(expected.loss.detach().abs()))
    assert_close(out.loss, expected.loss, **tol(quantity, stat_dtype, scale=scale), name="loss")
    assert_close(out.logprobs, expected.logprobs, **tol(quantity, stat_dtype), name="logprobs")
    assert_close(out.entropy, expected.entropy, **tol(quantity, stat_dtype), name="entropy")
    assert torch.equal(out.mask, expected.mask)
    for name, value in expected.metrics.items():
        m_scale = max(1.0, float(value.abs())) if torch.isfinite(value) else 1.0
        assert_close(out.metrics[name], value, **tol(quantity, stat_dtype, scale=m_scale), name=name)
    g_scale = max(1e-3, float(expected_grad.abs().max()))
    grad_quantity = "same_path" if dtype == torch.float64 else "reordered.dlogits"
    assert_close(grad, expected_grad[:, lo:hi], **tol(grad_quantity, stat_dtype, scale=g_scale), name="dlogits slice")

    # token_logprobs with sum p^2, and results bitwise identical on every rank
    stats = rlkernels.token_logprobs(shard.detach(), batch.labels, temperature=0.8, compute_entropy=True,
                                     compute_sum_pi_squared=True, backend=backend, tp_group=dist.group.WORLD)
    want = rlkernels.token_logprobs(full, batch.labels, temperature=0.8, compute_entropy=True,
                                    compute_sum_pi_squared=True, backend="torch")
    for name in ("logprobs", "entropy", "sum_pi_squared"):
        assert_close(getattr(stats, name), getattr(want, name), **tol(quantity, stat_dtype), name=name)
    mine = torch.cat([stats.logprobs, stats.entropy, stats.sum_pi_squared, out.loss.detach().reshape(1)])
    everyone = [torch.empty_like(mine) for _ in range(world)]
    real_all_gather(everyone, mine)
    assert all(torch.equal(everyone[0], other) for other in everyone), "ranks disagree"
    counter.restore()


def _check_rank_linear(rank, world, dtype, backend):
    """The fused-linear path with the head's weight (and bias) split over the vocabulary."""
    import rlkernels
    from rlkernels import PolicyLossConfig, RolloutCorrection

    from ..cases import assert_close, make_batch, tol

    V, H = 13, 5
    sizes, offsets = _shards(V, world)
    lo, hi = offsets[rank], offsets[rank] + sizes[rank]
    batch = make_batch("packed", [5, 0, 4, 6], V, dtype=dtype, seed=9, mask_p=0.8)
    gen = torch.Generator().manual_seed(9)
    hidden = torch.randn(15, H, generator=gen, dtype=torch.float64).to(dtype)
    weight = torch.randn(V, H, generator=gen, dtype=torch.float64).to(dtype)
    bias = torch.randn(V, generator=gen, dtype=torch.float64).to(dtype)
    config = PolicyLossConfig(rollout_correction=RolloutCorrection.seq_mis(), entropy_coeff=0.01, temperature=0.9)
    kw = dict(batch.kwargs("decoupled"), config=config, memory_budget_bytes=64)
    stat_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    quantity = "same_path" if dtype == torch.float64 else "reordered"
    grad_quantity = "same_path" if dtype == torch.float64 else "linear.grad"

    leaves = [t.clone().requires_grad_(True) for t in (hidden, weight, bias)]
    expected = rlkernels.linear_decoupled_ppo_loss(leaves[0], leaves[1], batch.labels, batch.advantages,
                                                   batch.response_mask, bias=leaves[2], backend="torch", **kw)
    want = torch.autograd.grad(expected.loss, leaves)

    counter = Collectives("all_gather", "all_reduce")
    mine = [hidden.clone().requires_grad_(True), weight[lo:hi].clone().requires_grad_(True),
            bias[lo:hi].clone().requires_grad_(True)]
    rlkernels.linear_token_logprobs(mine[0].detach(), mine[1].detach(), batch.labels, bias=mine[2].detach(),
                                    backend=backend, tp_group=dist.group.WORLD)  # warm-up: the shard offsets
    counter.reset()
    out = rlkernels.linear_decoupled_ppo_loss(mine[0], mine[1], batch.labels, batch.advantages, batch.response_mask,
                                              bias=mine[2], backend=backend, tp_group=dist.group.WORLD, **kw)
    assert dict(counter.calls) == {("all_gather", "world"): 1}, f"forward collectives: {counter.calls}"
    got = torch.autograd.grad(out.loss, mine)
    assert dict(counter.calls) == {("all_gather", "world"): 1, ("all_reduce", "world"): 1}, counter.calls
    N = hidden.shape[0]
    assert counter.sent[("all_gather", "world")] == 48 * N, counter.sent
    assert counter.sent[("all_reduce", "world")] == N * H * hidden.element_size(), counter.sent
    counter.restore()

    scale = max(1.0, float(expected.loss.detach().abs()))
    assert_close(out.loss, expected.loss, **tol(quantity, stat_dtype, scale=scale), name="loss")
    assert_close(out.logprobs, expected.logprobs, **tol(quantity, stat_dtype), name="logprobs")
    for name, value in expected.metrics.items():
        m_scale = max(1.0, float(value.abs())) if torch.isfinite(value) else 1.0
        assert_close(out.metrics[name], value, **tol(quantity, stat_dtype, scale=m_scale), name=name)
    expected_grads = (want[0], want[1][lo:hi], want[2][lo:hi])
    for name, g, w in zip(("d_hidden", "d_weight slice", "d_bias slice"), got, expected_grads):
        assert_close(g, w, **tol(grad_quantity, stat_dtype, scale=max(1e-3, float(w.abs().max()))), name=name)


def _spawn(pools, world, dtype_name, backend, kind="logits"):
    pools(world).run(_check_rank if kind == "logits" else _check_rank_linear, getattr(torch, dtype_name), backend)


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("dtype_name", ["float64", "float32"])
def test_vocab_parallel_matches_the_single_process_loss(world, dtype_name, rank_pools):
    _spawn(rank_pools, world, dtype_name, "torch")


@pytest.mark.interpret
def test_vocab_parallel_on_the_triton_backend(rank_pools):
    if os.environ.get("TRITON_INTERPRET") != "1" or torch.cuda.is_available():
        pytest.skip("runs the Triton kernels through the CPU interpreter")
    _spawn(rank_pools, 2, "float32", "triton")


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("dtype_name", ["float64", "float32"])
def test_vocab_parallel_fused_linear_matches_the_single_process_loss(world, dtype_name, rank_pools):
    _spawn(rank_pools, world, dtype_name, "torch", kind="linear")
