"""numerics="batch_invariant" on the logits path: a row's log-prob, entropy, sum p^2 and gradient row have the same
bits whatever else is in the batch, where the row stands, the layout ([B, T, V], the causal-shift view, packed
[N, V]), the torch backend's chunking and the thread count, on every backend this machine runs (Triton through the
interpreter); and they are right (against the float64 oracle), so that a constant cannot pass for invariant.

Why the torch backend needed work: ATen sums a lone row longer than its parallel grain (32,768) across threads,
in another order than the same row among many (torch_backend.row_sum). From hidden states the head GEMM's order
depends on the rows it multiplies (a lone fp32 row takes another oneDNN kernel): the mode runs every head GEMM in
zero-padded blocks of 64 rows (ops/linear.GEMM_BLOCK_ROWS), and a row's statistics and d_hidden row come out the
same whatever the batch, the memory budget, the rows in the loss, their order and the thread count.
"""

import pytest
import torch

import rlkernels
from rlkernels import backends, reference

from ..cases import BF16, F32, assert_close, interpreted, tol

BACKENDS = [
    ("torch", 40_000),
    pytest.param("cpu", 40_000, marks=pytest.mark.skipif(not backends.available()["cpu"],
                                                         reason="the CPU kernels could not be built here")),
    pytest.param("triton", 300, marks=[pytest.mark.interpret, pytest.mark.skipif(
        not interpreted(), reason="the Triton backend on CPU tensors needs the interpreter")]),
]


def _outputs(logits, labels, backend, **kw):
    leaf = logits.clone().requires_grad_(True)
    out = rlkernels.token_logprobs(leaf, labels, temperature=kw.pop("temperature", 1.0), compute_entropy=True,
                                   compute_sum_pi_squared=True, numerics="batch_invariant", backend=backend)
    (out.logprobs.sum() + 0.5 * out.entropy.sum()).backward()
    return out.logprobs.reshape(-1), out.entropy.reshape(-1), out.sum_pi_squared.reshape(-1), \
        leaf.grad.reshape(-1, logits.shape[-1])


@pytest.mark.parametrize("backend, V", BACKENDS)
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_a_rows_bits_do_not_depend_on_its_batch(backend, V, temperature):
    gen = torch.Generator().manual_seed(V)
    B, T = 3, 5
    logits = torch.randn(B, T, V, generator=gen) * 3
    labels = torch.randint(0, V, (B, T), generator=gen)
    batch = _outputs(logits, labels, backend, temperature=temperature)
    # the oracle: right as well as invariant
    x = logits.reshape(-1, V).double()
    lp, H, s2 = reference.token_stats(x, labels.reshape(-1), temperature=temperature)
    assert_close(batch[0], lp, **tol("value", F32, scale=float(lp.abs().max())), name="logprobs")
    assert_close(batch[1], H, **tol("value", F32, scale=float(H.abs().max())), name="entropy")
    flat, flat_labels = logits.reshape(-1, V), labels.reshape(-1)
    for row in (0, 7, B * T - 1):  # alone: first, middle, last
        alone = _outputs(flat[row:row + 1], flat_labels[row:row + 1], backend, temperature=temperature)
        for got, want in zip(alone, batch):
            assert torch.equal(got[0], want[row])
    # packed [N, V], the rows in another order, and the causal-shift view of a longer sequence
    order = torch.randperm(B * T, generator=gen)
    packed = _outputs(flat[order], flat_labels[order], backend, temperature=temperature)
    for got, want in zip(packed, batch):
        assert torch.equal(got, want[order])
    whole = torch.cat([logits, torch.randn(B, 1, V, generator=gen)], dim=1)
    shifted = _outputs(whole, torch.cat([labels, labels[:, :1]], 1), backend, temperature=temperature)
    keep = torch.arange(B * (T + 1)).reshape(B, T + 1)[:, :T].reshape(-1)
    for got, want in zip(shifted, batch):
        assert torch.equal(got[keep], want)


def test_the_torch_backend_is_invariant_to_its_chunks_and_threads():
    gen = torch.Generator().manual_seed(0)
    V = 40_000
    logits = torch.randn(9, V, generator=gen) * 3
    labels = torch.randint(0, V, (9,), generator=gen)
    base = _outputs(logits, labels, "torch")
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        single = _outputs(logits, labels, "torch")
    finally:
        torch.set_num_threads(threads)
    chunked = [t.reshape(-1) if t.dim() == 1 else t for t in base]
    for rows in (1, 4):  # the chunk's rows: from a fresh backend object with chunk_rows set
        stats = backends.instance("torch", chunk_rows=rows).token_stats_fwd(logits, labels, 1.0, True, True)
        assert torch.equal(stats.logprobs, chunked[0]) and torch.equal(stats.entropy, chunked[1])
        assert torch.equal(stats.sum_pi_squared, chunked[2])
    for got, want in zip(single, base):
        assert torch.equal(got, want)


@pytest.mark.parametrize("dtype, head_dtype", [(torch.float32, None), (torch.bfloat16, None),
                                               (torch.bfloat16, "float32")], ids=["fp32", "bf16", "bf16-fp32-head"])
def test_from_hidden_states_a_rows_bits_do_not_depend_on_its_batch(dtype, head_dtype):
    gen = torch.Generator().manual_seed(1)
    N, H, V = 70, 64, 5003
    hidden = torch.randn(N, H, generator=gen).to(dtype)
    weight = (torch.randn(V, H, generator=gen) * 0.2).to(dtype)
    labels = torch.randint(0, V, (N,), generator=gen)

    def run(rows, budget=None):
        leaf = hidden[rows].clone().requires_grad_(True)
        out = rlkernels.linear_token_logprobs(leaf, weight, labels[rows], compute_entropy=True, head_dtype=head_dtype,
                                              numerics="batch_invariant", memory_budget_bytes=budget)
        (out.logprobs.sum() + out.entropy.sum()).backward()
        return out.logprobs.detach(), out.entropy.detach(), leaf.grad

    full = run(torch.arange(N))
    x = torch.nn.functional.linear(hidden.double(), weight.double())
    lp, _, _ = reference.token_stats(x, labels)
    if dtype == torch.float32 or head_dtype:
        bound = tol("value", F32, scale=float(lp.abs().max()))
    else:  # a bf16 head rounds every logit to bf16 first
        bound = tol("bf16_head.logprobs", BF16, scale=float(x.abs().max()))
    assert_close(full[0], lp, **bound, name="logprobs")
    for row in (0, 33, N - 1):
        alone = run(torch.tensor([row]))
        assert all(torch.equal(a[0], b[row]) for a, b in zip(alone, full)), row
    small_chunks = run(torch.arange(N), budget=V * 4 * 7)  # 7 rows a chunk
    assert all(torch.equal(a, b) for a, b in zip(small_chunks, full))
    order = torch.randperm(N, generator=gen)
    shuffled = run(order)
    assert all(torch.equal(a, b[order]) for a, b in zip(shuffled, full))
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        single = run(torch.arange(N))
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(a, b) for a, b in zip(single, full))
