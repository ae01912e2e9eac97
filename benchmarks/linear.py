"""The loss from hidden states and the LM head (op `linear`): fused-linear vs logits paths vs peers.

    python -m benchmarks.linear --device cpu                      # N=4096 H=512 V=32768 fp32, 25/50/100 % rows
    python -m benchmarks.linear --device cuda --N 8192 --H 4096 --V 151936 --dtype bf16 --fractions 0.5

Cases (packed sequences of 256 tokens, a fraction f of the tokens in the loss, token-mean):
  seq_mis    (default) decoupled PPO with dual clip 3 and seq-MIS from pi_old vs pi_rollout: sequence IS
             truncated at 2 + seq_sum_k1 rejection (0.5, 2) (RolloutCorrection.seq_mis())
  token_tis  token TIS at C = 2, no dual clip: the configuration every provider supports (Liger's too)

Providers:
  naive                       h @ W.T -> float32 log_softmax -> gather -> IS/RS/PPO ops (eager)
  naive[compile]              the same under torch.compile
  rlkernels[logits]           h @ W.T, then rlkernels.decoupled_ppo_loss
  rlkernels[linear]           rlkernels.linear_decoupled_ppo_loss (no [N, V] logits); both cases take its
                              one-pass form (the gradient formed in the forward: 3 GEMMs of the loss's rows, selected
                              with one host read: select_loss_rows=True, as every rlkernels[linear*] provider)
  rlkernels[linear-sync-free] the same without the host read (validate=False alone): every row through the GEMMs
  rlkernels[linear-two-pass]  the same with linear_one_pass=False (its backward recomputes the logits: 4)
  rlkernels[linear-fp32-head] rlkernels[linear] with head_dtype="float32" (float32 GEMMs on bf16/fp16 operands)
  rlkernels[linear-tf32-head] the same with head_dtype="tf32" (TF32 matrix units on CUDA; float32 on a CPU)
  rlkernels[linear-invariant] rlkernels[linear] with numerics="batch_invariant" (head GEMMs in 64-row blocks)
  liger                       Liger-Kernel's LigerFusedLinearGRPOLoss (token_tis only; loss_type="dapo",
                              vllm_is_ratio = the IS weights)
  liger[ppo-logprobs]         Liger-Kernel's fused-linear PPO log-probs (LigerFusedLinearScaledCrossEntropyFunction,
                              liger-kernel >= 0.8.2: verl's default output head since verl #7461), then rlkernels'
                              stage on them (rlkernels.policy_loss): the same loss as rlkernels[linear-two-pass],
                              both cases
  gemm                        (GPU) the forward GEMM h @ W.T alone: t_GEMM, for the (1 + 2f) * t_GEMM floor

`--gemm-count` profiles one step of every provider and reports its GEMMs (aten::mm / addmm / addmm_ calls and
the token rows they multiply).

Time: forward + backward, every provider run in turn in each round (interleaved), medians and
ratios to naive from the same run. Memory (CPU): each provider in a fresh process; peak RSS of one
step above the inputs, the parameters and the gradients it produces ("peak working memory").
On CUDA: the caching allocator's peak above the same.
"""

import argparse
import functools
import json
import os
import statistics
import sys
import time
from typing import Callable, Dict

import torch

import rlkernels
from rlkernels import PolicyLossConfig, RolloutCorrection

from .harness import WORKER_LINE, peak_rss_bytes, release_free_heap, reset_peak_rss, rss_bytes, run_memory_worker
from .naive import naive_decoupled_ppo_loss

PROVIDERS = ("naive", "naive[compile]", "rlkernels[logits]", "rlkernels[linear]", "rlkernels[linear-two-pass]",
             "liger")
CASES = ("seq_mis", "token_tis")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
SEQ_LEN = 256
CLIP, IS_CAP = 0.2, 2.0
CONFIGS = {
    "token_tis": PolicyLossConfig(rollout_correction=RolloutCorrection.token_tis(IS_CAP), clip_ratio_c=None,
                                  loss_agg_mode="token-mean", validate=False),
    "seq_mis": PolicyLossConfig(rollout_correction=RolloutCorrection.seq_mis(IS_CAP), clip_ratio_c=3.0,
                                loss_agg_mode="token-mean", validate=False),
}


def make_inputs(N: int, H: int, V: int, fraction: float, dtype: str, device: str, seed: int = 0) -> Dict:
    g = torch.Generator().manual_seed(seed)
    dt = DTYPES[dtype]
    B = N // SEQ_LEN
    hidden = torch.randn(N, H, generator=g).to(device=device, dtype=dt)
    weight = (torch.randn(V, H, generator=g) / H**0.5 * 2).to(device=device, dtype=dt)
    labels = torch.randint(0, V, (N,), generator=g).to(device)
    # the first (1 - f) of every sequence is prompt: outside the loss, as in an RL batch
    pos = torch.arange(N) % SEQ_LEN
    mask = (pos >= int(round((1 - fraction) * SEQ_LEN))).to(device)
    with torch.no_grad():  # current log-probs in chunks, to place the old / rollout policies near them
        current = torch.cat([torch.log_softmax((hidden[s:s + 512] @ weight.T).float(), -1)
                             .gather(1, labels[s:s + 512, None]).squeeze(1) for s in range(0, N, 512)]).cpu()
    old = current + 0.1 * torch.randn(N, generator=g)
    rollout = old + 0.02 * torch.randn(N, generator=g)
    seq_adv = torch.randn(B, generator=g)
    return dict(hidden=hidden, weight=weight, labels=labels, mask=mask, old=old.to(device), rollout=rollout.to(device),
                seq_adv=seq_adv.to(device), adv=seq_adv.repeat_interleave(SEQ_LEN).to(device),
                cu=torch.arange(0, N + 1, SEQ_LEN, device=device), B=B)


def naive_seq_mis_loss(hidden, weight, labels, mask, old, rollout, adv, cu):
    """benchmarks/naive.py's decoupled PPO on logits h @ W.T: sequence IS at 2, seq_sum_k1 (0.5, 2), dual clip 3."""
    return naive_decoupled_ppo_loss(hidden @ weight.T, labels, adv, mask, old, rollout, cu, is_level="sequence",
                                    is_threshold=IS_CAP, rs=(("seq_sum_k1", (0.5, 2.0)),), clip_ratio_c=3.0)


def naive_loss(hidden, weight, labels, mask, old, rollout, adv):
    logp = torch.log_softmax((hidden @ weight.T).float(), dim=-1).gather(1, labels[:, None]).squeeze(1)
    w = torch.exp((old - rollout).clamp(-20, 20)).clamp(max=IS_CAP)
    ratio = torch.exp((logp - old).clamp(-20, 20))
    per_token = torch.maximum(-adv * ratio, -adv * ratio.clamp(1 - CLIP, 1 + CLIP)) * w
    m = mask.float()
    return (per_token * m).sum() / m.sum().clamp_min(1)


def build(provider: str, x: Dict, case: str = "token_tis") -> Callable[[], torch.Tensor]:
    """A zero-argument function returning the loss (with autograd to hidden and weight)."""
    h, W = x["hidden"], x["weight"]
    tensors = (x["labels"], x["mask"], x["old"], x["rollout"], x["adv"])
    naive = naive_loss if case == "token_tis" else functools.partial(naive_seq_mis_loss, cu=x["cu"])
    if provider == "naive":
        return lambda: naive(h, W, *tensors)
    if provider == "naive[compile]":
        compiled = torch.compile(naive)
        return lambda: compiled(h, W, *tensors)
    kw = dict(old_logprobs=x["old"], rollout_logprobs=x["rollout"], cu_seqlens=x["cu"], config=CONFIGS[case])
    if provider == "rlkernels[logits]":
        return lambda: rlkernels.decoupled_ppo_loss(h @ W.T, x["labels"], x["adv"], x["mask"], **kw).loss
    if provider.startswith("rlkernels[linear"):
        head_dtype = {"rlkernels[linear-fp32-head]": "float32", "rlkernels[linear-tf32-head]": "tf32"}.get(provider)
        numerics = "batch_invariant" if provider == "rlkernels[linear-invariant]" else "default"
        known = ("rlkernels[linear]", "rlkernels[linear-two-pass]", "rlkernels[linear-invariant]",
                 "rlkernels[linear-sync-free]")
        if provider not in known and head_dtype is None:
            raise ValueError(f"unknown provider {provider!r}")
        kw["config"] = kw["config"].with_overrides(linear_one_pass=provider != "rlkernels[linear-two-pass]",
                                                   head_dtype=head_dtype, numerics=numerics,
                                                   select_loss_rows=provider != "rlkernels[linear-sync-free]")
        return lambda: rlkernels.linear_decoupled_ppo_loss(h, W, x["labels"], x["adv"], x["mask"], **kw).loss
    if provider == "gemm":  # the forward GEMM alone: the same for every case
        return lambda: h @ W.T
    if provider == "liger[ppo-logprobs]":
        from liger_kernel.ops.fused_linear_scaled_cross_entropy import LigerFusedLinearScaledCrossEntropyFunction

        labels = torch.where(x["mask"], x["labels"], torch.full_like(x["labels"], -100))

        def ppo_logprobs():
            logprobs = -LigerFusedLinearScaledCrossEntropyFunction.apply(h, W, labels, 1.0, -100)
            return rlkernels.policy_loss(logprobs, x["adv"], x["mask"], **kw).loss
        return ppo_logprobs
    if case != "token_tis":
        raise ValueError(f"{provider} runs the token_tis case only")
    if provider == "liger":
        from liger_kernel.chunked_loss import LigerFusedLinearGRPOLoss

        loss_fn = LigerFusedLinearGRPOLoss(beta=0.0, use_ref_model=False, epsilon_low=CLIP, epsilon_high=CLIP,
                                           loss_type="dapo")
        B, T = x["B"], SEQ_LEN
        is_ratio = torch.exp((x["old"] - x["rollout"]).clamp(-20, 20)).clamp(max=IS_CAP).view(B, T)

        def step():
            out = loss_fn(h.view(B, T, -1), W, x["labels"].view(B, T), x["mask"].view(B, T).long(), x["seq_adv"],
                          old_per_token_logps=x["old"].view(B, T), vllm_is_ratio=is_ratio)
            return out[0] if isinstance(out, tuple) else out
        return step
    raise ValueError(f"unknown provider {provider!r}")


def _sync(device):
    if device == "cuda":
        torch.cuda.synchronize()


def _step(fn, x, backward: bool):
    x["hidden"].grad = x["weight"].grad = None
    out = fn()
    if backward:
        out.backward()
    return out


def measure_memory(provider: str, args) -> Dict:
    """One provider in this (fresh) process: peak working memory of one step, and its loss."""
    x = make_inputs(args.N, args.H, args.V, args.fraction, args.dtype, args.device)
    x["hidden"].requires_grad_(True)
    x["weight"].requires_grad_(True)
    fn = build(provider, x, args.case)
    _step(fn, x, True)  # warm-up: compilation, allocator growth
    grads = x["hidden"].numel() * x["hidden"].element_size() + x["weight"].numel() * x["weight"].element_size()
    # the warm-up's gradients go before the baseline: held through it, they were counted in `base` and the step's
    # own (which reuse their memory) subtracted once more (peaks came out below zero)
    x["hidden"].grad = x["weight"].grad = None
    release_free_heap()
    if args.device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    else:
        base = rss_bytes()
        reset_peak_rss()  # without it (old kernels) the peak is the process's, an overestimate
    loss = fn()
    loss.backward()
    _sync(args.device)
    peak = torch.cuda.max_memory_allocated() if args.device == "cuda" else peak_rss_bytes()
    return dict(provider=provider, fraction=args.fraction, loss=float(loss), peak_working_bytes=peak - base - grads,
                grad_norm=float(x["weight"].grad.float().norm()))


def measure_times(args, fraction: float) -> Dict[str, list]:
    x = make_inputs(args.N, args.H, args.V, fraction, args.dtype, args.device)
    x["hidden"].requires_grad_(True)
    x["weight"].requires_grad_(True)
    fns, failed = {}, {}
    for p in args.providers:  # build and warm up (compilation included); a provider that cannot run is reported
        try:
            fns[p] = build(p, x, args.case)
            _step(fns[p], x, p != "gemm")
        except Exception as exc:  # noqa: BLE001 (a missing peer, an unsupported shape)
            fns.pop(p, None)
            failed[p] = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:200]
    times = {p: [] for p in fns}
    for _ in range(args.reps):
        for p, fn in fns.items():  # interleaved: every provider once per round
            _sync(args.device)
            t0 = time.perf_counter()
            with torch.no_grad() if p == "gemm" else torch.enable_grad():
                _step(fn, x, p != "gemm")
            _sync(args.device)
            times[p].append((time.perf_counter() - t0) * 1e3)
    return times, failed


GEMMS = ("aten::mm", "aten::addmm", "aten::addmm_")


def count_gemms(step: Callable[[], None], V: int) -> Dict:
    """One call of `step` under the profiler: its GEMMs (aten::mm / addmm / addmm_) and the token rows they
    multiply, read off the operand shapes: the M of [n, .] @ [., .] products (logits, d_hidden), the K of the
    weight's [V, n] @ [n, H]."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True) as prof:
        step()
    calls = rows = 0
    for event in prof.events():
        shapes = [s for s in event.input_shapes if len(s) == 2] if event.name in GEMMS else []
        if len(shapes) >= 2:
            a = shapes[-2]
            calls += 1
            rows += a[1] if a[0] == V else a[0]
    return dict(gemm_calls=calls, gemm_rows=rows)


def measure_gemms(args, fraction: float) -> Dict[str, Dict]:
    x = make_inputs(args.N, args.H, args.V, fraction, args.dtype, args.device)
    x["hidden"].requires_grad_(True)
    x["weight"].requires_grad_(True)
    out = {}
    for p in args.providers:
        if p in ("gemm", "liger", "naive[compile]"):  # a peer's or a compiled graph's GEMMs are not ours to read
            continue
        try:
            fn = build(p, x, args.case)
        except ValueError:
            continue
        _step(fn, x, True)
        out[p] = count_gemms(lambda: _step(fn, x, True), args.V)  # noqa: B023 (called at once)
    return out


def _memory_subprocess(provider: str, fraction: float, args) -> Dict:
    argv = ["--memory-worker", provider, "--fraction", str(fraction), "--N", str(args.N), "--H", str(args.H),
            "--V", str(args.V), "--dtype", args.dtype, "--device", args.device, "--case", args.case]
    return run_memory_worker("benchmarks.linear", argv, dict(provider=provider, fraction=fraction))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--N", type=int, default=4096)
    ap.add_argument("--H", type=int, default=512)
    ap.add_argument("--V", type=int, default=32768)
    ap.add_argument("--dtype", default="fp32", choices=sorted(DTYPES))
    ap.add_argument("--case", default="seq_mis", choices=CASES)
    ap.add_argument("--gemm-count", action="store_true", help="profile one step per provider: its GEMMs and rows")
    ap.add_argument("--fractions", default="0.25,0.5,1.0", help="fractions of the tokens in the loss")
    ap.add_argument("--providers", default=",".join(PROVIDERS))
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--no-memory", action="store_true", help="time only")
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--tag", default=None)
    ap.add_argument("--memory-worker", help=argparse.SUPPRESS)
    ap.add_argument("--fraction", type=float, default=0.5, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.memory_worker:
        print(WORKER_LINE + json.dumps(measure_memory(args.memory_worker, args)), flush=True)
        return None
    args.providers = [p.strip() for p in args.providers.split(",") if p.strip()]
    if args.device == "cuda" and "gemm" not in args.providers:
        args.providers.append("gemm")
    rows = []
    for fraction in (float(f) for f in args.fractions.split(",")):
        gemms = measure_gemms(args, fraction) if args.gemm_count else {}
        times, failed = measure_times(args, fraction)
        for p in args.providers:
            if p in failed:
                print(f"{p}: not measured: {failed[p]}", file=sys.stderr)
                continue
            row = dict(provider=p, fraction=fraction, median_ms=statistics.median(times[p]), samples_ms=times[p],
                       **gemms.get(p, {}))
            if not args.no_memory and p != "gemm":
                row.update({k: v for k, v in _memory_subprocess(p, fraction, args).items() if k not in row})
            rows.append(row)
    _report(rows, args)
    return rows


def _report(rows, args):
    tag = args.tag or f"{args.device}-linear-{args.N}x{args.H}x{args.V}-{args.dtype}" + (
        "" if args.case == "token_tis" else f"-{args.case}")
    print(f"\nlinear: N={args.N} H={args.H} V={args.V} {args.dtype} {args.device}, fwd+bwd, case {args.case}, "
          f"token-mean; {args.reps} interleaved rounds")
    print(f"{'rows':>5} {'provider':26} {'median ms':>10} {'x naive':>8} {'peak MiB':>9} {'x naive':>8} {'loss':>12} "
          f"{'GEMMs (rows / N)':>17}")
    for fraction in sorted({r["fraction"] for r in rows}):
        group = [r for r in rows if r["fraction"] == fraction]
        naive = next((r for r in group if r["provider"] == "naive"), None)
        gemm = next((r for r in group if r["provider"] == "gemm"), None)
        for r in group:
            t_ratio = r["median_ms"] / naive["median_ms"] if naive else float("nan")
            mem = r.get("peak_working_bytes")
            naive_mem = naive.get("peak_working_bytes") if naive else None
            m_ratio = mem / naive_mem if (mem is not None and naive_mem) else float("nan")
            mem_s = f"{mem / 2**20:9.1f}" if mem is not None else f"{'-':>9}"
            loss = f"{r['loss']:12.6f}" if "loss" in r else f"{r.get('error', '-')[:12]:>12}"
            gemms = f"{r['gemm_calls']} ({r['gemm_rows'] / args.N:.2f})" if "gemm_calls" in r else "-"
            print(f"{fraction:5.2f} {r['provider']:26} {r['median_ms']:10.1f} {t_ratio:8.2f} {mem_s} {m_ratio:8.3f} "
                  f"{loss} {gemms:>17}")
        if gemm:  # t_GEMM: the forward GEMM over all N rows; the one-pass form runs 3 GEMMs over f N of them
            for name, k in (("rlkernels[linear]", 2), ("rlkernels[linear-two-pass]", 3)):
                live = next((r for r in group if r["provider"] == name), None)
                if live is not None:
                    floor = (1 + k * fraction) * gemm["median_ms"]
                    print(f"      {name} vs (1 + {k}f) t_GEMM = {floor:.2f} ms: {live['median_ms'] / floor:.2f}x")
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, tag + ".json")
    with open(path, "w") as f:
        json.dump(dict(args={k: v for k, v in vars(args).items() if k != "memory_worker"}, rows=rows,
                       torch=torch.__version__, date=time.strftime("%Y-%m-%d"), loadavg=os.getloadavg()), f, indent=1)
    print(f"wrote {path}")
    if not any(r["provider"] == "naive" for r in rows):  # the plot's ratios are to naive
        return
    try:
        _plot(rows, path[:-5] + ".png", tag)
        print(f"wrote {path[:-5]}.png")
    except ImportError:
        pass


def _plot(rows, path, title):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    providers = [p for p in dict.fromkeys(r["provider"] for r in rows) if p != "gemm"]
    fractions = sorted({r["fraction"] for r in rows})
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    panels = ((axes[0], "median_ms", "time vs naive"), (axes[1], "peak_working_bytes", "peak working memory vs naive"))
    for ax, key, label in panels:
        width = 0.8 / len(providers)
        for i, p in enumerate(providers):
            ys = []
            for f in fractions:
                r = next(r for r in rows if r["provider"] == p and r["fraction"] == f)
                n = next(r for r in rows if r["provider"] == "naive" and r["fraction"] == f)
                ys.append(r[key] / n[key] if r.get(key) is not None and n.get(key) else 0.0)
            ax.bar([j + i * width for j in range(len(fractions))], ys, width, label=p)
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(fractions))], [f"{f:.0%} rows" for f in fractions])
        ax.set_title(label)
        ax.axhline(1.0, color="gray", lw=0.8)
    axes[0].legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
