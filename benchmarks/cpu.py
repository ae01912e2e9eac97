"""The CPU path on a shared machine: rlkernels' CPU kernels against the torch backend and the naive
composition (eager and under torch.compile), quiet and beside a competing PyTorch process.

    python -m benchmarks.cpu                        # N = 4096, V = 32768 fp32, seq_mis decoupled PPO
    python -m benchmarks.cpu --N 1024 --reps 5 --json out.json

Cases: the training step (forward + backward of the seq_mis decoupled PPO loss) and the no-grad
log-prob pass trainers run for old and reference log-probs every step (`token_logprobs` vs
log_softmax + gather). Each measurement round times every provider once, in turn (interleaved, so
drift and noise land on all of them alike); medians over the rounds, ratios against naive from the
same rounds. "contended" repeats the rounds while another process runs a 2-thread matmul loop (what
a CI runner, a data-loader or a second job does to the cores). The floor is what the memory system
allows at this machine's measured bandwidth: one read of the logits for the forward, and one read
plus one read-and-write for forward + backward (2 reads + 1 write), timed with a sum and a copy of an
N x V tensor.
"""

import argparse
import json
import statistics
import subprocess
import sys
import time

import torch

from .problems import CASES, make_inputs
from .providers import PROVIDERS

PROVIDER_NAMES = ("naive", "naive+compile", "rlkernels[torch]", "rlkernels[cpu]")
COMPETITOR = ("import torch\ntorch.set_num_threads(2)\na = torch.randn(1024, 1024)\n"
              "while True:\n    b = a @ a\n")


def _steps(N: int, V: int, seed: int = 0):
    """{(case, provider): zero-argument step}; case 'train' (fwd + bwd) or 'logprobs' (no-grad fwd)."""
    case = CASES["seq_mis"]
    x = make_inputs(N, V, "fp32", case.layout, "cpu", seed)
    steps = {}
    for name in PROVIDER_NAMES:
        provider = PROVIDERS[name]
        if provider.skip_reason("ppo", case, V, "cpu"):
            continue
        loss = provider.build("ppo", case, x)
        logprobs = provider.build("logprobs", None, x)

        def train(loss=loss):
            x["logits"].grad = None
            loss().backward()

        def forward(logprobs=logprobs):
            with torch.no_grad():
                logprobs()

        steps[("train", name)] = train
        steps[("logprobs", name)] = forward
    return steps, x


def _rounds(steps: dict, reps: int) -> dict:
    for step in steps.values():  # warm up (compiles naive+compile, builds the CPU kernels)
        step()
        step()
    times = {key: [] for key in steps}
    for _ in range(reps):
        for key, step in steps.items():
            t0 = time.perf_counter()
            step()
            times[key].append(time.perf_counter() - t0)
    return {key: statistics.median(v) * 1e3 for key, v in times.items()}


def _floor(N: int, V: int, reps: int = 5) -> dict:
    a, b = torch.randn(N, V), torch.empty(N, V)
    read, copy = [], []
    for _ in range(reps):
        t0 = time.perf_counter()
        a.sum()
        read.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        b.copy_(a)
        copy.append(time.perf_counter() - t0)
    r, c = statistics.median(read) * 1e3, statistics.median(copy) * 1e3
    gbps = N * V * 4 / (r * 1e-3) / 1e9
    return {"read_ms": r, "copy_ms": c, "read_GBps": gbps, "logprobs": r, "train": r + c}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--N", type=int, default=4096)
    ap.add_argument("--V", type=int, default=32768)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--no-contended", action="store_true")
    ap.add_argument("--json", help="also write the results to this file")
    args = ap.parse_args(argv)
    steps, _ = _steps(args.N, args.V)
    results = {"N": args.N, "V": args.V, "threads": torch.get_num_threads(), "floor": _floor(args.N, args.V)}
    results["quiet"] = _rounds(steps, args.reps)
    if not args.no_contended:
        competitor = subprocess.Popen([sys.executable, "-c", COMPETITOR])
        try:
            time.sleep(3)  # let it reach its loop
            results["contended"] = _rounds(steps, args.reps)
        finally:
            competitor.kill()
            competitor.wait()
    floor = results["floor"]
    print(f"N = {args.N}, V = {args.V}, fp32, {results['threads']} threads; memory: {floor['read_GBps']:.1f} GB/s read")
    for case, title in (("train", "decoupled PPO seq_mis, forward + backward"), ("logprobs", "no-grad log-probs")):
        print(f"\n{title}   (floor at measured bandwidth: {floor[case]:.1f} ms)")
        states = [s for s in ("quiet", "contended") if s in results]
        print(f"{'provider':18} " + "  ".join(f"{s + ' ms':>13} {'/naive':>7}" for s in states))
        for name in PROVIDER_NAMES:
            if (case, name) not in results["quiet"]:
                continue
            cells = []
            for state in states:
                ms = results[state][(case, name)]
                cells.append(f"{ms:>13.1f} {ms / results[state][(case, 'naive')]:>7.2f}")
            print(f"{name:18} " + "  ".join(cells))
    if args.json:
        serial = {k: ({f"{c}/{p}": v for (c, p), v in val.items()} if isinstance(val, dict) and k != "floor" else val)
                  for k, val in results.items()}
        with open(args.json, "w") as f:
            json.dump(serial, f, indent=1)
    return results


if __name__ == "__main__":
    main()
