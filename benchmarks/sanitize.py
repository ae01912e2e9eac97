"""One launch of every vocabulary kernel at a real vocabulary, for compute-sanitizer (benchmarks/gpu_check.sh):

    compute-sanitizer --tool memcheck --error-exitcode 1 python -m benchmarks.sanitize --device cuda
    compute-sanitizer --tool racecheck --error-exitcode 1 python -m benchmarks.sanitize --device cuda --backends cuda
    python -m benchmarks.sanitize                     # CPU: the same calls through the CPU kernels (the smoke test)

Each backend runs, through the public API, the calls that reach each of its kernels once: the token statistics
forward and backward (with and without entropy, in place), the top-k head columns (`sampler_topk_ids`), the full
divergences forward and backward (`sampler_logits`), numerics="vllm", the fused stage and the gradient formed in
the forward with its factors (Triton). The rows are
few (16) and the vocabulary real (151,936 by default): the sanitizer checks every access and is slow, so the shape
is what a launch at scale touches per row, not its row count. Prints one line per call, so that a report names the
kernel it came from.
"""

import argparse

import torch

import rlkernels
from rlkernels import PolicyLossConfig, RolloutCorrection, backends


def calls(N: int, V: int, device: str, backend: str):
    """(name, thunk) for every kernel the backend has."""
    g = torch.Generator(device="cpu").manual_seed(0)
    logits = (torch.randn(N, V, generator=g) * 2).to(torch.bfloat16).to(device)
    labels = torch.randint(0, V, (N,), generator=g).to(device)
    labels[1] = -100  # a skipped row
    sampler = (logits.float() + 0.01 * torch.randn(N, V, generator=g).to(device)).to(torch.bfloat16)
    topk = sampler.float().topk(8, -1)
    mask = labels != -100
    common = dict(advantages=torch.randn(N, device=device), response_mask=mask,
                  old_logprobs=torch.full((N,), -3.0, device=device), rollout_logprobs=torch.full((N,), -3.0,
                                                                                               device=device))
    seq_mis = PolicyLossConfig(rollout_correction=RolloutCorrection(is_level="sequence", is_threshold=(0, 2.0),
                                                                      is_mode="mask"), backend=backend,
                               compute_entropy=True, validate=False)

    def logprobs(entropy, inplace):
        x = logits.clone().requires_grad_(True)
        y = x * 1.0 if inplace else x  # in place needs a computed tensor that owns its storage
        out = rlkernels.token_logprobs(y, labels, compute_entropy=entropy, backend=backend, validate=False,
                                       inplace_backward=inplace)
        (out.logprobs.sum() + (out.entropy.sum() if entropy else 0)).backward()

    def ppo(config=seq_mis, **sampler_inputs):
        x = logits.clone().requires_grad_(True)
        rlkernels.decoupled_ppo_loss(x, labels, config=config, **common, **sampler_inputs).loss.backward()

    out = [("token_stats + token_grad", lambda: logprobs(False, False)),
           ("token_stats + token_grad, entropy, in place", lambda: logprobs(True, True)),
           ("head columns (sampler top-k)", lambda: ppo(sampler_topk_ids=topk.indices,
                                                        sampler_topk_logprobs=topk.values.log_softmax(-1)))]
    if backend != "cuda":  # the full form and vLLM's order are Triton / CPU kernels
        out += [("full divergences fwd + bwd", lambda: ppo(sampler_logits=sampler)),
                ("vllm_logprobs", lambda: rlkernels.token_logprobs(logits, labels, backend=backend, validate=False,
                                                                   numerics="vllm"))]
    if backend == "triton":  # the fused stage's two kernels (16 rows in 3 sequences, one of them empty)
        fused = seq_mis.with_overrides(metrics="loss_only", fused_stage=True, entropy_coeff=0.01, kl_coef=0.0)
        cu = torch.tensor([0, 5, 5, N], device=device)
        out.append(("fused stage", lambda: ppo(fused, cu_seqlens=cu)))
        # validate=True: on CUDA the gradient formed in the forward reads its incoming gradient on the host
        out.append(("fused stage, factors + gradient formed in the forward",
                    lambda: ppo(fused.with_overrides(validate=True), cu_seqlens=cu)))
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--N", type=int, default=16)
    p.add_argument("--V", type=int, default=151936)
    p.add_argument("--backends", default=None, help="comma list (default: every kernel backend for the device)")
    args = p.parse_args(argv)
    names = args.backends.split(",") if args.backends else (
        ["triton", "cuda"] if args.device == "cuda" else ["cpu"])
    for backend in names:
        if not backends.is_available(backend):
            print(f"{backend}: not available here, skipped")
            continue
        for name, thunk in calls(args.N, args.V, args.device, backend):
            thunk()
            if args.device == "cuda":
                torch.cuda.synchronize()  # a fault is reported at this call, not a later one
            print(f"{backend}: {name}: ran", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
