"""Sampler replay: the kept-set statistics (K kept ids per row) and a per-token temperature against the
full-vocabulary pass, and the naive masked log-softmax.

    python -m benchmarks.sampler                          # CPU, N = 4096, V = 32768 fp32, K = 50 and V
    python -m benchmarks.sampler --device cuda --N 8192 --V 151936 --dtype bf16 --json out.json

Each round times every variant once, in turn (interleaved: drift lands on all of them alike); medians
over the rounds, ratios against "full" (one temperature, the whole vocabulary) from the same rounds.
Variants, each as `token_logprobs` forward + backward (entropy on) and no-grad forward:
    full           one temperature over V (the vocabulary pass of the default backend)
    full+T_t       a per-token temperature over V (the same pass, 1/T per row)
    kept K=<k>     the kept set: gather K logits per row, softmax over them (the gradient is scattered
                   into the [N, V] zeros autograd allocates)
    naive K=<k>    logits / T_t with -inf outside the kept set, log_softmax over V, gather
The kept set at K = V is every id (a permutation), the worst case of the gather path.
"""

import argparse
import json
import statistics
import time

import torch

import rlkernels

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _support(N: int, V: int, K: int, labels: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """[N, K] distinct ids per row with the label first (random rows, built without an [N, V] sort); at
    K >= V one permutation of every id, shared by the rows (the label is always among them)."""
    if K >= V:
        return torch.randperm(V, generator=gen).expand(N, V).contiguous()
    others = torch.randint(0, V, (N, 4 * K), generator=gen)
    rows = []
    for y, cand in zip(labels.tolist(), others):
        keep = torch.unique(cand[cand != y])[: K - 1]
        while keep.numel() < K - 1:  # tiny V: fill deterministically
            extra = torch.arange(V)
            keep = torch.unique(torch.cat([keep, extra[extra != y]]))[: K - 1]
        rows.append(torch.cat([torch.tensor([y]), keep]))
    return torch.stack(rows)


def _variants(N: int, V: int, dtype: torch.dtype, device: str, ks, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    logits = (torch.randn(N, V, generator=gen) * 2).to(dtype).to(device).requires_grad_(True)
    labels = torch.randint(0, V, (N,), generator=gen)
    temperature = (0.5 + torch.rand(N, generator=gen)).to(device)
    supports = {K: _support(N, V, K, labels, gen).to(device) for K in ks}
    labels = labels.to(device)

    def ours(**kw):
        def step(grad: bool):
            if grad:
                logits.grad = None
                out = rlkernels.token_logprobs(logits, labels, compute_entropy=True, validate=False, **kw)
                (out.logprobs.sum() + 0.01 * out.entropy.sum()).backward()
            else:
                with torch.no_grad():
                    rlkernels.token_logprobs(logits, labels, validate=False, **kw)
        return step

    def naive(support):
        kept = torch.zeros(N, V + 1, dtype=torch.bool, device=device)
        kept.scatter_(1, torch.where(support >= 0, support, V), True)
        kept = kept[:, :V]

        def step(grad: bool):
            with torch.set_grad_enabled(grad):
                if grad:
                    logits.grad = None
                z = logits.float() / temperature[:, None]
                log_p = torch.log_softmax(z.masked_fill(~kept, float("-inf")), dim=-1)
                lp = log_p.gather(1, labels[:, None]).squeeze(1)
                if grad:
                    p = log_p.exp()
                    ent = -(p * log_p.masked_fill(~kept, 0.0)).sum(1)
                    (lp.sum() + 0.01 * ent.sum()).backward()
        return step

    variants = {"full": ours(), "full+T_t": ours(temperature=temperature)}
    for K in ks:
        variants[f"kept K={K}"] = ours(temperature=temperature, sampling_support=supports[K])
        variants[f"naive K={K}"] = naive(supports[K])
    return variants


def _sync(device):
    if device == "cuda":
        torch.cuda.synchronize()


def measure(N: int, V: int, dtype: str, device: str, ks, reps: int) -> dict:
    variants = _variants(N, V, DTYPES[dtype], device, ks)
    results = {}
    for grad in (True, False):
        for step in variants.values():  # warm up
            step(grad)
        times = {name: [] for name in variants}
        for _ in range(reps):
            for name, step in variants.items():
                _sync(device)
                t0 = time.perf_counter()
                step(grad)
                _sync(device)
                times[name].append(time.perf_counter() - t0)
        ms = {name: statistics.median(v) * 1e3 for name, v in times.items()}
        results["fwd+bwd" if grad else "fwd"] = {
            name: {"ms": round(t, 3), "vs_full": round(t / ms["full"], 3)} for name, t in ms.items()
        }
    return results


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--N", type=int, default=4096)
    ap.add_argument("--V", type=int, default=32768)
    ap.add_argument("--dtype", default="fp32", choices=sorted(DTYPES))
    ap.add_argument("--K", type=int, action="append", help="kept ids per row (default 50 and V)")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--json", help="also write the results to this file")
    args = ap.parse_args(argv)
    ks = args.K or [50, args.V]
    results = measure(args.N, args.V, args.dtype, args.device, ks, args.reps)
    print(f"N={args.N} V={args.V} {args.dtype} {args.device}; median ms over {args.reps} interleaved rounds")
    print(f"{'variant':14} {'fwd+bwd ms':>11} {'vs full':>8} {'fwd ms':>9} {'vs full':>8}")
    for name in results["fwd"]:
        a, b = results["fwd+bwd"][name], results["fwd"][name]
        print(f"{name:14} {a['ms']:>11.3f} {a['vs_full']:>8.3f} {b['ms']:>9.3f} {b['vs_full']:>8.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"N": args.N, "V": args.V, "dtype": args.dtype, "device": args.device, "K": ks,
                       "results": results}, f, indent=1)
    return results


if __name__ == "__main__":
    main()
