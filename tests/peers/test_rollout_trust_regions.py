"""The 2026 trust regions on the rollout policy (SPEC §6.1) against float64 transcriptions of their references' code.

Neither prime-rl nor open-instruct installs here (both pull their whole training stacks), so each reference is
transcribed below, in float64, from the commit named in its docstring, with what was changed said there. Each
test runs `rlkernels.policy_loss` on hypothesis batches from tests/cases.py: both layouts, empty sequences and
masks, extreme mismatches (rollout log-probs 50 nats off), near-one-hot and -inf logits. The loss and its
gradient with respect to the log-probs (autograd through the transcription) agree to float64 rounding (TOL
"value"). The references take r = p/q unclamped, so `log_ratio_clamp=None` here; the clamp is tested in the oracle
parity draws.
"""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import rlkernels
from rlkernels import PolicyLossConfig, RolloutCorrection

from ..cases import approx, assert_close, batches, scaled, tol


# ---------------------------------------------------------------- transcriptions (float64, per token)
def prime_rl_ipo(lp, q, A, mask, eps, kl_tau, kl_on_kept):
    """prime-rl src/prime_rl/trainer/rl/loss.py `ipo_loss_fn` at 559b4477 (PR #2798's IPO; `ipo_threshold` is the
    `eps` PR #3418 renamed it to), normalised as its `compute_loss` does: the sum over the loss mask divided by
    the number of loss tokens. kl_on_kept: PR #2458's KL on the kept tokens (559b4477: on every loss token)."""
    log_r = lp - q
    r = torch.exp(log_r)
    masked = (torch.exp(lp) - torch.exp(q)).abs() > eps
    keep = mask & ~masked
    pg = torch.where(keep, A * r, torch.zeros_like(r))  # 559b4477 multiplies by keep; a where: no 0 * inf
    kl = torch.where(keep if kl_on_kept else mask, log_r ** 2, torch.zeros_like(r))
    return (-pg + kl_tau * kl).sum() / mask.sum().clamp_min(1)


def prime_rl_kpop(lp, q, A, mask, phi, kl_tau):
    """prime-rl PR #3283 (head 489621ac) `kpop_loss_fn`: both binary KLs of the probabilities clamped to
    [1e-6, 1 - 1e-6] within phi; the rest as IPO at 559b4477 (KL on every loss token)."""
    eps = 1e-6
    p, pq = torch.exp(lp).clamp(eps, 1 - eps), torch.exp(q).clamp(eps, 1 - eps)

    def binary_kl(a, b):
        return a * torch.log(a / b) + (1 - a) * torch.log((1 - a) / (1 - b))

    masked = (binary_kl(p, pq) > phi) | (binary_kl(pq, p) > phi)
    keep = mask & ~masked
    log_r = lp - q
    r = torch.exp(log_r)
    pg = torch.where(keep, A * r, torch.zeros_like(r))
    kl = torch.where(mask, log_r ** 2, torch.zeros_like(r))
    return (-pg + kl_tau * kl).sum() / mask.sum().clamp_min(1)


def prime_rl_binary_tv(lp, q, A, mask, low, high):
    """prime-rl PR #2434 (head 04096522) symmetric DPPO binary-TV: keep iff p - q in [-low, high], no advantage
    conditioning, no KL; -keep A r summed, normalised by the loss tokens."""
    gap = (torch.exp(lp) - torch.exp(q)).detach()
    keep = mask & (gap >= -low) & (gap <= high)
    r = torch.exp(lp - q)
    return -torch.where(keep, A * r, torch.zeros_like(r)).sum() / mask.sum().clamp_min(1)


def open_instruct_vaco_dapo(lp, old, mu, A, mask, threshold, kind, clip_low, clip_high, rho_cap):
    """open-instruct PR #1755 (head 5c2bf9ab) `compute_rho_correction` with rho_divergence_algo="vaco" and the
    DAPO policy loss of `compute_grpo_loss`, on padded [B, T] rows (a row is a sequence here; open-instruct's
    packed rows may hold several): the per-token binary divergence of (mu, pi_old), its row mean over the
    response mask, tokens with sign(log pi_old - log mu) A > 0 dropped in rows above the threshold, the others
    weighted by clamp(rho, max=rho_cap); then max(-A r, -A clip(r)) * weight, averaged over the mask's tokens."""
    old_c, mu_c = old.clamp(-30.0, 0.0), mu.clamp(-30.0, 0.0)
    pi, m = torch.exp(old_c), torch.exp(mu_c)
    if kind == "tv":
        div = (m - pi).abs()
    else:
        e = 1e-6
        mc, pc = m.clamp(e, 1 - e), pi.clamp(e, 1 - e)
        div = mc * (mc.log() - pc.log()) + (1 - mc) * (torch.log1p(-mc) - torch.log1p(-pc))
    div = torch.where(mask, div, torch.zeros_like(div))
    valid = mask.double()
    row_mean = ((div * valid).sum(-1, keepdim=True) / valid.sum(-1, keepdim=True).clamp_min(1.0)).expand_as(div)
    away = torch.sign(old_c - mu_c) * A > 0
    dropped = (row_mean > threshold) & mask & away
    rho = torch.exp(torch.where(mask, (old_c - mu_c).clamp(-10.0, 10.0), torch.zeros_like(old)))
    weights = torch.where(mask & ~dropped, rho.clamp(max=rho_cap), torch.zeros_like(rho))
    ratio = torch.exp(lp - old)
    pg = torch.maximum(-A * ratio, -A * ratio.clamp(1 - clip_low, 1 + clip_high)) * weights
    return torch.where(mask, pg, torch.zeros_like(pg)).sum() / mask.sum().clamp_min(1)


# ---------------------------------------------------------------- the comparison
def _inputs(batch):
    """Per-token float64 log-probs of the batch's labels (with autograd), its sampler's, advantages, mask."""
    labels = batch.labels.clamp_min(0)
    lp = torch.log_softmax(batch.logits.double(), -1).gather(-1, labels[..., None])[..., 0]
    mask = batch.response_mask & (batch.labels >= 0) & torch.isfinite(lp)
    lp = torch.where(mask, lp, torch.zeros_like(lp)).detach()
    zero = torch.zeros((), dtype=torch.float64)
    clean = lambda t: torch.where(mask, t.double(), zero)  # noqa: E731  (padding holds NaN advantages)
    return lp, clean(batch.rollout_logprobs), clean(batch.old_logprobs), clean(batch.advantages), mask


def _compare(want_fn, lp, mask, A, config, **kw):
    leaf = lp.clone().requires_grad_(True)
    out = rlkernels.policy_loss(leaf, A, mask, config=config, **kw)
    (grad,) = torch.autograd.grad(out.loss, leaf)
    ref_leaf = lp.clone().requires_grad_(True)
    want = want_fn(ref_leaf)
    (want_grad,) = torch.autograd.grad(want, ref_leaf)
    assert torch.isfinite(out.loss) and torch.isfinite(grad).all()
    assert_close(out.loss, want, **tol("value", torch.float64, scale=max(1.0, float(want.abs()))), name="loss")
    scale = max([1.0] + want_grad.abs().reshape(-1).tolist())
    assert_close(grad, want_grad, **tol("value", torch.float64, scale=scale), name="gradient")
    return out


COMMON = dict(loss_agg_mode="token-mean", log_ratio_clamp=None)


@settings(max_examples=scaled(40), deadline=None)
@given(batch=batches(), eps=st.sampled_from([0.3, 0.05, 1.0]), kl_tau=st.sampled_from([0.0, 1e-3, 0.1]))
def test_ipo_equals_prime_rl(batch, eps, kl_tau):
    """ipo_kl_tau is PR #2458's KL on the kept tokens; log_ratio_sq_coef (the Kimi-K2.5 term) is 559b4477's own
    KL on every loss token: IPO with one or the other equals prime-rl's loss of that form."""
    lp, q, _, A, mask = _inputs(batch)
    cu = {"cu_seqlens": batch.cu_seqlens}
    kept = PolicyLossConfig(loss_type="ipo", ipo_eps=eps, ipo_kl_tau=kl_tau, **COMMON)
    out = _compare(lambda x: prime_rl_ipo(x, q, A, mask, eps, kl_tau, kl_on_kept=True), lp, mask, A, kept,
                   rollout_logprobs=q, **cu)
    everywhere = PolicyLossConfig(loss_type="ipo", ipo_eps=eps, log_ratio_sq_coef=kl_tau, **COMMON)
    _compare(lambda x: prime_rl_ipo(x, q, A, mask, eps, kl_tau, kl_on_kept=False), lp, mask, A, everywhere,
             rollout_logprobs=q, **cu)
    p = torch.exp(lp)
    outside = mask & ((p - torch.exp(q)).abs() > eps)
    want_frac = outside.sum().double() / mask.sum().clamp_min(1)
    assert float(out.metrics["actor/pg_clipfrac"]) == approx(float(want_frac), "fraction")


@settings(max_examples=scaled(40), deadline=None)
@given(batch=batches(), phi=st.sampled_from([0.1, 0.01, 1.0]), kl_tau=st.sampled_from([0.0, 1e-3]))
def test_kpop_equals_prime_rl(batch, phi, kl_tau):
    """PR #3283 puts its KL on every loss token: log_ratio_sq_coef there, ipo_kl_tau = 0."""
    lp, q, _, A, mask = _inputs(batch)
    config = PolicyLossConfig(loss_type="kpop", kpop_phi=phi, log_ratio_sq_coef=kl_tau, **COMMON)
    _compare(lambda x: prime_rl_kpop(x, q, A, mask, phi, kl_tau), lp, mask, A, config, rollout_logprobs=q,
             cu_seqlens=batch.cu_seqlens)


@settings(max_examples=scaled(40), deadline=None)
@given(batch=batches(), low=st.sampled_from([0.2, 0.05]), high=st.sampled_from([0.2, 0.5]))
def test_dppo_binary_tv_equals_prime_rl(batch, low, high):
    lp, q, _, A, mask = _inputs(batch)
    config = PolicyLossConfig(loss_type="dppo_binary_tv", binary_tv_low=low, binary_tv_high=high, **COMMON)
    _compare(lambda x: prime_rl_binary_tv(x, q, A, mask, low, high), lp, mask, A, config, rollout_logprobs=q,
             cu_seqlens=batch.cu_seqlens)


@settings(max_examples=scaled(40), deadline=None)
@given(batch=batches(layout="padded"), threshold=st.sampled_from([0.02, 0.1, 0.5]),
       kind=st.sampled_from(["tv", "kl"]))
def test_vaco_equals_open_instruct(batch, threshold, kind):
    """open-instruct's VACO with its default rho clamp (max 2, no minimum) is rlkernels' token TIS at C = 2 and
    vaco_threshold on the PPO clip without dual clip (its clip_higher 0.272). Its rho clamps the log-ratio to
    +-10 (rlkernels: +-20) and takes it of the log-probs clamped to [-30, 0] (rlkernels: as given): the batch keeps
    |old - rollout| < 10 and the rollout's log-probs <= 0, as log-probs are (the batches' synthetic rollout
    log-probs may exceed 0)."""
    lp, mu, old, A, mask = _inputs(batch)
    mu = (old + (mu - old).clamp(-9.0, 9.0)).clamp(max=0.0)
    config = PolicyLossConfig(loss_type="vanilla", clip_ratio_c=None, clip_ratio_high=0.272,
                              rollout_correction=RolloutCorrection(is_level="token", is_threshold=2.0),
                              vaco_threshold=threshold, vaco_divergence=kind, **COMMON)
    out = _compare(lambda x: open_instruct_vaco_dapo(x, old, mu, A, mask, threshold, kind, 0.2, 0.272, 2.0),
                   lp, mask, A, config, old_logprobs=old, rollout_logprobs=mu)
    assert "actor/vaco_masked_fraction" in out.metrics


def test_vaco_drops_only_tokens_moving_away_in_diverged_sequences():
    """open-instruct's test vector (test_vaco_tv_divergence): mu = (.5, .1, .1), pi_old = (.4, .6, .6) per row, A =
    (+1, +1, -1), threshold 0.3: D = (.1, .5, .5); row 1 (pi_old > mu, A > 0) is dropped, rows 0 (D below) and 2
    (A < 0: toward mu) keep their tokens."""
    old = torch.tensor([0.4, 0.6, 0.6], dtype=torch.float64).log()[:, None].expand(3, 3).contiguous()
    mu = torch.tensor([0.5, 0.1, 0.1], dtype=torch.float64).log()[:, None].expand(3, 3).contiguous()
    A = torch.tensor([1.0, 1.0, -1.0], dtype=torch.float64)[:, None].expand(3, 3).contiguous()
    mask = torch.ones(3, 3, dtype=torch.bool)
    out = rlkernels.policy_loss(old.clone(), A, mask, old_logprobs=old, rollout_logprobs=mu, vaco_threshold=0.3,
                                clip_ratio_c=None)
    assert float(out.metrics["actor/vaco_masked_fraction"]) == approx(1 / 3, "by_hand.below_one")
    assert float(out.metrics["actor/vaco_divergence_mean"]) == approx((0.1 + 0.5 + 0.5) / 3, "by_hand")
    # without IS weights (on the old policy's ratio 1) the loss is -mean(A) over the kept tokens
    assert float(out.loss) == approx(-(3 * 1.0 + 3 * -1.0) / 9, "by_hand.below_one")


def test_the_masked_tokens_make_no_nan():
    """prime-rl PR #2085: a token outside the trust region with r = exp(1e4) overflowed to inf and 0 * inf made the
    loss NaN. Here a masked token is selected away, never multiplied, and the clamp holds r finite besides."""
    lp = torch.tensor([[-1e-3, -2.0, -1e4]], dtype=torch.float64, requires_grad=True)
    q = torch.tensor([[-1e4, -2.1, 0.0]], dtype=torch.float64)
    A = torch.tensor([[1.0, -1.0, 1.0]], dtype=torch.float64)
    mask = torch.ones(1, 3, dtype=torch.bool)
    for loss_type in ("ipo", "kpop", "dppo_binary_tv"):
        for clamp in (20.0, None):
            out = rlkernels.policy_loss(lp, A, mask, rollout_logprobs=q, loss_type=loss_type, log_ratio_clamp=clamp,
                                        ipo_kl_tau=0.01)
            (grad,) = torch.autograd.grad(out.loss, lp)
            assert torch.isfinite(out.loss) and torch.isfinite(grad).all(), (loss_type, clamp, out.loss, grad)
            assert float(out.metrics["actor/pg_clipfrac"]) > 0  # the extreme tokens are outside the region


@pytest.mark.parametrize("loss_type", ["ipo", "kpop", "dppo_binary_tv"])
def test_the_ratio_is_against_the_sampler_in_every_mode(loss_type):
    """With old log-probs too (decoupled), r is still p / q against the sampler, not p / p_old: the same loss as in
    bypass mode. With neither, q is the current policy: r = 1, every token kept, the loss -mean(A)."""
    g = torch.Generator().manual_seed(0)
    lp = -torch.rand(2, 5, generator=g, dtype=torch.float64)
    q = lp + 0.2 * torch.randn(2, 5, generator=g, dtype=torch.float64)
    A = torch.randn(2, 5, generator=g, dtype=torch.float64)
    mask = torch.ones(2, 5, dtype=torch.bool)
    kw = dict(loss_type=loss_type, rollout_correction=RolloutCorrection(rs={"seq_mean_k1": (0.1, 10.0)}))
    bypass = rlkernels.policy_loss(lp, A, mask, rollout_logprobs=q, **kw)
    decoupled = rlkernels.policy_loss(lp, A, mask, rollout_logprobs=q, old_logprobs=lp - 0.5, **kw)
    assert float(decoupled.loss) == approx(float(bypass.loss), "mode_paths")
    on_policy = rlkernels.policy_loss(lp, A, mask, loss_type=loss_type)
    assert float(on_policy.loss) == approx(-float(A.mean()), "by_hand.relative")


def test_computed_is_weights_are_refused_for_the_rollout_ratio_losses():
    with pytest.raises(ValueError, match="^rollout_correction: loss_type='ipo'"):
        PolicyLossConfig(loss_type="ipo", rollout_correction=RolloutCorrection.token_tis())
    PolicyLossConfig(loss_type="kpop", rollout_correction=RolloutCorrection(rs={"token_k3": 0.1}))  # masks apply
