"""The engine-exact modes (docs/numerics.md): how many log-probs equal vLLM's bit for bit, per backend, dtype and
temperature, with numerics="default" and numerics="vllm"; and what each mode costs against "default".

    python -m benchmarks.numerics --device cpu            # N=128 V=32768, T in {1, 0.7}, fp32 and bf16
    python -m benchmarks.numerics --device cuda --N 1024 --V 151936

vLLM's values: its V1 sampler's (ATen: a float32 copy / T, log_softmax) for the torch, CPU and CUDA backends; its
V2 sampler's own Triton kernels (from its wheel, rlkernels.testing.peers.vllm_v2_sampler) for the Triton backend,
which runs on a GPU or, on a CPU, through Triton's interpreter (TRITON_INTERPRET=1: the operation order, not a
device's bits). Costs: forward + backward of token_logprobs, interleaved rounds, medians, ratio to "default".
"""

import argparse
import json
import os
import statistics
import time

import torch


def match_counts(args, backends_here):
    import rlkernels
    from rlkernels.testing.peers import vllm_v1_processed_logprobs, vllm_v2_processed_logprobs, vllm_v2_sampler

    kernels = None
    rows = []
    gen = torch.Generator().manual_seed(0)
    for dtype in ("fp32", "bf16"):
        logits = (torch.randn(args.N, args.V, generator=gen) * 3).to(getattr(torch, {"fp32": "float32",
                                                                                      "bf16": "bfloat16"}[dtype]))
        labels = torch.randint(0, args.V, (args.N,), generator=gen)
        logits, labels = logits.to(args.device), labels.to(args.device)
        for T in (1.0, 0.7):
            for backend in backends_here:
                if backend == "triton":
                    if kernels is None:
                        try:
                            kernels = vllm_v2_sampler()
                        except RuntimeError as exc:  # no wheel here (a GPU machine without internet)
                            print(f"triton rows left out: {exc}")
                            kernels = False
                    if not kernels:
                        continue
                    want = vllm_v2_processed_logprobs(kernels, logits, labels,
                                                      torch.full((args.N,), T, device=args.device))
                    engine = "vLLM V2"
                else:
                    want, engine = vllm_v1_processed_logprobs(logits, labels, T), "vLLM V1"
                for numerics in ("default", "vllm"):
                    got = rlkernels.token_logprobs(logits, labels, temperature=T, backend=backend,
                                                   numerics=numerics).logprobs
                    rows.append(dict(backend=backend, dtype=dtype, T=T, engine=engine, numerics=numerics,
                                     equal=int((got == want).sum()), N=args.N))
    return rows


def costs(args, backend):
    import rlkernels

    gen = torch.Generator().manual_seed(1)
    logits = (torch.randn(args.N, args.V, generator=gen) * 3).to(args.device)
    labels = torch.randint(0, args.V, (args.N,), generator=gen).to(args.device)
    times = {m: [] for m in ("default", "vllm", "batch_invariant")}
    for _ in range(args.reps):
        for numerics in times:  # interleaved: each round runs every mode once
            leaf = logits.clone().requires_grad_(True)
            if args.device == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            out = rlkernels.token_logprobs(leaf, labels, temperature=0.7, backend=backend, numerics=numerics)
            out.logprobs.sum().backward()
            if args.device == "cuda":
                torch.cuda.synchronize()
            times[numerics].append((time.perf_counter() - t0) * 1e3)
    base = statistics.median(times["default"])
    return [dict(backend=backend, numerics=m, median_ms=statistics.median(t), ratio=statistics.median(t) / base)
            for m, t in times.items()]


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m benchmarks.numerics", description=__doc__.split("\n")[0])
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--N", type=int, default=128)
    ap.add_argument("--V", type=int, default=32768)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    from rlkernels import backends

    # the backends that take this device's tensors (Triton on CPU tensors only through the interpreter)
    wanted = ("torch", "triton", "cuda") if args.device == "cuda" else \
        ("torch", "cpu") + (("triton",) if os.environ.get("TRITON_INTERPRET") == "1" else ())
    here = [b for b in wanted if backends.is_available(b)]
    matches = match_counts(args, here)
    print(f"bitwise equal log-probs of {args.N} (V = {args.V}, {args.device})")
    print(f"{'backend':8} {'dtype':5} {'T':>4} {'against':8} {'default':>8} {'vllm':>8}")
    for i in range(0, len(matches), 2):
        d, v = matches[i], matches[i + 1]
        print(f"{d['backend']:8} {d['dtype']:5} {d['T']:>4} {d['engine']:8} {d['equal']:>8} {v['equal']:>8}")
    timed = [r for b in here if b != "triton" or args.device == "cuda" for r in costs(args, b)]
    print(f"\ntoken_logprobs fwd + bwd at T = 0.7, medians of {args.reps} interleaved rounds")
    for r in timed:
        print(f"{r['backend']:8} {r['numerics']:16} {r['median_ms']:9.2f} ms  {r['ratio']:5.2f}x default")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(matches=matches, costs=timed), f, indent=1)
    return matches, timed


if __name__ == "__main__":
    main()
