"""The fused stage (stage/fused.py) against the torch stage over its family, in both its implementations: two Triton
launches (kernels/triton/stage.py, under TRITON_INTERPRET=1 on CPU tensors: backend="triton") and the CPU kernels'
one op (csrc/cpu/token_passes.cpp sequence_stage: backend "auto" / "cpu"); which calls it takes (stage.choose) and
which it refuses.

The torch stage is held to the float64 oracle elsewhere (tests/stage/test_loss_family.py); here both sides compute
in float32 and differ in summation order (a sequence's sums in blocks, the batch's sums per sequence), so the
comparison is the ("reordered", fp32) row of the tolerance table: the loss, the gradient the coefficients give the
log-probs and the entropy, the IS weights, the reported log-probs, and the final mask exactly. Inputs: both layouts,
empty and all-masked sequences, NaN padding, mismatches from 0 to 50 nats (clamped weights, rejected sequences),
every aggregation with and without the global counts, every KL type, log_ratio_clamp None.
"""

import collections
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import rlkernels
from rlkernels import PolicyLossConfig, RolloutCorrection, reference, stage
from rlkernels.config import LOSS_AGG_MODES
from rlkernels.stage import fused
from rlkernels.stage.metrics import DeferredMetrics
from rlkernels.testing.launches import count_launches

from ..cases import F32, assert_close, batches, scaled, tol

pytestmark = [pytest.mark.interpret,
              pytest.mark.filterwarnings("ignore:(overflow|invalid value) encountered:RuntimeWarning")]

FAMILY_KL = ("k1", "k2", "abs", "k3", "k3_unclamped", "low_var_kl", "k1+", "k3+", "abs+")
FAMILY_RS = ("seq_sum_k1", "seq_mean_k1", "seq_sum_k3", "seq_mean_k3", "token_k1", "token_k2", "token_k3",
             "seq_all_k1", "seq_sum_k2", "seq_mean_k2", "seq_max_k2", "seq_max_k3", "token_bkl", "token_btv",
             "seq_mean_bkl", "seq_mean_btv")
FAMILY_POLICY_TERMS = (("vanilla", "token"), ("ppo_clip", "token"), ("vanilla", "sequence"), ("gspo", "token"),
                       ("cispo", "token"), ("cispo", "sequence"), ("dppo_binary_tv", "token"),
                       ("dppo_binary_tv_signed", "token"), ("ipo", "token"), ("luspo", "token"),
                       ("luspo", "sequence"), ("gpg", "token"), ("dro", "token"), ("sapo", "token"),
                       ("sapo", "sequence"), ("dppo_tv", "token"), ("dppo_kl", "token"))
TRUST_REGIONS = ("dppo_binary_tv", "dppo_binary_tv_signed", "ipo")  # weigh by p/q themselves: no IS level
IMPLEMENTATIONS = ("triton", "cpu")  # the backend that runs the fused stage on CPU tensors
STAGE_OP = {"triton": "triton:_sequence_kernel", "cpu": "sequence_stage"}  # one per stage run, as counted
needs_cpu_kernels = pytest.mark.skipif(not rlkernels.backends.is_available("cpu"),
                                       reason="the CPU kernels are not built here")
implementations = pytest.mark.parametrize("backend", [
    "triton", pytest.param("cpu", marks=needs_cpu_kernels)])


@st.composite
def family_corrections(draw, zero_weight: bool = True, is_weights: bool = True):
    """A rollout correction inside the family: an IS level (or none; `is_weights` False: none), truncated or masked,
    batch-normalised or not, rejection on k1 / k2 / k3 sums and means and k2 / k3 maxima over the sequence and on
    k1 / k2 / k3 of each token or of every token of the sequence, its statistics over m or over the tokens the token
    options keep, leaving m' or zeroing weights."""
    is_level = draw(st.sampled_from((None, "token", "sequence", "geometric") if is_weights else (None,)))
    threshold = draw(st.sampled_from((2.0, 1.2, (0.5, 5.0), (0.8, 1.25), (0.0, 3.0))))
    rs = {}
    for option in draw(st.lists(st.sampled_from(FAMILY_RS), max_size=3, unique=True)):
        if option.endswith("k1"):
            rs[option] = draw(st.sampled_from(((0.999, 1.001), (0.5, 2.0), (0.3, 5.0), (0.0, 1.1), (0.9, math.inf))))
        else:
            rs[option] = draw(st.sampled_from((0.001, 0.05, 4.0)))
    if is_level is None and not rs:
        return None
    normalize = is_level is not None and draw(st.booleans())
    # rejection zeroes the IS weights instead of leaving m' (OpenRLHF's, NeMo-RL's), where there are weights to zero
    zero_weight = zero_weight and is_level is not None and bool(rs) and not normalize and draw(st.booleans()) \
        and (is_level == "token" or not any(option.startswith("token_") for option in rs))
    return RolloutCorrection(is_level=is_level, is_threshold=threshold, rs=rs,
                             is_mode=draw(st.sampled_from((None, "truncate", "mask"))), is_batch_normalize=normalize,
                             rs_mode="zero_weight" if zero_weight else "mask",
                             seq_tokens=draw(st.sampled_from(("mask", "kept"))))


@st.composite
def family_configs(draw, mode: str, one_pass: bool = False):
    """A config inside the family; `one_pass`: inside the part the logits path's one-pass form takes (PPO's clip of
    each token's ratio, the token's own advantage, the KL's plain derivative: fused.factors_blocker)."""
    kl = draw(st.sampled_from((None,) + FAMILY_KL))
    globals_ = draw(st.booleans())
    # PPO's clip of the token's ratio or of the sequence's (TRL's GSPO), GSPO's token form (verl's), CISPO
    loss_type, ratio_level = draw(st.sampled_from(FAMILY_POLICY_TERMS[:2] if one_pass else FAMILY_POLICY_TERMS))
    # the KL's score term (NeMo-RL's) or the KL times the policy ratio (TRL's, DeepSeek-V3.2's), never both
    kl_form = draw(st.sampled_from((None, "kl_score_gradient", "kl_bias_correction"))) if kl and not one_pass \
        else None
    return PolicyLossConfig(
        loss_type=loss_type, ratio_level=ratio_level,
        cispo_cap=draw(st.sampled_from((None, 5.0, 1.1))) if loss_type == "cispo" else None,
        dro_beta=draw(st.sampled_from((0.1, 1.0))) if loss_type == "dro" else None,
        # SAPO's gate temperatures, a steep one among them (its gate saturates: the slope is formed apart)
        tau_pos=draw(st.sampled_from((1.0, 2.0, 40.0))), tau_neg=draw(st.sampled_from((1.05, 0.5, 40.0))),
        # LUSPO's own aggregation stands for the config's (over every sequence, whatever seq_mean_over says); an
        # entropy at a mode of its own would need the config's seq_mean_over beside it (blocker refuses that)
        entropy_agg_mode=None if loss_type == "luspo" else draw(st.sampled_from((None, None) + tuple(LOSS_AGG_MODES))),
        clip_ratio_low=draw(st.sampled_from((0.2, 0.1))), clip_ratio_high=draw(st.sampled_from((0.2, 0.28))),
        clip_ratio_c=draw(st.sampled_from((3.0, None, 1.5))), loss_agg_mode=draw(st.sampled_from(LOSS_AGG_MODES)),
        entropy_coeff=draw(st.sampled_from((0.0, 0.01, -0.02))), adaptive_entropy=draw(st.booleans()),
        kl_coef=0.0 if kl is None else draw(st.sampled_from((0.05, 1.0))), kl_type=kl or "k3",
        kl_score_gradient=kl_form == "kl_score_gradient", kl_bias_correction=kl_form == "kl_bias_correction",
        seq_mean_advantages=not one_pass and loss_type != "gspo" and draw(st.booleans()),
        rollout_correction=draw(family_corrections(loss_type != "gspo", loss_type not in TRUST_REGIONS))
        if mode == "decoupled" else None,
        # prime-rl's bands on p - q and their square on the kept tokens; the log-ratio square beside any loss
        binary_tv_low=draw(st.sampled_from((0.2, 0.02))), binary_tv_high=draw(st.sampled_from((0.2, 0.05))),
        ipo_kl_tau=draw(st.sampled_from((0.0, 0.01))), ipo_eps=draw(st.sampled_from((0.3, 0.05))),
        log_ratio_sq_coef=0.0 if one_pass else draw(st.sampled_from((0.0, 0.0, 1e-3, 0.1))),
        # DeepSeek-V3.2's off-policy sequence mask (TRL's); 0 is a threshold, not "off"
        off_policy_mask_threshold=None if one_pass else draw(st.sampled_from((None, None, None, 0.0, 0.05))),
        global_num_tokens=13.0 if globals_ else None, global_num_seqs=3.0 if globals_ else None,
        loss_scale_factor=draw(st.sampled_from((None, 4.0))), seq_mean_over=draw(st.sampled_from(("nonempty", "all"))),
        log_ratio_clamp=draw(st.sampled_from((20.0, 5.0, None))), metrics="loss_only", validate=False)


def _both(batch, mode, config, logprobs, entropy, is_weights=None):
    """(output, d loss / d logprobs, d loss / d entropy) of the torch stage and of the fused one; `is_weights`: a
    trainer's own."""
    results = []
    for fused_stage in (False, True):
        lp, h = logprobs.clone().requires_grad_(True), entropy.clone().requires_grad_(True)
        kwargs = dict(batch.kwargs(mode), is_weights=is_weights)
        out = rlkernels.policy_loss(lp, batch.advantages, batch.response_mask, entropy=h,
                                    config=config.with_overrides(fused_stage=fused_stage), **kwargs)
        results.append((out, *torch.autograd.grad(out.loss, (lp, h), allow_unused=True)))
    return results


@settings(max_examples=scaled(300), deadline=None)  # ~15 s: the interpreter runs these small batches quickly
@given(batch=batches(dtype=F32, max_seqs=6, max_len=11),
       mode=st.sampled_from(("decoupled", "decoupled", "decoupled", "bypass", "on-policy")), data=st.data())
def test_fused_stage_matches_the_torch_stage(batch, mode, data):
    config = data.draw(family_configs(mode))
    if rlkernels.backends.is_available("cpu"):
        config = config.with_overrides(backend=data.draw(st.sampled_from(IMPLEMENTATIONS)))
    else:
        config = config.with_overrides(backend="triton")
    gen = torch.Generator().manual_seed(int(batch.labels.numel()))
    shape = batch.labels.shape
    logprobs = batch.old_logprobs + torch.randn(shape, generator=gen) * data.draw(st.sampled_from((0.0, 0.1, 2.0)))
    entropy = torch.rand(shape, generator=gen) * 3
    rc = config.rollout_correction
    # a trainer's own IS weights (verl's, TRL's), where the correction computes none
    given = (mode != "on-policy" and (rc is None or rc.is_level is None) and data.draw(st.booleans()))
    is_weights = torch.rand(shape, generator=gen) * 2 if given else None
    (want, want_lp, want_h), (got, got_lp, got_h) = _both(batch, mode, config, logprobs, entropy, is_weights)
    assert got.metrics == {} and got.path == want.path
    assert torch.equal(got.mask, want.mask), "final mask differs"
    scale = max(1.0, float(want.loss.detach().abs())) if torch.isfinite(want.loss) else 1.0
    if config.kl_bias_correction and config.kl_coef:
        scale *= _largest_ratio(batch, mode, config, logprobs)
    assert_close(got.loss, want.loss, **tol("reordered", F32, scale=scale), name="loss")
    assert_close(got.logprobs, want.logprobs, **tol("reordered", F32), name="logprobs")
    assert (got.is_weights is None) == (want.is_weights is None)
    if want.is_weights is not None:
        assert_close(got.is_weights, want.is_weights, **tol("reordered", F32), name="is_weights")
    for name, g, w in (("dlogprobs", got_lp, want_lp), ("dentropy", got_h, want_h)):
        assert (g is None) == (w is None), name
        if w is not None:
            scale = max(1e-3, float(w.abs().amax()) if w.numel() else 0.0)
            assert_close(g, w, **tol("reordered", F32, scale=scale), name=name)


def _assert_same_metrics(got, want):
    """The same names in the same order, each the same bits (NaN where the other is NaN)."""
    assert list(got) == list(want)
    for name, value in want.items():
        assert got[name].dtype == value.dtype, name
        assert torch.equal(got[name], value) or bool(torch.isnan(got[name]) & torch.isnan(value)), \
            (name, got[name], value)


def _torch_and_fused(lp, adv, mask, config, backend, **inputs):
    """((output, d loss / d lp) of the torch stage, the same of the fused stage) of one policy_loss call on the
    statistics `lp`; the fused one runs the stage's kernels once, the torch one never."""
    results = []
    for fused_stage in (False, True):
        leaf = lp.clone().requires_grad_(True)
        out, launched = count_launches(rlkernels.policy_loss, leaf, adv, mask,
                                       config=config.with_overrides(fused_stage=fused_stage), **inputs)
        assert launched.ops[STAGE_OP[backend]] == int(fused_stage)
        results.append((out, *torch.autograd.grad(out.loss, leaf)))
    return results


def _largest_ratio(batch, mode: str, config, logprobs) -> float:
    """The largest policy ratio r on the mask (1 at least). The bias-corrected KL is k r: k3 = e^d - d - 1 cancels
    to ~1e-3 from parts of ~1, so an ulp of e^d in either implementation's exp (1e-7) is a relative error of 1e-4 in
    k, which r carries into the loss at r times its size (bypass draws sampler log-ratios of tens of nats)."""
    l_old = batch.old_logprobs if mode == "decoupled" else batch.rollout_logprobs if mode == "bypass" else logprobs
    log_r = torch.where(batch.response_mask, logprobs - l_old, 0.0)
    if config.log_ratio_clamp is not None:
        log_r = log_r.clamp(-config.log_ratio_clamp, config.log_ratio_clamp)
    return max([1.0] + torch.exp(log_r).flatten().tolist())


@settings(max_examples=scaled(120), deadline=None)
@given(batch=batches(dtype=F32, max_seqs=6, max_len=11),
       mode=st.sampled_from(("decoupled", "decoupled", "bypass", "on-policy")), data=st.data())
def test_with_every_metric_the_metrics_are_the_torch_stages_when_read(batch, mode, data):
    """metrics="all" (the default) inside the family: the fused stage's loss, and the torch stage's metrics on the
    same inputs, computed when first read (outputs.DeferredMetrics): the same names and bits as fused_stage=False
    gives, in both implementations."""
    config = data.draw(family_configs(mode)).with_overrides(metrics="all")
    backend = data.draw(st.sampled_from(IMPLEMENTATIONS)) if rlkernels.backends.is_available("cpu") else "triton"
    gen = torch.Generator().manual_seed(int(batch.labels.numel()))
    logprobs = batch.old_logprobs + torch.randn(batch.labels.shape, generator=gen) * 0.5
    entropy = torch.rand(batch.labels.shape, generator=gen) * 3
    (want, _, _), (got, _, _) = _both(batch, mode, config.with_overrides(backend=backend), logprobs, entropy)
    assert isinstance(got.metrics, DeferredMetrics) and not got.metrics.ready
    assert isinstance(want.metrics, dict) and len(want.metrics) > 0
    _assert_same_metrics(got.metrics, want.metrics)


@needs_cpu_kernels
def test_deferred_metrics_are_computed_once_when_first_read():
    """The call launches no metric op; the first read runs the torch stage once (on the inputs the call kept, then
    let go), later reads and dict operations none; the all-rejected flag is known without it."""
    call, _, _ = _policy_call(metrics="all", fused_stage=True, backend="cpu")
    out, launched = count_launches(call)
    metrics = out.metrics
    assert launched.ops["sequence_stage"] == 1 and launched.launching <= 25, launched.ops
    assert not metrics.ready and set(metrics.known) == {"rollout_corr/rollout_rs_all_rejected"}
    _, first = count_launches(lambda: dict(metrics))
    assert metrics.ready and first.launching > 100 and metrics._compute is None
    _, again = count_launches(lambda: (dict(metrics), len(metrics), "actor/pg_loss" in metrics, repr(metrics)))
    assert again.total == 0
    assert float(metrics.known["rollout_corr/rollout_rs_all_rejected"]) == \
        float(metrics["rollout_corr/rollout_rs_all_rejected"])
    metrics["mine"] = torch.tensor(1.0)
    merged = {**metrics, "other": 2.0}
    del metrics["mine"]
    assert "mine" in merged and "mine" not in metrics and merged["actor/pg_loss"] is metrics["actor/pg_loss"]


@needs_cpu_kernels
def test_deferred_metrics_go_where_a_dict_goes():
    """What trainers and their libraries do with a metrics dict, each on metrics not read yet: pickle it (Ray, a
    queue, torch.save with torch.load's default weights_only=True), copy it, merge it with `|` or `**`, compare it
    (with an OrderedDict on the left too), tree_map it (with paths), rebuild it as type(m)(items) or type(m)(**items)
    (accelerate's send_to_device and gather_for_metrics); each gives the values. JSON refuses it loudly: a dict
    subclass gave '{}' there, before its first read (found by review), hence a Mapping that is not a dict."""
    import copy
    import io
    import json
    import pickle
    from collections.abc import Mapping

    def fresh():
        metrics = _policy_call(metrics="all", fused_stage=True, backend="cpu")[0]().metrics
        assert isinstance(metrics, DeferredMetrics) and isinstance(metrics, Mapping) and not metrics.ready
        return metrics

    want = dict(fresh())

    def saved(metrics, weights_only):
        buffer = io.BytesIO()
        torch.save(metrics, buffer)
        buffer.seek(0)
        return torch.load(buffer, weights_only=weights_only)

    def keyword_arguments(**values):
        return values

    for use in (lambda m: pickle.loads(pickle.dumps(m)), lambda m: saved(m, True), lambda m: saved(m, False),
                copy.copy, copy.deepcopy, dict, lambda m: {**m}, lambda m: keyword_arguments(**m),
                lambda m: m.copy(), lambda m: dict(m.items()), lambda m: m | {}, lambda m: {} | m,
                lambda m: torch.utils._pytree.tree_map(lambda t: t, m)):
        got = use(fresh())
        assert isinstance(got, dict) and got == want and list(got) == list(want)
    assert fresh() == want and want == fresh() and fresh() == fresh() and collections.OrderedDict(want) == fresh()
    assert not (fresh() != want) and fresh() != {} and not (collections.OrderedDict(want) != fresh())
    assert len(fresh()) == len(want) and "actor/pg_loss" in fresh() and list(reversed(fresh())) == list(want)[::-1]
    assert "%(actor/pg_loss)s" % fresh() == str(want["actor/pg_loss"])
    assert type(saved(fresh(), True)) is collections.OrderedDict  # the dict type weights_only=True rebuilds
    paths, _ = torch.utils._pytree.tree_flatten_with_path(fresh())
    assert [path[0].key for path, _ in paths] == list(want)
    with pytest.raises(TypeError, match="not JSON serializable"):
        json.dumps(fresh(), default=lambda value: float(value) if isinstance(value, torch.Tensor) else
                   json.JSONEncoder().default(value))
    metrics = fresh()
    assert (metrics | {"x": 1.0})["x"] == 1.0 and ({"x": 1.0} | metrics).keys() == {"x", *want}
    metrics |= {"x": 1.0}
    assert metrics.keys() == {"x", *want} and metrics.pop("x") == 1.0 and metrics == want
    for rebuilt in (type(metrics)({name: value * 2 for name, value in fresh().items()}),
                    type(metrics)(**{name.replace("/", "_"): value * 2 for name, value in fresh().items()})):
        assert rebuilt.ready and len(rebuilt) == len(want)
        assert torch.equal(rebuilt.get("actor/pg_loss", rebuilt.get("actor_pg_loss")), want["actor/pg_loss"] * 2)
    cleared = fresh()
    cleared.clear()
    assert cleared.ready and cleared == {}


@needs_cpu_kernels
@pytest.mark.parametrize("reader", ["autocast", "grad", "inference", "thread"])
def test_deferred_metrics_are_the_calls_whoever_reads_them(reader):
    """The metrics are the same bits whether read where the call ran or inside autocast (which they do not restore:
    no op of theirs is autocast-eligible), with grad enabled (they are computed under no_grad), inside inference mode
    (they are computed in the call's: a logger may still edit them in place outside it), or from other threads
    (computed once: the second reader waits; a clear() meanwhile is not undone by the reader)."""
    import threading
    import time

    call = _policy_call(metrics="all", fused_stage=True, backend="cpu")[0]
    want = dict(call().metrics)
    metrics = call().metrics
    if reader == "autocast":
        for dtype in (torch.bfloat16, torch.float16):
            unread = call().metrics
            with torch.autocast("cpu", dtype=dtype):
                got = dict(unread)
            _assert_same_metrics(got, want)
    elif reader == "grad":
        with torch.enable_grad():
            got = dict(metrics)
        assert not any(value.requires_grad for value in got.values())
    elif reader == "inference":
        with torch.inference_mode():
            got = dict(metrics)
        assert not any(value.is_inference() for value in got.values())
        got["actor/pg_loss"].clone().add_(0.0), metrics["actor/pg_loss"].add_(0.0)
    else:
        computed, seen = [], []
        compute = metrics._compute
        metrics._compute = lambda: computed.append(1) or time.sleep(0.2) or compute()  # the others arrive meanwhile
        readers = [threading.Thread(target=lambda: seen.append(dict(metrics))) for _ in range(4)]
        for thread in readers:
            thread.start()
        for thread in readers:
            thread.join(timeout=60)
        assert computed == [1] and len(seen) == 4
        got = seen[-1]
        racing = call().metrics
        compute = racing._compute
        racing._compute = lambda: time.sleep(0.2) or compute()
        reader = threading.Thread(target=lambda: len(racing))
        reader.start()
        time.sleep(0.05)
        racing.clear()
        reader.join(timeout=60)
        assert racing.ready and len(racing) == 0
    _assert_same_metrics(got, want)


@settings(max_examples=scaled(60), deadline=None)
@given(batch=batches(dtype=F32, max_seqs=4, max_len=7, max_vocab=23),
       mode=st.sampled_from(("decoupled", "decoupled", "bypass", "on-policy")), data=st.data())
def test_fused_stage_matches_the_float64_oracle(batch, mode, data):
    """decoupled_ppo_loss on float32 logits with the fused stage against the float64 oracle (rlkernels.reference),
    through the backends' parity check (tests/backends/parity.py): loss, log-probs, IS weights, the final mask and
    d loss / d logits at the ("value", fp32) rows. log_ratio_clamp is drawn finite: without it exp() overflows float32
    where float64 does not (cases.config_options says the same)."""
    from ..backends.parity import check_against_reference

    config = data.draw(family_configs(mode))
    backend = data.draw(st.sampled_from(IMPLEMENTATIONS)) if rlkernels.backends.is_available("cpu") else "triton"
    config = config.with_overrides(fused_stage=True, log_ratio_clamp=config.log_ratio_clamp or 20.0,
                                   compute_entropy=data.draw(st.booleans()))
    check_against_reference(batch, mode, config, backend=backend)


@implementations
def test_the_logits_route_takes_it_and_its_gradient_matches(backend):
    """decoupled_ppo_loss on logits with the fused stage: d loss / d logits as the torch stage's."""
    g = torch.Generator().manual_seed(1)
    N, V = 29, 17
    logits, labels = torch.randn(N, V, generator=g), torch.randint(0, V, (N,), generator=g)
    adv, mask = torch.randn(N, generator=g), torch.rand(N, generator=g) > 0.2
    old = torch.log_softmax(logits, -1).gather(1, labels[:, None])[:, 0] + 0.2 * torch.randn(N, generator=g)
    grads, losses = [], []
    for fused_stage in (False, True):
        leaf = logits.clone().requires_grad_(True)
        config = PolicyLossConfig(rollout_correction=RolloutCorrection.seq_mis(), kl_coef=0.1, entropy_coeff=0.01,
                                  metrics="loss_only", fused_stage=fused_stage, backend=backend)
        out = rlkernels.decoupled_ppo_loss(leaf, labels, adv, mask, old_logprobs=old, rollout_logprobs=old - 0.1,
                                           ref_logprobs=old + 0.05, cu_seqlens=torch.tensor([0, 4, 4, 20, N]),
                                           config=config)
        losses.append(out.loss.detach())
        grads.append(torch.autograd.grad(out.loss, leaf)[0])
    assert_close(losses[1], losses[0], **tol("reordered", F32), name="loss")
    assert_close(grads[1], grads[0], **tol("reordered.dlogits", F32, scale=float(grads[0].abs().max())), name="dlogits")


@implementations
def test_the_fused_stage_is_two_launches(backend):
    """The stage's launches: 2 Triton kernels (or the CPU kernels' one op) and a few allocations, against dozens for
    the torch stage: the launch counter (which counts a Triton launch as one op) on the stage alone."""
    call, _, config = _policy_call(fused_stage=True, backend=backend)
    _, fused_count = count_launches(call)
    _, torch_count = count_launches(_policy_call(fused_stage=False)[0])
    if backend == "triton":
        triton_launches = {k: v for k, v in fused_count.ops.items() if k.startswith("triton:")}
        assert triton_launches == {"triton:_sequence_kernel": 1, "triton:_finish_kernel": 1}, fused_count.ops
    else:
        assert fused_count.ops["sequence_stage"] == 1, fused_count.ops
    assert torch_count.launching - fused_count.launching >= 40, (torch_count.ops, fused_count.ops)


def _policy_call(**overrides):
    g = torch.Generator().manual_seed(2)
    N = 40
    old = -torch.rand(N, generator=g) * 3
    config = PolicyLossConfig(**{"rollout_correction": RolloutCorrection.seq_mis(), "metrics": "loss_only",
                                 "validate": False, **overrides})
    lp = (old + 0.1 * torch.randn(N, generator=g)).requires_grad_(True)
    adv, mask = torch.randn(N, generator=g), torch.rand(N, generator=g) > 0.1
    entropy = torch.rand(N, generator=g)
    return (lambda: rlkernels.policy_loss(lp, adv, mask, old_logprobs=old, rollout_logprobs=old + 0.05,
                                          entropy=entropy, cu_seqlens=torch.tensor([0, 10, 25, N]), config=config)), \
        None, config


@pytest.mark.parametrize("override, reason", [
    (dict(loss_type="geo_mean"), "loss_type='geo_mean'"),
    (dict(loss_type="kl_cov"), "loss_type='kl_cov'"),
    (dict(m2po_threshold=0.5), "m2po_threshold"),
    (dict(vaco_threshold=0.1), "vaco_threshold=0.1"),
    (dict(rollout_correction=RolloutCorrection.token_tis(rs={"seq_max_bkl": 0.1})), "rejection options"),
    (dict(rollout_correction=RolloutCorrection(rs={"seq_max_btv": 0.5})), "rejection options"),
    (dict(loss_type="kpop", rollout_correction=None), "loss_type='kpop'"),
    (dict(loss_type="luspo", entropy_agg_mode="seq-mean-token-mean", entropy_coeff=0.01), "own aggregation"),
    (dict(loss_type="clip_cov"), "loss_type='clip_cov'"),
])
def test_outside_the_family_the_torch_stage_runs_and_true_is_refused(override, reason):
    call, _, config = _policy_call(**override)
    out = call()  # fused_stage=None on the CPU: the torch stage, whatever the family
    assert out.loss.requires_grad
    with pytest.raises(ValueError, match=f"fused_stage: True, but .*{reason}"):
        _policy_call(fused_stage=True, **override)[0]()
    prepared = _prepared(config.with_overrides(**override))
    assert stage.choose(torch.zeros(1), prepared, config.with_overrides(fused_stage=True, **override)) \
        is not fused.run


def _prepared(config):
    from rlkernels.inputs import Arguments, prepare_policy

    g = torch.Generator().manual_seed(3)
    lp = torch.randn(8, generator=g)
    args = Arguments(advantages=torch.randn(8, generator=g), response_mask=torch.ones(8, dtype=torch.bool),
                     old_logprobs=lp, rollout_logprobs=lp + 0.1, entropy=torch.rand(8, generator=g))
    return prepare_policy(lp, args, config, {})[1]


def test_which_kernels_take_it():
    """fused_stage=None (the default): on CPU tensors the CPU kernels (backend "auto" / "cpu"), Triton's interpreter
    for backend="triton", none for backend="torch"; True the same, refusing a call they cannot take before any pass;
    False never; inside a compiled region never (it traces the torch stage)."""
    config = PolicyLossConfig(metrics="loss_only")
    batch = _prepared(config)
    x = torch.zeros(1)
    cpu = "cpu" if rlkernels.backends.is_available("cpu") else None
    assert fused.implementation(config, x.device) == cpu
    assert fused.implementation(config.with_overrides(backend="triton"), x.device) == "triton"
    assert fused.implementation(config.with_overrides(backend="torch"), x.device) is None
    assert fused.implementation(config.with_overrides(fused_stage=False), x.device) is None
    assert (stage.choose(x, batch, config) is fused.run) == (cpu is not None)
    assert stage.choose(x, batch, config.with_overrides(fused_stage=False)) is not fused.run
    with pytest.raises(ValueError, match="fused_stage: True needs .* backend='torch'"):
        stage.check_fused(batch, config.with_overrides(fused_stage=True, backend="torch"), torch.float32, x.device)
    assert fused.blocker(batch, config, torch.float64) == "torch.float64 statistics (the kernels compute in float32)"
    with pytest.raises(TypeError, match="fused_stage: expected a bool or None"):
        PolicyLossConfig(fused_stage="yes")


@pytest.mark.parametrize("layout", ["packed", "padded"])
@pytest.mark.parametrize("rc, agg", [
    (RolloutCorrection.seq_mis(), "seq-mean-token-mean"),
    (RolloutCorrection.geo_rs_token_tis(bounds=(0.98, 1.02)), "token-mean"),
    (RolloutCorrection(is_level="geometric", is_threshold=(0.8, 1.25), rs={"seq_mean_k3": 0.05}),
     "seq-mean-token-sum-norm"),
])
@implementations
def test_sequences_longer_than_a_block(layout, rc, agg, backend):
    """Sequences of 0 to 1,100 tokens: the sequence kernel's two reads step through several 512-token blocks (a
    partial last one), and the finish programs each take a block of tokens (cases.make_batch's inputs)."""
    from ..cases import make_batch

    lengths = [1100, 0, 513, 3, 512] if layout == "packed" else [700] * 3
    batch = make_batch(layout, lengths, 2, dtype=F32, seed=4, mismatch=0.05, mask_p=0.85)
    config = PolicyLossConfig(rollout_correction=rc, loss_agg_mode=agg, kl_coef=0.1, kl_type="k3", entropy_coeff=0.01,
                              metrics="loss_only", validate=False, backend=backend)
    gen = torch.Generator().manual_seed(5)
    logprobs = batch.old_logprobs + 0.05 * torch.randn(batch.labels.shape, generator=gen)
    entropy = torch.rand(batch.labels.shape, generator=gen)
    (want, want_lp, want_h), (got, got_lp, got_h) = _both(batch, "decoupled", config, logprobs, entropy)
    assert torch.equal(got.mask, want.mask) and 0 < int(got.mask.sum()) < got.mask.numel()
    assert_close(got.loss, want.loss, **tol("reordered", F32, scale=max(1.0, float(want.loss.abs()))), name="loss")
    assert_close(got.is_weights, want.is_weights, **tol("reordered", F32), name="is_weights")
    for name, g, w in (("dlogprobs", got_lp, want_lp), ("dentropy", got_h, want_h)):
        assert_close(g, w, **tol("reordered", F32, scale=float(w.abs().amax())), name=name)


@pytest.mark.parametrize("loss_type, ratio_level, cispo_cap", [
    ("vanilla", "sequence", None), ("gspo", "token", None), ("cispo", "token", None), ("cispo", "sequence", 1.1)])
@pytest.mark.parametrize("layout", ["packed", "padded"])
@implementations
def test_the_sequence_ratios_clip_on_both_sides(loss_type, ratio_level, cispo_cap, layout, backend):
    """PPO on each sequence's ratio (its gradient chained through the sequence's mean log-ratio), GSPO's token
    form and CISPO (clipped per token, capped per sequence), where the sequences' ratios fall below, inside and
    above the clip range (0.6 nats of noise per token over 1 to 12 tokens), with seq-MIS and batch-normalised
    weights, a KL penalty and the entropy bonus at another aggregation than the loss's: the draws of the hypothesis
    test reach these only now and then."""
    from ..cases import make_batch

    lengths = [3, 7, 1, 0, 12, 5, 9, 2, 4] if layout == "packed" else [6] * 7
    batch = make_batch(layout, lengths, 2, dtype=F32, seed=11, mismatch=0.05, mask_p=0.85)
    config = PolicyLossConfig(
        loss_type=loss_type, ratio_level=ratio_level, clip_ratio_c=None if loss_type == "gspo" else 3.0,
        cispo_cap=cispo_cap,
        rollout_correction=RolloutCorrection.seq_mis(bounds=(0.7, 1.4), is_batch_normalize=True),
        loss_agg_mode="seq-mean-token-mean", entropy_agg_mode="token-mean", kl_coef=0.1, kl_type="k3",
        entropy_coeff=0.01, metrics="loss_only", validate=False, backend=backend)
    gen = torch.Generator().manual_seed(12)
    logprobs = batch.old_logprobs + 0.6 * torch.randn(batch.labels.shape, generator=gen)
    entropy = torch.rand(batch.labels.shape, generator=gen)
    (want, want_lp, want_h), (got, got_lp, got_h) = _both(batch, "decoupled", config, logprobs, entropy)
    mask = got.mask.reshape(-1)
    ids = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    delta = torch.where(mask, (logprobs - batch.old_logprobs).reshape(-1), 0.0)
    ratio = torch.exp(torch.zeros(len(lengths)).index_add(0, ids, delta)
                      / torch.zeros(len(lengths)).index_add(0, ids, mask.float()).clamp_min(1))
    kept = torch.zeros(len(lengths)).index_add(0, ids, mask.float()) > 0
    assert bool((ratio[kept] < 0.8).any()) and bool((ratio[kept] > 1.2).any()), ratio[kept]
    assert bool(((ratio[kept] > 0.8) & (ratio[kept] < 1.2)).any()), ratio[kept]
    assert torch.equal(got.mask, want.mask)
    assert_close(got.loss, want.loss, **tol("reordered", F32, scale=max(1.0, float(want.loss.abs()))), name="loss")
    assert_close(got.is_weights, want.is_weights, **tol("reordered", F32), name="is_weights")
    for name, g, w in (("dlogprobs", got_lp, want_lp), ("dentropy", got_h, want_h)):
        assert_close(g, w, **tol("reordered", F32, scale=float(w.abs().amax())), name=name)


@pytest.mark.parametrize("loss_type, ratio_level", [("vanilla", "token"), ("gspo", "token"), ("vanilla", "sequence"),
                                                     ("cispo", "sequence")])
@pytest.mark.parametrize("kl_type", ["k3", "k3_unclamped", "abs+"])
@implementations
def test_the_bias_corrected_kl(loss_type, ratio_level, kl_type, backend):
    """kl_bias_correction (TRL's use_bias_correction_kl, DeepSeek-V3.2's): the KL times the policy ratio, the token's
    (its own derivative r k added where log_ratio_clamp passes it) or the sequence's (that part chained through the
    sequence's mean log-ratio), where the log-ratios (0.6 nats of noise per token) fall on both sides of a clamp of
    0.4, with token IS and batch-normalised weights (which the KL's chained part must not be divided by)."""
    from ..cases import make_batch

    lengths = [3, 7, 1, 0, 12, 5, 9, 2, 4]
    batch = make_batch("packed", lengths, 2, dtype=F32, seed=11, mismatch=0.05, mask_p=0.85)
    config = PolicyLossConfig(
        loss_type=loss_type, ratio_level=ratio_level, log_ratio_clamp=0.4, kl_coef=0.5, kl_type=kl_type,
        kl_bias_correction=True, loss_agg_mode="seq-mean-token-mean",
        rollout_correction=RolloutCorrection(is_level="token", is_threshold=2.0, is_batch_normalize=True),
        metrics="loss_only", validate=False, backend=backend)
    gen = torch.Generator().manual_seed(12)
    logprobs = batch.old_logprobs + 0.6 * torch.randn(batch.labels.shape, generator=gen)
    entropy = torch.rand(batch.labels.shape, generator=gen)
    (want, want_lp, _), (got, got_lp, _) = _both(batch, "decoupled", config, logprobs, entropy)
    mask = got.mask.reshape(-1)
    delta = torch.where(mask, (logprobs - batch.old_logprobs).reshape(-1), 0.0)
    if ratio_level == "sequence":
        ids = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
        counts = torch.zeros(len(lengths)).index_add(0, ids, mask.float())
        log_r = (torch.zeros(len(lengths)).index_add(0, ids, delta) / counts.clamp_min(1))[counts > 0]
    else:
        log_r = delta[mask]
    assert bool((log_r.abs() > 0.4).any()) and bool((log_r.abs() < 0.4).any()), log_r
    assert torch.equal(got.mask, want.mask)
    assert_close(got.loss, want.loss, **tol("reordered", F32, scale=max(1.0, float(want.loss.abs()))), name="loss")
    assert_close(got_lp, want_lp, **tol("reordered", F32, scale=float(want_lp.abs().amax())), name="dlogprobs")
    # the correction is not a no-op here: without it the loss and its gradient differ
    (plain, plain_lp, _), _ = _both(batch, "decoupled", config.with_overrides(kl_bias_correction=False), logprobs,
                                    entropy)
    assert not torch.allclose(plain_lp, want_lp, **tol("reordered", F32, scale=float(want_lp.abs().amax())))


@pytest.mark.parametrize("loss_type", TRUST_REGIONS)
@pytest.mark.parametrize("own_weights, clamp", [(False, None), (True, None), (False, 0.3)])
@implementations
def test_prime_rls_trust_regions(loss_type, own_weights, clamp, backend):
    """prime-rl's default calls, DPPO binary-TV on the advantage's side at 559b4477 and IPO since
    (rlkernels.integrations.prime_rl: bypass mode, token-sum, unclamped ratio, its kl_tau as log_ratio_sq_coef, or
    its loss_weights as is_weights) on one sample of 300 tokens, where p - q falls past the band on each side for
    each sign of the advantage and for A = 0 (the signed form drops only the side the update would widen), with the
    trust region's own square (ipo_kl_tau) on: a kept token with A = 0 keeps its gradient 2 tau d. With a
    log_ratio_clamp (not prime-rl's), -A r passes no gradient past it."""
    from rlkernels.integrations.prime_rl import _config

    g = torch.Generator().manual_seed(5)
    N = 300
    q = torch.log(torch.rand(N, generator=g) * 0.9 + 0.05)
    lp = (q + 0.4 * torch.randn(N, generator=g)).clamp_max(-1e-3)
    lp[3::13] = q[3::13] - 1.5  # p / q < 1 / e: IPO's |p - q| no longer from a near-cancelling difference
    adv, mask = torch.randn(N, generator=g), torch.rand(N, generator=g) > 0.1
    adv[::7] = 0.0  # a group whose rewards were all equal: A = 0 takes the low side (prime-rl's A > 0 test)
    weights = torch.rand(N, generator=g) + 0.5 if own_weights else None
    config = _config(loss_type, binary_tv_low=0.1, binary_tv_high=0.05, ipo_eps=0.08, backend=backend,
                     log_ratio_sq_coef=0.0 if own_weights else 1e-3, metrics="loss_only", validate=False)
    config = config.with_overrides(ipo_kl_tau=0.01, log_ratio_clamp=clamp)
    gap = torch.exp(lp) - torch.exp(q)
    assert clamp is None or bool((mask & ((lp - q).abs() > clamp) & (gap.abs() < 0.05)).any())
    for side in (adv > 0, adv < 0, adv == 0):
        assert bool((mask & side & (gap > 0.05)).any()) and bool((mask & side & (gap < -0.1)).any())
        assert bool((mask & side & (gap.abs() < 0.05)).any())
    results = []
    for fused_stage in (False, True):
        leaf = lp.clone().requires_grad_(True)
        out = rlkernels.policy_loss(leaf, adv, mask, rollout_logprobs=q, is_weights=weights,
                                    config=config.with_overrides(fused_stage=fused_stage))
        results.append((out, *torch.autograd.grad(out.loss, leaf)))
    (want, want_lp), (got, got_lp) = results
    assert torch.equal(got.mask, want.mask)
    assert_close(got.loss, want.loss, **tol("reordered", F32, scale=max(1.0, float(want.loss.abs()))), name="loss")
    assert_close(got_lp, want_lp, **tol("reordered", F32, scale=float(want_lp.abs().amax())), name="dlogprobs")
    # the band holds the gradient of the tokens past it (dropped: 0), and keeps the others'
    if loss_type == "ipo":
        dropped = mask & (gap.abs() > 0.08)
    elif loss_type == "dppo_binary_tv":
        dropped = mask & ((gap > 0.05) | (gap < -0.1))
    else:
        dropped = mask & torch.where(adv > 0, gap > 0.05, gap < -0.1)
    if own_weights:  # no other term: a dropped token's gradient is 0
        assert bool((got_lp[dropped] == 0).all()) and bool((got_lp[mask & ~dropped] != 0).all())


@pytest.mark.parametrize("option, bound", [("seq_sum_k2", 0.05), ("seq_mean_k2", 0.004), ("seq_max_k2", 0.02),
                                           ("seq_max_k3", 0.02)])
@pytest.mark.parametrize("seq_tokens", ["mask", "kept"])
@implementations
def test_k2_and_maximum_rejection(option, bound, seq_tokens, backend):
    """AReaL's k2 rejection of whole sequences (its sum, mean or maximum over the sequence) and k3's maximum, over m
    or over the tokens a token_k1 band keeps, with sequence IS: 24 sequences whose trainer-sampler mismatch grows
    with their index, so that the bound keeps some and rejects others (asserted from the torch stage's mask), one
    sequence without a token in m (its maximum is 0). The final mask exactly, the loss and gradient as the torch
    stage's."""
    g = torch.Generator().manual_seed(10)
    S, T = 24, 10
    N = S * T
    cu = torch.arange(0, N + 1, T)
    old = -torch.rand(N, generator=g) * 3
    spread = torch.linspace(0.005, 0.3, S).repeat_interleave(T)  # each sequence's mismatch scale
    rollout = old + spread * torch.randn(N, generator=g)
    lp = old + 0.1 * torch.randn(N, generator=g)
    adv, mask = torch.randn(N, generator=g), torch.rand(N, generator=g) > 0.1
    mask[:T] = False
    rs = {option: bound, **({"token_k1": (0.8, 1.25)} if seq_tokens == "kept" else {})}
    config = PolicyLossConfig(rollout_correction=RolloutCorrection(is_level="sequence", is_threshold=3.0, rs=rs,
                                                                   seq_tokens=seq_tokens),
                              metrics="loss_only", validate=False, backend=backend)
    (want, want_lp), (got, got_lp) = _torch_and_fused(lp, adv, mask, config, backend, old_logprobs=old,
                                                     rollout_logprobs=rollout, cu_seqlens=cu)
    kept_sequences = want.mask.view(S, T).any(1)
    assert 3 <= int(kept_sequences.sum()) <= S - 4, kept_sequences
    assert torch.equal(got.mask, want.mask)
    assert_close(got.loss, want.loss, **tol("reordered", F32, scale=max(1.0, float(want.loss.abs()))), name="loss")
    assert_close(got_lp, want_lp, **tol("reordered", F32, scale=float(want_lp.abs().amax())), name="dlogprobs")


@pytest.mark.parametrize("level, gating", [("token", "binary_kl"), ("token", "tv"), ("seq", "binary_kl"),
                                           ("seq", "tv")])
@implementations
def test_openrlhfs_binary_gates(level, gating, backend):
    """OpenRLHF's binary-KL and TV gates (rlkernels.integrations.openrlhf: token_bkl / token_btv, seq_mean_bkl /
    seq_mean_btv, the dropped units' weights zeroed) on 24 sequences whose trainer-sampler mismatch grows with their
    index, some tokens' probabilities near 0 and 1 (the divergences' clamps to [1e-6, 1 - 1e-6]), and one sequence
    without a token in m: some units dropped and some kept (asserted from the torch stage's weights), the weights, the
    loss and the gradient as the torch stage's. (stage_options.BINARY_EPS is correction.BINARY_EPS.)"""
    from rlkernels.integrations.openrlhf import rollout_correction_from_openrlhf
    from rlkernels.kernels.stage_options import BINARY_EPS
    from rlkernels.stage.correction import BINARY_EPS as CORRECTION_EPS

    assert BINARY_EPS == CORRECTION_EPS
    g = torch.Generator().manual_seed(12)
    S, T = 24, 10
    N = S * T
    cu = torch.arange(0, N + 1, T)
    old = -torch.rand(N, generator=g) * 3
    old[5::17] = -1e-8  # p within 1e-6 of 1: the complement is clamped
    old[7::19] = -30.0  # p below 1e-6
    spread = torch.linspace(0.005, 0.5, S).repeat_interleave(T)
    rollout = (old + spread * torch.randn(N, generator=g)).clamp_max(0.0)
    lp = old + 0.1 * torch.randn(N, generator=g)
    adv, mask = torch.randn(N, generator=g), torch.rand(N, generator=g) > 0.1
    mask[:T] = False
    rc = rollout_correction_from_openrlhf(level, "mask", gating, (0.5, 0.01 if gating == "binary_kl" else 0.05))
    config = PolicyLossConfig(rollout_correction=rc, metrics="loss_only", validate=False, backend=backend)
    (want, want_lp), (got, got_lp) = _torch_and_fused(lp, adv, mask, config, backend, old_logprobs=old,
                                                     rollout_logprobs=rollout, cu_seqlens=cu)
    dropped = mask & (want.is_weights == 0)
    assert int(dropped.sum()) >= 5 and int((mask & ~dropped).sum()) >= 20
    assert torch.equal(got.mask, want.mask) and torch.equal(got.is_weights == 0, want.is_weights == 0)
    assert_close(got.is_weights, want.is_weights, **tol("reordered", F32), name="is_weights")
    assert_close(got.loss, want.loss, **tol("reordered", F32, scale=max(1.0, float(want.loss.abs()))), name="loss")
    assert_close(got_lp, want_lp, **tol("reordered", F32, scale=float(want_lp.abs().amax())), name="dlogprobs")


@pytest.mark.parametrize("mode, policy", [("decoupled", {}), ("bypass", {}),
                                          ("decoupled", dict(ratio_level="sequence", loss_type="cispo")),
                                          ("decoupled", dict(loss_type="dro", dro_beta=0.1))])
@implementations
def test_the_off_policy_sequence_mask(mode, policy, backend):
    """DeepSeek-V3.2's off-policy sequence mask (off_policy_mask_threshold, TRL's): the policy term is zeroed for the
    tokens with A < 0 of the sequences whose mean log-ratio of the sampler to the current policy over m' exceeds
    delta; 24 sequences whose current policy drifts from the sampler more with their index, so that some exceed it
    and some do not (asserted from the inputs), with advantages of both signs and 0 (kept: DRO's term is not 0
    there) in each. Decoupled, π_old lies 0.05 from the sampler (the mask is taken against the sampler, not π_old)
    and a token_k1 band drops some tokens (the mean is over m'). Loss and each token's gradient as the torch
    stage's; without a KL or entropy term, a masked token's gradient is exactly 0."""
    g = torch.Generator().manual_seed(14)
    S, T, delta = 24, 10, 0.05
    N = S * T
    cu = torch.arange(0, N + 1, T)
    rollout = -torch.rand(N, generator=g) * 3
    drift = torch.linspace(0.0, 0.2, S).repeat_interleave(T)
    lp = rollout - drift + 0.01 * torch.randn(N, generator=g)  # the sampler's log-prob above the current one
    old = rollout + 0.05 + 0.01 * torch.randn(N, generator=g)
    adv, mask = torch.randn(N, generator=g), torch.rand(N, generator=g) > 0.1
    adv[::7] = 0.0
    seq_kl = torch.where(mask, rollout - lp, 0.0).view(S, T).sum(1) / mask.view(S, T).sum(1).clamp_min(1)
    assert bool((seq_kl > delta).any()) and bool((seq_kl < delta).any())
    decoupled = mode == "decoupled"
    band = RolloutCorrection.token_tis(rs={"token_k1": (1.045, 1.06)})  # rho = e^(old - rollout) ~ e^0.05
    config = PolicyLossConfig(off_policy_mask_threshold=delta, metrics="loss_only", validate=False, backend=backend,
                              rollout_correction=band if decoupled else None, **policy)
    (want, want_lp), (got, got_lp) = _torch_and_fused(lp, adv, mask, config, backend,
                                                     old_logprobs=old if decoupled else None,
                                                     rollout_logprobs=rollout, cu_seqlens=cu)
    masked = want.mask & (adv < 0) & (seq_kl > delta).repeat_interleave(T)  # (seq_kl over m: the mean's a guide)
    assert int(masked.sum()) >= 10
    if policy.get("loss_type") != "dro":
        assert bool((want_lp[masked] == 0).all()) and bool((got_lp[masked] == 0).all())
    assert torch.equal(got.mask, want.mask) and (not decoupled or int((mask & ~want.mask).sum()) >= 10)
    assert_close(got.loss, want.loss, **tol("reordered", F32, scale=max(1.0, float(want.loss.abs()))), name="loss")
    scale = float(want_lp.abs().amax()) if policy else 0.0  # a sequence's tokens share its mean; else each its own
    assert_close(got_lp, want_lp, **tol("reordered", F32, scale=scale), name="dlogprobs")


@pytest.mark.parametrize("loss_type", ["gpg", "dro", "dppo_tv", "dppo_kl"])
@pytest.mark.parametrize("mode", ["decoupled", "bypass"])
@implementations
def test_verls_gpg_dro_and_dppo(loss_type, mode, backend):
    """verl's GPG (-A lp), DRO (-(A lp - beta/2 (lp - l_old)^2), beta 0.1) and DPPO (-A sg(min(r, c)) lp inside a
    TV or binary-KL region around p_old, c = 20 or a dual clip of 3 in bypass mode) on 240 tokens a log-ratio of up to
    ~1.5 from l_old, p - p_old past the region on both sides for both signs of A (asserted from the inputs), with token
    TIS (decoupled) or verl's own IS weights (bypass), seq-mean-token-mean: the loss and each token's gradient as the
    torch stage's, to the gradient's own size."""
    g = torch.Generator().manual_seed(8)
    N, S = 240, 12
    cu = torch.arange(0, N + 1, N // S)
    old = -torch.rand(N, generator=g) * 3
    lp = (old + 0.6 * torch.randn(N, generator=g)).clamp_max(-1e-3)
    adv, mask = torch.randn(N, generator=g), torch.rand(N, generator=g) > 0.1
    rollout = old + 0.1 * torch.randn(N, generator=g)
    decoupled = mode == "decoupled"
    l_old = old if decoupled else rollout
    if loss_type.startswith("dppo"):
        gap = torch.exp(lp) - torch.exp(l_old)
        for side in (adv > 0, adv <= 0):
            assert bool((mask & side & (gap > 0.28)).any()) and bool((mask & side & (gap < -0.2)).any())
            assert bool((mask & side & (gap.abs() < 0.2)).any())
        assert decoupled or bool((mask & (lp - l_old > math.log(3.0))).any())  # past the dual clip's cap
    config = PolicyLossConfig(loss_type=loss_type, dro_beta=0.1 if loss_type == "dro" else None,
                              loss_agg_mode="seq-mean-token-mean", metrics="loss_only", validate=False, backend=backend,
                              clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=None if decoupled else 3.0,
                              rollout_correction=RolloutCorrection.token_tis(threshold=1.5) if decoupled else None)
    weights = None if decoupled else torch.rand(N, generator=g) + 0.5
    (want, want_lp), (got, got_lp) = _torch_and_fused(lp, adv, mask, config, backend,
                                                     old_logprobs=old if decoupled else None,
                                                     rollout_logprobs=rollout, cu_seqlens=cu, is_weights=weights)
    assert torch.equal(got.mask, want.mask)
    assert_close(got.loss, want.loss, **tol("reordered", F32, scale=max(1.0, float(want.loss.abs()))), name="loss")
    assert bool((want_lp[mask] != 0).all()) if not loss_type.startswith("dppo") else \
        bool((want_lp[mask] == 0).any() and (want_lp[mask] != 0).any())  # outside the region: no gradient
    assert_close(got_lp, want_lp, **tol("reordered", F32, scale=0.0), name="dlogprobs")  # each to its own size


@pytest.mark.parametrize("ratio_level", ["token", "sequence"])
@pytest.mark.parametrize("tau, clamp", [((1.0, 1.05), None), ((40.0, 40.0), None), ((2.0, 0.5), 0.3)])
@implementations
def test_sapos_soft_gate(ratio_level, tau, clamp, backend):
    """SAPO (verl's and TRL's sapo) of the token's and of the sequence's ratio, verl's temperatures, steep ones, and a
    log_ratio_clamp that log-ratios fall on both sides of (asserted from the inputs), decoupled with seq-MIS: each
    token's gradient as the torch stage's to its own size. At tau = 40 every gate saturates (|tau (r - 1)| > 17, where
    1 - g cancels to 0 in float32): the whole gradient is the slope g sigmoid(-x), which 1 - g would make 0."""
    g = torch.Generator().manual_seed(6)
    N, S = 240, 12
    cu = torch.arange(0, N + 1, N // S)
    old = -torch.rand(N, generator=g) * 3
    # |log r| of 0.6 (r - 1 of 0.82 or -0.45) and, beside a clamp, of 0.1 too; for the sequence's ratio one sign and
    # size per sequence, so that its mean log-ratio is one of them
    sign = torch.where(torch.rand(S, generator=g) > 0.5, 1.0, -1.0)
    size = torch.where(torch.rand(S, generator=g) > 0.5, 0.6, 0.1) if clamp is not None else torch.full((S,), 0.6)
    per_token = torch.rand(N, generator=g) > 0.5
    step = (sign * size).repeat_interleave(N // S) if ratio_level == "sequence" else \
        torch.where(per_token, 1.0, -1.0) * torch.where(torch.rand(N, generator=g) > 0.5, size.max(), size.min())
    lp = old + step + 0.02 * torch.randn(N, generator=g)
    adv, mask = torch.randn(N, generator=g), torch.rand(N, generator=g) > 0.1
    log_r = lp - old
    if ratio_level == "sequence":
        lengths = torch.segment_reduce(mask.float(), "sum", offsets=cu)
        log_r = (torch.segment_reduce(torch.where(mask, log_r, 0.0), "sum", offsets=cu) / lengths.clamp_min(1))
        log_r = log_r.repeat_interleave(N // S)
    if clamp is not None:
        assert bool((mask & (log_r.abs() > clamp)).any()) and bool((mask & (log_r.abs() < clamp)).any())
    if tau[0] == 40.0:  # every rising gate saturated
        x = 40.0 * (torch.exp(log_r) - 1.0)
        assert bool((x[mask & (x > 0)] > 17).all()) and bool((mask & (x > 0)).sum() > 10)
    config = PolicyLossConfig(loss_type="sapo", ratio_level=ratio_level, tau_pos=tau[0], tau_neg=tau[1],
                              log_ratio_clamp=clamp, rollout_correction=RolloutCorrection.seq_mis(bounds=(0.5, 2.0)),
                              metrics="loss_only", validate=False, backend=backend)
    (want, want_lp), (got, got_lp) = _torch_and_fused(lp, adv, mask, config, backend, old_logprobs=old,
                                                     rollout_logprobs=old + 0.01, cu_seqlens=cu)
    assert torch.equal(got.mask, want.mask) and bool(want.mask.any())
    assert_close(got.loss, want.loss, **tol("reordered", F32, scale=max(1e-6, float(want.loss.abs()))), name="loss")
    # each token to its own size (the rtol alone); a sequence's tokens share its mean, a sum of terms of both signs
    scale = float(want_lp.abs().amax()) if ratio_level == "sequence" else 0.0
    assert_close(got_lp, want_lp, **tol("reordered", F32, scale=scale), name="dlogprobs")
    assert bool((want_lp[want.mask] != 0).any())


@pytest.mark.parametrize("fused_stage", [False, True])
@implementations
def test_the_unclamped_k3s_score_term_far_from_the_reference(fused_stage, backend):
    """kl_score_gradient with k3_unclamped, 40 nats from the reference (found by a hypothesis run at 4x examples):
    its derivative dk + k = (1 - e^d) + (e^d - d - 1) is -d, where the e^d terms (1e17) cancelled to 0 in float32
    and to within 32 of -d in the float64 oracle. The torch stage, the fused one and the oracle now give -d."""
    lp = torch.tensor([-40.0, -1.0, -0.2, -25.0])
    ref = torch.tensor([-0.5, -1.2, -30.0, -0.1])
    config = PolicyLossConfig(kl_type="k3_unclamped", kl_coef=0.05, kl_score_gradient=True, loss_agg_mode="token-sum",
                              metrics="loss_only", validate=False, backend=backend, fused_stage=fused_stage)
    leaf = lp.clone().requires_grad_(True)
    out = rlkernels.policy_loss(leaf, torch.zeros(4), torch.ones(4, dtype=torch.bool), ref_logprobs=ref,
                                config=config)
    grad, = torch.autograd.grad(out.loss, leaf)
    want = 0.05 * (lp.double() - ref.double())
    assert_close(grad, want, **tol("value", F32, scale=float(want.abs().amax())), name="dlogprobs")
    oracle_lp = lp.double().requires_grad_(True)
    expected = reference.policy_loss(oracle_lp, torch.zeros(4, dtype=torch.float64), torch.ones(4, dtype=torch.bool),
                                     ref_logprobs=ref.double(), config=config)
    assert_close(torch.autograd.grad(expected.loss, oracle_lp)[0], want, **tol("value", torch.float64,
                 scale=float(want.abs().amax())), name="the oracle's dlogprobs")


TRAINER_OPTIONS = {
    # NeMo-RL: token IS, a geometric rejection that zeroes the weights (the tokens stay in m'), the KL's score term
    "zero_weight+kl_score": dict(
        rollout_correction=RolloutCorrection(is_level="token", is_threshold=2.0, rs={"seq_mean_k1": (0.97, 1.03)},
                                             rs_mode="zero_weight"),
        kl_coef=0.1, kl_type="k3", kl_score_gradient=True),
    # AReaL's GSPO: the sequence's ratio and its mean advantage, with seq-MIS
    "seq_mean_advantages": dict(ratio_level="sequence", seq_mean_advantages=True,
                                rollout_correction=RolloutCorrection.seq_mis(bounds=(0.8, 1.25))),
    # SkyRL: token-level k1 rejection, every token of the sequence in a wider band, the geometric rejection over the
    # tokens the token option keeps
    "token_k1+seq_all_k1, kept": dict(rollout_correction=RolloutCorrection(
        is_level="token", is_threshold=2.0, rs={"token_k1": (0.9, 1.1), "seq_all_k1": (0.85, 1.18),
                                                 "seq_mean_k1": (0.97, 1.03)}, seq_tokens="kept")),
    # token-level k3 rejection that zeroes the weights (OpenRLHF's order), with AReaL's sequence-mean advantages
    "token_k3, zero_weight": dict(seq_mean_advantages=True, rollout_correction=RolloutCorrection(
        is_level="token", is_threshold=(0.0, math.inf), is_mode="mask", rs={"token_k3": 0.002},
        rs_mode="zero_weight")),
    # geometric IS over the kept tokens, token-level k2 and a k3 sum, GSPO's sequence ratio
    "token_k2, geometric, kept": dict(ratio_level="sequence", rollout_correction=RolloutCorrection(
        is_level="geometric", is_threshold=(0.8, 1.25), rs={"token_k2": 0.002, "seq_sum_k3": 0.05},
        seq_tokens="kept")),
}


@pytest.mark.parametrize("options", sorted(TRAINER_OPTIONS))
@implementations
def test_the_trainers_options(options, backend):
    """Options the trainers' own losses set, where rejection drops some sequences and keeps others (a mismatch of
    0.1 nats per token): the loss, the gradients, the IS weights and the final mask as the torch stage's."""
    from ..cases import make_batch

    lengths = [3, 7, 1, 0, 12, 5, 9, 2, 4, 6, 8]
    batch = make_batch("packed", lengths, 2, dtype=F32, seed=13, mismatch=0.1, mask_p=0.85)
    config = PolicyLossConfig(**TRAINER_OPTIONS[options], entropy_coeff=0.01, metrics="loss_only", validate=False,
                              backend=backend)
    gen = torch.Generator().manual_seed(14)
    logprobs = batch.old_logprobs + 0.3 * torch.randn(batch.labels.shape, generator=gen)
    entropy = torch.rand(batch.labels.shape, generator=gen)
    (want, want_lp, want_h), (got, got_lp, got_h) = _both(batch, "decoupled", config, logprobs, entropy)
    weights = want.is_weights[batch.response_mask]
    assert bool((weights == 0).any()) or not bool(want.mask[batch.response_mask].all()), "nothing was rejected"
    assert bool((weights[want.mask[batch.response_mask]] != 0).any()), "everything was rejected"
    assert torch.equal(got.mask, want.mask)
    assert_close(got.loss, want.loss, **tol("reordered", F32, scale=max(1.0, float(want.loss.abs()))), name="loss")
    assert_close(got.is_weights, want.is_weights, **tol("reordered", F32), name="is_weights")
    for name, g, w in (("dlogprobs", got_lp, want_lp), ("dentropy", got_h, want_h)):
        assert_close(g, w, **tol("reordered", F32, scale=float(w.abs().amax())), name=name)


@pytest.mark.parametrize("layout", ["packed", "padded"])
@implementations
def test_a_trainers_own_is_weights(layout, backend):
    """verl and TRL compute their IS weights themselves and hand them to the loss (is_weights=): the fused stage
    applies them as the torch stage does (on the mask, no batch normalisation), with a sequence rejection beside
    them, and reports them as the call's is_weights."""
    from ..cases import make_batch

    lengths = [3, 7, 1, 0, 12, 5, 9] if layout == "packed" else [6] * 5
    batch = make_batch(layout, lengths, 2, dtype=F32, seed=15, mismatch=0.1, mask_p=0.85)
    config = PolicyLossConfig(rollout_correction=RolloutCorrection(rs={"seq_mean_k1": (0.97, 1.03)}), kl_coef=0.1,
                              kl_type="k3", loss_agg_mode="seq-mean-token-mean", metrics="loss_only", validate=False,
                              backend=backend)
    gen = torch.Generator().manual_seed(16)
    logprobs = batch.old_logprobs + 0.2 * torch.randn(batch.labels.shape, generator=gen)
    weights = torch.rand(batch.labels.shape, generator=gen) * 2
    weights = torch.where(batch.response_mask, weights, torch.nan)  # off the mask: anything
    (want, want_lp, _), (got, got_lp, _) = _both(batch, "decoupled", config, logprobs, torch.zeros_like(logprobs),
                                                 weights)
    assert torch.equal(got.mask, want.mask) and 0 < int(got.mask.sum()) < int(batch.response_mask.sum())
    assert torch.equal(got.is_weights, torch.where(batch.response_mask, weights, 0.0))
    assert_close(got.is_weights, want.is_weights, **tol("reordered", F32), name="is_weights")
    assert_close(got.loss, want.loss, **tol("reordered", F32, scale=max(1.0, float(want.loss.abs()))), name="loss")
    assert_close(got_lp, want_lp, **tol("reordered", F32, scale=float(want_lp.abs().amax())), name="dlogprobs")


@implementations
@pytest.mark.parametrize("one_pass", [True, False])
def test_the_hidden_state_routes_take_it(one_pass, backend):
    """linear_decoupled_ppo_loss with the fused stage: in the one-pass form every chunk's coefficients come from the
    two kernels (the correction decided again from the proximal and sampler log-probs, as the torch stage's once),
    in the two-pass form the stage after the pass; the gradients of the hidden states and the weight as the torch
    stage's, with chunks of 8 rows so that the one-pass form runs several."""
    g = torch.Generator().manual_seed(6)
    N, H, V = 30, 8, 23
    hidden, weight = torch.randn(N, H, generator=g), torch.randn(V, H, generator=g) / 3
    labels, adv = torch.randint(0, V, (N,), generator=g), torch.randn(N, generator=g)
    mask = torch.rand(N, generator=g) > 0.2
    old = -torch.rand(N, generator=g) * 3
    rollout = old + 0.1 * torch.randn(N, generator=g)
    results = []
    for fused_stage in (False, True):
        h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
        config = PolicyLossConfig(rollout_correction=RolloutCorrection.geo_rs_token_tis(bounds=(0.8, 1.25)),
                                  entropy_coeff=0.01, kl_coef=0.1, metrics="loss_only", fused_stage=fused_stage,
                                  linear_one_pass=one_pass, backend=backend, memory_budget_bytes=8 * V * 4,
                                  validate=False)
        out, launched = count_launches(
            rlkernels.linear_decoupled_ppo_loss, h, w, labels, adv, mask, old_logprobs=old, rollout_logprobs=rollout,
            ref_logprobs=old + 0.05, cu_seqlens=torch.tensor([0, 9, 9, 21, N]), config=config)
        # one-pass: a stage per chunk of 8 rows (4) and the final one; two-pass: the one after the pass
        assert launched.ops[STAGE_OP[backend]] == (0 if not fused_stage else 5 if one_pass else 1)
        results.append((out, *torch.autograd.grad(out.loss, (h, w))))
    (want, want_h, want_w), (got, got_h, got_w) = results
    assert got.path == want.path == ("linear_one_pass" if one_pass else "linear_two_pass")
    assert torch.equal(got.mask, want.mask)
    assert_close(got.loss, want.loss, **tol("reordered", F32, scale=max(1.0, float(want.loss.abs()))), name="loss")
    for name, x, y in (("dhidden", got_h, want_h), ("dweight", got_w, want_w)):
        assert_close(x, y, **tol("reordered", F32, scale=float(y.abs().amax())), name=name)


def test_the_one_pass_chunks_take_it_with_every_metric(monkeypatch):
    """With metrics="all" (the default) on CUDA (fused_stage=None; simulated here by letting the kernels run on the
    CPU), the one-pass form's per-chunk runs and its final run take the two kernels; the final run's metrics are the
    torch stage's with the correction computed once, when read: the same loss and gradients, the same metrics bit
    for bit."""
    g = torch.Generator().manual_seed(8)
    N, H, V = 24, 8, 19
    hidden, weight = torch.randn(N, H, generator=g), torch.randn(V, H, generator=g) / 3
    labels, adv, old = torch.randint(0, V, (N,), generator=g), torch.randn(N, generator=g), -torch.rand(N, generator=g)
    config = PolicyLossConfig(rollout_correction=RolloutCorrection.seq_mis(), backend="torch",
                              memory_budget_bytes=8 * V * 4, validate=False)
    results = []
    for kernels in (False, True):
        monkeypatch.setattr(fused, "implementation", lambda config, device, on=kernels: "triton" if on else None)
        h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
        out, launched = count_launches(
            rlkernels.linear_decoupled_ppo_loss, h, w, labels, adv, torch.ones(N, dtype=torch.bool), old_logprobs=old,
            rollout_logprobs=old - 0.05, cu_seqlens=torch.tensor([0, 10, N]), config=config)
        assert out.path == "linear_one_pass"
        assert launched.ops["triton:_sequence_kernel"] == (4 if kernels else 0)  # 3 chunks of 8 rows, the final run
        results.append((out, *torch.autograd.grad(out.loss, (h, w))))
    (want, want_h, want_w), (got, got_h, got_w) = results
    assert isinstance(got.metrics, DeferredMetrics) and not got.metrics.ready and len(want.metrics) > 20
    _assert_same_metrics(got.metrics, want.metrics)
    assert_close(got.loss, want.loss, **tol("reordered", F32, scale=max(1.0, float(want.loss.abs()))), name="loss")
    for name, x, y in (("dhidden", got_h, want_h), ("dweight", got_w, want_w)):
        assert_close(x, y, **tol("reordered", F32, scale=float(y.abs().amax())), name=name)


@pytest.mark.gpu
@pytest.mark.parametrize("agg, policy", [
    ("token-mean", {}), ("seq-mean-token-mean", {}),
    ("seq-mean-token-mean", dict(loss_type="gspo", entropy_agg_mode="token-mean")),
    ("token-mean", dict(ratio_level="sequence")),
    # SkyRL's token rejection over the kept tokens with CISPO; NeMo-RL's zero weights and KL score term; verl's weights
    ("token-mean", dict(loss_type="cispo", rollout_correction=RolloutCorrection(
        is_level="token", is_threshold=2.0, rs={"token_k1": (0.97, 1.03), "seq_all_k1": (0.9, 1.1)},
        seq_tokens="kept"))),
    ("seq-mean-token-mean", dict(kl_type="k3", kl_score_gradient=True, rollout_correction=RolloutCorrection(
        is_level="token", is_threshold=2.0, rs={"seq_mean_k1": (0.998, 1.002)}, rs_mode="zero_weight"))),
    ("token-mean", dict(rollout_correction=RolloutCorrection(rs={"seq_mean_k1": (0.998, 1.002)}), is_weights=True)),
    # TRL's bias-corrected k3, of the token's ratio and of the sequence's (its GSPO)
    ("token-mean", dict(kl_type="k3", kl_bias_correction=True)),
    ("seq-mean-token-mean", dict(kl_type="k3_unclamped", kl_bias_correction=True, ratio_level="sequence",
                                 log_ratio_clamp=0.02)),
    # prime-rl's trust regions on the sampler, with the log-ratio square
    ("token-sum", dict(loss_type="dppo_binary_tv_signed", rollout_correction=None, log_ratio_clamp=None,
                       binary_tv_low=0.002, binary_tv_high=0.002, log_ratio_sq_coef=1e-3)),
    ("token-sum", dict(loss_type="ipo", ipo_eps=0.002, rollout_correction=None, log_ratio_clamp=None)),
    # verl's SAPO, GPG, DRO and DPPO (regions narrow enough to cut this batch's 0.05-nat moves); TRL's SAPO of the
    # sequence's ratio
    ("seq-mean-token-mean", dict(loss_type="sapo")),
    ("seq-mean-token-mean", dict(loss_type="sapo", ratio_level="sequence", tau_pos=2.0, tau_neg=40.0)),
    ("token-mean", dict(loss_type="gpg")),
    ("token-mean", dict(loss_type="dro", dro_beta=0.5)),
    ("seq-mean-token-mean", dict(loss_type="dppo_tv", clip_ratio_high=0.01, clip_ratio_low=0.01)),
    ("seq-mean-token-mean", dict(loss_type="dppo_kl", clip_ratio_high=1e-4, clip_ratio_low=1e-4, clip_ratio_c=3.0)),
    # AReaL's k2 rejection (the sampler's 0.02-nat noise: k2 ~ 2e-4 a token) and the k3 maximum
    ("token-mean", dict(rollout_correction=RolloutCorrection(is_level="token", is_threshold=2.0, rs={
        "seq_max_k2": 1e-3, "seq_mean_k2": 3e-4, "seq_max_k3": 2e-3}))),
    # OpenRLHF's binary-KL gate per token and its TV gate over the sequence, the dropped units' weights zeroed
    ("token-mean", dict(rollout_correction=RolloutCorrection(
        is_level="token", is_threshold=(0.0, math.inf), is_mode="mask", rs={"token_bkl": 1e-4, "seq_mean_btv": 3e-3},
        rs_mode="zero_weight"))),
    # DeepSeek-V3.2's off-policy sequence mask (TRL's off_policy_mask_threshold) at a delta inside the batch's spread
    ("token-mean", dict(off_policy_mask_threshold=2e-4)),
])
def test_on_a_gpu_the_default_takes_it_and_matches_the_torch_stage(agg, policy):
    """On CUDA, fused_stage=None with metrics="loss_only" runs the two kernels (compiled for the device, not
    interpreted) at 8192 tokens in 128 sequences of mixed lengths, with the trainers' options; loss, weights, mask
    and gradients as the torch stage's. The GPU's exp (ex2.approx) differs from torch's by a few ulps: the
    "reordered" row still bounds it."""
    policy = dict(policy)
    own_weights = policy.pop("is_weights", False)
    g = torch.Generator().manual_seed(9)
    N, S = 8192, 128
    cuts = torch.sort(torch.randperm(N - 1, generator=g)[:S - 1] + 1).values
    cu = torch.cat([torch.tensor([0]), cuts, torch.tensor([N])]).cuda()
    old = (-torch.rand(N, generator=g) * 3).cuda()
    lp = old + 0.05 * torch.randn(N, generator=g).cuda()
    adv, entropy = torch.randn(N, generator=g).cuda(), torch.rand(N, generator=g).cuda()
    mask = (torch.rand(N, generator=g) > 0.05).cuda()
    rollout = old + 0.02 * torch.randn(N, generator=g).cuda()
    weights = (torch.rand(N, generator=g) + 0.5).cuda() if own_weights else None
    results = []
    for fused_stage in (False, None):
        leaf, h = lp.clone().requires_grad_(True), entropy.clone().requires_grad_(True)
        config = PolicyLossConfig(**{
            "rollout_correction": RolloutCorrection.seq_mis(bounds=(0.9, 1.1)), "kl_coef": 0.05, "entropy_coeff": 0.01,
            "loss_agg_mode": agg, "metrics": "loss_only", "validate": False, "fused_stage": fused_stage, **policy})
        out, launched = count_launches(rlkernels.policy_loss, leaf, adv, mask, old_logprobs=old,
                                       rollout_logprobs=rollout, ref_logprobs=old - 0.01, entropy=h, cu_seqlens=cu,
                                       is_weights=weights, config=config)
        assert launched.ops["triton:_sequence_kernel"] == (1 if fused_stage is None else 0)
        results.append((out, *torch.autograd.grad(out.loss, (leaf, h))))
    (want, want_lp, want_h), (got, got_lp, got_h) = results
    assert torch.equal(got.mask, want.mask) and 0 < int(got.mask.sum()) < N
    assert_close(got.loss, want.loss, **tol("reordered", F32, scale=max(1.0, float(want.loss.abs()))), name="loss")
    assert_close(got.is_weights, want.is_weights, **tol("reordered", F32), name="is_weights")
    for name, x, y in (("dlogprobs", got_lp, want_lp), ("dentropy", got_h, want_h)):
        assert_close(x, y, **tol("reordered", F32, scale=float(y.abs().amax())), name=name)


@pytest.mark.gpu
def test_on_a_gpu_metrics_read_on_another_stream_are_the_calls():
    """The call on a side stream whose inputs are written late (after a sleep kernel), its metrics read on the
    default stream: they are computed on the call's stream, which the reader's then waits for, so they are the
    torch stage's bits. Computed on the reader's stream, they would read the inputs before they are written."""
    g = torch.Generator().manual_seed(3)
    N = 8192
    base, noise = (-torch.rand(N, generator=g) * 3).cuda(), (0.05 * torch.randn(N, generator=g)).cuda()
    adv, mask = torch.randn(N, generator=g).cuda(), (torch.rand(N, generator=g) > 0.05).cuda()
    cu = torch.arange(0, N + 1, 64).cuda()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    outputs = {}
    with torch.cuda.stream(side):
        for fused_stage in (False, None):
            torch.cuda._sleep(100_000_000)  # ~50 ms: the inputs below are written after it, the host not waiting
            old = base * 1.0
            lp = old + noise
            config = PolicyLossConfig(rollout_correction=RolloutCorrection.seq_mis(bounds=(0.9, 1.1)), kl_coef=0.05,
                                      metrics="all", validate=False, fused_stage=fused_stage)
            outputs[fused_stage] = rlkernels.policy_loss(lp, adv, mask, old_logprobs=old, rollout_logprobs=old + 0.01,
                                                         ref_logprobs=old - 0.01, cu_seqlens=cu, config=config)
        want = dict(outputs[False].metrics)  # the torch stage's, computed on the side stream
    got = outputs[None].metrics
    assert isinstance(got, DeferredMetrics) and not got.ready
    got = {name: value.clone() for name, value in got.items()}  # read, and used, on the default stream
    torch.cuda.synchronize()
    _assert_same_metrics(got, want)


@implementations
def test_strided_offsets_and_outputs_edited_in_place(backend):
    """Found by review: int64 cu_seqlens as a strided view were read as contiguous (the wrong boundaries, writes past
    the outputs); and the reported log-probs shared a version counter with the saved coefficients, so editing them in
    place broke the backward. Now the offsets are the view's values and the outputs are the caller's to edit."""
    g = torch.Generator().manual_seed(11)
    N = 16
    cu = torch.tensor([0, 99, 3, 99, 3, 99, 10, 99, 16, 99])[::2]  # [0, 3, 3, 10, 16], stride 2
    old = -torch.rand(N, generator=g) * 2
    lp, adv, mask = old + 0.1 * torch.randn(N, generator=g), torch.randn(N, generator=g), torch.ones(N, dtype=bool)
    losses, grads = [], []
    for fused_stage in (False, True):
        leaf = lp.clone().requires_grad_(True)
        config = PolicyLossConfig(rollout_correction=RolloutCorrection.seq_mis(), loss_agg_mode="seq-mean-token-mean",
                                  metrics="loss_only", validate=False, fused_stage=fused_stage, backend=backend)
        out = rlkernels.policy_loss(leaf, adv, mask, old_logprobs=old, rollout_logprobs=old + 0.05, cu_seqlens=cu,
                                    config=config)
        out.logprobs.mul_(2.0)
        out.is_weights.mul_(2.0)
        losses.append(out.loss.detach())
        grads.append(torch.autograd.grad(out.loss, leaf)[0])
    assert_close(losses[1], losses[0], **tol("reordered", F32), name="loss")
    assert_close(grads[1], grads[0], **tol("reordered", F32, scale=float(grads[0].abs().amax())), name="dlogprobs")


def test_a_long_record_spreads_the_finish_over_fewer_programs():
    """520 one- and two-token sequences (the finish programs' record reduction is each program's cost, so each
    takes ceil(S / 512) = 2 blocks of tokens here): the same values as the torch stage, with a per-sequence and a
    batch-wide aggregation (~10 s in the interpreter, one program per sequence)."""
    from ..cases import make_batch

    lengths = [1 + i % 2 for i in range(520)]
    batch = make_batch("packed", lengths, 2, dtype=F32, seed=12, mismatch=0.3, mask_p=0.9)
    for agg in ("seq-mean-token-mean", "token-mean"):
        config = PolicyLossConfig(rollout_correction=RolloutCorrection.seq_tis(), loss_agg_mode=agg, kl_coef=0.1,
                                  entropy_coeff=0.01, metrics="loss_only", validate=False, backend="triton")
        (want, want_lp, want_h), (got, got_lp, got_h) = _both(batch, "decoupled", config, batch.old_logprobs - 0.1,
                                                              torch.ones(batch.labels.shape))
        assert_close(got.loss, want.loss, **tol("reordered", F32, scale=max(1.0, float(want.loss.abs()))), name=agg)
        for name, x, y in (("dlogprobs", got_lp, want_lp), ("dentropy", got_h, want_h)):
            assert_close(x, y, **tol("reordered", F32, scale=float(y.abs().amax())), name=f"{agg} {name}")


@needs_cpu_kernels
def test_the_cpu_kernels_give_the_same_bits_on_any_thread_count_and_refuse_bad_offsets():
    """Found by review: the token loop's KL coefficient was contracted to an FMA in the threaded copy of the loop and
    not in the serial one (-ffp-contract=fast), so the gradient depended on the thread count; and with validate=False
    offsets past N were read. Now one rounding everywhere (std::fma), and the op checks the offsets on the host."""
    g = torch.Generator().manual_seed(13)
    B, T = 3, 3001  # over the token loop's grain (4,096), so that two threads split it
    old = -torch.rand(B, T, generator=g) * 3
    lp, adv, entropy = old + 0.1 * torch.randn(B, T, generator=g), torch.randn(B, T, generator=g), torch.rand(B, T)
    config = PolicyLossConfig(rollout_correction=RolloutCorrection.seq_tis(), kl_type="k2", kl_coef=0.1,
                              entropy_coeff=0.01, metrics="loss_only", validate=False, fused_stage=True)
    threads, results = torch.get_num_threads(), []
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            leaf = lp.clone().requires_grad_(True)
            out = rlkernels.policy_loss(leaf, adv, torch.rand(B, T, generator=torch.Generator().manual_seed(1)) > 0.1,
                                        old_logprobs=old, rollout_logprobs=old + 0.05, ref_logprobs=old - 0.1,
                                        entropy=entropy, config=config)
            results.append((out.loss.detach(), torch.autograd.grad(out.loss, leaf)[0]))
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][1], results[1][1])
    with pytest.raises(RuntimeError, match="cu_seqlens must run from 0 to N = 8"):
        rlkernels.policy_loss(torch.randn(8), torch.randn(8), torch.ones(8, dtype=torch.bool),
                              cu_seqlens=torch.tensor([0, 4, 100000]),
                              config=PolicyLossConfig(metrics="loss_only", validate=False, fused_stage=True))
