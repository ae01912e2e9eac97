"""What one call launches: ATen ops, host syncs, and on a GPU the CUDA kernels and the time of a forward + backward
eager, with the stage compiled, and replayed from a CUDA graph.

    python -m benchmarks.launches                                  # CPU: ATen ops per call (seconds)
    python -m benchmarks.launches --device cuda --json out.json    # + CUDA kernels (profiler) and times

Every ATen op below autograd that is not a view launches a kernel on a GPU, from the host: the count is the host
cost of a call that the device never hides (rlkernels/testing/launches.py counts them, inside our custom ops too).
Cases, all with validate=False (no host sync, so a step can be captured in a CUDA graph):

    ppo[all] / ppo[loss_only]   decoupled_ppo_loss, packed, decoupled, seq-MIS, the torch stage: every metric, or
                                the loss alone
    ppo[all,fused]              every metric with the fused stage (two Triton launches; on the CPU the CPU kernels'
                                op): the metrics are the torch stage's, run when read, after the backward
                                (metrics_launches; the step's time includes that read)
    ppo[loss_only,fused]        the loss alone with the fused stage
    ppo[loss_only,one_pass]     the same with dlogits formed in the forward (SPEC §2.4; logits_one_pass=True: on
                                the CPU the CPU kernels' op, on CUDA the Triton kernel, with validate=True there:
                                its backward reads g on the host)
    logprobs                    token_logprobs: the vocabulary pass alone (the floor the loss is measured against)
    topk_head / plain_pass      the sampler's top-k form (ops.head_stats, k ids) against the plain pass
    linear                      linear_decoupled_ppo_loss, the one-pass form (hidden states)

On CUDA each case also reports the kernels the profiler saw per forward + backward and the median time of a forward
+ backward: eager, and (ppo cases) replayed from a CUDA graph captured after warm-up. Runs interleave the variants.
"""

import argparse
import json
import math
import statistics
import time

import torch

import rlkernels
from rlkernels import PolicyLossConfig, RolloutCorrection
from rlkernels.backends.temperature import Temperature
from rlkernels.ops import vocab
from rlkernels.ops.head import head_token_stats
from rlkernels.testing.launches import count_launches

from .harness import cuda_graph


def _ppo_inputs(N: int, V: int, S: int, device: str, dtype: torch.dtype):
    torch.manual_seed(0)  # drawn on the device: an 8192 x 151,936 batch drawn on the host takes seconds
    old = torch.randn(N, device=device) * 0.1 - 3
    return dict(logits=(torch.randn(N, V, device=device) * 2).to(dtype).requires_grad_(True),
                labels=torch.randint(0, V, (N,), device=device), advantages=torch.randn(N, device=device),
                response_mask=torch.rand(N, device=device) > 0.1, old_logprobs=old,
                rollout_logprobs=old + 0.02 * torch.randn(N, device=device),
                cu_seqlens=torch.linspace(0, N, S + 1, device=device).long())


# the trainers' own calls, each outside the fused stage's family until it took them: verl's GSPO with its own IS
# weights, TRL's loss (it sets entropy_agg_mode on every call) and its GSPO with the bias-corrected KL, SkyRL's
# token-level rejection over the kept tokens, NeMo-RL's zero-weight rejection with the KL's score term, prime-rl's
# default loss, verl's SAPO, OpenRLHF's binary-KL gate, TRL's off-policy sequence mask; each with every metric, as the
# trainers log them. (options, the trainer's own IS weights, bypass mode)
TRAINERS = {
    "verl_gspo": (dict(loss_type="gspo", loss_agg_mode="seq-mean-token-mean"), True, False),
    "trl": (dict(loss_agg_mode="token-mean", entropy_agg_mode="token-mean", rollout_correction=RolloutCorrection(
        is_level="sequence", is_threshold=3.0, is_mode="mask")), False, False),
    # TRL's GSPO with beta > 0 and use_bias_correction_kl: the KL times the sequence's ratio, chained through it
    "trl_gspo_kl": (dict(ratio_level="sequence", log_ratio_clamp=None, loss_agg_mode="token-mean",
                         entropy_agg_mode="token-mean", kl_coef=0.04, kl_type="k3_unclamped", kl_bias_correction=True,
                         rollout_correction=RolloutCorrection(is_level="sequence", is_threshold=3.0, is_mode="mask")),
                    False, False),
    "skyrl": (dict(rollout_correction=RolloutCorrection(
        is_level="token", is_threshold=2.0, rs={"token_k1": (0.5, 2.0), "seq_all_k1": (0.2, 5.0)},
        seq_tokens="kept")), False, False),
    "nemo_rl": (dict(kl_coef=0.01, kl_type="k3", kl_score_gradient=True, rollout_correction=RolloutCorrection(
        is_level="token", is_threshold=2.0, rs={"seq_mean_k1": (0.99, 1.01)}, rs_mode="zero_weight")), False, False),
    # prime-rl's default loss (rlkernels.integrations.prime_rl.default_loss_fn): bypass mode, DPPO binary-TV on the
    # advantage's side, token-sum, its kl_tau as the log-ratio square
    "prime_rl": (dict(loss_type="dppo_binary_tv_signed", loss_agg_mode="token-sum", log_ratio_clamp=None,
                      log_ratio_sq_coef=1e-3), False, True),
    # and its default since PR #3418 (2026-08-27): IPO, |p - q| <= 0.3, no KL term
    "prime_rl_ipo": (dict(loss_type="ipo", ipo_eps=0.3, loss_agg_mode="token-sum", log_ratio_clamp=None), False,
                     True),
    # verl's SAPO (its loss function forces seq-mean-token-mean) with its own IS weights
    "verl_sapo": (dict(loss_type="sapo", loss_agg_mode="seq-mean-token-mean"), True, False),
    # OpenRLHF's binary-KL gate per token (rlkernels.integrations.openrlhf.rollout_correction_from_openrlhf("token",
    # "mask", "binary_kl", (0.5, 0.01))): dropped tokens' weights zeroed, the survivors' untruncated
    "openrlhf_bkl": (dict(rollout_correction=RolloutCorrection(is_level="token", is_threshold=(0.0, math.inf),
                                                              is_mode="mask", rs={"token_bkl": 0.01},
                                                              rs_mode="zero_weight")), False, False),
    # TRL's loss with DeepSeek-V3.2's off-policy sequence mask (its off_policy_mask_threshold)
    "trl_opsm": (dict(loss_agg_mode="token-mean", entropy_agg_mode="token-mean", off_policy_mask_threshold=0.5,
                      rollout_correction=RolloutCorrection(is_level="sequence", is_threshold=3.0, is_mode="mask")),
                 False, False),
}


def trainer_cases(N: int, V: int, S: int, device: str, dtype: torch.dtype):
    """trainer[name,torch|fused] -> a forward: each of TRAINERS with the torch stage and with the fused one."""
    x = _ppo_inputs(N, V, S, device, dtype)
    logits = x.pop("logits")
    x["ref_logprobs"] = x["old_logprobs"] - 0.01
    out = {}
    for name, (options, own_weights, bypass) in TRAINERS.items():
        kwargs = dict(x, is_weights=torch.rand(N, device=device) + 0.5) if own_weights else x
        if bypass:  # the sampler's log-probs alone: it is the proximal policy
            kwargs = {k: v for k, v in kwargs.items() if k != "old_logprobs"}
        for stage in ("torch", "fused"):
            config = PolicyLossConfig(**options, validate=False, compile_stage=False, fused_stage=stage == "fused")
            out[f"trainer[{name},{stage}]"] = lambda c=config, kw=kwargs: rlkernels.decoupled_ppo_loss(
                logits, config=c, **kw)
    return out


def cases(N: int, V: int, H: int, S: int, k: int, device: str, dtype: torch.dtype):
    """name -> a forward returning a loss to differentiate, or (outputs, their incoming gradients): the two passes
    are compared on their op alone, not on a loss of ours around them."""
    x = _ppo_inputs(N, V, S, device, dtype)
    logits = x.pop("logits")
    out = {}
    for metrics in ("all", "loss_only"):
        # the stage eager: its launches are what is counted, and a CUDA graph replays them (compile_stage=None would
        # compile it on CUDA, tens of seconds of first contact)
        config = PolicyLossConfig(rollout_correction=RolloutCorrection.seq_mis(), validate=False, metrics=metrics,
                                  compile_stage=False, fused_stage=False)  # the torch stage (see the fused row)
        out[f"ppo[{metrics}]"] = lambda c=config: rlkernels.decoupled_ppo_loss(logits, config=c, **x)
    if device == "cuda" or rlkernels.backends.is_available("cpu"):  # the fused stage (Triton, or the CPU kernels)
        for metrics in ("all", "loss_only"):
            config = PolicyLossConfig(rollout_correction=RolloutCorrection.seq_mis(), validate=False,
                                      metrics=metrics, compile_stage=False, fused_stage=True)
            out[f"ppo[{metrics},fused]"] = lambda c=config: rlkernels.decoupled_ppo_loss(logits, config=c, **x)
        config = PolicyLossConfig(rollout_correction=RolloutCorrection.seq_mis(), validate=device == "cuda",
                                  metrics="loss_only", compile_stage=False, fused_stage=True, logits_one_pass=True)
        out["ppo[loss_only,one_pass]"] = lambda c=config: rlkernels.decoupled_ppo_loss(logits, config=c, **x)
    out["logprobs"] = lambda: rlkernels.token_logprobs(logits, x["labels"], validate=False).logprobs.sum()
    # k distinct ids per row: one permutation's first k, shifted by the row (distinct mod V)
    ids = (torch.randperm(V, device=device)[:k][None, :] + torch.arange(N, device=device)[:, None]) % V
    T = Temperature.of(1.0)
    c, coef = torch.randn(N, device=device), torch.randn(N, k, device=device)
    backend = rlkernels.backends.resolve("auto", logits)
    out["plain_pass"] = lambda: ([vocab.token_stats(logits, x["labels"], T.tensor, False, False, False, backend, 0,
                                                    "default")[2]], [c])
    out["topk_head"] = lambda: (lambda s: ([s.logprobs, s.head_logprobs], [c, coef]))(
        head_token_stats(logits, x["labels"], ids, T, False, False, backend))
    hidden = torch.randn(N, H, device=device).to(dtype).requires_grad_(True)
    weight = (torch.randn(V, H, device=device) / H ** 0.5).to(dtype).requires_grad_(True)
    linear_config = PolicyLossConfig(rollout_correction=RolloutCorrection.seq_mis(), validate=False,
                                     compile_stage=False)
    out["linear"] = lambda: rlkernels.linear_decoupled_ppo_loss(hidden, weight, config=linear_config, **x)
    return out


def _backward(result) -> None:
    if hasattr(result, "loss"):  # a loss's output
        result.loss.backward()
    elif isinstance(result, tuple):
        outputs, grads = result
        torch.autograd.backward(outputs, grads)
    else:
        result.backward()


def _read_metrics(result) -> None:
    """A logger's read of a loss's metrics, after its backward (a fused stage's are computed here)."""
    dict(getattr(result, "metrics", {}))


def step(fn) -> None:
    result = fn()
    _backward(result)
    _read_metrics(result)


def count(fn) -> dict:
    result, forward = count_launches(fn)
    _, backward = count_launches(_backward, result)
    _, read = count_launches(_read_metrics, result)
    return dict(forward_launches=forward.launching, backward_launches=backward.launching,
                launches=forward.launching + backward.launching, aten_ops=forward.total + backward.total,
                metrics_launches=read.launching, syncs=len(forward.syncs) + len(backward.syncs) + len(read.syncs))


def cuda_kernels(fn) -> int:
    """CUDA kernels the profiler sees in one forward + backward."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step(fn)
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)


def _graphed(fn):
    """The forward + backward captured in a CUDA graph after warm-up (a step with validate=False syncs nothing, so
    it can be), or None with the reason."""
    try:
        graph, _ = cuda_graph(lambda: step(fn))
    except Exception as e:  # noqa: BLE001 (reported, not hidden: the table says why there is no graphed time)
        return None, f"{type(e).__name__}: {str(e)[:120]}"
    return graph.replay, None


def time_calls(variants: dict, reps: int, sync=torch.cuda.synchronize) -> dict:
    """Median ms per call of each variant, runs interleaved."""
    times = {name: [] for name in variants}
    for _ in range(reps):
        for name, run in variants.items():
            sync()
            t0 = time.perf_counter()
            run()
            sync()
            times[name].append((time.perf_counter() - t0) * 1e3)
    return {name: statistics.median(t) for name, t in times.items()}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--N", type=int, default=1024)
    p.add_argument("--V", type=int, default=4096)
    p.add_argument("--H", type=int, default=256)
    p.add_argument("--S", type=int, default=16)
    p.add_argument("--k", type=int, default=128)
    p.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--json", default=None)
    p.add_argument("--trainers", action="store_true",
                   help="also the TRAINERS' calls with the torch stage and the fused one (launches, and times with "
                        "--time-ppo)")
    p.add_argument("--time-ppo", action="store_true",
                   help="on the CPU too: the ppo cases' forward + backward time, interleaved (ratios, not absolutes)")
    args = p.parse_args(argv)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    rows = {}
    every = cases(args.N, args.V, args.H, args.S, args.k, args.device, dtype)
    if args.trainers:
        every.update(trainer_cases(args.N, args.V, args.S, args.device, dtype))
    for name, fn in every.items():
        step(fn)  # first contact (a compiled stage compiles here), outside the counts
        row = count(fn)
        if args.device == "cuda":
            row["cuda_kernels"] = cuda_kernels(fn)
            variants = {"eager": lambda f=fn: step(f)}
            if name.startswith("ppo"):
                replay, why = _graphed(fn)
                if replay is not None:
                    variants["graphed"] = replay
                else:
                    row["graphed"] = why
            row.update({f"{v}_ms": t for v, t in time_calls(variants, args.reps).items()})
        rows[name] = row
        print(f"{name:16} " + "  ".join(f"{key} {value if not isinstance(value, float) else f'{value:.3f}'}"
                                        for key, value in row.items()), flush=True)
    if args.time_ppo and args.device != "cuda":
        ppo = {name: (lambda f=fn: step(f)) for name, fn in every.items()
               if name.startswith(("ppo", "trainer")) or name == "logprobs"}
        times = time_calls(ppo, args.reps, sync=lambda: None)
        for name, t in times.items():
            rows[name]["eager_ms"] = t
        print("forward + backward ms (median, interleaved): " + "  ".join(f"{n} {t:.3f}" for n, t in times.items()))
    over = {phase: rows["topk_head"][f"{phase}_launches"] - rows["plain_pass"][f"{phase}_launches"]
            for phase in ("forward", "backward")}
    print(f"the top-k form over the plain pass: {over['forward']} launches forward, {over['backward']} backward")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(args=vars(args), torch=torch.__version__, results=rows, topk_over_plain=over), f, indent=1)


if __name__ == "__main__":
    main()
