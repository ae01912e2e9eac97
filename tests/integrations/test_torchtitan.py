"""TorchTitan 0.3.0 RL: the adapter's losses, built from their configs as TorchTitan's trainer builds them
(`Config.build()`), against TorchTitan's own `GRPOLoss` / `DAPOLoss` from the logits, and inside a
`ChunkedLossWrapper` from hidden states.

TorchTitan upcasts the logits to float32 (`compute_logprobs`) whatever their dtype, so the batches are float32 and
the tolerance float32's: values to 1e-6 relative, gradients to 1e-5 of their largest element (a log-softmax over
V = 37 in float32, two implementations).
"""

import itertools

import pytest
import torch

from ..cases import F32, assert_close, tol
from .trainer_imports import trainer_or_skip

TT = trainer_or_skip("torchtitan_rl", "torchtitan 0.3.0")
from rlkernels.integrations import torchtitan as rlk_titan  # noqa: E402  (after TorchTitan's bare import)

B, L, V, D = 3, 8, 37, 16


def _batch(seed):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(B, L, D, generator=g)
    head = torch.nn.Linear(D, V, bias=False)
    with torch.no_grad():
        head.weight.copy_(torch.randn(V, D, generator=g) * 0.5)
    labels = torch.randint(0, V, (B, L), generator=g)
    with torch.no_grad():
        lp = torch.log_softmax(head(hidden), -1).gather(-1, labels[..., None])[..., 0]
    generator_logprobs = lp + 0.3 * torch.randn(B, L, generator=g)
    loss_mask = torch.rand(B, L, generator=g) > 0.25
    if seed % 3 == 0:  # a generator log-prob lost (vLLM under cudagraph): dropped by both
        generator_logprobs[0, 1] = float("nan")
        generator_logprobs[1, 2] = float("-inf")
    advantages = torch.randn(B, 1, generator=g).expand(B, L).contiguous()
    return hidden, head, labels, generator_logprobs, loss_mask, advantages


def _gvt(loss_mask, generator_logprobs, kind):
    n = (loss_mask & torch.isfinite(generator_logprobs)).sum()
    return {"none": None, "count": n, "global": n.float() * 2 + 3}[kind]


CONFIGS = [("GRPOLoss", dict(clip_eps=0.2)), ("DAPOLoss", dict(ratio_clip_low=0.2, ratio_clip_high=0.28)),
           ("DAPOLoss", dict(ratio_clip_low=0.1, ratio_clip_high=0.4))]
CASES = list(itertools.product(range(len(CONFIGS)), range(4), ["none", "count", "global"]))


@pytest.mark.parametrize("config, seed, gvt", CASES)
def test_logits_loss_matches_torchtitans_own(config, seed, gvt):
    name, fields = CONFIGS[config]
    hidden, head, labels, gen, mask, adv = _batch(seed)
    logits = head(hidden).detach()
    denominator = _gvt(mask, gen, gvt)

    def run(cls):
        x = logits.clone().requires_grad_(True)
        loss, metrics = cls.Config(**fields).build()(x, labels, denominator, generator_logprobs=gen,
                                                     advantages=adv, loss_mask=mask)
        (grad,) = torch.autograd.grad(loss, x)
        return loss.detach(), grad, metrics

    theirs, ours = run(getattr(TT.losses, name)), run(getattr(rlk_titan, name))
    assert isinstance(getattr(rlk_titan, name).Config(**fields).build(), getattr(rlk_titan, name))
    assert_close(ours[0], theirs[0], **tol("torchtitan", F32), name="loss")
    assert_close(ours[1], theirs[1], **tol("torchtitan", F32, scale=float(theirs[1].abs().max())),
                 name="dlogits")
    for key in ("loss/mean", "loss/ratio_clipped_frac", "bit_wise/logprob_diff/mean", "trainer/entropy/mean"):
        assert_close(ours[2][key], theirs[2][key], **tol("torchtitan", F32), name=key)


@pytest.mark.parametrize("config, seed", list(itertools.product([0, 1], range(3))))
def test_hidden_state_loss_matches_torchtitans_chunked_wrapper(config, seed):
    """TorchTitan's own ChunkedLossWrapper around its GRPO / DAPO loss against the adapter's Linear form: loss,
    the gradient to the hidden states and to the LM head."""
    name, fields = CONFIGS[config]
    hidden, head, labels, gen, mask, adv = _batch(seed)
    denominator = _gvt(mask, gen, "count")
    inner = getattr(TT.losses, name).Config(**fields)

    def run(wrapper):
        wrapper.set_lm_head(head)
        head.weight.grad = None
        h = hidden.clone().requires_grad_(True)
        loss, _ = wrapper(h, labels, denominator, generator_logprobs=gen, advantages=adv, loss_mask=mask)
        loss.backward()
        return loss.detach(), h.grad, head.weight.grad.clone()

    theirs = run(TT.loss.ChunkedLossWrapper.Config(num_chunks=2, loss_fn=inner).build())
    linear = getattr(rlk_titan, "Linear" + name).Config(**fields).build()
    assert isinstance(linear, TT.loss.ChunkedLossWrapper)  # so TorchTitan's trainer hands it hidden states
    ours = run(linear)
    assert_close(ours[0], theirs[0], **tol("torchtitan", F32), name="loss")
    for i, what in ((1, "dhidden"), (2, "dweight")):
        assert_close(ours[i], theirs[i], **tol("torchtitan", F32, scale=float(theirs[i].abs().max())), name=what)


def test_linear_form_needs_the_head():
    loss = rlk_titan.LinearGRPOLoss.Config().build()
    hidden, head, labels, gen, mask, adv = _batch(1)
    with pytest.raises(ValueError, match="set_lm_head"):
        loss(hidden, labels, None, generator_logprobs=gen, advantages=adv, loss_mask=mask)


@pytest.mark.parametrize("name", ["GRPOLoss", "LinearGRPOLoss"])
def test_batch_invariant_mode_is_refused(name, monkeypatch):
    """TorchTitan's debug.batch_invariant (the flag its set_batch_invariance sets): the trainer's log-probs must
    be TorchTitan's own, bitwise, so both loss forms refuse it by name; outside the mode they run."""
    import torchtitan.distributed.utils as titan_utils

    loss = getattr(rlk_titan, name).Config().build()
    hidden, head, labels, gen, mask, adv = _batch(2)
    if name.startswith("Linear"):
        loss.set_lm_head(head)
        pred = hidden
    else:
        pred = head(hidden)
    call = dict(generator_logprobs=gen, advantages=adv, loss_mask=mask)
    loss(pred, labels, None, **call)
    monkeypatch.setattr(titan_utils, "_batch_invariant_enabled", True)
    assert titan_utils.is_in_batch_invariant_mode()
    with pytest.raises(ValueError, match=r"^debug.batch_invariant=True"):
        loss(pred, labels, None, **call)
