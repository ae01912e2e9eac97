"""Every Triton kernel, in every configuration the vocabulary-tier heuristic picks, touches only the elements of the
tensors it is given (rlkernels/testing/bounds.py: each load and store of the interpreter checked against the
launch's tensors, the inputs given as views with a gap on every side). The shapes are the ones a GPU run would
meet first, shrunk to what the interpreter runs quickly: a vocabulary that is not a multiple of the block in each
tier, a partial last block of rows, -1, out-of-range and foreign (-2) labels, the causal-shift view
[B, T + 1, V][:, :-1], a per-row temperature, the backward in place. Rows past 2^31 elements and 262,144-id
vocabularies run compiled on a GPU (test_gpu_kernels.py). A copy of the forward kernel with one mask removed is
caught at its line, so the check can fail.
"""

import importlib.util
import inspect
import re

import pytest
import torch
from triton import cdiv as triton_cdiv

from rlkernels.kernels.triton import divergences, head_columns, token_grad, token_stats, vllm_logprobs
from rlkernels.kernels.triton.tl_math import VOCAB_TIERS, pair_config, vocab_config
from rlkernels.testing.bounds import bounds_checked, guarded

from ..cases import interpreted

pytestmark = [
    pytest.mark.interpret,
    pytest.mark.skipif(not interpreted(), reason="the bounds check runs the kernels through Triton's interpreter"),
    pytest.mark.filterwarnings("ignore:(divide by zero|invalid value|overflow) encountered:RuntimeWarning"),
]

# one vocabulary inside each tier, odd (so its last block is partial); the last tier's is past one 8192 block
TIER_VOCABS = [37, 131, 517, 2053, 8197]
assert [vocab_config(V).BLOCK_V for V in TIER_VOCABS] == [tier[1] for tier in VOCAB_TIERS]


def _rows(V):
    return 2 * vocab_config(V).BLOCK_N + 1  # a partial last block of rows (one row per program: three rows)


def _labels(N, V, gen):
    labels = torch.randint(0, V, (N,), generator=gen)
    labels[1::4], labels[2::4] = -1, V  # skipped: ignored, and out of range
    labels[3::4] = -2  # a foreign target (vocabulary parallelism): statistics, no logprob
    return labels


def _assert_clean(violations):
    assert not violations, "\n".join(map(str, violations))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("V", TIER_VOCABS)
@pytest.mark.parametrize("layout", ["rows", "causal_shift"])
def test_token_kernels_stay_inside_their_tensors(layout, V, dtype):
    gen = torch.Generator().manual_seed(V)
    if layout == "rows":
        N = _rows(V)
        plain = torch.randn(N, V, generator=gen).to(dtype)
        logits = guarded(plain)
    else:  # [B, T + 1, V][:, :-1]: the last position of each sequence is in the allocation and no element
        B, T = 2, (_rows(V) + 1) // 2
        whole = guarded(torch.randn(B, T + 1, V, generator=gen).to(dtype))
        logits, plain = whole[:, :-1], whole[:, :-1].contiguous()
        N = B * T
    labels = _labels(N, V, gen)
    per_row_t = 0.5 + torch.rand(N, generator=gen)
    c, e = torch.randn(N, generator=gen), torch.randn(N, generator=gen)
    with bounds_checked(read_only=[logits]) as violations:  # only the in-place backward may write the logits
        stats = token_stats.token_stats_fwd(logits, guarded(labels), guarded(per_row_t), True, True)
        lean = token_stats.token_stats_fwd(logits, guarded(labels), 0.7, False, False)
        grad = token_grad.token_grad_bwd(logits, guarded(labels), guarded(stats.row_max), guarded(stats.log_norm),
                                         guarded(stats.entropy), guarded(c), guarded(e), guarded(per_row_t), False)
        token_grad.token_grad_bwd(logits, guarded(labels), guarded(lean.row_max), guarded(lean.log_norm), None,
                                  guarded(c), None, 0.7, False)
        in_place = logits.clone() if layout == "rows" else guarded(whole.clone())[:, :-1]
        token_grad.token_grad_bwd(in_place, guarded(labels), stats.row_max, stats.log_norm, stats.entropy, c, e,
                                  per_row_t, True)
        # several programs per row on grid axis 1, the last with a partial block (the launch heuristic splits a row
        # only past 32,768 columns)
        split = token_grad.token_grad_bwd(logits, guarded(labels), guarded(stats.row_max), guarded(stats.log_norm),
                                          guarded(stats.entropy), guarded(c), guarded(e), guarded(per_row_t), False,
                                          block_v=16 if V < 1000 else 1024, split=3)
    _assert_clean(violations)
    # the guards' NaN never reached a result: the same launches on plain tensors give the same bits
    expected = token_stats.token_stats_fwd(plain, labels, per_row_t, True, True)
    assert all(torch.equal(a, b) for a, b in zip(stats, expected))
    expected_grad = token_grad.token_grad_bwd(plain, labels, stats.row_max, stats.log_norm, stats.entropy, c, e,
                                              per_row_t, False)
    assert torch.equal(grad.reshape(expected_grad.shape), expected_grad)
    assert torch.equal(in_place.reshape(expected_grad.shape), expected_grad)
    assert torch.equal(split.reshape(expected_grad.shape), expected_grad)


@pytest.mark.parametrize("K", [1, 45])  # one id; more than one block of ids (BLOCK_K = 32), the last one partial
@pytest.mark.parametrize("layout", ["rows", "causal_shift"])
def test_the_head_kernels_stay_inside_their_tensors(layout, K):
    """The sampler's top-k beside the passes (kernels/triton/head_columns.py): the head's log-probs (k reads per row)
    and the backward's columns (reads of k ids and the label per row, writes into dlogits only); pads, ids past V,
    skipped and foreign labels, a partial block of rows."""
    V = 131
    gen = torch.Generator().manual_seed(K)
    if layout == "rows":
        N = 2 * head_columns.BLOCK_N + 3
        logits = guarded(torch.randn(N, V, generator=gen))
    else:
        B, T = 2, head_columns.BLOCK_N + 2
        logits = guarded(torch.randn(B, T + 1, V, generator=gen))[:, :-1]
        N = B * T
    labels = _labels(N, V, gen)
    ids = torch.stack([torch.randperm(V, generator=gen)[:K] for _ in range(N)])
    ids[::3, 0], ids[1::5, -1] = -1, V  # pads, and an id past the vocabulary (never read nor written)
    per_row_t = 0.5 + torch.rand(N, generator=gen)
    stats = token_stats.token_stats_fwd(logits, labels, per_row_t, True, False)
    c, e, C = torch.randn(N, generator=gen), torch.randn(N, generator=gen), torch.randn(N, K, generator=gen)
    dlogits = guarded(torch.zeros(N, V)).view(logits.shape) if layout == "rows" else \
        guarded(torch.zeros(B, T, V))
    with bounds_checked(read_only=[logits]) as violations:
        head = head_columns.head_logprobs_fwd(logits, guarded(labels), guarded(ids), guarded(stats.row_max),
                                              guarded(stats.log_norm), guarded(per_row_t))
        head_columns.write_head_columns(logits, dlogits, guarded(labels), guarded(ids), guarded(stats.row_max),
                                        guarded(stats.log_norm), guarded(stats.entropy), guarded(c),
                                        guarded(c + C.sum(1)), guarded(C), guarded(e), guarded(per_row_t))
    _assert_clean(violations)
    written = dlogits.reshape(N, V) != 0
    assert bool(written.any()) and not bool(written[(labels == -1) | (labels == V)].any()), "skipped rows untouched"
    skipped = (labels == -1) | (labels == V)
    pads_in_the_loss = (ids < 0) & ~skipped[:, None]
    assert torch.equal(head[skipped], torch.zeros_like(head[skipped]))
    assert bool(torch.isinf(head[pads_in_the_loss]).all())


@pytest.mark.parametrize("V", TIER_VOCABS)
@pytest.mark.parametrize("layout", ["rows", "causal_shift"])
def test_divergence_kernels_stay_inside_their_tensors(layout, V):
    gen = torch.Generator().manual_seed(V)
    N = 2 * pair_config(V).BLOCK_N + 1
    if layout == "rows":
        logits = guarded(torch.randn(N, V, generator=gen).to(torch.bfloat16))
    else:
        B, T = 2, (N + 1) // 2
        logits = guarded(torch.randn(B, T + 1, V, generator=gen).to(torch.bfloat16))[:, :-1]
        N = B * T
    reference = guarded(torch.randn(N, V, generator=gen).to(torch.bfloat16))
    active = torch.rand(N, generator=gen) < 0.7
    coef = torch.randn(N, 4, generator=gen)
    with bounds_checked(read_only=[logits, reference]) as violations:
        stats = divergences.full_divergences_fwd(logits, reference, guarded(active), 0.9, 1.1).stats
        divergences.full_divergences_bwd(logits, reference, guarded(stats), guarded(coef), 0.9, 1.1)
    _assert_clean(violations)
    assert torch.isfinite(stats).all()


@pytest.mark.parametrize("V", [1000, 3001])
@pytest.mark.parametrize("layout", ["rows", "causal_shift"])
def test_the_vllm_order_kernel_stays_inside_its_tensors(layout, V):
    gen = torch.Generator().manual_seed(V)
    if layout == "rows":
        logits = guarded(torch.randn(5, V, generator=gen).to(torch.bfloat16))
    else:
        logits = guarded(torch.randn(2, 4, V, generator=gen).to(torch.bfloat16))[:, :-1]
    N = logits.numel() // V
    labels = _labels(N, V, gen)
    with bounds_checked(read_only=[logits]) as violations:
        vllm_logprobs.vllm_logprobs(logits, guarded(labels), guarded(0.5 + torch.rand(N, generator=gen)))
        vllm_logprobs.vllm_logprobs(logits, guarded(labels), 0.7)
    _assert_clean(violations)


def _mutant(tmp_path):
    """token_stats.py with the mask (and its padding value) taken off the logits load of the forward's masked
    tail; the mutated line's number."""
    source = inspect.getsource(token_stats)
    load = 'z = tl.load(block_ptrs + v_full, mask=tail, other=float("-inf")).to(tl.float32)'
    unmasked = "z = tl.load(block_ptrs + v_full).to(tl.float32)"
    assert source.count(load) == 1, "the forward's logits load changed: update the mutant"
    mutated = source.replace(load, unmasked)
    mutated = re.sub(r"^from \.\.(\w+) import", r"from rlkernels.kernels.\1 import", mutated, flags=re.M)
    mutated = re.sub(r"^from \.(\w+) import", r"from rlkernels.kernels.triton.\1 import", mutated, flags=re.M)
    path = tmp_path / "token_stats_mutant.py"
    path.write_text(mutated)
    spec = importlib.util.spec_from_file_location("token_stats_mutant", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    line = mutated.splitlines().index(next(ln for ln in mutated.splitlines() if unmasked in ln))
    return module, f"{path.name}:{line + 1}"


def test_a_store_into_an_input_is_caught():
    """The out-of-place backward handed the logits as its output buffer: every store lands on a read-only tensor."""
    gen = torch.Generator().manual_seed(0)
    V = 131
    logits = guarded(torch.randn(5, V, generator=gen))
    labels = torch.randint(0, V, (5,), generator=gen)
    stats = token_stats.token_stats_fwd(logits, labels, 1.0, False, False)
    c = torch.ones(5)
    with bounds_checked(read_only=[logits]) as violations:
        token_grad.token_grad_bwd(logits, labels, stats.row_max, stats.log_norm, None, c, None, 1.0, True)
    assert violations and all(v.op == "store into a read-only tensor" for v in violations)
    # every element once, and each row's target column again after its blocks (token_grad's `_grad_target`)
    assert sum(v.lanes for v in violations) == 5 * V + 5


def test_a_load_without_its_mask_is_caught_at_its_line(tmp_path):
    mutant, where = _mutant(tmp_path)
    V = 131  # 256-wide blocks: the last 125 lanes of each row's block fall outside it
    gen = torch.Generator().manual_seed(0)
    logits = guarded(torch.randn(_rows(V), V, generator=gen))
    labels = torch.randint(0, V, (_rows(V),), generator=gen)
    with bounds_checked() as violations:
        mutant.token_stats_fwd(logits, labels, 1.0, True, True)
    assert violations, "the mutant's unmasked load went unnoticed"
    print("\n".join(map(str, violations)))
    assert {(v.kernel, v.where, v.op) for v in violations} == {("_token_stats_fwd_kernel", where, "load")}
    # every lane past a row's end: 256 - 131 for each of the 3 programs' 8 rows (the last program's 7 rows past
    # the batch wrap onto its first rows: row n lies at (n % rows) * stride)
    cfg = vocab_config(V)
    programs = triton_cdiv(_rows(V), cfg.BLOCK_N)
    assert len(violations) == programs
    assert sum(v.lanes for v in violations) == programs * cfg.BLOCK_N * (cfg.BLOCK_V - V)
    with bounds_checked() as violations:  # the kernel as shipped, same launch
        token_stats.token_stats_fwd(logits, labels, 1.0, True, True)
    _assert_clean(violations)
