"""Benchmark problems: deterministic inputs for one (N, V, dtype, layout) and the loss cases.

Inputs are built so that every branch does real work: the proximal policy differs from the current
one by a few percent (some tokens clip), the behaviour policy differs from the proximal one by a
little on most sequences and by a lot on about a quarter of them (which the rejection options drop).
"""

from dataclasses import dataclass
from typing import Optional

import torch

from rlkernels import PolicyLossConfig, RolloutCorrection

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True)
class Case:
    """A loss configuration every provider is asked to compute (and may decline)."""

    name: str
    rollout_correction: RolloutCorrection
    clip_ratio_c: Optional[float]
    layout: str  # "mixed": packed sequences of mixed lengths; "uniform": equal lengths (what Liger takes)

    def config(self, backend: str = "auto") -> PolicyLossConfig:
        return PolicyLossConfig(
            rollout_correction=self.rollout_correction, clip_ratio_c=self.clip_ratio_c, backend=backend,
            loss_agg_mode="token-mean",
        )


CASES = {
    # sequence-level IS (TIS at 2.0) + sequence-product rejection (0.5, 2.0), dual clip: the main case
    "seq_mis": Case("seq_mis", RolloutCorrection.seq_mis(), 3.0, "mixed"),
    # geometric-mean rejection + token TIS
    "geo_rs_token_tis": Case("geo_rs_token_tis", RolloutCorrection.geo_rs_token_tis(), 3.0, "mixed"),
    # what Liger's GRPO loss supports: token TIS weights, no dual clip, equal-length sequences
    "token_tis": Case("token_tis", RolloutCorrection.token_tis(), None, "uniform"),
}

UNIFORM_SEQ_LEN = 256


def seq_lengths(N: int, layout: str, gen: torch.Generator) -> list:
    if layout == "uniform":
        T = min(N, UNIFORM_SEQ_LEN)
        if N % T:
            raise ValueError(f"uniform layout needs N divisible by {T}, got N={N}")
        return [T] * (N // T)
    lengths, total = [], 0
    lo, hi = max(1, min(32, N // 8)), max(2, min(2048, N // 2))
    while total < N:
        n = int(torch.randint(lo, hi + 1, (1,), generator=gen))
        n = min(n, N - total)
        lengths.append(n)
        total += n
    return lengths


@torch.no_grad()
def _chunked_logprobs(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Exact log-probs with small temporaries, so that input set-up never raises the memory peak much."""
    N, V = logits.shape
    rows = max(1, (1 << 20) // V)
    out = torch.empty(N, dtype=torch.float32, device=logits.device)
    for s in range(0, N, rows):
        x = logits[s : s + rows].float()
        out[s : s + rows] = x.gather(1, labels[s : s + rows, None]).squeeze(1) - torch.logsumexp(x, 1)
    return out


def make_inputs(N: int, V: int, dtype: str, layout: str, device: str = "cpu", seed: int = 0) -> dict:
    """Per-token tensors of one packed micro-batch of N tokens, plus the [N, V] logits (requires_grad)."""
    gen = torch.Generator().manual_seed(seed)
    lengths = seq_lengths(N, layout, gen)
    S = len(lengths)
    cu = torch.zeros(S + 1, dtype=torch.int32)
    cu[1:] = torch.tensor(lengths).cumsum(0)
    seq_id = torch.repeat_interleave(torch.arange(S), torch.tensor(lengths))

    logits = torch.empty(N, V, dtype=DTYPES[dtype], device=device)
    rows = max(1, (1 << 22) // V)
    dev_gen = torch.Generator(device=device).manual_seed(seed)
    for s in range(0, N, rows):  # chunked, to keep set-up temporaries small
        e = min(N, s + rows)
        logits[s:e] = (2.0 * torch.randn(e - s, V, generator=dev_gen, device=device)).to(logits.dtype)
    labels = torch.randint(0, V, (N,), generator=gen).to(device)
    current = _chunked_logprobs(logits, labels).cpu()
    old = current + 0.1 * torch.randn(N, generator=gen)
    drift = torch.where(torch.rand(S, generator=gen) < 0.25, 0.01, 0.0) * torch.sign(torch.randn(S, generator=gen))
    rollout = old + 0.002 * torch.randn(N, generator=gen) + drift[seq_id]
    seq_advantages = torch.randn(S, generator=gen)  # one advantage per response, as in GRPO
    advantages = seq_advantages[seq_id]
    response_mask = torch.rand(N, generator=gen) > 0.05
    out = {
        "logits": logits.requires_grad_(True),
        "labels": labels,
        "advantages": advantages.to(device),
        "response_mask": response_mask.to(device),
        "old_logprobs": old.to(device),
        "rollout_logprobs": rollout.to(device),
        "cu_seqlens": cu.to(device),
        "seq_lengths": lengths,
        "seq_advantages": seq_advantages.to(device),
    }
    return out


def input_bytes(inputs: dict) -> int:
    return sum(t.numel() * t.element_size() for t in inputs.values() if isinstance(t, torch.Tensor))
