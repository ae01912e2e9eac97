"""SPEC §10, unfused and in float64 with Python loops: the optimal token baseline and the variance proxies.

Rows are lists of token indices (`sequences.sequence_indices`); a group's baseline is built position by
position over its member rows, exactly as the spec states it.
"""

from typing import Dict, List, Optional

import torch

from .sequences import sequence_indices


def _per_row(values: torch.Tensor, seqs: List[torch.Tensor]) -> List[torch.Tensor]:
    return [values[idx] for idx in seqs]


def optimal_token_baseline(token_rewards, response_mask, group_index, old_logprobs, sum_pi_squared, *,
                           is_weights=None, multi_turn=False, handle_zero_tail=True, eps=1e-8, cu_seqlens=None):
    """(advantages, returns), shaped like token_rewards, float64."""
    shape = tuple(token_rewards.shape)
    seqs, _ = sequence_indices(shape, cu_seqlens, token_rewards.device)
    flat = lambda t: None if t is None else t.reshape(-1).double()  # noqa: E731
    r, m, old, s2, isw = (flat(token_rewards), flat(response_mask), flat(old_logprobs), flat(sum_pi_squared),
                          flat(is_weights))
    groups = [int(g) for g in group_index.reshape(-1).tolist()]
    G = torch.zeros_like(r)
    W = torch.zeros_like(r)
    for idx in seqs:
        running_g, running_w = 0.0, 0.0
        for t in reversed(idx.tolist()):  # G_t: the masked reward-to-go
            running_g = running_g + float(r[t] * m[t])
            G[t] = running_g
        for t in idx.tolist():  # W_t: the masked cumulative sum of w
            w = 1 - 2 * torch.exp(old[t]) + s2[t]
            if isw is not None:
                w = w * isw[t] ** 2
            running_w = running_w + float(w * m[t])
            W[t] = running_w
    # each row's tokens at the positions OTB aligns: every column, or (multi-turn) the masked tokens in order
    aligned = [[t for t in idx.tolist() if (m[t] > 0 or not multi_turn)] for idx in seqs]
    lengths = [int(m[idx].sum()) for idx in seqs]
    members: Dict[int, List[int]] = {}
    for i, g in enumerate(groups):
        if lengths[i] > 0 or not multi_turn:
            members.setdefault(g, []).append(i)
    B = torch.zeros_like(r)
    for rows in members.values():
        if len(rows) == 1:
            continue  # a group of one: B = 0
        width = max(len(aligned[i]) for i in rows)
        for k in range(width):
            num = sum(float(G[aligned[i][k]] * W[aligned[i][k]] * m[aligned[i][k]]) for i in rows
                      if k < len(aligned[i]))
            den = sum(float(W[aligned[i][k]] * m[aligned[i][k]]) for i in rows if k < len(aligned[i])) + eps
            for i in rows:
                if k < len(aligned[i]):
                    B[aligned[i][k]] = num / den
        if handle_zero_tail:
            ordered = sorted(lengths[i] for i in rows)
            longest = [i for i in rows if lengths[i] == ordered[-1]]
            if len(longest) == 1 and ordered[-1] > ordered[-2]:
                for k, t in enumerate(aligned[longest[0]]):
                    if k >= ordered[-2]:
                        B[t] = 0.0
    A = (G - B) * m
    return A.reshape(shape), G.reshape(shape)


def variance_proxy_metrics(advantages, response_mask, old_logprobs, sum_pi_squared, *, is_weights=None,
                           grad_norm: Optional[float] = None, cu_seqlens=None) -> Dict[str, torch.Tensor]:
    shape = tuple(advantages.shape)
    seqs, _ = sequence_indices(shape, cu_seqlens, advantages.device)
    a, m = advantages.reshape(-1).double(), response_mask.reshape(-1).double()
    w = 1 - 2 * torch.exp(old_logprobs.reshape(-1).double()) + sum_pi_squared.reshape(-1).double()
    isw = None if is_weights is None else is_weights.reshape(-1).double()
    if isw is not None:
        w = w * isw ** 2
    a_rows, w_rows, p2_rows = [], [], []
    for idx in seqs:
        n = float(m[idx].sum())
        a_i = float((a[idx] * m[idx]).sum()) / (n + 1e-8)
        w_i = float((w[idx] * m[idx]).sum())
        if isw is None:
            p2_rows.append(a_i ** 2 * max(w_i, 0.0))
        else:
            rho_i = float((isw[idx] * m[idx]).sum()) / (n + 1e-8)
            w_unscaled = max(float((w[idx] / torch.clamp(isw[idx] ** 2, min=1e-10) * m[idx]).sum()), 0.0)
            p2_rows.append(rho_i ** 2 * a_i ** 2 * w_unscaled)
        a_rows.append(a_i)
        w_rows.append(w_i)
    R = len(seqs)
    mean = lambda xs: sum(xs) / len(xs) if xs else 0.0  # noqa: E731
    p2 = mean(p2_rows)
    p1 = 0.0 if grad_norm is None else grad_norm ** 2
    p3 = max(0.0, (p2 - p1) / (R - 1)) if (grad_norm is not None and R > 1) else 0.0
    values = {"proxy1_signal_strength": p1, "proxy2_total_power": p2, "proxy3_pure_noise": p3,
              "expected_a_squared": mean([x * x for x in a_rows]), "expected_w": mean(w_rows)}
    return {f"variance_proxy/{k}": torch.tensor(v, dtype=torch.float64) for k, v in values.items()}
