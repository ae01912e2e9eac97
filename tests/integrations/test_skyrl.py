"""SkyRL 0.4.0: the adapter, looked up in SkyRL's own registry, against SkyRL's own registered losses on seeded
batches over every option its losses read.

Tolerance: SkyRL exponentiates every ratio in float32 (`safe_exp_delta`), also for float64 inputs, so its loss
carries float32 rounding (relative 6e-8 per ratio) that rlkernels' float64 computation does not: values and
gradients agree to 1e-6 relative, not to float64's 1e-12. A float32 rounding can also move a ratio across a mask
bound; the batches are drawn so that no ratio lies within 1e-4 of one (a draw that does is redrawn).
"""

import itertools
import random

import pytest
import torch

from rlkernels.integrations import skyrl as rlk_skyrl

from ..cases import F64, approx, assert_close, tol
from .trainer_imports import trainer_or_skip

SK = trainer_or_skip("skyrl_ppo_utils", "SkyRL 0.4.0")
REDUCTIONS = ("token_mean", "sequence_mean", "seq_mean_token_sum_norm", "prompt_mean", "token_mean_legacy")
MASK_BOUNDS = (0.5, 0.8, 0.99, 1.01, 1.25, 2.0, 1e-4, 100.0, 1.5, 3.0, 0.7)


def _options(rng: random.Random, loss_type: str) -> dict:
    """One draw of SkyRL's AlgorithmConfig options for `loss_type` (off-policy correction included)."""
    opc = {}
    if loss_type != "cispo" or rng.random() < 0.5:
        opc["tis_ratio_type"] = rng.choice([None, "token", "sequence"])
        opc["token_tis_ratio_clip_high"] = rng.choice([1.2, 2.0, 5.0])
        opc["sequence_tis_ratio_clip_high"] = rng.choice([1.5, 5.0])
    opc["sequence_mask_metric"] = rng.choice([None, "geometric", "product"])
    opc["geo_mask_low"], opc["geo_mask_high"] = rng.choice([(0.99, 1.01), (0.8, 1.25), (0.5, 2.0)])
    opc["product_mask_low"], opc["product_mask_high"] = rng.choice([(0.5, 2.0), (0.2, 5.0)])
    if rng.random() < 0.5:
        opc["outlier_token_is_threshold_low"] = rng.choice([None, 0.5, 0.7])
        opc["outlier_token_is_threshold_high"] = rng.choice([None, 1.5, 3.0])
    if rng.random() < 0.5 and loss_type != "gspo":  # refused with gspo (test_refusals_name_skyrls_option)
        opc["token_mask_is_threshold_low"] = rng.choice([0.6, 0.8])
        opc["token_mask_is_threshold_high"] = rng.choice([1.25, 2.0])
    algorithm = dict(policy_loss_type=loss_type, eps_clip_low=rng.choice([0.2, 0.1]),
                     eps_clip_high=rng.choice([0.2, 0.28]), clip_ratio_c=rng.choice([3.0, 1.5]),
                     loss_reduction=rng.choice(REDUCTIONS))
    return dict(algorithm=algorithm, opc=opc)


def _build(options):
    algorithm = SK.AlgorithmConfig(**options["algorithm"],
                                   off_policy_correction=SK.OffPolicyCorrectionConfig(**options["opc"]))
    if options["algorithm"]["policy_loss_type"] == "cispo" and options.get("cispo"):
        for key, value in options["cispo"].items():
            setattr(algorithm.cispo, key, value)
    return algorithm


def _batch(seed: int):
    g = torch.Generator().manual_seed(seed)
    B, T = 6, 11
    log_probs = -torch.rand(B, T, generator=g, dtype=torch.float64) * 3
    old = log_probs + 0.2 * torch.randn(B, T, generator=g, dtype=torch.float64)
    rollout = old + 0.3 * torch.randn(B, T, generator=g, dtype=torch.float64)
    lengths = torch.randint(0, T + 1, (B,), generator=g)
    mask = (torch.arange(T)[None, :] < lengths[:, None]).to(torch.float64)
    advantages = torch.randn(B, 1, generator=g, dtype=torch.float64).expand(B, T).clone()
    return log_probs, old, rollout, mask, advantages


def _near_a_bound(old, rollout, mask) -> bool:
    """Whether a token ratio, or a sequence product / geometric mean, lies within 1e-4 (relative) of a bound drawn."""
    log_r = (old - rollout) * mask
    seq_sum = log_r.sum(-1)
    seq_mean = seq_sum / mask.sum(-1).clamp(min=1)
    values = torch.cat([log_r[mask > 0], seq_sum, seq_mean])
    bounds = torch.log(torch.tensor(MASK_BOUNDS + (1.2, 5.0, 0.2), dtype=torch.float64))
    return bool(((values[:, None] - bounds[None, :]).abs() < 1e-4).any())


def _prescale(advantages, mask, reduction):
    """SkyRL's own advantage pre-scaling of its trainer (the registered loss then sums)."""
    B = advantages.shape[0]
    return SK.ppo_utils.apply_loss_reduction_to_advantages_minibatch(
        advantages, mask, reduction, micro_batch_size=2, max_seq_len=advantages.shape[1],
        prompt_boundaries=[(0, B // 2), (B // 2, B)])


CASES = list(itertools.product(["regular", "dual_clip", "gspo", "cispo", "sapo"], range(8)))


def test_registered_names():
    names = rlk_skyrl.register()
    assert set(names) == set(rlk_skyrl.LOSS_NAMES)
    available = SK.PolicyLossRegistry.list_available()
    assert all(name in available for name in names.values())
    assert rlk_skyrl.register() == names  # a second call registers nothing twice (SkyRL raises on a duplicate)


@pytest.mark.parametrize("loss_type, draw", CASES)
def test_matches_skyrls_own_loss(loss_type, draw):
    rlk_skyrl.register()
    rng = random.Random(f"{loss_type}-{draw}")
    options = _options(rng, loss_type)
    if loss_type == "cispo":
        options["cispo"] = {"cispo_eps_clip_low": rng.choice([1.0, 0.2]),
                            "cispo_eps_clip_high": rng.choice([4.0, 0.28])}
        if draw % 3 == 0:  # anchored on the sampler: no TIS (SkyRL refuses it) and no masks (refused here)
            options["cispo"]["cispo_anchor"] = "rollout"
            options["opc"] = {}
    seed = draw
    while True:
        log_probs, old, rollout, mask, advantages = _batch(seed)
        if not _near_a_bound(old, rollout, mask) and not _near_a_bound(log_probs, old, mask):
            break
        seed += 1000
    advantages = _prescale(advantages, mask, options["algorithm"]["loss_reduction"])
    algorithm = _build(options)

    def run(fn):
        lp = log_probs.clone().requires_grad_(True)
        loss, metrics = fn(lp, old, advantages, config=algorithm, loss_mask=mask, rollout_logprobs=rollout)
        (grad,) = torch.autograd.grad(loss, lp)
        return loss.detach(), grad, metrics

    theirs = run(SK.PolicyLossRegistry.get(loss_type))
    ours = run(SK.PolicyLossRegistry.get(rlk_skyrl.LOSS_NAMES[loss_type]))
    scale = max(1.0, float(theirs[0].abs()))
    assert_close(ours[0], theirs[0], **tol("skyrl", F64, scale=scale), name="loss")
    g_scale = max(1e-3, float(theirs[1].abs().max()))
    assert_close(ours[1], theirs[1], **tol("skyrl", F64, scale=g_scale), name="dlog_probs")
    # every metric SkyRL logs, under its name, with its value (a SkyRL dashboard reads these)
    assert set(theirs[2]) <= set(ours[2]), set(theirs[2]) - set(ours[2])
    for name, value in theirs[2].items():
        assert ours[2][name] == approx(value, "metric"), name


def test_cispo_on_the_rollout_without_old_log_probs():
    """SkyRL's skip-forward path: cispo anchored on the sampler is called with old_log_probs=None."""
    rlk_skyrl.register()
    log_probs, _, rollout, mask, advantages = _batch(7)
    algorithm = SK.AlgorithmConfig(policy_loss_type="cispo")
    algorithm.cispo.cispo_anchor = "rollout"
    results = []
    for name in ("cispo", rlk_skyrl.LOSS_NAMES["cispo"]):
        lp = log_probs.clone().requires_grad_(True)
        loss, metrics = SK.PolicyLossRegistry.get(name)(lp, None, advantages, algorithm, mask, rollout)
        results.append((loss.detach(), torch.autograd.grad(loss, lp)[0], metrics))
    theirs, ours = results
    assert_close(ours[0], theirs[0], **tol("skyrl", F64, scale=max(1.0, float(theirs[0].abs()))), name="loss")
    assert_close(ours[1], theirs[1], **tol("skyrl", F64, scale=max(1e-3, float(theirs[1].abs().max()))),
                 name="dlog_probs")
    for name, value in theirs[2].items():
        assert ours[2][name] == approx(value, "metric"), name
    with pytest.raises(ValueError, match="old_log_probs: required by regular"):
        rlk_skyrl.policy_loss_fn("regular")(log_probs, None, advantages, SK.AlgorithmConfig(), mask, rollout)


def test_refusals_name_skyrls_option():
    with pytest.raises(ValueError, match="use_tis"):
        rlk_skyrl.config_from_skyrl(SK.AlgorithmConfig(use_tis=True), "regular")
    with pytest.raises(ValueError, match="rollout_is"):
        rlk_skyrl.config_from_skyrl(SK.AlgorithmConfig(), "rollout_is")
    algorithm = SK.AlgorithmConfig(off_policy_correction=SK.OffPolicyCorrectionConfig(sequence_mask_metric="product"))
    algorithm.cispo.cispo_anchor = "rollout"
    with pytest.raises(ValueError, match=r"^off_policy_correction.sequence_mask_metric with cispo.cispo_anchor"):
        rlk_skyrl.config_from_skyrl(algorithm, "cispo")
    algorithm.off_policy_correction = SK.OffPolicyCorrectionConfig(tis_ratio_type="token")
    with pytest.raises(ValueError, match=r"^off_policy_correction.tis_ratio_type='token' with cispo.cispo_anchor"):
        rlk_skyrl.config_from_skyrl(algorithm, "cispo")
    token_mask = SK.OffPolicyCorrectionConfig(token_mask_is_threshold_low=0.5, token_mask_is_threshold_high=2.0)
    with pytest.raises(ValueError, match="token_mask_is_threshold"):
        rlk_skyrl.config_from_skyrl(SK.AlgorithmConfig(off_policy_correction=token_mask), "gspo")


@pytest.mark.parametrize("dtype, masked, entropy_grad", [(torch.float32, False, True), (torch.float32, True, False),
                                                         (torch.bfloat16, True, True)])
def test_logprob_route_matches_skyrls_functions(dtype, masked, entropy_grad):
    """HFModelWrapper.forward's two calls on the same logits, log-probs then entropy: rlkernels' (one fused pass)
    against SkyRL's own (`logprobs_from_logits_v2` here, without flash-attn; `chunked_entropy_from_logits`).
    float32: against SkyRL's, the float32 rows. bf16: SkyRL's bf16 path takes log_softmax in bf16 arithmetic, several
    bf16 ulps from the exact values, so the route is held to the float64 oracle of the same logits: float32
    log-probs, and the entropy and gradient rounded once to bf16."""
    torch_utils = SK.torch_utils
    g = torch.Generator().manual_seed(5)
    B, T, V = 3, 6, 41
    logits = (torch.randn(B, T, V, generator=g) * 2).to(dtype)
    labels = torch.randint(0, V, (B, T), generator=g)
    attention = (torch.rand(B, T, generator=g) > 0.2).to(dtype) if masked else None
    a, b = torch.randn(B, T, generator=g), torch.randn(B, T, generator=g)
    results = []
    for module in (torch_utils, rlk_skyrl):
        x = logits.clone().requires_grad_(True)
        lp = module.logprobs_from_logits(x, labels, inplace_backward=True)
        ent = module.chunked_entropy_from_logits(x, requires_grad=entropy_grad, attention_mask=attention)
        assert ent.dtype == dtype and ent.requires_grad == entropy_grad
        objective = (a * lp.float()).sum() + ((b * ent.float()).sum() if entropy_grad else 0.0)
        (grad,) = torch.autograd.grad(objective, x)
        results.append((lp.detach().float(), ent.detach().float(), grad.float()))
    theirs, ours = results
    if dtype == torch.float32:
        assert_close(ours[0], theirs[0], **tol("value", torch.float32, scale=2.0), name="logprobs")
        assert_close(ours[1], theirs[1], **tol("value", torch.float32, scale=2.0), name="entropy")
        assert_close(ours[2], theirs[2], **tol("dlogits", dtype), name="dlogits")
    else:  # against the float64 oracle of the same bf16 logits (SkyRL's own bf16 arithmetic is further from it)
        x = logits.double().requires_grad_(True)
        exact_lp = torch.log_softmax(x, -1)
        exact = [exact_lp.gather(-1, labels[..., None])[..., 0],
                 -(exact_lp.exp() * exact_lp).sum(-1) * (1 if attention is None else attention.double())]
        # the entropy is bf16 in SkyRL's contract, so the gradient reaching it is rounded to bf16 (the cast's backward)
        exact.append(torch.autograd.grad((a * exact[0]).sum() + (b.to(dtype).double() * exact[1]).sum(), x)[0])
        assert_close(ours[0], exact[0].float(), **tol("value", torch.float32, scale=2.0), name="logprobs")
        for i, name in ((1, "entropy"), (2, "dlogits")):  # float32-exact, rounded once to bf16: the bf16 row
            assert_close(ours[i], exact[i].float(), **tol("dlogits", dtype), name=name)


def test_entropy_without_a_log_prob_pass_before_it():
    """The entropy call alone (or on other logits than the last log-prob pass) runs its own pass."""
    g = torch.Generator().manual_seed(6)
    logits, other = torch.randn(2, 5, 17, generator=g), torch.randn(2, 5, 17, generator=g)
    rlk_skyrl.logprobs_from_logits(other, torch.zeros(2, 5, dtype=torch.long))
    ours = rlk_skyrl.chunked_entropy_from_logits(logits)
    theirs = SK.torch_utils.chunked_entropy_from_logits(logits)
    assert_close(ours, theirs, **tol("value", torch.float32), name="entropy")


def test_route_under_inference_mode_and_its_cache_lifetime():
    """SkyRL's old / ref passes may run under inference mode (no version counter) or no_grad (no entropy asked for
    with the log-probs); the update forward's entropy call takes the cached entropy and clears the cache."""
    g = torch.Generator().manual_seed(8)
    logits, labels = torch.randn(2, 5, 17, generator=g), torch.randint(0, 17, (2, 5), generator=g)
    expected = SK.torch_utils.chunked_entropy_from_logits(logits)
    with torch.inference_mode():
        rlk_skyrl.logprobs_from_logits(logits.clone(), labels)
        assert rlk_skyrl._last_pass is None  # nothing cached without autograd
        assert_close(rlk_skyrl.chunked_entropy_from_logits(logits.clone()), expected, **tol("value", torch.float32),
                     name="entropy under inference mode")
    x = logits.clone().requires_grad_(True)
    rlk_skyrl.logprobs_from_logits(x, labels)
    assert rlk_skyrl._last_pass is not None and rlk_skyrl._last_pass[0]() is x
    entropy = rlk_skyrl.chunked_entropy_from_logits(x, requires_grad=True)
    assert rlk_skyrl._last_pass is None and entropy.requires_grad
    assert_close(entropy.detach(), expected, **tol("value", torch.float32), name="cached entropy")
