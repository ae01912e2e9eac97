"""verl 0.9.1's actor step with its own loss path against the plugin's logits and linear routes, on the CPU.

    python -m benchmarks.verl_engine                       # V = 32768, 16 sequences of 32 + 96 tokens, fp32
    python -m benchmarks.verl_engine --V 65536 --reps 5 --json out.json

One actor step is verl's `FSDPEngineWithLMHead.forward_backward_batch` on one micro-batch (the model of
examples/verl_actor.py with a large vocabulary, so that the logits dominate), temperature 0.8, entropy
bonus and KL penalty on, token IS + geometric rejection from the driver:
    verl      loss_mode=vanilla: verl scales the logits by 1/T (a copy), takes log-probs and entropy from
              them (on the CPU: log_softmax + gather, and softmax for the entropy) and runs ppo_loss
    logits    loss_mode=rlkernels_logits: the packed logits go to decoupled_ppo_loss (one fused pass,
              gradient written into the logits)
    linear    loss_mode=rlkernels_linear: the model's forward hands the last hidden states and the LM
              head to linear_decoupled_ppo_loss (the logits are never formed)
Each round runs both, in turn (interleaved, so drift lands on both alike); medians over the rounds, ratios
against verl's from the same rounds. Peak memory is the step's rise of the process's peak RSS over its RSS
before the step (VmHWM reset), which includes the model's activations common to both. verl's GPU path
uses flash-attn's cross-entropy instead of log_softmax + gather: on a GPU the figures differ.
"""

import argparse
import json
import os
import statistics
import time
import warnings
from functools import partial

import torch

from rlkernels.testing.peers import import_verl, load_example

from .harness import peak_rss_bytes, release_free_heap, reset_peak_rss, rss_bytes

CORRECTION = {"rollout_is": "token", "rollout_is_threshold": 2.0, "rollout_rs": "seq_mean_k1",
              "rollout_rs_threshold": "0.95_1.05"}


def _steps(V: int, sequences: int, prompt: int, response: int):
    import_verl()  # verl's import (ray stood in where it is missing); loads the plugin
    from verl.protocol import DataProto
    from verl.workers.config import FSDPActorConfig, PolicyLossConfig
    from verl.workers.utils import losses

    from rlkernels.integrations import verl as rlk_verl

    rlk_verl.install_routes()  # the opt-in (RLKERNELS_VERL_ROUTES=1): the routes from the first (timed) step
    example = load_example("verl_actor.py")
    model = example.tiny_model(vocab=V)
    engine = example.cpu_engine(model)
    fields = example.rollout_batch(model, 0.8, seed=0, batch_size=sequences, prompt=prompt, response=response)
    batch = DataProto.from_dict(tensors={k: fields[k] for k in ("old_log_probs", "rollout_log_probs",
                                                                 "response_mask")})
    batch, _ = rlk_verl.compute_rollout_correction_and_add_to_batch(batch, CORRECTION)
    fields.update(response_mask=batch.batch["response_mask"], rollout_is_weights=batch.batch["rollout_is_weights"])
    tokens = int(fields["attention_mask"].sum())

    def step_of(loss_mode):
        actor = FSDPActorConfig(strategy="fsdp", rollout_n=1, ppo_mini_batch_size=sequences,
                                ppo_micro_batch_size_per_gpu=sequences, entropy_coeff=0.01, use_kl_loss=True,
                                kl_loss_coef=0.01, policy_loss=PolicyLossConfig(loss_mode=loss_mode))
        loss_function = partial(losses.ppo_loss, config=actor)

        def step():
            td = example.actor_batch(fields, 0.8, calculate_entropy=True, global_batch_size=sequences,
                                     micro_batch_size=sequences)
            model.zero_grad(set_to_none=True)
            with warnings.catch_warnings():
                warnings.simplefilter("error", UserWarning)  # the routes must not fall back
                out = engine.forward_backward_batch(td, loss_function=loss_function, forward_only=False)
            return out["loss"]
        return step

    return {"verl": step_of("vanilla"), "logits": step_of("rlkernels_logits"),
            "linear": step_of("rlkernels_linear")}, tokens


def measure(V: int, sequences: int, prompt: int, response: int, reps: int) -> dict:
    import torch.distributed as dist

    if not dist.is_initialized():  # verl's engine all-reduces the token count over its data-parallel group
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29533")
        dist.init_process_group("gloo", rank=0, world_size=1)
    steps, tokens = _steps(V, sequences, prompt, response)
    for step in steps.values():  # warm up
        step()
    times = {name: [] for name in steps}
    peaks = {name: [] for name in steps}
    for _ in range(reps):
        for name, step in steps.items():
            release_free_heap()
            base = rss_bytes()
            reset_peak_rss()
            t0 = time.perf_counter()
            step()
            times[name].append(time.perf_counter() - t0)
            peaks[name].append(peak_rss_bytes() - base)
    ms = {name: statistics.median(v) * 1e3 for name, v in times.items()}
    mib = {name: statistics.median(v) / 2**20 for name, v in peaks.items()}
    logits_mib = tokens * V * 4 / 2**20
    return {"tokens": tokens, "V": V, "logits_mib": round(logits_mib, 1), "results": {
        name: {"ms": round(ms[name], 1), "vs_verl": round(ms[name] / ms["verl"], 3),
               "peak_mib": round(mib[name], 1), "peak_vs_verl": round(mib[name] / mib["verl"], 3)}
        for name in steps}}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--V", type=int, default=32768)
    ap.add_argument("--sequences", type=int, default=16)
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--response", type=int, default=96)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--json", help="also write the results to this file")
    args = ap.parse_args(argv)
    torch.set_num_threads(max(1, torch.get_num_threads()))
    out = measure(args.V, args.sequences, args.prompt, args.response, args.reps)
    print(f"verl actor step, {out['tokens']} packed tokens, V={args.V} fp32 (logits {out['logits_mib']} MiB); "
          f"median over {args.reps} interleaved rounds")
    print(f"{'path':6} {'ms':>9} {'vs verl':>8} {'peak MiB':>9} {'vs verl':>8}")
    for name, r in out["results"].items():
        print(f"{name:6} {r['ms']:>9.1f} {r['vs_verl']:>8.3f} {r['peak_mib']:>9.1f} {r['peak_vs_verl']:>8.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return out


if __name__ == "__main__":
    main()
