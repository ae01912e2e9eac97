"""The per-sequence stage (IS weights, rejection, loss, metrics on [N] tensors): eager vs compiled.

    python -m benchmarks.stage --device cpu                # kernel count + CPU time, eager vs compiled
    python -m benchmarks.stage --device cuda --tokens 8192

The stage is ~100 small torch ops. On CUDA each is a kernel launch, so rlkernels compiles it with
torch.compile(dynamic=True) (`compile_stage=None` does so on CUDA). This measures what that buys:
the number of kernels Inductor generates for the stage (torch._inductor.metrics, on any device) and
the stage's time eager vs compiled, runs interleaved (eager, compiled, eager, ...) and reported as
medians with their ratio. Hyperparameters change on every timed call, as a schedule would, and the
script checks that they cause no recompilation and that both versions agree.

    python -m benchmarks.stage --device cuda --split       # + the cost of a data-parallel split

`--split` also times the stage with `dp_group` set to a one-rank group (gloo on the CPU, NCCL on
CUDA) against no group, eager and compiled, interleaved: what the split's packing, merging, two
all_gathers and graph breaks cost by themselves, before any network time.

    python -m benchmarks.stage --device cuda --fused       # + the fused stage (two Triton launches)
    python -m benchmarks.stage --device cuda --fused-only  # the fused stage's rows alone

`--fused` times the loss alone (metrics="loss_only") of the cases the fused stage covers (stage/fused.py): the
torch stage eager, compiled, and eager replayed from a CUDA graph, against the two kernels, interleaved, with the
loss of each checked against the eager one. On the CPU it needs TRITON_INTERPRET=1 (a correctness run, not a time).
"""

import argparse
import json
import statistics
import time

import torch
import torch._dynamo
import torch._inductor.metrics as inductor_metrics

from rlkernels import PolicyLossConfig, RolloutCorrection
from rlkernels import stage as rk_stage
from rlkernels.stage.segments import Segments
from rlkernels.testing.stage import run_stage

from .harness import cuda_graph

CASES = {
    "seq_mis+kl+entropy": lambda: PolicyLossConfig(
        rollout_correction=RolloutCorrection.seq_mis(), kl_coef=0.05, entropy_coeff=0.01,
        loss_agg_mode="seq-mean-token-mean", validate=False),
    "geo_rs_token_tis": lambda: PolicyLossConfig(
        rollout_correction=RolloutCorrection.geo_rs_token_tis(bounds=(0.9, 1.1)), validate=False),
    # verl's GSPO (the token form) with seq-MIS, and TRL's entropy aggregation: the fused stage's sequence ratios
    "gspo_seq_mis": lambda: PolicyLossConfig(
        loss_type="gspo", rollout_correction=RolloutCorrection.seq_mis(), entropy_coeff=0.01,
        entropy_agg_mode="token-mean", loss_agg_mode="seq-mean-token-mean", validate=False),
    # the loss family's sync-free options at once: TRL's sequence-level ratio and bias-corrected k3,
    # DeepSeek-V3.2's off-policy mask, M2PO's batch sort, TRL's sequence means, token IS with a lower bound
    "family": lambda: PolicyLossConfig(
        ratio_level="sequence", log_ratio_clamp=None, kl_coef=0.04, kl_type="k3_unclamped", kl_bias_correction=True,
        off_policy_mask_threshold=0.3, m2po_threshold=0.04, seq_mean_over="all", entropy_coeff=0.01,
        entropy_agg_mode="token-mean", loss_agg_mode="seq-mean-token-mean",
        rollout_correction=RolloutCorrection(is_level="token", is_threshold=(0.5, 3.0), is_mode="truncate"),
        validate=False),
    # the 2026 trust regions on the sampler: IPO with its KL on the kept tokens, VACO's sequence mask, the
    # Kimi-K2.5 term, a geometric rejection (IS weights are refused with these losses)
    "rollout_trust_regions": lambda: PolicyLossConfig(
        loss_type="ipo", ipo_kl_tau=1e-3, vaco_threshold=0.05, log_ratio_sq_coef=1e-3,
        rollout_correction=RolloutCorrection(rs={"seq_mean_k1": (0.9, 1.1)}), validate=False),
}


def stage_inputs(num_tokens: int, num_seqs: int, device: str, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    cuts = torch.sort(torch.randperm(num_tokens - 1, generator=g)[: num_seqs - 1] + 1).values
    cu = torch.cat([torch.tensor([0]), cuts, torch.tensor([num_tokens])]).to(device)
    lp = (-torch.rand(num_tokens, generator=g) * 3).to(device)
    old = lp + 0.05 * torch.randn(num_tokens, generator=g).to(device)
    rollout = old + 0.02 * torch.randn(num_tokens, generator=g).to(device)
    ent = torch.rand(num_tokens, generator=g).to(device)
    adv = torch.randn(num_tokens, generator=g).to(device)
    mask = (torch.rand(num_tokens, generator=g) > 0.05).to(device)
    seg = Segments.packed(cu, num_tokens, torch.device(device))
    return lp, ent, adv, mask, old, rollout, old - 0.01, seg


def _sync(device):
    if device == "cuda":
        torch.cuda.synchronize()


def measure(case: str, num_tokens: int, num_seqs: int, device: str, reps: int) -> dict:
    base = CASES[case]().with_overrides(global_num_tokens=float(num_tokens))  # the static set being timed
    inputs = stage_inputs(num_tokens, num_seqs, device)
    torch._dynamo.reset()
    inductor_metrics.reset()
    compiled = torch.compile(rk_stage.run, dynamic=True)
    t0 = time.perf_counter()
    run_stage(*inputs, base, fn=compiled)
    _sync(device)
    compile_s = time.perf_counter() - t0
    kernels = inductor_metrics.generated_kernel_count
    eager_s, compiled_s = [], []
    max_rel = 0.0
    with torch._dynamo.config.patch(error_on_recompile=True):  # a new hyperparameter must not recompile
        for i in range(reps):
            config = base.with_overrides(clip_ratio_high=0.2 + 0.01 * (i % 7), global_num_tokens=float(num_tokens + i))
            for fn, times in ((rk_stage.run, eager_s), (compiled, compiled_s)):
                _sync(device)
                t = time.perf_counter()
                out = run_stage(*inputs, config, fn=fn)
                _sync(device)
                times.append(time.perf_counter() - t)
                if fn is rk_stage.run:
                    want = out.loss
                else:
                    max_rel = max(max_rel, float((out.loss - want).abs() / want.abs().clamp_min(1e-30)))
    eager_ms, compiled_ms = statistics.median(eager_s) * 1e3, statistics.median(compiled_s) * 1e3
    return dict(case=case, device=device, tokens=num_tokens, seqs=num_seqs, inductor_kernels=kernels,
                first_call_s=round(compile_s, 2), eager_ms=round(eager_ms, 3), compiled_ms=round(compiled_ms, 3),
                compiled_vs_eager=round(compiled_ms / eager_ms, 3), loss_max_rel_diff=max_rel)


def measure_split(case: str, num_tokens: int, num_seqs: int, device: str, reps: int) -> dict:
    import os
    import tempfile

    import torch.distributed as dist

    from rlkernels.stage.split import LOCAL, BatchSplit

    if not dist.is_initialized():
        init = os.path.join(tempfile.mkdtemp(), "rendezvous")
        dist.init_process_group("nccl" if device == "cuda" else "gloo", init_method=f"file://{init}", rank=0,
                                world_size=1)
    split = BatchSplit(dp_group=dist.group.WORLD)
    config = CASES[case]()
    inputs = stage_inputs(num_tokens, num_seqs, device)
    runs = {}
    for compiled in (False, True):
        stage = rk_stage.select(inputs[0], compiled)
        for name, s in (("local", LOCAL), ("split", split)):
            run_stage(*inputs, config, s, fn=stage)  # compile / warm up
            runs[(compiled, name)] = (stage, s, [])
    for _ in range(reps):
        for stage, s, times in runs.values():
            _sync(device)
            t = time.perf_counter()
            run_stage(*inputs, config, s, fn=stage)
            _sync(device)
            times.append(time.perf_counter() - t)
    ms = {key: statistics.median(times) * 1e3 for key, (_, _, times) in runs.items()}
    return dict(case=case, device=device, tokens=num_tokens, seqs=num_seqs,
                eager_local_ms=round(ms[(False, "local")], 3), eager_split_ms=round(ms[(False, "split")], 3),
                compiled_local_ms=round(ms[(True, "local")], 3), compiled_split_ms=round(ms[(True, "split")], 3),
                eager_split_vs_local=round(ms[(False, "split")] / ms[(False, "local")], 3),
                compiled_split_vs_local=round(ms[(True, "split")] / ms[(True, "local")], 3))


def measure_fused(case: str, num_tokens: int, num_seqs: int, device: str, reps: int, compiled: bool = True) -> dict:
    """The loss alone: the torch stage eager, compiled (unless `compiled` is False: its first call compiles for
    tens of seconds on a GPU machine) and graph-replayed (CUDA) against the fused kernels."""
    from rlkernels.outputs import TokenStats
    from rlkernels.stage import fused
    from rlkernels.testing.stage import stage_batch

    lp, ent, adv, mask, old, rollout, ref, seg = stage_inputs(num_tokens, num_seqs, device)
    config = CASES[case]().with_overrides(metrics="loss_only")
    batch, stats = stage_batch(mask, seg, adv, old, rollout, ref), TokenStats(lp, ent, None)
    reason = fused.blocker(batch, config, lp.dtype)
    if reason is not None:
        return dict(case=case, device=device, fused=f"not covered: {reason}")
    variants = {"eager": lambda: rk_stage.run(stats, batch, config, metrics=False),
                "fused": lambda: fused.run(stats, batch, config)}
    if compiled:
        variants["compiled"] = lambda: rk_stage.select(lp, True)(stats, batch, config, metrics=False)
    losses = {name: fn().loss for name, fn in variants.items()}  # first contact (compiles) outside the times
    if device == "cuda":
        variants["graphed"] = cuda_graph(variants["eager"])[0].replay
    times = {name: [] for name in variants}
    for _ in range(reps):
        for name, fn in variants.items():
            _sync(device)
            t = time.perf_counter()
            fn()
            _sync(device)
            times[name].append(time.perf_counter() - t)
    ms = {name: statistics.median(t) * 1e3 for name, t in times.items()}
    want = losses["eager"]
    return dict(case=case, device=device, tokens=num_tokens, seqs=num_seqs,
                **{f"{name}_ms": round(t, 4) for name, t in ms.items()},
                fused_vs_eager=round(ms["fused"] / ms["eager"], 3),
                **({"fused_vs_compiled": round(ms["fused"] / ms["compiled"], 3)} if compiled else {}),
                **({"fused_vs_graphed": round(ms["fused"] / ms["graphed"], 3)} if "graphed" in ms else {}),
                loss_max_rel_diff={name: float((loss - want).abs() / want.abs().clamp_min(1e-30))
                                   for name, loss in losses.items()})


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--seqs", type=int, default=64)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--case", action="append", choices=sorted(CASES), help="default: every case")
    ap.add_argument("--json", help="also write the rows to this file")
    ap.add_argument("--split", action="store_true", help="also time a one-rank dp_group against no group")
    ap.add_argument("--fused", action="store_true", help="also time the loss alone against the fused stage")
    ap.add_argument("--fused-only", action="store_true", help="only --fused's rows")
    ap.add_argument("--no-compiled", action="store_true", help="--fused's rows without the compiled stage")
    args = ap.parse_args(argv)
    args.fused = args.fused or args.fused_only
    rows = [] if args.fused_only else [measure(c, args.tokens, args.seqs, args.device, args.reps)
                                       for c in (args.case or sorted(CASES))]
    if rows:
        print(f"{'case':22} {'device':6} {'N':>6} {'S':>4} {'kernels':>7} {'first call s':>12} "
              f"{'eager ms':>9} {'compiled ms':>11} {'compiled/eager':>14}")
    for r in rows:
        print(f"{r['case']:22} {r['device']:6} {r['tokens']:>6} {r['seqs']:>4} {r['inductor_kernels']:>7} "
              f"{r['first_call_s']:>12} {r['eager_ms']:>9.3f} {r['compiled_ms']:>11.3f} "
              f"{r['compiled_vs_eager']:>14.3f}")
    if args.split:
        split_rows = [measure_split(c, args.tokens, args.seqs, args.device, args.reps)
                      for c in (args.case or sorted(CASES))]
        print(f"\n{'case':22} {'device':6} {'eager ms':>9} {'+dp_group':>9} {'ratio':>6} {'compiled ms':>11} "
              f"{'+dp_group':>9} {'ratio':>6}")
        for r in split_rows:
            print(f"{r['case']:22} {r['device']:6} {r['eager_local_ms']:>9.3f} {r['eager_split_ms']:>9.3f} "
                  f"{r['eager_split_vs_local']:>6.2f} {r['compiled_local_ms']:>11.3f} {r['compiled_split_ms']:>9.3f} "
                  f"{r['compiled_split_vs_local']:>6.2f}")
        rows += split_rows
    if args.fused:
        fused_rows = [measure_fused(c, args.tokens, args.seqs, args.device, args.reps, not args.no_compiled)
                      for c in (args.case or sorted(CASES))]
        print()
        for r in fused_rows:
            print("  ".join(f"{k} {v}" for k, v in r.items()))
        rows += fused_rows
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return rows


if __name__ == "__main__":
    main()
