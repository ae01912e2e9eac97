"""The logits path's gradient formed in the forward (SPEC §2.4): where the fused stage's kernels cover a call, one
launch forms the statistics, the token's coefficients and dlogits (kernels/triton/forward_grad.py, a program per
row; the CPU kernels' forward_gradient op, a row at a time), and the backward hands back g * dlogits. The Triton
kernel runs here under TRITON_INTERPRET=1 (backend="triton" on CPU tensors), the CPU op compiled
(logits_one_pass=True: not its default).

Against the two-pass form (logits_one_pass=False): the same kernels' arithmetic in the same order, so the loss, the
log-probs, the entropy, the metrics and dlogits are the same bits, over the fused stage's family (hypothesis), the
kernel tier of LLM vocabularies (a program per row, its blocks full and a tail, or one masked block; forced at a
small V, whose own tiers keep two passes), both layouts, the causal-shift view, T != 1, per-token
temperatures, bf16, -inf rows and rows outside the loss. Autograd as PyTorch users expect it: a scaled loss, a
retained graph, logits from a matmul, validate=False. Which calls take it (out.path) and which keep two passes.
"""

import contextlib
from unittest import mock

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import rlkernels
from rlkernels import PolicyLossConfig, RolloutCorrection
from rlkernels.kernels.triton import forward_grad, tl_math, token_grad, token_stats

from ..cases import BF16, F32, assert_close, batches, make_batch, scaled, tol
from ..stage.test_fused_stage import family_configs

pytestmark = [pytest.mark.interpret,
              pytest.mark.filterwarnings("ignore:(overflow|invalid value|divide by zero) encountered:RuntimeWarning")]


def _step(logits, labels, advantages, mask, config, scale=None, **kwargs):
    """(output, d loss / d logits) of one decoupled_ppo_loss forward and backward on a fresh leaf."""
    leaf = logits.detach().clone().requires_grad_(True)
    out = rlkernels.decoupled_ppo_loss(leaf, labels, advantages, mask, config=config, **kwargs)
    (out.loss if scale is None else out.loss * scale).backward()
    return out, leaf.grad


def _same(a, b, name):
    assert a.shape == b.shape and a.dtype == b.dtype, name
    assert torch.equal(torch.nan_to_num(a, 7.0, 8.0, 9.0), torch.nan_to_num(b, 7.0, 8.0, 9.0)) and \
        torch.equal(a.isnan(), b.isnan()), (name, (a - b).abs().nan_to_num().max())


def _both(logits, labels, advantages, mask, config, **kwargs):
    """The two forms' outputs and gradients, checked to be the same bits; returns the one-pass output."""
    want, want_grad = _step(logits, labels, advantages, mask, config.with_overrides(logits_one_pass=False), **kwargs)
    got, got_grad = _step(logits, labels, advantages, mask, config, **kwargs)
    assert want.path == "logits" and got.path == "logits_one_pass"
    _same(got.loss.detach(), want.loss.detach(), "loss")
    _same(got_grad, want_grad, "dlogits")
    _same(got.logprobs, want.logprobs, "logprobs")
    assert (got.entropy is None) == (want.entropy is None)
    if want.entropy is not None:
        _same(got.entropy, want.entropy, "entropy")
    _same(got.mask, want.mask, "mask")
    assert list(got.metrics) == list(want.metrics)
    for name in want.metrics:
        _same(got.metrics[name], want.metrics[name], name)
    return got


@contextlib.contextmanager
def rows_per_program(block_v: int):
    """The LLM vocabularies' tier at a small V, in all three kernels alike: a program per row, streaming it in
    blocks of `block_v` (full blocks and a tail, or one masked block). The kernel covers only these
    (forward_grad.covers): the real tiers of V <= 1024 stack rows."""
    real = tl_math.vocab_config
    with contextlib.ExitStack() as stack:
        for module in (token_stats, token_grad, forward_grad):
            stack.enter_context(mock.patch.object(module, "vocab_config",
                                                  lambda V, block_v=None, block_n=None, b=block_v: real(V, b, 1)))
        yield


CPU_KERNELS = rlkernels.backends.is_available("cpu")
# the implementations: the Triton kernel under the interpreter (its tier forced: blocks and a tail, or one masked
# block), and the CPU kernels' op (logits_one_pass=True: not their default, which measured no faster)
IMPLEMENTATIONS = ["triton-blocks", "triton-block"] + (["cpu"] if CPU_KERNELS else [])


@contextlib.contextmanager
def implementation(name: str):
    """The config overrides that select it, inside the tier it needs."""
    if name == "cpu":
        yield dict(backend="cpu", logits_one_pass=True)
        return
    with rows_per_program(8 if name == "triton-blocks" else 64):
        yield dict(backend="triton")


@pytest.fixture(params=IMPLEMENTATIONS)
def tier(request):
    with implementation(request.param) as overrides:
        yield overrides


@settings(max_examples=scaled(80), deadline=None)
@given(batch=batches(dtype=F32, max_seqs=5, max_len=9, max_vocab=23),
       mode=st.sampled_from(("decoupled", "decoupled", "bypass", "on-policy")), data=st.data())
def test_it_is_the_two_pass_form_bit_for_bit(batch, mode, data):
    config = data.draw(family_configs(mode, one_pass=True)).with_overrides(validate=False,
                                                            metrics=data.draw(st.sampled_from(("all", "loss_only"))))
    with implementation(data.draw(st.sampled_from(IMPLEMENTATIONS))) as overrides:
        _both(batch.logits, batch.labels, batch.advantages, batch.response_mask, config.with_overrides(**overrides),
              **batch.kwargs(mode))


@pytest.mark.parametrize("dtype", [F32, BF16])
@pytest.mark.parametrize("layout", ["packed", "padded"])
def test_tiers_layouts_and_dtypes(tier, layout, dtype):
    batch = make_batch(layout, [7, 0, 5, 9] if layout == "packed" else [6, 6, 6], 37, dtype=dtype, seed=3,
                       logit_kind="neg_inf")
    config = PolicyLossConfig(rollout_correction=RolloutCorrection.geo_rs_token_tis(bounds=(0.5, 2.0)),
                              kl_coef=0.1, kl_type="k3", entropy_coeff=0.01, validate=False, **tier)
    _both(batch.logits, batch.labels, batch.advantages, batch.response_mask, config, **batch.kwargs("decoupled"))


def _tokens(B=3, T=6, V=29, seed=5):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(B, T + 1, V, generator=g) * 2
    labels = torch.randint(0, V, (B, T), generator=g)
    labels[0, 2] = -100  # ignored
    old = -torch.rand(B, T, generator=g) * 3
    return logits, labels, torch.randn(B, T, generator=g), torch.rand(B, T, generator=g) > 0.2, old


@pytest.mark.parametrize("temperature", ["one", "per token"])
def test_the_causal_shift_view_and_temperatures(tier, temperature):
    """logits[:, :-1] read where they lie (a [B, T, V] view whose rows are not one stride), T != 1 or one per token."""
    logits, labels, adv, mask, old = _tokens()
    T = 0.7 if temperature == "one" else 0.5 + torch.rand(labels.shape, generator=torch.Generator().manual_seed(1))
    config = PolicyLossConfig(rollout_correction=RolloutCorrection.seq_mis(), entropy_coeff=-0.02, **tier)
    _both(logits[:, :-1], labels, adv, mask, config, old_logprobs=old, rollout_logprobs=old + 0.05,
          temperature=T)


def test_a_scaled_loss_a_retained_graph_and_logits_from_a_matmul(tier):
    """g != 1 scales the formed dlogits (the two-pass backward forms them from g c: the same to rounding); a
    retained graph's second backward adds them again; logits from a matmul pass the gradient on to its inputs."""
    logits, labels, adv, mask, old = _tokens()
    rows, labels, adv, mask, old = logits[:, :-1].reshape(-1, 29), labels.reshape(-1), adv.reshape(-1), \
        mask.reshape(-1), old.reshape(-1)
    config = PolicyLossConfig(rollout_correction=RolloutCorrection.seq_mis(), entropy_coeff=0.01, **tier)
    kwargs = dict(old_logprobs=old, rollout_logprobs=old - 0.1, cu_seqlens=torch.tensor([0, 6, 12, 18]))
    grads = [_step(rows, labels, adv, mask, config.with_overrides(logits_one_pass=one), scale=-3.0, **kwargs)[1]
             for one in (False, True)]
    assert_close(grads[1], grads[0], **tol("reordered.dlogits", F32, scale=float(grads[0].abs().max())),
                 name="scaled")
    leaf = rows.clone().requires_grad_(True)
    out = rlkernels.decoupled_ppo_loss(leaf, labels, adv, mask, config=config, **kwargs)
    out.loss.backward(retain_graph=True)
    once = leaf.grad.clone()
    out.loss.backward()
    assert out.path == "logits_one_pass" and torch.equal(leaf.grad, once + once)
    # both backwards hand back the one saved tensor: one modified in place by a hook fails loudly (SPEC §2.4)
    leaf = rows.clone().requires_grad_(True)
    out = rlkernels.decoupled_ppo_loss(leaf, labels, adv, mask, config=config, **kwargs)
    leaf.register_hook(lambda grad: grad.mul_(2.0))
    out.loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.loss.backward()
    g = torch.Generator().manual_seed(2)
    hidden, weight = torch.randn(18, 8, generator=g), torch.randn(29, 8, generator=g)
    got = []
    for one in (False, True):
        h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
        out = rlkernels.decoupled_ppo_loss(h @ w.T, labels, adv, mask, config=config.with_overrides(
            logits_one_pass=one), **kwargs)
        out.loss.backward()
        got.append((out.path, h.grad, w.grad))
    assert [path for path, _, _ in got] == ["logits", "logits_one_pass"]
    assert torch.equal(got[0][1], got[1][1]) and torch.equal(got[0][2], got[1][2])


def test_without_validation_on_cpu_tensors(tier):
    """validate=False reads nothing from a device: on CPU tensors g is read as with validation (the host is the
    device: no sync, as the launch counter agrees); on CUDA that call keeps two passes (ops.logits_one_pass_blocker)."""
    logits, labels, adv, mask, old = _tokens()
    config = PolicyLossConfig(rollout_correction=RolloutCorrection.seq_mis(), validate=False, **tier)
    _both(logits[:, :-1], labels, adv, mask, config, old_logprobs=old, rollout_logprobs=old + 0.05)


@pytest.mark.parametrize("override, reason", [
    (dict(logits_one_pass=False), "logits_one_pass=False"),
    pytest.param(dict(backend="cpu"), "the CPU kernels with logits_one_pass=None",
                 marks=pytest.mark.skipif(not CPU_KERNELS, reason="the CPU kernels are not built here")),
    (dict(small_vocabulary=True), "V = 29"),
    (dict(backend="torch"), "the torch backend"),
    (dict(loss_type="gspo"), "loss_type='gspo'"),
    (dict(ratio_level="sequence"), "ratio_level='sequence'"),
    (dict(seq_mean_advantages=True), "seq_mean_advantages"),
    (dict(kl_coef=0.1, kl_score_gradient=True), "kl_score_gradient"),
    (dict(kl_coef=0.1, kl_bias_correction=True), "kl_bias_correction"),
    (dict(log_ratio_sq_coef=1e-3), "log_ratio_sq_coef"),
    (dict(off_policy_mask_threshold=0.05), "off_policy_mask_threshold"),
    (dict(loss_type="cispo"), "loss_type='cispo' (the one-pass kernel forms PPO's clip)"),
    (dict(fused_stage=False), "the fused stage's kernels are not the pass's backend's"),
    (dict(numerics="vllm"), "a numerics mode"),
    (dict(inplace_backward=True), "inplace_backward=True"),
])
def test_outside_it_the_two_pass_form_runs(override, reason):
    """Whatever blocks it, the call is the two-pass form's (as the real tiers of V = 29 are)."""
    override = dict(override)
    with contextlib.nullcontext() if override.pop("small_vocabulary", False) else rows_per_program(8):
        _outside(override, reason)


def _outside(override, reason):
    from rlkernels import step
    from rlkernels.inputs import Arguments, prepare_logits_loss

    logits, labels, adv, mask, old = _tokens()
    config = PolicyLossConfig(**{"rollout_correction": RolloutCorrection.seq_mis(), "backend": "triton", **override})
    leaf = logits[:, :-1].clone().requires_grad_(True)
    kwargs = dict(old_logprobs=old, rollout_logprobs=old + 0.05)
    if config.kl_coef:
        kwargs["ref_logprobs"] = old - 0.1
    out = rlkernels.decoupled_ppo_loss(leaf, labels, adv, mask, config=config, **kwargs)
    assert out.path == "logits"
    args = Arguments(labels=labels, advantages=adv, response_mask=mask, **kwargs)
    batch = prepare_logits_loss(leaf, args, config, {})[1]
    assert reason in step._logits_one_pass_blocker(leaf, batch, config, step.pass_options(config))
    with torch.no_grad():
        assert rlkernels.decoupled_ppo_loss(leaf, labels, adv, mask, config=config, **kwargs).path == "logits"
    half = leaf.detach().half().requires_grad_(True)
    assert rlkernels.decoupled_ppo_loss(half, labels, adv, mask, config=config, **kwargs).path == "logits"


@pytest.mark.gpu
def test_on_a_gpu_it_runs_at_a_real_vocabulary():
    """On CUDA at V = 151,936 bf16 (the tier of a program per row, 8192-wide blocks), the default config with
    validate=True takes the one-pass form: its log-probs, entropy and loss are the two-pass form's bits (the same
    code), and dlogits agree to the reordered tolerance (compiled separately, the two kernels' products may contract
    into FMAs differently)."""
    g = torch.Generator().manual_seed(4)
    N, V = 256, 151936
    logits = (torch.randn(N, V, generator=g) * 2).to(torch.bfloat16).cuda()
    labels = torch.randint(0, V, (N,), generator=g).cuda()
    old = (-torch.rand(N, generator=g) * 3).cuda()
    adv, mask = torch.randn(N, generator=g).cuda(), (torch.rand(N, generator=g) > 0.1).cuda()
    config = PolicyLossConfig(rollout_correction=RolloutCorrection.seq_mis(), entropy_coeff=0.01)
    kwargs = dict(old_logprobs=old, rollout_logprobs=old + 0.02, cu_seqlens=torch.tensor([0, 100, 200, N]).cuda())
    (want, want_grad), (got, got_grad) = [_step(logits, labels, adv, mask, config.with_overrides(logits_one_pass=one),
                                                **kwargs) for one in (False, True)]
    assert (want.path, got.path) == ("logits", "logits_one_pass")
    _same(got.logprobs, want.logprobs, "logprobs")
    _same(got.entropy, want.entropy, "entropy")
    _same(got.loss.detach(), want.loss.detach(), "loss")
    scale = float(want_grad.float().abs().max())
    assert_close(got_grad.float(), want_grad.float(), **tol("reordered.dlogits", BF16, scale=scale), name="dlogits")
