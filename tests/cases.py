"""Shared test inputs: hypothesis strategies for batches and configurations, and the comparison helper.

Values come from a torch generator seeded by hypothesis (drawing thousands of floats one by one
through hypothesis is slow); shapes, masks, layouts and options are drawn by hypothesis itself so
that shrinking finds the smallest failing structure.

Tolerances (one row per compared dtype, with the reason):
- float64 inputs: rtol 1e-9. Same math in the same precision, different summation order; the
  largest terms are exp(20) ~ 5e8, so absolute errors scale with the value (hence relative).
- float32 inputs: rtol 2e-5, atol 1e-5 * scale. A blocked fp32 exp-sum errs by about
  (V/BLOCK + log2 BLOCK) * 2^-24 ~ 1e-6 relative; exp() of a log-ratio that carries that error
  amplifies it by |delta| <= 20 (the clamp), so 2e-5 bounds it.
"""

import os
from dataclasses import dataclass
from typing import Dict, Optional

import torch
from hypothesis import strategies as st

from rlkernels import PolicyLossConfig, RolloutCorrection
from rlkernels.config import RS_OPTIONS

# Every property test states its CI example budget; HYPOTHESIS_SCALE=10 runs ten times as many.
EXAMPLE_SCALE = int(os.environ.get("HYPOTHESIS_SCALE", "1"))


def scaled(n: int) -> int:
    return n * EXAMPLE_SCALE


TOLERANCES = {torch.float64: dict(rtol=1e-9, atol=1e-10), torch.float32: dict(rtol=2e-5, atol=1e-5)}
LOGIT_KINDS = ("normal", "offset_pos", "offset_neg", "neg_inf", "one_hot")
MISMATCH_SCALES = (0.0, 0.01, 0.3, 3.0, 50.0)


@dataclass
class Batch:
    logits: torch.Tensor  # [B, T, V] or [N, V]
    labels: torch.Tensor
    advantages: torch.Tensor
    response_mask: torch.Tensor
    old_logprobs: torch.Tensor
    rollout_logprobs: torch.Tensor
    ref_logprobs: torch.Tensor
    cu_seqlens: Optional[torch.Tensor]

    @property
    def padded(self) -> bool:
        return self.logits.dim() == 3

    def kwargs(self, mode: str) -> Dict[str, Optional[torch.Tensor]]:
        """Keyword tensors for a mode: decoupled (old + rollout), bypass (rollout), on-policy (none)."""
        return dict(
            old_logprobs=self.old_logprobs if mode == "decoupled" else None,
            rollout_logprobs=self.rollout_logprobs if mode in ("decoupled", "bypass") else None,
            ref_logprobs=self.ref_logprobs,
            cu_seqlens=self.cu_seqlens,
        )


def make_logits(gen: torch.Generator, shape, kind: str, dtype) -> torch.Tensor:
    V = shape[-1]
    x = torch.randn(shape, generator=gen, dtype=torch.float64) * 2
    if kind == "offset_pos":
        x = x + 1e4  # a huge common offset must change nothing (fp32 keeps ~1e-3 absolute there)
    elif kind == "offset_neg":
        x = x - 1e4
    elif kind == "neg_inf" and V > 1:
        drop = torch.rand(shape, generator=gen) < 0.4
        drop[..., 0] = False  # every row keeps a finite entry: an all -inf row has no distribution
        x = x.masked_fill(drop, float("-inf"))
    elif kind == "one_hot":
        x = torch.zeros(shape, dtype=torch.float64)
        hot = torch.randint(0, V, shape[:-1], generator=gen)
        x.scatter_(-1, hot.unsqueeze(-1), 40.0)  # p ~ 1 - (V-1) e^-40: near one-hot
    return x.to(dtype)


@st.composite
def batches(draw, layout=None, max_seqs=5, max_len=8, max_vocab=19, dtype=torch.float64, allow_empty=True):
    layout = layout or draw(st.sampled_from(["padded", "packed"]))
    if layout == "padded":
        S = draw(st.integers(1, max_seqs))
        T = draw(st.integers(1, max_len))
        lengths = [T] * S
    else:
        S = draw(st.integers(0 if allow_empty else 1, max_seqs))
        lengths = [draw(st.integers(0 if allow_empty else 1, max_len)) for _ in range(S)]
    V = draw(st.integers(1, max_vocab))
    kind = draw(st.sampled_from(LOGIT_KINDS))
    scale = draw(st.sampled_from(MISMATCH_SCALES))
    mask_p = draw(st.sampled_from([0.0, 0.5, 0.85, 1.0]))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))

    token_shape = (S, lengths[0] if S else 0) if layout == "padded" else (sum(lengths),)
    logits = make_logits(gen, token_shape + (V,), kind, dtype)
    labels = torch.randint(0, V, token_shape, generator=gen)
    if kind == "neg_inf":
        labels = torch.zeros(token_shape, dtype=torch.long)  # column 0 is finite in every row
    mask = torch.rand(token_shape, generator=gen) < mask_p
    labels = torch.where(mask | (torch.rand(token_shape, generator=gen) < 0.5), labels, torch.full_like(labels, -100))
    adv = torch.randn(token_shape, generator=gen, dtype=torch.float64)
    adv = torch.where(mask, adv, torch.full_like(adv, float("nan")))  # padding may hold anything
    old = -torch.rand(token_shape, generator=gen, dtype=torch.float64) * 4
    roll = old + torch.randn(token_shape, generator=gen, dtype=torch.float64) * scale
    ref = old + torch.randn(token_shape, generator=gen, dtype=torch.float64) * 0.2
    cu = None
    if layout == "packed":
        cu = torch.tensor([0] + list(torch.tensor(lengths, dtype=torch.long).cumsum(0).tolist()), dtype=torch.int32)
    to = lambda t: t.to(dtype if dtype != torch.bfloat16 and dtype != torch.float16 else torch.float32)  # noqa: E731
    return Batch(logits, labels, to(adv), mask, to(old), to(roll), to(ref), cu)


def _ratio_bound(draw):
    lo = draw(st.sampled_from([0.3, 0.5, 0.9, 0.999]))
    hi = draw(st.sampled_from([1.001, 1.1, 2.0, 5.0]))
    return (lo, hi) if draw(st.booleans()) else hi


@st.composite
def rollout_corrections(draw):
    if draw(st.integers(0, 5)) == 0:
        return None
    is_level = draw(st.sampled_from([None, "token", "sequence"]))
    threshold = draw(st.sampled_from([2.0, 1.2, 10.0, (0.5, 5.0), (0.8, 1.25)]))
    options = draw(st.lists(st.sampled_from(RS_OPTIONS), max_size=3, unique=True))
    rs = {}
    for option in options:
        rs[option] = _ratio_bound(draw) if option.endswith("k1") else draw(st.sampled_from([0.001, 0.05, 0.5, 4.0]))
    return RolloutCorrection(is_level=is_level, is_threshold=threshold, is_batch_normalize=draw(st.booleans()), rs=rs)


@st.composite
def configs(draw, mode: str, **fixed):
    """A PolicyLossConfig over the whole option product, consistent with the mode."""
    loss_type = draw(st.sampled_from(["ppo_clip", "reinforce"])) if mode == "bypass" else "ppo_clip"
    rc = draw(rollout_corrections()) if mode != "on-policy" else None
    kl = draw(st.sampled_from([None, "k1", "k2", "k3"]))
    kw = dict(
        loss_type=loss_type,
        clip_ratio_low=draw(st.sampled_from([0.2, 0.1])),
        clip_ratio_high=draw(st.sampled_from([0.2, 0.28])),
        clip_ratio_c=draw(st.sampled_from([3.0, None, 1.5])),
        loss_agg_mode=draw(st.sampled_from(
            ["token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"])),
        temperature=draw(st.sampled_from([1.0, 0.7])),
        entropy_coeff=draw(st.sampled_from([0.0, 0.01])),
        compute_entropy=draw(st.booleans()),
        kl_coef=0.0 if kl is None else 0.05,
        kl_type=kl or "k3",
        rollout_correction=rc,
    )
    if draw(st.integers(0, 7)) == 0:
        kw["global_num_tokens"] = 13.0
        kw["global_num_seqs"] = 3.0
    if draw(st.integers(0, 7)) == 0:
        kw["loss_scale_factor"] = 4.0
    kw.update(fixed)
    return PolicyLossConfig(**kw)


def assert_close(actual, expected, *, rtol, atol, name="value"):
    """allclose with NaN/inf agreement and a message naming the worst element."""
    if expected is None or actual is None:
        assert actual is None and expected is None, f"{name}: one of actual/expected is None"
        return
    a = actual.detach().to(torch.float64).cpu()
    # the oracle's value as the output dtype can hold it (beyond float32's range that is inf)
    e = expected.detach().to(actual.dtype).to(torch.float64).cpu()
    assert a.shape == e.shape, f"{name}: shape {tuple(a.shape)} != {tuple(e.shape)}"
    nan_a, nan_e = torch.isnan(a), torch.isnan(e)
    assert torch.equal(nan_a, nan_e), f"{name}: NaN pattern differs"
    inf_a, inf_e = torch.isinf(a), torch.isinf(e)
    assert torch.equal(inf_a & (a > 0), inf_e & (e > 0)) and torch.equal(inf_a & (a < 0), inf_e & (e < 0)), f"{name}: inf pattern differs"
    fin = ~(nan_e | inf_e)
    if fin.any():
        err = (a[fin] - e[fin]).abs()
        bound = atol + rtol * e[fin].abs()
        worst = int(torch.argmax(err - bound))
        assert bool((err <= bound).all()), (
            f"{name}: worst element actual={a[fin][worst].item()!r} expected={e[fin][worst].item()!r} "
            f"err={err[worst].item():.3e} > bound={bound[worst].item():.3e}"
        )
