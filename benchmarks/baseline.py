"""The optimal token baseline (docs/spec.md §10): rlkernels' segmented OTB against verl 0.9.1's function.

    python -m benchmarks.baseline                                   # CPU: the issue's two batches, both variants
    python -m benchmarks.baseline --device cuda --json out.json     # on a GPU (verl, where installed)
    python -m benchmarks.baseline --batch 64x128x4 --reps 3         # a custom B x T x group size

verl loops in Python over the prompt groups (with host syncs per group) and, in its multi-turn variant
(TIR-OTB), over the rows; rlkernels sorts the tokens by (group, position) and takes one segmented reduction, so
its cost does not depend on the number of groups. Per batch and variant the runs interleave (verl, rlkernels
eager, rlkernels compiled with torch.compile(dynamic=True), again ...) and the table reports medians and their
ratios from the same run; each row also checks that the three agree (max |diff| over the largest return).
verl's inputs are its own: float32 tensors and `index` as a numpy array of uid strings. Where verl is not
installed (a bare GPU image) the verl columns are empty and rlkernels is still timed, with a second batch of
the same shape in groups of one (B groups): the group count's cost, which should be none.
"""

import argparse
import json
import statistics
import time
from typing import Optional

import numpy as np
import torch

import rlkernels

BATCHES = ("1024x2048x8", "4096x512x4")  # B x T x responses per prompt (the issue's)
VARIANTS = {"otb": False, "tir": True}  # verl's compute_optimal_token_baseline_advantage / its multi-turn form


def otb_inputs(B: int, T: int, group_size: int, device: str, seed: int = 0, multi_turn: bool = False):
    """A rollout batch as verl's driver holds it: right-padded responses of random length, one reward at the last
    token, π_old log-probs and Σπ² of a peaked distribution, groups of `group_size` under shuffled uids; the
    multi-turn batch has holes in its masks (tool-output tokens)."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    mask = torch.arange(T)[None] < lengths[:, None]
    if multi_turn:
        mask &= torch.rand(B, T, generator=g) > 0.2
    rewards = torch.zeros(B, T)
    rewards[torch.arange(B), lengths - 1] = torch.randn(B, generator=g)
    p = torch.rand(B, T, generator=g) * 0.9 + 0.05
    old_logprobs = p.log()
    sum_pi_squared = p ** 2 + (1 - p) ** 2 * torch.rand(B, T, generator=g)  # >= p^2, <= 1
    uid = torch.randperm(B, generator=g) // group_size
    index = np.array([f"uid-{int(u)}" for u in uid], dtype=object)
    tensors = [t.to(device) for t in (rewards, mask.float(), old_logprobs, sum_pi_squared)]
    return tensors, index, uid.to(device)


def _verl_functions():
    try:
        from rlkernels.testing.peers import import_verl

        _, core_algos, _ = import_verl()
    except ImportError:
        return None
    return {"otb": core_algos.compute_optimal_token_baseline_advantage,
            "tir": core_algos.compute_multi_turn_optimal_token_baseline_advantage}


def _sync(device):
    if device == "cuda":
        torch.cuda.synchronize()


def _timed(fn, device):
    _sync(device)
    t = time.perf_counter()
    out = fn()
    _sync(device)
    return out, (time.perf_counter() - t) * 1e3


def measure(B: int, T: int, group_size: int, variant: str, device: str, reps: int,
            verl: Optional[dict]) -> dict:
    multi_turn = VARIANTS[variant]
    (rewards, mask, old, s2), index, uid = otb_inputs(B, T, group_size, device, multi_turn=multi_turn)

    def ours(fn):
        return lambda: fn(rewards, mask, uid, old, s2, multi_turn=multi_turn, validate=False).advantages

    compiled = torch.compile(rlkernels.optimal_token_baseline, dynamic=True)
    providers = {"rlkernels": ours(rlkernels.optimal_token_baseline), "rlkernels_compiled": ours(compiled)}
    if verl is not None:
        providers = {"verl": lambda: verl[variant](rewards, mask, index, old, s2)[0], **providers}
    outputs, first_ms = {}, {}
    for name, fn in providers.items():  # warm-up: the compile, the allocator
        outputs[name], first_ms[name] = _timed(fn, device)
    times = {name: [] for name in providers}
    for _ in range(reps):
        for name, fn in providers.items():
            times[name].append(_timed(fn, device)[1])
    ms = {name: statistics.median(t) for name, t in times.items()}
    want = outputs.get("verl", outputs["rlkernels"])
    scale = max(1.0, float(want.abs().max()))
    row = dict(variant=variant, device=device, B=B, T=T, group_size=group_size, groups=int(uid.unique().numel()),
               reps=reps, compile_s=round(first_ms["rlkernels_compiled"] / 1e3, 2),
               **{f"{name}_ms": round(v, 3) for name, v in ms.items()},
               max_rel_diff={name: float((out - want).abs().max()) / scale for name, out in outputs.items()})
    if verl is not None:
        row["rlkernels_vs_verl"] = round(ms["rlkernels"] / ms["verl"], 4)
        row["compiled_vs_verl"] = round(ms["rlkernels_compiled"] / ms["verl"], 4)
    return row


def _parse_batch(text: str):
    B, T, n = (int(x) for x in text.lower().split("x"))
    return B, T, n


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--batch", action="append", help=f"B x T x group size (default: {', '.join(BATCHES)})")
    ap.add_argument("--variant", action="append", choices=sorted(VARIANTS), help="default: both")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--json", help="also write the rows to this file")
    args = ap.parse_args(argv)
    verl = _verl_functions()
    rows = []
    for text in args.batch or BATCHES:
        B, T, n = _parse_batch(text)
        for variant in args.variant or sorted(VARIANTS):
            rows.append(measure(B, T, n, variant, args.device, args.reps, verl))
            if verl is None:  # the same shape in groups of one: what the group count costs
                rows.append(measure(B, T, 1, variant, args.device, args.reps, None))
    print(f"{'variant':7} {'device':6} {'B':>5} {'T':>5} {'groups':>6} {'verl ms':>9} {'rlk ms':>9} "
          f"{'compiled ms':>11} {'rlk/verl':>8} {'comp/verl':>9} {'max rel diff':>12}")
    for r in rows:
        verl_ms = f"{r['verl_ms']:9.1f}" if "verl_ms" in r else f"{'-':>9}"
        ratios = (f"{r['rlkernels_vs_verl']:8.3f} {r['compiled_vs_verl']:9.3f}" if "verl_ms" in r
                  else f"{'-':>8} {'-':>9}")
        print(f"{r['variant']:7} {r['device']:6} {r['B']:>5} {r['T']:>5} {r['groups']:>6} {verl_ms} "
              f"{r['rlkernels_ms']:9.1f} {r['rlkernels_compiled_ms']:11.1f} {ratios} "
              f"{max(r['max_rel_diff'].values()):12.1e}")
    if args.json:
        from .harness import environment

        with open(args.json, "w") as f:
            json.dump({"environment": environment(args.device), "rows": rows}, f, indent=1)
    return rows


if __name__ == "__main__":
    main()
