"""head_dtype on the fused-linear path: a float32 (or TF32) head GEMM on bf16 operands, forward and backward, in
both forms (one pass, two passes), against the float64 oracle of the float32 head's logits; the bf16 head misses
that oracle by a bf16 rounding of the logits, which is what the option removes. On a CPU "tf32" is float32."""

import pytest
import torch
import torch.nn.functional as F

import rlkernels
from rlkernels import reference
from rlkernels.ops import linear

from ..cases import BF16, F32, F64, assert_close, tol

N, H, V = 37, 24, 301


def _inputs(seed=0):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(N, H, generator=gen).to(BF16)
    weight = (torch.randn(V, H, generator=gen) * 0.3).to(BF16)
    bias = torch.randn(V, generator=gen).to(BF16)
    labels = torch.randint(0, V, (N,), generator=gen)
    labels[3] = labels[20] = -100
    return hidden, weight, bias, labels


def _oracle(hidden, weight, bias, labels):
    """float64 log-probs, entropies and gradients of logits = h W^T + b from the bf16 operands, exactly."""
    leaves = [t.detach().to(F64).requires_grad_(True) for t in (hidden, weight, bias)]
    valid = labels >= 0
    lp, ent, _ = reference.token_stats(F.linear(*leaves), torch.where(valid, labels, -1))
    (lp.sum() + 0.3 * (ent * valid).sum()).backward()
    return lp, torch.where(valid, ent, 0.0), [t.grad for t in leaves]


def _run(head_dtype, memory_budget_bytes=4096):
    hidden, weight, bias, labels = (t.clone() for t in _inputs())
    leaves = [t.requires_grad_(True) for t in (hidden, weight, bias)]
    out = rlkernels.linear_token_logprobs(*leaves[:2], labels, bias=leaves[2], compute_entropy=True,
                                          head_dtype=head_dtype, memory_budget_bytes=memory_budget_bytes)
    (out.logprobs.sum() + 0.3 * out.entropy.sum()).backward()
    return out, [t.grad for t in leaves]


def test_a_float32_head_meets_the_oracle_of_the_float32_logits():
    lp, ent, grads = _oracle(*_inputs())
    out, got = _run("float32")  # a 4 KiB budget: three rows a chunk, and the weight in blocks of vocabulary rows
    scale = max(1.0, float(lp.abs().max()))
    assert_close(out.logprobs, lp, **tol("value", F32, scale=scale), name="logprobs")
    assert_close(out.entropy, ent, **tol("value", F32, scale=scale), name="entropy")
    for name, g, want in zip(("d_hidden", "d_weight", "d_bias"), got, grads):
        assert g.dtype == BF16
        assert_close(g, want, **tol("head.float32.grad", BF16, scale=float(want.abs().max())), name=name)
    # the bf16 head rounds each logit to bf16 first: its log-probs miss the same check by a bf16 rounding of the
    # logits (~1e-2 here, against a bound of ~1e-4), which is what the option removes
    plain, plain_grads = _run(None)
    bf16_error = float((plain.logprobs.detach().double() - lp.detach()).abs().max())
    assert bf16_error > 10 * tol("value", F32, scale=scale)["atol"]
    # and its gradients (from bf16 logits) miss the bound the float32 head's meet: GEMMs 2 and 3 ran in float32
    for name, g, want in zip(("d_hidden", "d_weight", "d_bias"), plain_grads, grads):
        with pytest.raises(AssertionError):
            assert_close(g, want, **tol("head.float32.grad", BF16, scale=float(want.abs().max())), name=name)


def test_tf32_is_float32_on_a_cpu_and_float32_inputs_are_unchanged():
    a, ga = _run("float32")
    b, gb = _run("tf32")
    assert torch.equal(a.logprobs, b.logprobs) and all(torch.equal(x, y) for x, y in zip(ga, gb))
    hidden, weight, bias, labels = _inputs()
    outs = [rlkernels.linear_token_logprobs(hidden.float(), weight.float(), labels, bias=bias.float(), head_dtype=hd)
            for hd in (None, "float32")]
    assert torch.equal(outs[0].logprobs, outs[1].logprobs)


@pytest.mark.parametrize("one_pass", [True, False])
def test_the_loss_with_a_float32_head_is_the_loss_on_float32_logits(one_pass):
    hidden, weight, bias, labels = _inputs(1)
    gen = torch.Generator().manual_seed(2)
    adv, mask = torch.randn(N, generator=gen), labels >= 0
    old = -torch.rand(N, generator=gen) * 5
    leaves = [t.clone().requires_grad_(True) for t in (hidden, weight, bias)]
    out = rlkernels.linear_decoupled_ppo_loss(*leaves[:2], labels, adv, mask, bias=leaves[2], old_logprobs=old,
                                              head_dtype="float32", linear_one_pass=one_pass,
                                              memory_budget_bytes=4096)
    out.loss.backward()
    assert out.path == ("linear_one_pass" if one_pass else "linear_two_pass")
    ref_leaves = [t.clone().requires_grad_(True) for t in (hidden, weight, bias)]
    logits = F.linear(*(t.float() for t in ref_leaves))  # the float32 head, formed whole
    ref = rlkernels.decoupled_ppo_loss(logits, labels, adv, mask, old_logprobs=old)
    ref.loss.backward()
    assert_close(out.loss, ref.loss, **tol("value", F32), name="loss")
    pairs = zip(("d_hidden", "d_weight", "d_bias"), (t.grad for t in leaves), (t.grad for t in ref_leaves))
    for name, g, want in pairs:
        assert_close(g, want.double(), **tol("head.float32.grad", BF16, scale=float(want.abs().max())), name=name)


def test_the_weight_is_upcast_in_blocks_no_larger_than_a_chunk_of_logits():
    weight = torch.zeros(V, H, dtype=BF16)
    for rows in (1, 3, 100, 1000):
        blocks = linear._weight_blocks(weight, rows)
        assert blocks[0][0] == 0 and blocks[-1][1] == V and all(a[1] == b[0] for a, b in zip(blocks, blocks[1:]))
        # float32 bytes of max(rows, 256) rows of logits: a one-row tail does not upcast a row at a time
        assert all((end - start) * H <= max(rows, 256) * V for start, end in blocks)
    wide = torch.zeros(151_936, 4096, dtype=BF16)
    assert len(linear._weight_blocks(wide, 1)) == 16  # 9,496 vocabulary rows a block, not one


def test_torch_float32_is_the_same_as_the_name():
    """A user passes the dtype: torch.float32 is "float32", to the bit (in the config too); other dtypes are named."""
    by_name, _ = _run("float32")
    by_dtype, _ = _run(torch.float32)
    assert torch.equal(by_name.logprobs, by_dtype.logprobs) and torch.equal(by_name.entropy, by_dtype.entropy)
    assert rlkernels.PolicyLossConfig(head_dtype=torch.float32).head_dtype == "float32"
    for bad in (torch.bfloat16, torch.float64, "fp32", 32):
        with pytest.raises(ValueError, match=r"head_dtype: expected None, 'float32' \(or torch.float32\) or 'tf32'"):
            rlkernels.PolicyLossConfig(head_dtype=bad)


def test_where_it_is_refused():
    hidden, weight, bias, labels = _inputs()
    with pytest.raises(ValueError, match=r"head_dtype: expected None, 'float32' \(or torch.float32\) or 'tf32'"):
        rlkernels.linear_token_logprobs(hidden, weight, labels, head_dtype="bf16")
    with pytest.raises(ValueError, match="head_dtype: 'float32' sets the precision"):
        rlkernels.decoupled_ppo_loss(torch.randn(N, V), labels, torch.zeros(N), labels >= 0, head_dtype="float32")
    gen = torch.Generator().manual_seed(3)
    support = torch.stack([torch.randperm(V, generator=gen)[:4] for _ in range(N)])
    labels = torch.where(labels >= 0, support[:, 0], labels)
    with pytest.raises(ValueError, match="head_dtype: 'float32' is not supported with a small kept set"):
        rlkernels.linear_token_logprobs(hidden, weight, labels, head_dtype="float32", sampling_support=support)
