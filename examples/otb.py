"""The optimal token baseline (docs/spec.md §10) in a hand-written RL step, on a toy batch, on a CPU.

Three prompts, four responses each, a tiny policy (embedding -> linear head over a 64-token vocabulary) and a
reward at the last token of each response. One vocabulary pass gives the log-probs *and* Σπ²
(`token_logprobs(..., compute_sum_pi_squared=True)`); the baseline is then a few segmented tensor ops, with
no loop over groups and no host synchronisation; the advantages feed `policy_loss`.

Two ways to get π_old's Σπ²:
  * a no-grad π_old forward before the update (verl's `compute_log_prob`): exact;
  * verl's bypass mode has no π_old forward, so Σπ² comes from the update's own forward (its log-probs
    detached): exact for the first mini-batch of the first epoch, where the policy still is π_old, and an
    approximation, as good as the trust region keeps the policy, for the later ones.

    python examples/otb.py
"""

import torch

import rlkernels

VOCAB, HIDDEN, GROUPS, PER_GROUP, T = 64, 16, 3, 4, 10


def toy_batch(seed: int = 0):
    """Tokens, labels, response mask (right-padded, lengths 2..T), group ids in shuffled order, last-token rewards."""
    g = torch.Generator().manual_seed(seed)
    B = GROUPS * PER_GROUP
    group = torch.arange(GROUPS).repeat_interleave(PER_GROUP)[torch.randperm(B, generator=g)] * 7 + 3  # any ids
    lengths = torch.randint(2, T + 1, (B,), generator=g)
    mask = torch.arange(T)[None] < lengths[:, None]
    tokens = torch.randint(0, VOCAB, (B, T + 1), generator=g)
    rewards = torch.zeros(B, T)
    rewards[torch.arange(B), lengths - 1] = (torch.rand(B, generator=g) < 0.5).float()  # right or wrong
    return tokens[:, :-1], tokens[:, 1:], mask, group, rewards


def policy():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Embedding(VOCAB, HIDDEN), torch.nn.Tanh(), torch.nn.Linear(HIDDEN, VOCAB))


def main():
    model = policy()
    inputs, labels, mask, group, rewards = toy_batch()

    # π_old's forward (no grad): log-probs and Σπ² from one pass over the vocabulary
    with torch.no_grad():
        old = rlkernels.token_logprobs(model(inputs), labels, compute_sum_pi_squared=True)
    otb = rlkernels.optimal_token_baseline(rewards, mask, group, old.logprobs, old.sum_pi_squared)
    proxies = rlkernels.variance_proxy_metrics(otb.advantages, mask, old.logprobs, old.sum_pi_squared)

    # the update: the current policy's pass, then the loss on the OTB advantages
    now = rlkernels.token_logprobs(model(inputs), labels, compute_sum_pi_squared=True)
    out = rlkernels.policy_loss(now.logprobs, otb.advantages, mask, old_logprobs=old.logprobs)
    out.loss.backward()

    # bypass mode: Σπ² from the update's own pass (exact here: the policy has not stepped yet)
    bypass = rlkernels.optimal_token_baseline(rewards, mask, group, now.logprobs.detach(), now.sum_pi_squared)

    for i in range(4):
        first = " ".join(f"{a:+.3f}" for a in otb.advantages[i, :4].tolist())
        print(f"response {i} (group {int(group[i])}, {int(mask[i].sum())} tokens, reward {int(rewards[i].sum())}): "
              f"OTB advantages {first} ...")
    print({k.split("/")[1]: round(float(v), 4) for k, v in proxies.items()})
    print(f"loss {float(out.loss.detach()):.4f}; bypass-mode advantages equal the pi_old pass's:",
          bool(torch.equal(bypass.advantages, otb.advantages)))
    return dict(otb=otb, bypass=bypass, proxies=proxies, loss=out.loss, batch=(mask, group, rewards),
                old=old, grad=model[2].weight.grad)


if __name__ == "__main__":
    main()
