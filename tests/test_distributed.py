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

import datetime
import os
import tempfile
import time
import traceback

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

TIMEOUT_S = 120


def _shards(V: int, world: int):
    """Uneven contiguous shards: the first V % world ranks get one id more."""
    sizes = [V // world + (1 if r < V % world else 0) for r in range(world)]
    offsets = [sum(sizes[:r]) for r in range(world)]
    return sizes, offsets


def _worker(rank, world, init_file, dtype_name, backend, kind, errors):
    code = 0
    try:
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=TIMEOUT_S))
        torch.set_num_threads(1)
        check = _check_rank if kind == "logits" else _check_rank_linear
        check(rank, world, getattr(torch, dtype_name), backend)
        dist.barrier()
    except BaseException:  # noqa: BLE001 -- reported to the parent, which fails the test
        errors.put((rank, traceback.format_exc()))
        code = 1
    # Leave without tearing the group down: after the barrier nothing is in flight, and gloo's
    # destructor racing a peer that already left can abort a rank that passed (seen once in CI runs)
    os._exit(code)


def _count_collectives(*names):
    """Wrap torch.distributed.<name> to count calls (the library calls them through the module) and the
    bytes each rank contributes (the tensor it sends: all_gather's input, all_reduce's buffer) under
    "<name>_bytes"."""
    calls = {name: 0 for name in names}
    calls.update({f"{name}_bytes": 0 for name in names})
    real = {name: getattr(dist, name) for name in names}

    def counting(name):
        def call(*args, **kwargs):
            calls[name] += 1
            sent = args[1] if name == "all_gather" else args[0]
            calls[f"{name}_bytes"] += sent.numel() * sent.element_size()
            return real[name](*args, **kwargs)
        return call

    for name in names:
        setattr(dist, name, counting(name))
    return calls, real


def _check_rank(rank, world, dtype, backend):
    if backend == "triton":
        os.environ["TRITON_INTERPRET"] = "1"
    import rlkernels
    from rlkernels import PolicyLossConfig, RolloutCorrection

    from .cases import assert_close, make_batch, tol

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
    calls, real = _count_collectives("all_gather")
    real_all_gather = real["all_gather"]
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
    calls.update(all_gather=0, all_gather_bytes=0)
    out = rlkernels.decoupled_ppo_loss(shard, batch.labels, batch.advantages, batch.response_mask, backend=backend,
                                       tp_group=dist.group.WORLD, **kw)
    forward_calls = calls["all_gather"]
    (grad,) = torch.autograd.grad(out.loss, shard)
    assert forward_calls == 1, f"forward collectives: {forward_calls}"
    assert calls["all_gather"] == 1, f"backward collectives: {calls['all_gather'] - forward_calls}"
    N = batch.labels.numel()
    assert calls["all_gather_bytes"] == 48 * N, f"bytes sent per rank: {calls['all_gather_bytes']}, 48 N = {48 * N}"

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
    dist.all_gather = real_all_gather


def _check_rank_linear(rank, world, dtype, backend):
    """The fused-linear path with the head's weight (and bias) split over the vocabulary."""
    import rlkernels
    from rlkernels import PolicyLossConfig, RolloutCorrection

    from .cases import assert_close, make_batch, tol

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

    calls, real = _count_collectives("all_gather", "all_reduce")
    mine = [hidden.clone().requires_grad_(True), weight[lo:hi].clone().requires_grad_(True),
            bias[lo:hi].clone().requires_grad_(True)]
    rlkernels.linear_token_logprobs(mine[0].detach(), mine[1].detach(), batch.labels, bias=mine[2].detach(),
                                    backend=backend, tp_group=dist.group.WORLD)  # warm-up: the shard offsets
    calls.update(all_gather=0, all_reduce=0, all_gather_bytes=0, all_reduce_bytes=0)
    out = rlkernels.linear_decoupled_ppo_loss(mine[0], mine[1], batch.labels, batch.advantages, batch.response_mask,
                                              bias=mine[2], backend=backend, tp_group=dist.group.WORLD, **kw)
    assert (calls["all_gather"], calls["all_reduce"]) == (1, 0), f"forward collectives: {calls}"
    got = torch.autograd.grad(out.loss, mine)
    assert (calls["all_gather"], calls["all_reduce"]) == (1, 1), f"forward + backward collectives: {calls}"
    N = hidden.shape[0]
    assert calls["all_gather_bytes"] == 48 * N and calls["all_reduce_bytes"] == N * H * hidden.element_size(), calls
    for name, value in real.items():
        setattr(dist, name, value)

    scale = max(1.0, float(expected.loss.detach().abs()))
    assert_close(out.loss, expected.loss, **tol(quantity, stat_dtype, scale=scale), name="loss")
    assert_close(out.logprobs, expected.logprobs, **tol(quantity, stat_dtype), name="logprobs")
    for name, value in expected.metrics.items():
        m_scale = max(1.0, float(value.abs())) if torch.isfinite(value) else 1.0
        assert_close(out.metrics[name], value, **tol(quantity, stat_dtype, scale=m_scale), name=name)
    expected_grads = (want[0], want[1][lo:hi], want[2][lo:hi])
    for name, g, w in zip(("d_hidden", "d_weight slice", "d_bias slice"), got, expected_grads):
        assert_close(g, w, **tol(grad_quantity, stat_dtype, scale=max(1e-3, float(w.abs().max()))), name=name)


def _spawn(world, dtype_name, backend, kind="logits"):
    with tempfile.TemporaryDirectory() as tmp:
        ctx = mp.get_context("spawn")
        errors = ctx.SimpleQueue()
        procs = [ctx.Process(target=_worker, args=(r, world, os.path.join(tmp, "rendezvous"), dtype_name, backend,
                                                   kind, errors)) for r in range(world)]
        for p in procs:
            p.start()
        deadline = time.monotonic() + TIMEOUT_S
        for p in procs:
            p.join(max(1.0, deadline - time.monotonic()))
        hung = [p for p in procs if p.is_alive()]
        for p in hung:
            p.kill()
        failures = []
        while not errors.empty():
            failures.append(errors.get())
        assert not failures, "\n".join(f"rank {r}:\n{tb}" for r, tb in failures)
        assert not hung, f"{len(hung)} rank(s) did not finish within {TIMEOUT_S} s"
        assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("dtype_name", ["float64", "float32"])
def test_vocab_parallel_matches_the_single_process_loss(world, dtype_name):
    _spawn(world, dtype_name, "torch")


@pytest.mark.interpret
def test_vocab_parallel_on_the_triton_backend():
    if os.environ.get("TRITON_INTERPRET") != "1" or torch.cuda.is_available():
        pytest.skip("runs the Triton kernels through the CPU interpreter")
    _spawn(2, "float32", "triton")


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("dtype_name", ["float64", "float32"])
def test_vocab_parallel_fused_linear_matches_the_single_process_loss(world, dtype_name):
    _spawn(world, dtype_name, "torch", kind="linear")
