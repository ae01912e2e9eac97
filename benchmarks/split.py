"""Collectives and bytes per call of a split batch (`tp_group`, `dp_group`, `cp_group`), measured.

Spawns gloo groups on the CPU (2 ranks per group kind; a 2 x 2 grid for the combinations), runs
`decoupled_ppo_loss` forward and backward on a packed batch, and prints, per group kind, the
all_gather / all_reduce calls and the bytes each rank sent -- counted by wrapping torch.distributed,
as tests/stage/test_batch_split.py does (it asserts the call counts; this prints the sizes). The counts do
not depend on the hardware; run it anywhere:

    python -m benchmarks.split [--tokens 4096] [--seqs 16] [--json benchmarks/results/cpu-split.json]

docs/distributed.md quotes the bytes of benchmarks/results/cpu-split.json.
"""

import argparse
import json
import random

import torch
from torch.distributed.device_mesh import init_device_mesh

from rlkernels.testing.spawn import Collectives, spawn

CONFIGS = {
    "plain (token-mean, no correction)": dict(),
    "seq_mis + entropy + KL (seq-mean-token-mean)": dict(
        preset="seq_mis", entropy_coeff=0.01, kl_coef=0.05, loss_agg_mode="seq-mean-token-mean"),
    "everything (token TIS normalised, 3 rejection options, norm)": dict(
        preset="full", entropy_coeff=0.01, kl_coef=0.05, loss_agg_mode="seq-mean-token-sum-norm"),
}


def _config(options):
    from rlkernels import PolicyLossConfig, RolloutCorrection

    options = dict(options)
    preset = options.pop("preset", None)
    rc = None
    if preset == "seq_mis":
        rc = RolloutCorrection.seq_mis()
    elif preset == "full":
        rc = RolloutCorrection(is_level="token", is_threshold=2.0, is_batch_normalize=True,
                               rs={"token_k2": 0.5, "seq_max_k3": 4.0, "seq_mean_k1": (0.5, 2.0)})
    return PolicyLossConfig(rollout_correction=rc, backend="torch", **options)


def _measure(rank, world, kinds, tokens, seqs, results):
    import rlkernels

    mesh = init_device_mesh("cpu", (2,) * len(kinds), mesh_dim_names=tuple(kinds))
    groups = {kind: mesh.get_group(kind) for kind in kinds}
    coords = {kind: mesh.get_local_rank(kind) for kind in kinds}
    rng = random.Random(0)
    lengths = [max(1, int(tokens / seqs * rng.uniform(0.5, 1.5))) for _ in range(seqs)]
    N, V = sum(lengths), 64
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist())
    g = torch.Generator().manual_seed(1)
    logits, labels = torch.randn(N, V, generator=g), torch.randint(V, (N,), generator=g)
    adv, old = torch.randn(N, generator=g), -torch.rand(N, generator=g)
    roll, ref = old + 0.1 * torch.randn(N, generator=g), old + 0.1 * torch.randn(N, generator=g)
    rows = torch.arange(N)
    if "cp" in groups:
        half = N // 2
        rows = rows[:half] if coords["cp"] == 0 else rows[half:]
    vocab = slice(0, V)
    if "tp" in groups:
        vocab = slice(0, V // 2) if coords["tp"] == 0 else slice(V // 2, V)
    kw = dict(tp_group=groups.get("tp"), dp_group=groups.get("dp"), cp_group=groups.get("cp"))
    counter = Collectives("all_gather", "all_reduce", labels={grp: k for k, grp in groups.items()})
    for name, options in CONFIGS.items():
        x = logits[rows][:, vocab].clone().requires_grad_(True)
        args = (x, labels[rows], adv[rows], torch.ones(len(rows), dtype=torch.bool))
        extra = dict(old_logprobs=old[rows], rollout_logprobs=roll[rows], ref_logprobs=ref[rows], cu_seqlens=cu,
                     config=_config(options), **kw)
        rlkernels.decoupled_ppo_loss(*args, **extra)  # warm-up (tp_group learns the shard offsets once)
        counter.reset()
        out = rlkernels.decoupled_ppo_loss(*args, **extra)
        forward = dict(counter.calls), dict(counter.sent)
        out.loss.backward()
        backward = ({k: v - forward[0].get(k, 0) for k, v in counter.calls.items()},
                    {k: v - forward[1].get(k, 0) for k, v in counter.sent.items()})
        if rank == 0:
            results.put((name, "x".join(kinds), len(rows), forward, backward, len(out.metrics)))
    counter.restore()


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--seqs", type=int, default=16)
    parser.add_argument("--json", default=None, help="also write the rows here")
    args = parser.parse_args()
    import torch.multiprocessing as mp

    print(f"packed batch: ~{args.tokens} tokens in {args.seqs} sequences per data-parallel rank, V = 64")
    print(f"{'groups':8} {'config':62} {'rank tokens':>11}  forward calls (bytes sent)  | backward")
    rows = []
    for kinds in (["tp"], ["dp"], ["cp"], ["dp", "tp"], ["cp", "tp"], ["dp", "cp"]):
        results = mp.get_context("spawn").SimpleQueue()
        spawn(2 ** len(kinds), _measure, kinds, args.tokens, args.seqs, results)
        while not results.empty():
            name, label, n, (calls, sent), (b_calls, b_sent) = results.get()[:5]
            fmt = lambda c, s: ", ".join(f"{g}:{op}x{c[(op, g)]} ({s[(op, g)]} B)"  # noqa: E731
                                         for (op, g) in sorted(c) if c[(op, g)]) or "none"
            print(f"{label:8} {name:62} {n:>11}  {fmt(calls, sent)}  | {fmt(b_calls, b_sent)}")
            counts = lambda c, s: [dict(group=g, op=op, calls=c[(op, g)], bytes=s[(op, g)])  # noqa: E731
                                   for (op, g) in sorted(c) if c[(op, g)]]
            rows.append(dict(groups=label, config=name, rank_tokens=n, forward=counts(calls, sent),
                             backward=counts(b_calls, b_sent)))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(tokens=args.tokens, seqs=args.seqs, rows=rows), f, indent=1)
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
