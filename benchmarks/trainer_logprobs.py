"""Each trainer's log-prob + entropy pass over its logits (its old, reference and update forwards) against the
adapter's fused route, forward + backward: peak working memory above the logits and their gradient, one fresh
process per provider (and its wall time there, once: a CPU figure, for scale only).

  areal             AReaL's gather_logprobs_entropy (a float32 copy of the logits, chunked; its softmax saved)
  rlkernels[areal]  the adapter's gather_logprobs_entropy (rlkernels.integrations.areal)
  skyrl             SkyRL's logprobs_from_logits + chunked_entropy_from_logits(requires_grad=True)
  rlkernels[skyrl]  the adapter's two functions (one fused pass; the entropy call reuses it)
  openrlhf          Actor.forward's tail: the float32 copy, log_probs_from_logits, compute_entropy
  rlkernels[openrlhf]  actor_forward's tail: token_logprobs(compute_entropy=True) on the logits as they are
  nemo_rl           NeMo-RL's get_next_token_logprobs_from_logits, local branch (model_utils.py @7ea279ab, written
                    out as its operations: NeMo-RL does not install here): a float32 copy, log_softmax, gather
  rlkernels[nemo_rl]  the adapter's get_next_token_logprobs_from_logits (no entropy in either)
  rlkernels[nemo_rl loss]  the adapter's ClippedPGLossFn(input_type="logit") on the logits, its gradient in place

The logits are [1, N, V] (one packed micro-batch), the objective sum(logp) + 0.01 sum(entropy). Each trainer's own
functions come from rlkernels.testing.trainers (the trainers installed with --no-deps, as CI installs them).

    python -m benchmarks.trainer_logprobs --N 4096 --V 151936 --dtype bf16
"""

import argparse
import json
import os
import time

import torch

from .harness import WORKER_LINE, peak_rss_bytes, release_free_heap, reset_peak_rss, rss_bytes, run_memory_worker

PROVIDERS = ("areal", "rlkernels[areal]", "skyrl", "rlkernels[skyrl]", "openrlhf", "rlkernels[openrlhf]", "nemo_rl",
             "rlkernels[nemo_rl]", "rlkernels[nemo_rl loss]")
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def build(provider: str):
    """fn(logits [1, N, V], labels [1, N]) -> (log-probs, entropy), as the trainer (or its adapter) computes them."""
    from rlkernels.testing import trainers

    if provider == "areal":
        trainers.areal_functional()  # AReaL's package without its controllers' imports
        from areal.utils.functional import gather_logprobs_entropy

        return gather_logprobs_entropy
    if provider == "rlkernels[areal]":
        from rlkernels.integrations import areal

        return areal.gather_logprobs_entropy
    if provider in ("skyrl", "rlkernels[skyrl]"):
        module = trainers.skyrl_ppo_utils().torch_utils
        if provider == "rlkernels[skyrl]":
            from rlkernels.integrations import skyrl as module

        def skyrl_pass(logits, labels):
            logprobs = module.logprobs_from_logits(logits, labels, inplace_backward=True)
            return logprobs, module.chunked_entropy_from_logits(logits, requires_grad=True)

        return skyrl_pass
    if provider == "openrlhf":
        utils = trainers.openrlhf_actor()

        def openrlhf_pass(logits, labels):
            logits = logits.to(torch.float32)  # Actor.forward's copy
            return utils.log_probs_from_logits(logits, labels), utils.compute_entropy(logits)

        return openrlhf_pass
    if provider == "rlkernels[openrlhf]":
        from rlkernels import token_logprobs

        def route(logits, labels):
            stats = token_logprobs(logits, labels, compute_entropy=True, validate=False)
            return stats.logprobs, stats.entropy

        return route
    if provider.startswith("nemo_rl") or provider.startswith("rlkernels[nemo_rl"):
        return _nemo_rl(provider)
    raise ValueError(f"provider: expected one of {PROVIDERS}, got {provider!r}")


def _nemo_rl(provider: str):
    """NeMo-RL's update-forward log-probs (labels as its input_ids: row t scores labels[:, t + 1]), no entropy."""
    if provider == "nemo_rl":
        def nemo_rl_pass(logits, labels):
            logprobs = torch.log_softmax(logits.to(torch.float32)[:, :-1], -1).gather(-1, labels[:, 1:, None])
            return logprobs[..., 0], logprobs.new_zeros(())

        return nemo_rl_pass
    from rlkernels.integrations import nemo_rl

    if provider == "rlkernels[nemo_rl]":
        return lambda logits, labels: (nemo_rl.get_next_token_logprobs_from_logits(labels, logits),
                                       logits.new_zeros((), dtype=torch.float32))
    loss_fn = nemo_rl.ClippedPGLossFn({"reference_policy_kl_penalty": 0.0}, input_type="logit", routes=False)

    def loss_pass(logits, labels):  # the loss's value stands for the log-probs' sum in the objective
        B, T = labels.shape
        ones = torch.ones(B, T, dtype=torch.float32)
        data = {"input_ids": labels, "advantages": ones, "prev_logprobs": -ones, "generation_logprobs": -ones,
                "token_mask": ones, "sample_mask": torch.ones(B)}
        # a view: a computed tensor, as a model's output is (a leaf is the caller's own, never written), no copy
        loss, _ = loss_fn(data, float(B), float(B * (T - 1)), logits=logits.view_as(logits))
        return loss, loss.new_zeros(())

    return loss_pass


def _step(fn, logits, labels):
    logprobs, entropy = fn(logits, labels)
    (logprobs.float().sum() + 0.01 * entropy.float().sum()).backward()


def measure(provider: str, args) -> dict:
    """One provider in this (fresh) process: a warm-up step, then the measured one."""
    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(1, args.N, args.V, generator=g) * 2).to(DTYPES[args.dtype]).requires_grad_(True)
    labels = torch.randint(0, args.V, (1, args.N), generator=g)
    fn = build(provider)
    _step(fn, logits.detach().clone().requires_grad_(True), labels)  # warm-up (imports, lazy builds)
    grad = logits.numel() * logits.element_size()
    release_free_heap()
    base = rss_bytes()
    reset_peak_rss()
    start = time.perf_counter()
    _step(fn, logits, labels)
    seconds = time.perf_counter() - start
    return dict(provider=provider, peak_working_bytes=peak_rss_bytes() - base - grad, seconds=seconds)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--N", type=int, default=4096)
    ap.add_argument("--V", type=int, default=151936)
    ap.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    ap.add_argument("--providers", default=",".join(PROVIDERS))
    ap.add_argument("--json", default=None, help="write the rows here")
    ap.add_argument("--memory-worker", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.memory_worker:
        print(WORKER_LINE + json.dumps(measure(args.memory_worker, args)), flush=True)
        return None
    rows = []
    for provider in (p.strip() for p in args.providers.split(",") if p.strip()):
        argv = ["--memory-worker", provider, "--N", str(args.N), "--V", str(args.V), "--dtype", args.dtype]
        rows.append(run_memory_worker("benchmarks.trainer_logprobs", argv, dict(provider=provider)))
    logits_gib = args.N * args.V * DTYPES[args.dtype].itemsize / 2**30
    print(f"\ntrainer log-prob + entropy passes: [1, {args.N}, {args.V}] {args.dtype} logits ({logits_gib:.2f} GiB), "
          "fwd+bwd peak working memory above the logits and their gradient (CPU RSS), one process each")
    for row in rows:
        if "error" in row:
            print(f"{row['provider']:22} error: {row['error']}")
        else:
            print(f"{row['provider']:22} {row['peak_working_bytes'] / 2**30:8.2f} GiB {row['seconds']:8.1f} s")
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(dict(args=vars(args), rows=rows, torch=torch.__version__, date=time.strftime("%Y-%m-%d")), f,
                      indent=1)
    return rows


if __name__ == "__main__":
    main()
