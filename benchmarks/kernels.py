"""The vocabulary passes alone, beside the machine's own ceilings measured in the same run.

    python -m benchmarks.kernels --device cuda --N 8192 --V 151936 --json out.json   # benchmarks/gpu_check.sh
    python -m benchmarks.kernels --N 64 --V 4096                                     # CPU: the same cases, small

The headline of `benchmarks.run` times the public call, `validate=True`'s host synchronisation included; this
splits that time into what the kernels take and what the call adds. Cases (median ms over interleaved rounds; on
CUDA `triton.testing.do_bench`, which clears the L2 cache before each call):

    read_ceiling           logits.sum(): one read of the N x V logits
    copy_ceiling           out.copy_(logits): one read and one write
    {backend}.forward      the backend's token_stats_fwd launcher alone (no validation, no autograd)
    {backend}.backward     its token_grad_bwd launcher alone (out of place)
    {backend}.divergences  its full_divergences_fwd alone against a second N x V tensor, without TV (the form
                           needs one read of both) and [tv] with it (two reads of both); the C++ kernels always
                           read twice, so their [tv]-less figure is held against bytes they do not achieve
    api.forward[validate]  rlkernels.token_logprobs(backend=...), validate True and False
    api.fwd_bwd[validate]  the same and its backward (the gradient of the log-probs' sum)
    graph.forward          token_logprobs(validate=False) replayed from a CUDA graph (CUDA only)
    triton.forward_gradient  the gradient formed in the forward (SPEC §2.4): statistics, PPO coefficients and
                           dlogits in one launch, held against one read and one write (its second read of each row
                           is meant to come from L2)
    ppo.fwd_bwd[one_pass|two_pass]  decoupled_ppo_loss (seq-MIS, the fused stage, validate=True) forward and
                           backward on the Triton backend, each form, held against the one-pass form's two passes

Each figure carries its bytes (forward: one read; backward: one read and one write; fwd + bwd: two reads and one
write of N x V), its GB/s, and its share of the ceiling for those bytes (the read ceiling's rate for a forward, the
copy ceiling's for the rest): the targets of docs/backends.md are set against these, not against a data sheet.
"""

import argparse
import json
import statistics
import time
from typing import Callable, Dict

import torch

import rlkernels
from rlkernels import backends

from .harness import cuda_graph, environment


def _timer(device: str) -> Callable[[Callable[[], object]], float]:
    """ms of one call: do_bench on CUDA (its median), else the wall time of one call."""
    if device == "cuda":
        from triton.testing import do_bench

        return lambda fn: do_bench(fn, warmup=5, rep=40, return_mode="median")

    def wall(fn):
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3

    return wall


def _cases(logits: torch.Tensor, labels: torch.Tensor, device: str) -> Dict[str, tuple]:
    """case name -> (callable, bytes it must move, the ceiling it is held against)."""
    N, V = labels.numel(), logits.shape[-1]
    read = N * V * logits.element_size()
    out = torch.empty_like(logits)
    cases = {"read_ceiling": (lambda: logits.sum(), read, "read_ceiling"),
             "copy_ceiling": (lambda: out.copy_(logits), 2 * read, "copy_ceiling")}
    c = torch.randn(N, device=device)
    reference = (logits.float() + 0.5 * torch.randn(logits.shape, device=device)).to(logits.dtype)
    every = torch.ones(N, dtype=torch.bool, device=device)
    for name in ("triton", "cuda", "cpu"):
        if not (backends.is_available(name) and backends._supports(name, logits)):
            continue
        kernel = backends.instance(name)
        stats = kernel.token_stats_fwd(logits, labels, 1.0, False, False)
        cases[f"{name}.forward"] = (lambda k=kernel: k.token_stats_fwd(logits, labels, 1.0, False, False), read,
                                    "read_ceiling")
        cases[f"{name}.backward"] = (
            lambda k=kernel, s=stats: k.token_grad_bwd(logits, labels, s.row_max, s.log_norm, None, c, None, 1.0,
                                                       False), 2 * read, "copy_ceiling")
        if name == "triton" and kernel.forward_gradient_covers(V):
            cases["triton.forward_gradient"] = (lambda k=kernel, s=stats: _forward_gradient(k, logits, labels, s, out),
                                                2 * read, "copy_ceiling")
        # the CUDA extension's divergences are the torch backend's chunked form: no kernel of its own to time
        for with_tv, reads in ((False, 2), (True, 4)) if name != "cuda" else ():
            cases[f"{name}.divergences{'[tv]' if with_tv else ''}"] = (
                lambda k=kernel, w=with_tv: k.full_divergences_fwd(logits, reference, every, 1.0, 1.0, w),
                reads * read, "read_ceiling")
    leaf = logits.detach().requires_grad_(True)
    for validate in (True, False):
        cases[f"api.forward[validate={validate}]"] = (
            lambda v=validate: rlkernels.token_logprobs(logits, labels, validate=v).logprobs, read, "read_ceiling")

        def fwd_bwd(v=validate):
            rlkernels.token_logprobs(leaf, labels, validate=v).logprobs.sum().backward()
            leaf.grad = None

        cases[f"api.fwd_bwd[validate={validate}]"] = (fwd_bwd, 3 * read, "copy_ceiling")
    if device == "cuda" and backends.is_available("triton"):
        cases.update(_ppo_cases(leaf, labels, read))
    if device == "cuda":
        captured = _captured(lambda: rlkernels.token_logprobs(logits, labels, validate=False).logprobs)
        if captured is not None:  # the graph and its output, which holds the replay's memory
            cases["graph.forward"] = (lambda g=captured: g[0].replay(), read, "read_ceiling")
    return cases


def _forward_gradient(kernel, logits, labels, stats, out):
    """The one-pass launch with decoupled PPO's factors: every row in the loss, a_t = 1 / N, no IS weight."""
    from rlkernels.kernels.triton.forward_grad import TokenFactors

    N = labels.numel()
    ones = torch.ones(N, dtype=torch.bool, device=logits.device)
    factors = TokenFactors(ones, stats.logprobs * 0 + 1.0, stats.logprobs - 0.01, None,
                           torch.full((N,), 1.0 / N, device=logits.device), None, None, None)
    codes = dict(PROXIMAL=1, WEIGHTED=False, NORMALIZE=0, RATIO_CLAMP=False, DUAL_CLIP=False, KL_TYPE=0,
                 KL_STRAIGHT=False)
    hyper = dict(ratio_clamp=0.0, clip_lo=0.8, clip_hi=1.28, clip_c=0.0, kl_coef=0.0)
    return kernel.forward_gradient(logits, labels, 1.0, out, factors, codes, hyper, False)


def _ppo_cases(leaf, labels, read: int) -> Dict[str, tuple]:
    """decoupled_ppo_loss fwd + bwd with seq-MIS on the Triton backend, the gradient formed in the forward or in the
    backward; both held against the one-pass form's bytes (two passes)."""
    N = labels.numel()
    g = torch.Generator(device=leaf.device).manual_seed(1)
    old = -torch.rand(N, device=leaf.device, generator=g) * 3
    kwargs = dict(old_logprobs=old, rollout_logprobs=old + 0.01, cu_seqlens=torch.linspace(
        0, N, 129, device=leaf.device).long())
    advantages, mask = torch.randn(N, device=leaf.device, generator=g), torch.ones(N, dtype=torch.bool,
                                                                                   device=leaf.device)
    cases = {}
    for one_pass in (True, False):
        config = rlkernels.PolicyLossConfig(rollout_correction=rlkernels.RolloutCorrection.seq_mis(),
                                            backend="triton", metrics="loss_only", logits_one_pass=one_pass)

        def step(c=config):
            rlkernels.decoupled_ppo_loss(leaf, labels, advantages, mask, config=c, **kwargs).loss.backward()
            leaf.grad = None

        cases[f"ppo.fwd_bwd[{'one_pass' if one_pass else 'two_pass'}]"] = (step, 2 * read, "copy_ceiling")
    return cases


def _captured(fn):
    """(a CUDA graph of fn, its output), fn warmed up on a side stream first (lazy allocations and compiles stay
    out of the graph); None, with the reason printed, where the call cannot be captured (a host synchronisation)."""
    try:
        return cuda_graph(fn)
    except RuntimeError as exc:
        print(f"graph.forward: not captured: {str(exc).splitlines()[0]}")
        return None


def run(N: int, V: int, dtype: torch.dtype, device: str, rounds: int) -> dict:
    torch.manual_seed(0)
    logits = (torch.randn(N, V, device=device) * 2).to(dtype)
    labels = torch.randint(0, V, (N,), device=device)
    cases = _cases(logits, labels, device)
    timer = _timer(device)
    samples = {name: [] for name in cases}
    for _ in range(rounds):  # interleaved: a drifting clock or a neighbour touches every case alike
        for name, (fn, _, _) in cases.items():
            samples[name].append(timer(fn))
    medians = {name: statistics.median(ms) for name, ms in samples.items()}
    rows = {}
    for name, (_, nbytes, ceiling) in cases.items():
        gbps = nbytes / (medians[name] * 1e-3) / 1e9
        ceiling_gbps = cases[ceiling][1] / (medians[ceiling] * 1e-3) / 1e9
        rows[name] = dict(ms=medians[name], bytes=nbytes, gbps=gbps, ceiling=ceiling,
                          pct_of_ceiling=100.0 * gbps / ceiling_gbps, samples_ms=samples[name])
    return {"N": N, "V": V, "dtype": str(dtype).replace("torch.", ""), "device": device, "rounds": rounds,
            "environment": environment(device), "cases": rows}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--N", type=int, default=64)
    p.add_argument("--V", type=int, default=4096)
    p.add_argument("--dtype", default="bf16", choices=("bf16", "fp16", "fp32"))
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--json")
    args = p.parse_args(argv)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    result = run(args.N, args.V, dtype, args.device, args.rounds)
    print(f"{args.N} x {args.V} {args.dtype} on {args.device}: median of {args.rounds} interleaved rounds")
    print(f"{'case':32} {'ms':>9} {'GB/s':>8} {'% of ceiling':>13}")
    for name, r in result["cases"].items():
        print(f"{name:32} {r['ms']:>9.3f} {r['gbps']:>8.1f} {r['pct_of_ceiling']:>12.1f}%  ({r['ceiling']})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
