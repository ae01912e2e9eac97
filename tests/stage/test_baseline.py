"""The optimal token baseline and the variance proxies (SPEC §10): against the float64 oracle's closed forms,
against verl 0.9.1's own `compute_optimal_token_baseline_advantage`, `compute_multi_turn_optimal_token_baseline_
advantage` and `compute_variance_proxy_metrics` on hypothesis batches, packed against padded, compiled against
eager.

Float64 throughout: the fast path sums along rows and over groups in other orders than verl's loops (a
segmented reduction over sorted tokens), so values agree to a few float64 roundings of O(1) terms: 1e-12
relative to the largest return (TOL "otb").
"""

import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import rlkernels
from rlkernels import reference

from ..cases import ATOMIC_OPS, F32, F64, approx, assert_close, aten_ops, scaled, tol
from ..verl_import import import_verl_or_skip


def _close(got, want, what):
    scale = max(1.0, float(want.abs().max())) if want.numel() else 1.0
    assert_close(got.double(), want.double(), **tol("otb", F64, scale=scale), name=what)


@st.composite
def otb_batches(draw):
    """Padded [B, T] batches: groups of 1, 2 and up to 16 under unsorted, non-contiguous ids, empty responses,
    ties for the longest response, zero rewards, masks with holes (multi-turn)."""
    sizes = draw(st.lists(st.sampled_from([1, 2, 3, 16]), min_size=1, max_size=4))
    B, T = sum(sizes), draw(st.integers(1, 9))
    seed = draw(st.integers(0, 2**31 - 1))
    g = torch.Generator().manual_seed(seed)
    ids = torch.randperm(1000, generator=g)[: len(sizes)] * 7 - 300  # any integers, negative included
    group_index = torch.cat([ids[i].repeat(n) for i, n in enumerate(sizes)])
    group_index = group_index[torch.randperm(B, generator=g)]  # unsorted
    lengths = torch.randint(0, T + 1, (B,), generator=g)
    if draw(st.booleans()):  # ties for the longest response
        lengths[: max(2, B // 2)] = T
    mask = torch.arange(T)[None, :] < lengths[:, None]
    if draw(st.booleans()):  # holes: multi-turn masks (tool tokens between the model's turns)
        mask &= torch.rand(B, T, generator=g) < 0.7
    rewards = torch.zeros(B, T, dtype=torch.float64)
    if draw(st.booleans()):  # outcome rewards on the last token; else all zero
        last = (lengths - 1).clamp_min(0)
        rewards[torch.arange(B), last] = torch.randn(B, generator=g, dtype=torch.float64)
    if draw(st.booleans()):
        rewards += 0.1 * torch.randn(B, T, generator=g, dtype=torch.float64)
    old = -torch.rand(B, T, generator=g, dtype=torch.float64) * 3
    s2 = torch.rand(B, T, generator=g, dtype=torch.float64) * 0.6 + 0.05
    is_weights = (0.3 + torch.rand(B, T, generator=g, dtype=torch.float64) * 1.7) if draw(st.booleans()) else None
    return rewards, mask.double(), group_index, old, s2, is_weights


def _verl_fns():
    _, core_algos, _ = import_verl_or_skip()
    return {False: core_algos.compute_optimal_token_baseline_advantage,
            True: core_algos.compute_multi_turn_optimal_token_baseline_advantage}


@pytest.mark.parametrize("multi_turn", [False, True], ids=["otb", "tir"])
@pytest.mark.parametrize("handle_zero_tail", [True, False], ids=["zero_tail", "no_zero_tail"])
@settings(max_examples=scaled(60))
@given(batch=otb_batches())
def test_optimal_token_baseline_matches_verl(multi_turn, handle_zero_tail, batch):
    rewards, mask, group_index, old, s2, is_weights = batch
    want_adv, want_ret = _verl_fns()[multi_turn](rewards, mask, group_index.numpy(), old, s2,
                                                 rollout_is_weights=is_weights, handle_zero_tail=handle_zero_tail)
    out = rlkernels.optimal_token_baseline(rewards, mask, group_index, old, s2, is_weights=is_weights,
                                           multi_turn=multi_turn, handle_zero_tail=handle_zero_tail)
    _close(out.advantages, want_adv, "advantages")
    _close(out.returns, want_ret, "returns")
    ref_adv, ref_ret = reference.optimal_token_baseline(rewards, mask, group_index, old, s2, is_weights=is_weights,
                                                        multi_turn=multi_turn, handle_zero_tail=handle_zero_tail)
    _close(ref_adv, want_adv, "oracle advantages")
    _close(ref_ret, want_ret, "oracle returns")


@pytest.mark.parametrize("multi_turn", [False, True], ids=["otb", "tir"])
@settings(max_examples=scaled(30))
@given(batch=otb_batches())
def test_packed_equals_padded(multi_turn, batch):
    """Each padded row packed whole (its masked-out columns included, as a packed batch carries its tool
    tokens): the same advantages at the same tokens."""
    rewards, mask, group_index, old, s2, is_weights = batch
    B, T = rewards.shape
    padded = rlkernels.optimal_token_baseline(rewards, mask, group_index, old, s2, is_weights=is_weights,
                                              multi_turn=multi_turn)
    cu = torch.arange(B + 1) * T
    flat = lambda t: None if t is None else t.reshape(-1)  # noqa: E731
    packed = rlkernels.optimal_token_baseline(flat(rewards), flat(mask), group_index, flat(old), flat(s2),
                                              is_weights=flat(is_weights), multi_turn=multi_turn, cu_seqlens=cu)
    _close(packed.advantages, padded.advantages.reshape(-1), "advantages")
    _close(packed.returns, padded.returns.reshape(-1), "returns")


def _one_group(B=4, T=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    rewards = torch.randn(B, T, generator=g, dtype=torch.float64)
    mask = torch.ones(B, T, dtype=torch.float64)
    old = -torch.rand(B, T, generator=g, dtype=torch.float64)
    s2 = torch.rand(B, T, generator=g, dtype=torch.float64) * 0.5
    return rewards, mask, torch.zeros(B, dtype=torch.long), old, s2


@pytest.mark.parametrize("impl", ["fast", "oracle"])
def test_closed_forms(impl):
    otb = rlkernels.optimal_token_baseline if impl == "fast" else reference.optimal_token_baseline

    def returns(r, m):
        return (r * m).flip(-1).cumsum(-1).flip(-1)

    rewards, mask, groups, old, s2 = _one_group()
    # a group of one: B = 0, the advantage is the return
    adv, ret = otb(rewards[:1], mask[:1], groups[:1], old[:1], s2[:1])[:2]
    assert_close(adv, returns(rewards[:1], mask[:1]), **tol("otb.returns", F64), name="group of one")
    assert torch.equal(adv, ret)
    # identical trajectories: B_t = G_t W_t n / (W_t n + eps), the advantage G eps / (n W + eps) ~ 0
    same = [t[:1].expand(3, -1).clone() for t in (rewards, mask, old, s2)]
    adv = otb(same[0], same[1], groups[:3], same[2], same[3])[0]
    assert_close(adv, torch.zeros_like(adv), **tol("otb.eps", F64), name="identical trajectories")
    # a single token: B = mean over the group's members of G W / W = the mean reward (one token each)
    one = [t[:, :1].clone() for t in (rewards, mask, old, s2)]
    adv = otb(one[0], one[1], groups, one[2], one[3])[0]
    w = 1 - 2 * torch.exp(one[2]) + one[3]
    expected = one[0] - (one[0] * w).sum() / (w.sum() + 1e-8)
    assert_close(adv, expected, **tol("otb.closed_form", F64), name="one-token sequences")
    # W = 0 everywhere (w = 1 - 2 pi + sum pi^2 = 0 at pi = 1): B = 0 / eps = 0, the advantage is the return
    adv = otb(rewards, mask, groups, torch.zeros_like(old), torch.ones_like(s2))[0]
    assert_close(adv, returns(rewards, mask), **tol("otb.returns", F64), name="W = 0")
    # ties for the longest response: no zero tail, the same baseline with and without the rule
    tied = mask.clone()
    tied[2:, 3:] = 0  # two rows of length 5, two of 3
    with_rule = otb(rewards, tied, groups, old, s2, handle_zero_tail=True)[0]
    without = otb(rewards, tied, groups, old, s2, handle_zero_tail=False)[0]
    assert torch.equal(with_rule, without)
    # one longest row: its tail beyond the second longest keeps the raw return
    tail = mask.clone()
    tail[1:, 3:] = 0
    adv = otb(rewards, tail, groups, old, s2, handle_zero_tail=True)[0]
    assert_close(adv[0, 3:], returns(rewards, tail)[0, 3:], **tol("otb.returns", F64), name="zero tail")


def test_the_compiled_baseline_equals_eager_with_no_graph_break():
    rewards, mask, _, old, s2 = _one_group(B=12, T=7)
    groups = torch.tensor([5, 2, 5, 9, 2, 2, 5, 9, 1, 5, 2, 9])
    mask[3, 4:] = 0
    mask[7] = 0

    def otb(r, m, g, o, s, multi_turn):
        return rlkernels.optimal_token_baseline(r, m, g, o, s, multi_turn=multi_turn, validate=False).advantages

    compiled = torch.compile(otb, fullgraph=True, dynamic=True)
    for multi_turn in (False, True):
        for B in (12, 5):
            got = compiled(rewards[:B], mask[:B], groups[:B], old[:B], s2[:B], multi_turn)
            _close(got, otb(rewards[:B], mask[:B], groups[:B], old[:B], s2[:B], multi_turn), f"B={B}")
    torch._dynamo.reset()



@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_the_cpu_and_segmented_group_sums_are_bitwise_equal(monkeypatch, dtype):
    """The padded path's per-group sums: eager on the CPU by index_add_ (a sequential loop over the rows), else
    (compiled, CUDA) by segment_reduce over the rows sorted by group. Both add each group's rows in row order
    from zero, as a plain loop does, so all three agree to the bit and a compiled step equals an eager one."""
    from rlkernels.stage import baseline as stage_baseline

    g = torch.Generator().manual_seed(0)
    x = torch.randn(40, 9, generator=g, dtype=dtype) * torch.logspace(-6, 6, 9, dtype=dtype)  # rounding shows
    dense = torch.randint(0, 5, (40,), generator=g)  # groups of ~7 rows
    dense[:6] = 40  # rows of no group (the id R)
    eager = stage_baseline._group_sums(x, dense)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    segmented = stage_baseline._group_sums(x, dense)
    assert torch.equal(eager, segmented)
    want = x.new_zeros(41, 9)
    for row in range(40):  # each group's rows added in row order, from zero
        want[dense[row]] = want[dense[row]] + x[row]
    assert torch.equal(segmented, want)

def _variance_batch(seed, B=6, T=5, weighted=False):
    g = torch.Generator().manual_seed(seed)
    adv = torch.randn(B, T, generator=g, dtype=torch.float64)
    mask = (torch.rand(B, T, generator=g) < 0.8).double()
    mask[2] = 0  # an empty row
    old = -torch.rand(B, T, generator=g, dtype=torch.float64) * 2
    s2 = torch.rand(B, T, generator=g, dtype=torch.float64) * 0.5
    isw = (0.2 + torch.rand(B, T, generator=g, dtype=torch.float64) * 2) if weighted else None
    return adv, mask, old, s2, isw


@pytest.mark.parametrize("weighted", [False, True], ids=["on_policy", "is_weights"])
# a 0-d tensor is what clip_grad_norm_ returns, and verl's function takes one too
@pytest.mark.parametrize("grad_norm", [None, 0.3, 5.0, torch.tensor(0.3), torch.tensor(5.0, dtype=torch.float64)],
                         ids=["none", "0.3", "5.0", "tensor_0.3", "tensor_5.0_f64"])
def test_variance_proxies_match_verl(weighted, grad_norm):
    import_verl_or_skip()
    from verl.protocol import DataProto
    from verl.trainer.ppo.metric_utils import compute_variance_proxy_metrics

    for seed in range(5):
        adv, mask, old, s2, isw = _variance_batch(seed, weighted=weighted)
        tensors = dict(advantages=adv, response_mask=mask, old_log_probs=old, sum_pi_squared=s2)
        if isw is not None:
            tensors["rollout_is_weights"] = isw
        want = compute_variance_proxy_metrics(DataProto.from_dict(tensors=tensors), gradient_norm=grad_norm)
        got = rlkernels.variance_proxy_metrics(adv, mask, old, s2, is_weights=isw, grad_norm=grad_norm)
        # the oracle takes a Python float; verl squares a tensor in its own dtype, so it is compared on the float
        number = None if grad_norm is None else float(grad_norm)
        want_float = compute_variance_proxy_metrics(DataProto.from_dict(tensors=tensors), gradient_norm=number)
        oracle = reference.variance_proxy_metrics(adv, mask, old, s2, is_weights=isw, grad_norm=number)
        assert set(got) == set(want) == set(oracle)
        for name, value in want.items():
            value = float(value)  # verl's metric: a float, or a 0-d tensor where grad_norm was one
            assert float(got[name]) == approx(value, "otb", scale=max(1.0, abs(value))), name
            value = float(want_float[name])
            assert float(oracle[name]) == approx(value, "otb", scale=max(1.0, abs(value))), f"oracle {name}"


def test_variance_proxies_packed_equal_padded():
    adv, mask, old, s2, isw = _variance_batch(3, weighted=True)
    B, T = adv.shape
    padded = rlkernels.variance_proxy_metrics(adv, mask, old, s2, is_weights=isw, grad_norm=1.0)
    packed = rlkernels.variance_proxy_metrics(*(t.reshape(-1) for t in (adv, mask, old, s2)),
                                              is_weights=isw.reshape(-1), grad_norm=1.0,
                                              cu_seqlens=torch.arange(B + 1) * T)
    for name in padded:
        value = float(padded[name])
        assert float(packed[name]) == approx(value, "otb", scale=max(1.0, abs(value))), name


@pytest.mark.parametrize("case, match", [
    (dict(group_index=torch.zeros(3, dtype=torch.long)), r"group_index: expected shape \(4,\)"),
    (dict(group_index=torch.zeros(4)), "group_index: expected an integer dtype"),
    (dict(old_logprobs=torch.zeros(4, 3)), r"old_logprobs: expected shape \(4, 5\)"),
    (dict(token_rewards=torch.zeros(4, 5, 2)), r"token_rewards: expected \[B, T\]"),
    (dict(sum_pi_squared=torch.full((4, 5), float("nan"))), "sum_pi_squared: expected no NaN"),
    (dict(eps=-1.0), "eps: expected a finite number >= 0"),
])
def test_bad_input_names_the_argument(case, match):
    kw = dict(token_rewards=torch.zeros(4, 5), response_mask=torch.ones(4, 5), group_index=torch.zeros(4, dtype=int),
              old_logprobs=torch.zeros(4, 5), sum_pi_squared=torch.zeros(4, 5))
    kw.update(case)
    eps = kw.pop("eps", 1e-8)
    with pytest.raises((TypeError, ValueError), match=match):
        rlkernels.optimal_token_baseline(**kw, eps=eps)


def test_no_gradient_flows():
    rewards, mask, groups, old, s2 = _one_group()
    old = old.clone().requires_grad_(True)
    out = rlkernels.optimal_token_baseline(rewards.requires_grad_(True), mask, groups, old, s2)
    assert not out.advantages.requires_grad and not out.returns.requires_grad


def test_many_groups_take_one_sort_not_a_loop():
    """8 and 8,000 groups of the same batch size give the same kind of computation (the same ops, counted by a
    profiler), so the time does not grow with the number of groups (benchmarks/baseline.py times it)."""
    from torch.profiler import ProfilerActivity, profile

    def ops(groups):
        rewards, mask, old, s2 = (torch.rand(8000, 16, dtype=torch.float64) for _ in range(4))
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            rlkernels.optimal_token_baseline(rewards, mask.round(), groups, -old, s2, validate=False)
        return sorted((e.key, e.count) for e in prof.key_averages() if e.key.startswith("aten::"))

    few, many = ops(torch.arange(8000) % 8), ops(torch.arange(8000))
    assert few == many, "the op sequence depends on the number of groups"
    assert sum(count for _, count in few) < 400  # ~330 aten calls, nested ones counted: no per-group or per-row op


def test_the_example_runs_as_written():
    """examples/otb.py: its advantages are the float64 oracle's on its batch (float32 inputs: 1e-6 of O(1)
    returns), its bypass-mode advantages equal the π_old pass's (the policy has not stepped), its loss reaches the
    head's gradient; and the script runs as a user runs it."""
    import subprocess
    import sys

    from rlkernels.testing.peers import EXAMPLES, load_example

    out = load_example("otb.py").main()
    mask, group, rewards = out["batch"]
    want, want_returns = reference.optimal_token_baseline(rewards, mask, group, out["old"].logprobs,
                                                          out["old"].sum_pi_squared)
    assert_close(out["otb"].advantages.double(), want, **tol("otb", F32), name="advantages")
    assert_close(out["otb"].returns.double(), want_returns, **tol("otb", F32), name="returns")
    assert float(out["otb"].advantages.abs().max()) > 0.1  # the batch has groups with mixed rewards
    assert torch.equal(out["bypass"].advantages, out["otb"].advantages)
    assert torch.isfinite(out["loss"]) and float(out["grad"].abs().max()) > 0
    run = subprocess.run([sys.executable, os.path.join(EXAMPLES, "otb.py")], capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 0, run.stderr
    assert "equal the pi_old pass's: True" in run.stdout, run.stdout


@pytest.mark.parametrize("multi_turn", [False, True])
@pytest.mark.parametrize("packed", [False, True])
def test_no_floating_point_atomics_off_the_cpu(monkeypatch, multi_turn, packed):
    """CUDA's index_add_ / scatter_add_ / scatter_reduce_ accumulate with atomics: on floats they change the last
    bits from run to run. Every ATen op of the code CUDA (and a compiled step) runs is recorded (aten_ops), and
    no such op may act on a floating-point tensor; on integers (group sizes, lengths) they are exact."""
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)  # the branch taken off the CPU's eager
    rewards, mask, _, old, s2 = _one_group(B=6, T=5)
    groups = torch.tensor([4, 1, 4, 1, 1, 7])
    cu = torch.tensor([0, 5, 9, 14, 20, 25, 30]) if packed else None
    flat = (lambda t: t.reshape(-1)) if packed else (lambda t: t)

    def otb(r, m, o, s):
        out = rlkernels.optimal_token_baseline(flat(r), flat(m), groups, flat(o), flat(s), is_weights=flat(s) + 0.5,
                                               multi_turn=multi_turn, cu_seqlens=cu, validate=False)
        return out.advantages, out.returns

    atomic = {name: dtypes for name, dtypes in aten_ops(otb, rewards, mask, old, s2).items() if name in ATOMIC_OPS}
    floating = {name: dtypes for name, dtypes in atomic.items() if any(d.is_floating_point for d in dtypes)}
    assert not floating, f"floating-point atomic ops: {floating}"
    assert atomic, "the integer group counts are recorded (the test sees the ops)"


def test_a_tensor_grad_norm_is_not_read_to_the_host(monkeypatch):
    """clip_grad_norm_'s 0-d tensor stays on the device: no .item(), float() or bool() of it (a sync on a GPU)."""
    adv, mask, old, s2, isw = _variance_batch(1, weighted=True)
    grad_norm = torch.tensor(0.7)
    expected = rlkernels.variance_proxy_metrics(adv, mask, old, s2, is_weights=isw, grad_norm=0.7)

    def forbidden(*_a, **_k):
        raise AssertionError("the gradient norm was read to the host")

    for name in ("item", "__float__", "__bool__", "tolist"):
        monkeypatch.setattr(torch.Tensor, name, forbidden)
    got = rlkernels.variance_proxy_metrics(adv, mask, old, s2, is_weights=isw, grad_norm=grad_norm)
    monkeypatch.undo()
    for name in expected:  # 0.7 squared in float32 against float64: float32's rounding, relative 6e-8
        assert float(got[name]) == approx(float(expected[name]), "variance_proxy.tensor_grad_norm", F32), name
    with pytest.raises(TypeError, match="grad_norm: expected a number, a 0-d float tensor or None"):
        rlkernels.variance_proxy_metrics(adv, mask, old, s2, grad_norm=torch.ones(2))
