"""The same public calls on two revisions of the package, in alternating fresh processes: did a change slow
anything down?

    python -m benchmarks.revisions --base e455f9d            # this checkout against a commit
    python -m benchmarks.revisions --base HEAD~3 --rounds 9 --N 4096 --V 32768

The base revision is checked out into a temporary git worktree; each round runs one fresh interpreter per
revision (in alternating order, so drift lands on both), each timing every case after a warm-up; the medians
over rounds and the ratio (this checkout / base) are printed. Only the public API is called, so any two
revisions that share it compare. Cases, fp32 on the CPU, decoupled PPO with seq-MIS (the README's headline):
`logprobs` (no-grad token_logprobs), `ppo` (decoupled_ppo_loss forward + backward), `linear` (the fused-linear
loss forward + backward, H = 512, half the rows in the loss), `linear_two_pass` (the same on every row of the mask,
the two-pass form), `policy` (policy_loss on given log-probs: the per-call Python and the stage alone).
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# runs inside each fresh interpreter: prints {case: seconds} (median of `reps` after one warm-up)
WORKER = r"""
import json, sys, time, torch
import rlkernels
from rlkernels import PolicyLossConfig, RolloutCorrection
N, V, H, reps = (int(a) for a in sys.argv[1:5])
torch.manual_seed(0)
S = 16
cu = torch.arange(S + 1) * (N // S)
logits = torch.randn(N, V) * 2
labels = torch.randint(0, V, (N,))
adv = torch.randn(N)
mask = torch.rand(N) < 0.9
old = -torch.rand(N)
roll = old + 0.05 * torch.randn(N)
hidden = torch.randn(N, H) / H ** 0.5
weight = torch.randn(V, H)
half = mask & (torch.arange(N) % 2 == 0)
config = PolicyLossConfig(rollout_correction=RolloutCorrection.seq_mis())

def logprobs():
    with torch.no_grad():
        rlkernels.token_logprobs(logits, labels)

def ppo():
    x = logits.requires_grad_(True)
    x.grad = None
    rlkernels.decoupled_ppo_loss(x, labels, adv, mask, old_logprobs=old, rollout_logprobs=roll, cu_seqlens=cu,
                                 config=config).loss.backward()

def linear():
    h = hidden.requires_grad_(True)
    h.grad = None
    rlkernels.linear_decoupled_ppo_loss(h, weight, labels, adv, half, old_logprobs=old, rollout_logprobs=roll,
                                        cu_seqlens=cu, config=config).loss.backward()

def linear_two_pass():
    h = hidden.requires_grad_(True)
    h.grad = None
    rlkernels.linear_decoupled_ppo_loss(h, weight, labels, adv, mask, old_logprobs=old, rollout_logprobs=roll,
                                        cu_seqlens=cu, config=config, linear_one_pass=False).loss.backward()

def policy():
    lp = (old + 0.01).requires_grad_(True)
    rlkernels.policy_loss(lp, adv, mask, old_logprobs=old, rollout_logprobs=roll, cu_seqlens=cu,
                          config=config).loss.backward()

out = {}
for name, fn in (("logprobs", logprobs), ("ppo", ppo), ("linear", linear), ("linear_two_pass", linear_two_pass),
                 ("policy", policy)):
    fn()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    times.sort()
    out[name] = times[len(times) // 2]
print(json.dumps(out))
"""


def _worktree(rev: str) -> Path:
    path = Path(tempfile.mkdtemp(prefix="rlkernels-base-"))
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", "-q", str(path), rev], check=True)
    return path


def _run(tree: Path, args) -> dict:
    # the tree's package first on the path (an editable install of this checkout stays below it); the CPU kernels
    # build once per source into the shared cache, so a revision with other kernels builds its own once
    env = dict(os.environ, PYTHONPATH=str(tree))
    run = subprocess.run([sys.executable, "-c", WORKER, str(args.N), str(args.V), str(args.H), str(args.reps)],
                         capture_output=True, text=True, env=env, cwd=tree, timeout=1800)
    if run.returncode != 0:
        raise RuntimeError(f"{tree}: {run.stderr[-2000:]}")
    return json.loads(run.stdout.strip().splitlines()[-1])


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base", required=True, help="the revision to compare this checkout with")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--N", type=int, default=4096)
    p.add_argument("--V", type=int, default=32768)
    p.add_argument("--H", type=int, default=512)
    p.add_argument("--json", help="write the rounds and medians here")
    args = p.parse_args(argv)
    base = _worktree(args.base)
    trees = {"base": base, "head": ROOT}
    rounds = {"base": [], "head": []}
    try:
        for r in range(args.rounds):
            for name in (("base", "head") if r % 2 == 0 else ("head", "base")):
                rounds[name].append(_run(trees[name], args))
                print(f"round {r + 1}/{args.rounds} {name}: " +
                      ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in rounds[name][-1].items()), flush=True)
    finally:
        subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(base)], check=False)
    cases = list(rounds["head"][0])
    medians = {name: {c: statistics.median(x[c] for x in rounds[name]) for c in cases} for name in rounds}
    print(f"\nN = {args.N}, V = {args.V}, H = {args.H}; medians over {args.rounds} rounds of fresh processes")
    print(f"{'case':16s} {'base ' + args.base:>22s} {'this checkout':>15s} {'ratio':>7s}")
    for c in cases:
        b, h = medians["base"][c], medians["head"][c]
        print(f"{c:16s} {b * 1e3:19.1f} ms {h * 1e3:12.1f} ms {h / b:6.2f}x")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "rounds": rounds, "medians": medians}, indent=1))


if __name__ == "__main__":
    main()
