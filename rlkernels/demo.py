"""`python -m rlkernels.demo`: a synthetic RL batch with a train-inference mismatch and a few bad responses, and
what six rollout-correction presets do with them.

Builds a packed batch of responses (128 by default) over a realistic vocabulary, simulates the
inference engine (the same model with perturbed logits, which samples the responses and reports
their log-probabilities), and makes a few of the responses bad: the engine reported them far less likely
than it drew them (a drifted engine, the failure the corrections target). It prints the batch's mismatch once,
with and without the bad responses, then runs `decoupled_ppo_loss` with plain PPO and the rollout-correction
presets (their bounds printed, a bound the demo sets marked as such) and says, per preset, what happened to the
bad responses (rejected, their weight capped, or let through), how much of the batch it kept (tokens and
sequences), and a verdict. Then it times forward + backward of the fused loss
against the naive PyTorch composition a trainer would otherwise write: both sides on the same
inputs, warmed up first, then run interleaved; it reports the medians, the speed-up or slow-down in
words, the first-call times when they stand out, peak memory where it can be measured honestly
(CUDA; CPU on Linux, for batches of 64 MiB of logits or more), a note when other processes competed
for the CPUs during the timing, and checks that both sides give the same loss and gradient.
"""

import argparse
import ctypes
import functools
import inspect
import math
import statistics
import sys
import time
from typing import Dict, List, NamedTuple, Optional

import torch

import rlkernels
from rlkernels import PolicyLossConfig, RolloutCorrection

# Health thresholds from the rollout-correction literature (verl docs, "When Speed Kills Stability"): of a preset's
# IS weights, and of the batch's mismatch
HEALTH = {
    "rollout_corr/rollout_is_mean": ("mean IS weight", lambda v: 0.5 <= v <= 2.0, "in [0.5, 2]"),
    "rollout_corr/rollout_is_eff_sample_size": ("ESS", lambda v: v >= 0.3, ">= 0.3"),
}
MISMATCH = (  # (metric, label, healthy range or None)
    ("rollout_corr/kl", "KL(mu||pi), k1 estimate (may be < 0)", (-0.1, 0.1)),
    ("rollout_corr/k3_kl", "KL(mu||pi), k3 estimate (>= 0)", None),
    ("rollout_corr/chi2_token", "chi2 per token (may be < 0)", (-1.0, 1.0)),
    ("rollout_corr/tv_token", "TV per token", None),
)
DRIFT = 1.5  # nats per token by which the engine under-reports a bad response's log-probs

# (name, preset, the keyword arguments the demo gives it: a bound set here, not the preset's own)
PRESETS = (
    ("none (plain PPO)", None, {}),
    ("token-TIS", RolloutCorrection.token_tis, {}),
    ("seq-MIS", RolloutCorrection.seq_mis, {}),
    ("Geo-RS + token-TIS", RolloutCorrection.geo_rs_token_tis, {}),
    ("Geo-RS + token-TIS, wide", RolloutCorrection.geo_rs_token_tis, dict(bounds=(0.9, 1.1))),
    ("IcePop", RolloutCorrection.icepop, {}),
    ("K3-RS", RolloutCorrection.k3_rs, {}),
)


class Batch(NamedTuple):
    inputs: Dict[str, torch.Tensor]  # decoupled_ppo_loss's keyword arguments
    bad: List[int]  # the bad responses (sequence indices)
    bad_tokens: torch.Tensor  # [N] bool, their tokens


def synthetic_batch(num_seqs: int, vocab: int, device, seed: int = 0, dtype=torch.float32) -> Batch:
    """A packed batch: the trainer's logits, the tokens the inference engine sampled, and the
    log-probabilities the engine reported for them; one response in 50 (at least one) is bad."""
    device = torch.device(device)
    g_cpu = torch.Generator().manual_seed(seed)  # sequence lengths and the choice of bad responses
    g = torch.Generator(device=device).manual_seed(seed)  # the [N, V] draws, made where they are used
    lengths = torch.randint(8, 65, (num_seqs,), generator=g_cpu)
    cu = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])
    N = int(cu[-1])
    logits = torch.randn(N, vocab, generator=g, device=device).mul_(2.5).to(dtype)
    with torch.no_grad():
        trainer = logits.float()
        # the engine's numerics: the same model with slightly different logits (bf16 kernels, ...);
        # the responses are sampled from the engine's distribution (by inverse CDF: one uniform per token)
        engine = torch.randn(N, vocab, generator=g, device=device).mul_(0.08).add_(trainer)
        cdf = torch.softmax(engine, -1).cumsum_(-1)
        u = torch.rand(N, 1, generator=g, device=device) * cdf[:, -1:]
        labels = torch.searchsorted(cdf, u).squeeze(1).clamp_(max=vocab - 1)
        del cdf
        rollout = engine.gather(1, labels[:, None]).squeeze(1) - torch.logsumexp(engine, -1)
        del engine
        lp = trainer.gather(1, labels[:, None]).squeeze(1) - torch.logsumexp(trainer, -1)
        del trainer
    # a few bad responses whose engine probabilities drifted far (the failure the fixes target)
    bad = sorted(torch.randperm(num_seqs, generator=g_cpu)[: max(1, num_seqs // 50)].tolist())
    bad_tokens = torch.zeros(N, dtype=torch.bool, device=device)
    for i in bad:
        bad_tokens[cu[i]: cu[i + 1]] = True
    rollout = torch.where(bad_tokens, rollout - DRIFT, rollout)
    old = lp - 0.02 * torch.randn(N, generator=g, device=device)  # the proximal policy: one step behind
    seq_reward = torch.randn(num_seqs, generator=g, device=device)
    advantages = seq_reward.repeat_interleave(lengths.to(device))
    mask = torch.ones(N, dtype=torch.bool, device=device)
    mask[cu[:-1].to(device)] = False  # the first token of each row is prompt, not response
    inputs = dict(logits=logits, labels=labels, advantages=advantages, response_mask=mask, old_logprobs=old,
                  rollout_logprobs=rollout, cu_seqlens=cu.to(device))
    return Batch(inputs, bad, bad_tokens & mask)


def naive_decoupled_ppo(logits, labels, advantages, response_mask, old_logprobs, rollout_logprobs,
                        config: PolicyLossConfig):
    """What a trainer writes today: fp32 log-softmax over [N, V], gather, token TIS, dual-clip PPO, token mean
    (the clip ratios, dual clip and truncation C of `config`)."""
    clip_low, clip_high, clip_c = config.clip_ratio_low, config.clip_ratio_high, config.clip_ratio_c
    C = config.rollout_correction.is_threshold
    logprobs = torch.log_softmax(logits.float(), dim=-1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    w = torch.exp((old_logprobs - rollout_logprobs).clamp(-20, 20)).clamp(max=C).detach()
    ratio = torch.exp((logprobs - old_logprobs).clamp(-20, 20))
    loss1 = -advantages * ratio
    loss2 = -advantages * ratio.clamp(1 - clip_low, 1 + clip_high)
    per_token = torch.maximum(loss1, loss2)
    if clip_c is not None:
        per_token = torch.where(advantages < 0, torch.minimum(per_token, -advantages * clip_c), per_token)
    per_token = per_token * w
    m = response_mask.float()
    return (per_token * m).sum() / m.sum().clamp_min(1)


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(step, device):
    """(seconds, result) of one call of `step`, the device work it queued included."""
    _sync(device)
    t0 = time.perf_counter()
    result = step()
    _sync(device)
    return time.perf_counter() - t0, result


def _fwd_bwd(loss_fn):
    """One training step's worth of the loss: forward, then backward into the logits' gradient."""
    loss = loss_fn()
    loss.backward()
    return loss


def _proc_status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise OSError(f"{field} not in /proc/self/status")


def _peak_memory(step, device) -> Optional[int]:
    """Bytes a call of `step` needs above the memory already live before it; None where that is not
    cheap to measure honestly.

    CUDA: the caching allocator's peak counter. CPU on Linux with glibc: the peak resident set size,
    reset through /proc/self/clear_refs right after returning the heap's free memory to the system
    (malloc_trim), so that memory an earlier call freed but the allocator kept cannot hide this
    call's needs."""
    if device.type == "cuda":
        _sync(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        step()
        _sync(device)
        return torch.cuda.max_memory_allocated(device) - base
    if device.type != "cpu" or not sys.platform.startswith("linux"):
        return None
    try:
        malloc_trim = ctypes.CDLL(None).malloc_trim  # glibc only (musl has none)
        malloc_trim(0)
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset the peak RSS (VmHWM) to the current RSS
        base = _proc_status_kib("VmRSS")
        if _proc_status_kib("VmHWM") > base + 1024:  # the reset did not take: no honest number
            return None
        step()
        return (_proc_status_kib("VmHWM") - base) * 1024
    except (OSError, AttributeError, ValueError):
        return None


def _cpu_pressure_us() -> Optional[int]:
    """Linux pressure stall information: total microseconds during which some runnable task (of any
    process) waited for a CPU; None where the kernel does not report it."""
    try:
        with open("/proc/pressure/cpu") as f:
            for line in f:
                if line.startswith("some"):
                    return int(line.split("total=")[1])
    except (OSError, IndexError, ValueError):
        pass
    return None


def _size(num_bytes: float) -> str:
    return f"{num_bytes / 2**30:.2f} GiB" if num_bytes >= 2**30 else f"{num_bytes / 2**20:.1f} MiB"


def _speed_in_words(t_naive: float, t_fused: float) -> str:
    if round(t_naive / t_fused, 1) == 1.0 and round(t_fused / t_naive, 1) == 1.0:
        return "rlkernels is about as fast as naive PyTorch (within 5%)"
    if t_fused < t_naive:
        return f"rlkernels is {t_naive / t_fused:.1f}\u00d7 faster than naive PyTorch"
    return f"rlkernels is {t_fused / t_naive:.1f}\u00d7 slower than naive PyTorch"


def _arguments(argv):
    parser = argparse.ArgumentParser(prog="python -m rlkernels.demo",
                                     description=" ".join(__doc__.split("\n\n")[0].split()))
    parser.add_argument("--sequences", type=int, default=128, help="responses in the batch (default 128)")
    parser.add_argument("--vocab", type=int, default=32000, help="vocabulary size (default 32000)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                        help="cpu or cuda[:N] (default: cuda when available)")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"),
                        help="dtype of the logits (default float32)")
    parser.add_argument("--repeats", type=int, default=5,
                        help="timed fwd+bwd runs of each side, interleaved (default 5)")
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")
    if args.sequences < 2:
        parser.error(f"--sequences must be at least 2 (a bad response among good ones), got {args.sequences}")
    if args.vocab < 2:
        parser.error(f"--vocab must be at least 2, got {args.vocab}")
    try:
        device = torch.device(args.device)
    except RuntimeError:
        parser.error(f"--device: expected cpu or cuda[:N], got {args.device!r}")
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error(f"--device {args.device}: no CUDA device is available to this PyTorch "
                     f"({torch.__version__}, {'a CPU-only build' if torch.version.cuda is None else 'no GPU found'}); "
                     "use --device cpu")
    if device.type == "cuda" and (device.index or 0) >= torch.cuda.device_count():
        parser.error(f"--device {args.device}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    if device.type not in ("cpu", "cuda") or (device.type == "cpu" and device.index is not None):
        parser.error(f"--device: expected cpu or cuda[:N], got {args.device!r}")
    return args


def _first_calls(sides, logits, device):
    """First calls, before anything else runs the loss (so they include every one-time start-up cost: kernel
    compilation, allocator growth); also the check that both sides agree. ({side: seconds}, (loss naive,
    loss fused), largest gradient difference, largest gradient entry)."""
    first, results = {}, {}
    for name, loss_fn in sides.items():
        logits.grad = None
        first[name], loss = _timed(functools.partial(_fwd_bwd, loss_fn), device)
        results[name] = (loss.item(), logits.grad)
    logits.grad = None
    (loss_naive, grad_naive), (loss_fused, grad_fused) = results.values()
    grad_diff = (grad_fused.float() - grad_naive.float()).abs().max().item()
    return first, (loss_naive, loss_fused), grad_diff, grad_naive.float().abs().max().item()


def _print_batch(batch: Batch) -> None:
    """The batch's story and its train-inference mismatch, once: it is the batch's, whatever the correction (the
    IS log-ratio log pi_old - log mu of the decoupled loss), with and without the bad responses."""
    x = batch.inputs
    mask, cu = x["response_mask"], x["cu_seqlens"]
    lengths = (cu[1:] - cu[:-1]).tolist()
    bad = len(batch.bad)
    print(f"The batch: {len(lengths)} responses, which the engine sampled with its own numerics (the trainer's "
          f"logits plus noise).\n{bad} of them {'is' if bad == 1 else 'are'} bad: the engine reported "
          f"{'its' if bad == 1 else 'their'} tokens {DRIFT} nats less likely than it drew them (a drifted engine): "
          + ", ".join(f"response #{i} ({lengths[i]} tokens)" for i in batch.bad) + ".\n")
    columns = {}
    for title, keep in (("all responses", mask), ("without the bad ones", mask & ~batch.bad_tokens)):
        out = rlkernels.rollout_correction(x["old_logprobs"], x["rollout_logprobs"], keep, cu_seqlens=cu,
                                           config=RolloutCorrection())
        columns[title] = rlkernels.metrics_to_floats(out.metrics)
    width = max(len(label) for _, label, _ in MISMATCH)
    print(f"The batch's train-inference mismatch, per token (rho = pi_old / mu; the batch's, the same for every "
          f"preset below; sample means, so an estimate of a quantity >= 0 may come out < 0):\n  {'':<{width}}"
          + "".join(f"  {title:>28}" for title in columns))
    for key, label, healthy in MISMATCH:
        cells = []
        for values in columns.values():
            v = values[key]
            flag = "" if healthy is None or healthy[0] <= v <= healthy[1] else \
                f" (outside [{healthy[0]:g}, {healthy[1]:g}])"
            cells.append(f"{f'{v:.4f}{flag}':>20}")
        print(f"  {label:<{width}}" + "".join(f"  {c:>28}" for c in cells))
    print()


def _describe(preset, overrides: dict) -> str:
    """What a preset keeps, in words, with its bounds; a bound set here is marked, beside the preset's default."""
    if preset is None:
        return "no correction: every response at weight 1, whatever the engine reported"
    rc = preset(**overrides)
    parts = []
    if rc.is_level is not None:
        level = "token" if rc.is_level == "token" else "sequence"
        lo, hi = rc.is_range
        parts.append(f"{level} IS weight 0 outside [{lo:g}, {hi:g}]" if rc.is_icepop
                     else f"{level} IS weight truncated at {hi:g}")
    for option, bound in rc.rs:
        what = {"seq_sum_k1": "its ratio prod(rho)", "seq_mean_k1": "its geometric-mean ratio",
                "seq_mean_k3": "its mean k3 = rho - log(rho) - 1"}.get(option, option)
        limit = f"outside [{bound[0]:g}, {bound[1]:g}]" if isinstance(bound, tuple) else f"above {bound:g}"
        parts.append(f"reject a sequence with {what} {limit}")
    text = "; ".join(parts)
    if overrides:  # a bound the demo sets, beside the preset's own default
        defaults = inspect.signature(preset).parameters
        text += " (set here; the preset's default: " + ", ".join(
            f"{k}={defaults[k].default}" for k in overrides) + ")"
    return text


class _Result(NamedTuple):
    loss: float
    tokens_kept: float  # the share of the response tokens left in the final mask
    seqs_kept: int  # sequences with a response token left
    seqs: int
    bad_rejected: int  # bad responses with no token left
    bad_weight: Optional[float]  # the mean IS weight of the bad responses' tokens left (None: no weights)
    others_weight: Optional[float]  # the same of the other tokens
    metrics: Dict[str, float]


def _run_preset(batch: Batch, preset, overrides: dict) -> _Result:
    x = batch.inputs
    rc = None if preset is None else preset(**overrides)
    with torch.no_grad():  # the forward only: the loss, its mask and its metrics
        out = rlkernels.decoupled_ppo_loss(**x, config=PolicyLossConfig(rollout_correction=rc))
    m = rlkernels.metrics_to_floats(out.metrics)  # one host sync for every metric
    cu = x["cu_seqlens"].cpu()
    lengths = cu[1:] - cu[:-1]
    mask, kept = x["response_mask"].cpu(), out.mask.cpu()
    responding = torch.segment_reduce(mask.float(), "sum", lengths=lengths) > 0
    left = torch.segment_reduce(kept.float(), "sum", lengths=lengths) > 0
    bad_tokens = batch.bad_tokens.cpu()
    weights = None if out.is_weights is None else out.is_weights.cpu()

    def mean_weight(tokens):
        tokens = tokens & kept
        return None if weights is None or not tokens.any() else float(weights[tokens].mean())

    return _Result(out.loss.item(), kept.sum().item() / max(1, mask.sum().item()), int((left & responding).sum()),
                   int(responding.sum()), sum(not bool(left[i]) for i in batch.bad), mean_weight(bad_tokens),
                   mean_weight(~bad_tokens), m)


def _verdict(r: _Result, num_bad: int) -> str:
    words = []
    if r.seqs_kept < 0.5 * r.seqs:
        words.append(f"rejects {1 - r.seqs_kept / r.seqs:.0%} of all sequences: bounds too narrow for this batch")
    elif r.bad_rejected == num_bad:
        words.append("catches the bad responses")
    elif r.bad_weight is not None and r.others_weight is not None and r.bad_weight <= 2.5 * r.others_weight:
        words.append("bounds the bad responses' weight")
    else:
        words.append("lets the bad responses through")
    failed = [label for key, (label, ok, _) in HEALTH.items() if key in r.metrics and not ok(r.metrics[key])]
    if failed:
        words.append("check " + ", ".join(failed))
    return "; ".join(words)


def _print_presets(batch: Batch) -> None:
    """Each preset: its bounds, then a table of what it did to the batch and to the bad responses."""
    width = max(len(name) for name, _, _ in PRESETS)
    print("The corrections:")
    for name, preset, overrides in PRESETS:
        print(f"  {name:<{width}}  {_describe(preset, overrides)}")
    rows = [(name, _run_preset(batch, preset, overrides)) for name, preset, overrides in PRESETS]
    header = (f"\n{'preset':<{width}}  {'loss':>8}  {'tokens kept':>11}  {'sequences kept':>14}  "
              f"{'bad responses':<24}  {'IS mean':>7}  {'ESS':>5}  verdict")
    print(header)
    print("-" * len(header.strip()))
    fmt = lambda v, w: f"{'-':>{w}}" if v is None else f"{v:>{w}.3f}"  # noqa: E731
    for name, r in rows:
        if r.bad_rejected:
            fate = f"rejected {r.bad_rejected}/{len(batch.bad)}"
        elif r.bad_weight is None:
            fate = "kept, weight 1"
        else:
            fate = f"kept, weight {r.bad_weight:.2f} ({r.others_weight:.2f})" if r.others_weight is not None else \
                f"kept, weight {r.bad_weight:.2f}"
        print(f"{name:<{width}}  {r.loss:>8.5f}  {r.tokens_kept:>11.1%}  {f'{r.seqs_kept}/{r.seqs}':>14}  "
              f"{fate:<24}  {fmt(r.metrics.get('rollout_corr/rollout_is_mean'), 7)}  "
              f"{fmt(r.metrics.get('rollout_corr/rollout_is_eff_sample_size'), 5)}  {_verdict(r, len(batch.bad))}")
    print("\n(bad responses: how many the preset rejected, or the mean IS weight their tokens got (the other tokens' "
          "in brackets);\n the raw weight pi_old/mu of a bad token is about "
          f"e^{DRIFT} = {math.exp(DRIFT):.1f}. IS mean and ESS: of the weights on every response token, before "
          "rejection (verl's\n convention), healthy when "
          + "; ".join(f"{label} {rule}" for label, _, rule in HEALTH.values()) + ")")


class _Timing(NamedTuple):
    times: Dict[str, list]  # seconds of each timed call, per side
    peak: Dict[str, Optional[int]]  # bytes above the inputs, per side (None: not measured)
    contended: Optional[float]  # the share of the timed runs' wall time tasks waited for a CPU


def _time_sides(sides, logits, device, repeats: int, measure_peak: bool) -> _Timing:
    """A second warm-up call of each side (after the presets), which also measures peak memory; then the timed
    calls, interleaved (naive, fused, naive, fused, ...) so that drift in the machine's speed (clocks, other
    processes) hits both sides alike."""
    peak = {}
    for name, loss_fn in sides.items():
        logits.grad = None
        step = functools.partial(_fwd_bwd, loss_fn)
        if measure_peak:
            peak[name] = _peak_memory(step, device)
        else:
            step()
            peak[name] = None
    times = {name: [] for name in sides}
    stall_start, wall_start = _cpu_pressure_us(), time.perf_counter()
    for _ in range(repeats):
        for name, loss_fn in sides.items():
            logits.grad = None
            times[name].append(_timed(functools.partial(_fwd_bwd, loss_fn), device)[0])
    stall_end, wall = _cpu_pressure_us(), time.perf_counter() - wall_start
    contended = None if stall_start is None or stall_end is None else (stall_end - stall_start) / 1e6 / wall
    logits.grad = None
    return _Timing(times, peak, contended)


def _print_timing(timing: _Timing, first, repeats: int, logits_size: str) -> None:
    times, peak, contended = timing
    sides = list(times)
    median = {name: statistics.median(ts) for name, ts in times.items()}
    notable_first = any(first[name] > 1.5 * median[name] for name in sides)
    show_peak = all(v is not None for v in peak.values())
    print(f"\ntiming: forward + backward of the token-TIS loss on this batch, the gradient reset before "
          f"every call;\n{repeats} run{'s' if repeats > 1 else ''} of each side, interleaved, "
          "after 2 warm-up runs of each")
    columns = {name: [f"{median[name] * 1e3:.1f} ms", f"{min(ts) * 1e3:.1f}-{max(ts) * 1e3:.1f} ms"]
               for name, ts in times.items()}
    titles = ["median", "range"]
    if notable_first:
        titles.append("first call")
        for name in sides:
            columns[name].append(f"{first[name] * 1e3:.1f} ms")
    if show_peak:
        titles.append("peak memory")
        for name in sides:
            columns[name].append(_size(peak[name]))
    width = max(map(len, sides))
    widths = [max(len(title), *(len(columns[name][i]) for name in sides)) for i, title in enumerate(titles)]
    print(f"  {'':<{width}}" + "".join(f"  {title:>{w}}" for title, w in zip(titles, widths)))
    for name in sides:
        print(f"  {name:<{width}}" + "".join(f"  {cell:>{w}}" for cell, w in zip(columns[name], widths)))
    verdict = _speed_in_words(median[sides[0]], median[sides[1]])
    if contended is not None and contended > 0.2:
        verdict += " on a busy machine (unreliable: see the note below)"
    print(f"  => {verdict}")
    notes = []
    if notable_first:
        notes.append("first call: one-time start-up included, kept out of the medians")
    if show_peak:
        notes.append(f"peak memory: above the inputs, including the {logits_size} gradient each side writes")
    else:
        notes.append("peak memory: not measured (on a CPU only for 64 MiB of logits or more, where the resident set "
                     "is fine-grained enough)")
    if contended is not None and contended > 0.2:
        notes.append(f"tasks waited for a CPU during {min(contended, 1):.0%} of the timed runs: other processes "
                     "competed for the CPUs, so these timings do not represent an idle machine")
    elif any(max(ts) > 1.5 * min(ts) for ts in times.values()):
        notes.append("the run times varied by over 50%: the machine is busy or throttling; rerun, or raise --repeats")
    for note in notes:
        print(f"  ({note})")


def main(argv=None):
    args = _arguments(argv)
    device = torch.device(args.device)
    bad_batch = synthetic_batch(args.sequences, args.vocab, device, dtype=getattr(torch, args.dtype))
    batch = bad_batch.inputs
    N = batch["labels"].numel()
    logits_bytes = batch["logits"].numel() * batch["logits"].element_size()
    logits_size = _size(logits_bytes)
    print(f"rlkernels {rlkernels.__version__} demo: {args.sequences} responses, {N} tokens, vocab {args.vocab}, "
          f"{batch['logits'].dtype} logits on {device} ({logits_size})\n")

    # The timed comparison: the fused token-TIS loss vs the naive composition of the same loss, both
    # forward + backward into the gradient of the same logits, which is reset to None before every call.
    cfg = PolicyLossConfig(rollout_correction=RolloutCorrection.token_tis())
    rest = {k: v for k, v in batch.items() if k not in ("logits", "cu_seqlens")}
    logits = batch["logits"].detach().requires_grad_(True)  # shares the batch's storage: no copy
    backend = rlkernels.backends.resolve("auto", logits)
    fused_name, naive_name = f"rlkernels ({backend} backend)", "naive PyTorch"
    sides = {  # naive first: _print_timing compares the first side with the second
        naive_name: lambda: naive_decoupled_ppo(logits, **rest, config=cfg),
        fused_name: lambda: rlkernels.decoupled_ppo_loss(logits, cu_seqlens=batch["cu_seqlens"], config=cfg,
                                                         **rest).loss,
    }
    first, (loss_naive, loss_fused), grad_diff, grad_scale = _first_calls(sides, logits, device)
    _print_batch(bad_batch)
    _print_presets(bad_batch)
    # (on the CPU the peak is the resident set, coarse by a few MiB: left out for small batches)
    timing = _time_sides(sides, logits, device, args.repeats, device.type != "cpu" or logits_bytes >= 64 * 2**20)
    _print_timing(timing, first, args.repeats, logits_size)
    print(f"  same loss ({loss_fused:.6f} vs {loss_naive:.6f}) and gradient (largest difference "
          f"{grad_diff:.1e}, {grad_diff / max(grad_scale, 1e-30):.1e} of the largest entry)")


if __name__ == "__main__":
    main()
