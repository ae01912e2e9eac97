"""Trainer-vs-sampler divergences (SPEC §9): rlkernels.token_divergences against the naive PyTorch composition.

Providers, each timed forward-only (the metrics and TRM's mask: no autograd) and forward + backward (a
divergence as a loss term, kl + tv), interleaved round by round in one process:

  logprob          rlkernels.token_logprobs: the plain log-prob pass, the yardstick of the top-k form
  naive[topk]      log_softmax(z) in float32, gather at the k ids, the partition's formulas in torch
  rlkernels[topk]  token_divergences(reference_topk_ids=, reference_topk_logprobs=): one pass + a k-gather
  naive[full]      two float32 log_softmaxes, the four divergences in dense torch
  rlkernels[full]  token_divergences(reference_logits=): the backend's passes over both tensors (on the GPU one
                   read for KL both ways and χ², a second for TV)
  rlkernels[full:kl]  the same with divergences=("kl", "reverse_kl", "chi2") and kl alone as the loss term:
                   on the GPU one read of both tensors forward

Peak working memory (above the inputs and the gradient) comes from one fresh process per provider.

    python -m benchmarks.divergences --device cpu --N 4096 --V 32768 --k 20,128
"""

import argparse
import json
import os
import statistics
import time
from typing import Callable, Dict

import torch

from benchmarks.harness import (
    WORKER_LINE,
    peak_rss_bytes,
    release_free_heap,
    reset_peak_rss,
    rss_bytes,
    run_memory_worker,
)

PROVIDERS = ("logprob", "naive[topk]", "rlkernels[topk]", "naive[full]", "rlkernels[full]", "rlkernels[full:kl]")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def make_inputs(N: int, V: int, k: int, dtype: str, device: str, seed: int = 0) -> Dict:
    gen = torch.Generator(device=device).manual_seed(seed)  # drawn where they live: 1.2 G values at 8192 x 151936
    z = (torch.randn(N, V, generator=gen, device=device) * 2).to(DTYPES[dtype])
    mu = (z.float() + torch.randn(N, V, generator=gen, device=device) * 0.5).to(DTYPES[dtype])
    mu_logp = torch.log_softmax(mu.float(), -1)
    ids = mu_logp.topk(k, -1).indices
    labels = ids[:, 0].clone()  # the sampled token: the sampler's top-1
    return dict(logits=z, sampler_logits=mu, ids=ids, topk_logprobs=mu_logp.gather(-1, ids), labels=labels)


def _naive_topk(z, ids, lq):
    lp = torch.log_softmax(z.float(), -1)
    head = lp.gather(-1, ids)
    pi, mu = head.exp(), lq.exp()
    pi_t, mu_t = (1 - pi.sum(-1)).clamp_min(1e-30), (1 - mu.sum(-1)).clamp_min(1e-30)
    kl = (mu * (lq - head)).sum(-1) + mu_t * (mu_t.log() - pi_t.log())
    tv = 0.5 * ((pi - mu).abs().sum(-1) + (pi_t - mu_t).abs())
    return kl, tv


def _naive_full(z, r):
    lp, lq = torch.log_softmax(z.float(), -1), torch.log_softmax(r.float(), -1)
    pi, mu = lp.exp(), lq.exp()
    kl = (mu * (lq - lp)).sum(-1)
    reverse = (pi * (lp - lq)).sum(-1)
    chi2 = torch.exp(2 * lp - lq).sum(-1) - 1
    tv = 0.5 * (pi - mu).abs().sum(-1)
    return kl, tv, reverse, chi2


def build(provider: str, x: Dict) -> Callable[[], torch.Tensor]:
    """A step returning a 0-d value whose backward is the fwd+bwd measurement (kl + tv, means over the rows)."""
    import rlkernels

    z, ids, lq, r = x["logits"], x["ids"], x["topk_logprobs"], x["sampler_logits"]
    if provider == "logprob":
        return lambda: rlkernels.token_logprobs(z, x["labels"], validate=False).logprobs.mean()
    if provider == "naive[topk]":
        return lambda: sum(t.mean() for t in _naive_topk(z, ids, lq))
    if provider == "rlkernels[topk]":
        def topk():
            out = rlkernels.token_divergences(z, x["labels"], reference_topk_ids=ids, reference_topk_logprobs=lq,
                                              validate=False)
            return out.kl.mean() + out.tv.mean()
        return topk
    if provider == "naive[full]":
        return lambda: sum(t.mean() for t in _naive_full(z, r)[:2])
    if provider == "rlkernels[full]":
        def full():
            out = rlkernels.token_divergences(z, reference_logits=r, validate=False)
            return out.kl.mean() + out.tv.mean()
        return full
    if provider == "rlkernels[full:kl]":
        def full_without_tv():
            out = rlkernels.token_divergences(z, reference_logits=r, validate=False,
                                              divergences=("kl", "reverse_kl", "chi2"))
            return out.kl.mean()
        return full_without_tv
    raise ValueError(f"provider: expected one of {PROVIDERS}, got {provider!r}")


def _sync(device):
    if device == "cuda":
        torch.cuda.synchronize()


def _step(fn, x, backward: bool):
    x["logits"].grad = None
    if not backward:
        with torch.no_grad():
            return fn()
    out = fn()
    out.backward()
    return out


def measure_times(args, k: int):
    x = make_inputs(args.N, args.V, k, args.dtype, args.device)
    x["logits"].requires_grad_(True)
    fns = {p: build(p, x) for p in args.providers}
    times = {(p, m): [] for p in fns for m in ("fwd", "fwdbwd")}
    values = {}
    for p, fn in fns.items():  # warm-up (the CPU kernels' first build, allocator growth)
        values[p] = float(_step(fn, x, True).detach())
    names = list(fns)
    for rep in range(args.reps):
        # interleaved: every provider once per round, the order rotated each round (the first after a mode switch
        # or after the naive providers' gigabytes were freed paid for it: 2.7x on the log-prob pass here)
        order = names[rep % len(names):] + names[:rep % len(names)]
        for mode in ("fwd", "fwdbwd"):
            for p in order:
                fn = fns[p]
                _sync(args.device)
                t0 = time.perf_counter()
                _step(fn, x, mode == "fwdbwd")
                _sync(args.device)
                times[(p, mode)].append((time.perf_counter() - t0) * 1e3)
    return times, values


def measure_memory(provider: str, args) -> Dict:
    """One provider, fwd+bwd, in this (fresh) process: peak working memory above the inputs and the gradient."""
    x = make_inputs(args.N, args.V, args.k_worker, args.dtype, args.device)
    x["logits"].requires_grad_(True)
    fn = build(provider, x)
    _step(fn, x, True)
    grad = x["logits"].numel() * x["logits"].element_size()
    x["logits"].grad = None
    release_free_heap()
    if args.device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    else:
        base = rss_bytes()
        reset_peak_rss()
    _step(fn, x, True)
    _sync(args.device)
    peak = torch.cuda.max_memory_allocated() if args.device == "cuda" else peak_rss_bytes()
    return dict(provider=provider, k=args.k_worker, peak_working_bytes=peak - base - grad)


def _memory_subprocess(provider: str, k: int, args) -> Dict:
    argv = ["--memory-worker", provider, "--k-worker", str(k), "--N", str(args.N), "--V", str(args.V),
            "--dtype", args.dtype, "--device", args.device]
    return run_memory_worker("benchmarks.divergences", argv, dict(provider=provider, k=k))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--N", type=int, default=4096)
    ap.add_argument("--V", type=int, default=32768)
    ap.add_argument("--k", default="20,128", help="top-k sizes, comma-separated")
    ap.add_argument("--dtype", default="fp32", choices=sorted(DTYPES))
    ap.add_argument("--providers", default=",".join(PROVIDERS))
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--no-memory", action="store_true", help="time only")
    ap.add_argument("--json", default=None, help="write the rows here")
    ap.add_argument("--memory-worker", help=argparse.SUPPRESS)
    ap.add_argument("--k-worker", type=int, default=20, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.memory_worker:
        print(WORKER_LINE + json.dumps(measure_memory(args.memory_worker, args)), flush=True)
        return None
    args.providers = [p.strip() for p in args.providers.split(",") if p.strip()]
    rows = []
    for k in (int(v) for v in args.k.split(",")):
        times, values = measure_times(args, k)
        memory = {} if args.no_memory else {p: _memory_subprocess(p, k, args) for p in args.providers}
        for p in args.providers:
            for mode in ("fwd", "fwdbwd"):
                rows.append(dict(provider=p, k=k, mode=mode, median_ms=statistics.median(times[(p, mode)]),
                                 samples_ms=times[(p, mode)], value=values[p],
                                 peak_working_bytes=memory.get(p, {}).get("peak_working_bytes")))
    _report(rows, args)
    return rows


def _report(rows, args):
    print(f"\ndivergences: N={args.N} V={args.V} {args.dtype} {args.device}; {args.reps} interleaved rounds; memory: "
          "fwd+bwd peak working set")
    print(f"{'k':>4} {'mode':6} {'provider':16} {'median ms':>10} {'x logprob':>9} {'x naive':>8} {'peak MiB':>9} "
          f"{'x naive':>8}")
    for k in sorted({r["k"] for r in rows}):
        for mode in ("fwd", "fwdbwd"):
            group = {r["provider"]: r for r in rows if r["k"] == k and r["mode"] == mode}
            base = group.get("logprob")
            for name, r in group.items():
                naive = group.get("naive[full]" if "full" in name else "naive[topk]")
                t_base = r["median_ms"] / base["median_ms"] if base else float("nan")
                t_naive = r["median_ms"] / naive["median_ms"] if naive else float("nan")
                mem, naive_mem = r["peak_working_bytes"], naive and naive["peak_working_bytes"]
                m_s = f"{mem / 2**20:9.1f}" if mem is not None else f"{'-':>9}"
                m_ratio = mem / naive_mem if mem is not None and naive_mem else float("nan")
                print(f"{k:4d} {mode:6} {name:16} {r['median_ms']:10.1f} {t_base:9.2f} {t_naive:8.2f} {m_s} "
                      f"{m_ratio:8.3f}")
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(dict(args={k: v for k, v in vars(args).items() if k not in ("memory_worker", "k_worker")},
                           rows=rows, torch=torch.__version__, date=time.strftime("%Y-%m-%d"),
                           loadavg=os.getloadavg()), f, indent=1)
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
