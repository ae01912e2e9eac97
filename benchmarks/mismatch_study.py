"""The mismatch study: GRPO-style RL of a tiny causal LM on a CPU, under a real trainer-sampler mismatch, one
arm per rollout correction, every arm through `rlkernels.linear_decoupled_ppo_loss`.

    python -m benchmarks.mismatch_study                      # the study (about 20 min on 2 cores)
    python -m benchmarks.mismatch_study --smoke --out /tmp/s # a minute: the CI test's run
    python -m benchmarks.mismatch_study --backend torch --out /tmp/torch   # the soak run on the reference backend
    python -m benchmarks.mismatch_study --compare benchmarks/results/mismatch-study.json /tmp/torch/mismatch-study.json
    python -m benchmarks.mismatch_study --regime collapse    # the collapse study (benchmarks/collapse_study.py)

The task: sort a list of 8-20 numbers (a vocabulary of 256 ids). The reward is the fraction of positions of the
response equal to the sorted list, over max(response length, list length): checkable, dense enough for a small
model and long enough (9-21 tokens) that sequence-level statistics differ from token-level ones. A brief
supervised phase leaves the model partly right; RL then improves it.

Where the mismatch comes from: the trainer runs the model in float32 over whole sequences. The sampler runs the
same weights the way an inference engine serves them: weights quantised to FP8 (E4M3, one scale per output row,
as vLLM's W8A16 FP8 rollouts) and every activation in bfloat16, decoding token by token from a KV cache (another
order of every reduction), and it samples with top-p. `--sampler` and `--top-p` choose other paths; the
measurement that chose these (mismatch of each path at the supervised start) is in the JSON's "mismatch".

Every arm runs decoupled PPO (clip 0.2, dual clip 3): π_old is the trainer's own float32 pass before the update,
`rollout_logprobs` the sampler's log-probs of its processed (top-p renormalised) distribution, two optimizer
steps per batch. The arms differ in the rollout correction only, and two in the advantage estimator (the group
mean, as Dr. GRPO, against the optimal token baseline, whose Σπ² comes out of the π_old pass).

Output: DIR/mismatch-study.json ({"config", "mismatch", "arms": {arm: {"seeds": [{"seed", "step": [...], ...}]}},
"summary"}) and DIR/mismatch-study.png (reward and mismatch per arm, mean and min-max over seeds), where
matplotlib is installed.
"""

import argparse
import copy
import dataclasses
import hashlib
import json
import math
import os
import sys
import time
from typing import Dict, List, Optional

import torch

import rlkernels
from rlkernels import PolicyLossConfig, RolloutCorrection

from .harness import environment, rss_bytes
from .study_model import (
    BOS,
    FIRST_NUMBER,
    PAD,
    SEP,
    StudyConfig,
    TinyLM,
    _rounded,
    _smoothed,
    backend_name,
    generate,
    load_served,
    pyplot,
    response_hidden,
    rewards_of,
    sampler_model,
    summarise,
    supervised_start,
    top_p_logprobs,
    trainer_inputs,
)

SMOKE = dict(sft_steps=20, rl_steps=4, prompts_per_step=4, group_size=4, seeds=1, max_items=10)


def arms() -> Dict[str, dict]:
    """Arm name -> (rollout correction, advantage estimator). The thresholds are verl's presets' defaults; the TRM
    bound is the max-criterion |log rho| <= log 1.5 (k2 = (log rho)^2 / 2)."""
    tis, band = 2.0, (0.0, 2.0)
    return {
        "none_group_mean": dict(rc=None, baseline="group_mean"),
        "token_tis": dict(rc=RolloutCorrection(is_level="token", is_threshold=tis), baseline="group_mean"),
        "seq_tis": dict(rc=RolloutCorrection(is_level="sequence", is_threshold=tis), baseline="group_mean"),
        "seq_mis": dict(rc=RolloutCorrection(is_level="sequence", is_threshold=band, is_mode="mask"),
                        baseline="group_mean"),
        "geo_rs_token_tis": dict(rc=RolloutCorrection(is_level="token", is_threshold=tis,
                                                      rs={"seq_mean_k1": (0.999, 1.001)}), baseline="group_mean"),
        "trm_seq_max_k2": dict(rc=RolloutCorrection(rs={"seq_max_k2": 0.5 * math.log(1.5) ** 2}),
                               baseline="group_mean"),
        # TRM's exact criterion (SPEC §9): max_t KL(mu_t || pi_t) over the sampler's top-20 and the tail, a lower
        # bound on the exact KL, against the bound k2's log 1.5 stands for (KL ~ k2 for a small mismatch)
        "trm_seq_max_kl": dict(rc=RolloutCorrection.trm(0.5 * math.log(1.5) ** 2), baseline="group_mean",
                               sampler_topk=True),
        "none_otb": dict(rc=None, baseline="otb"),
        # the control: no mismatch at all (the sampler is the trainer: float32, the same weights)
        "on_policy_reference": dict(rc=None, baseline="group_mean", sampler="fp32", staleness=0),
        # rlkernels.schedules.ResponseLengthLR on the uncorrected arm: LR decay on response-length surges
        "none_length_lr": dict(rc=None, baseline="group_mean", length_lr=True),
    }


# -- the model ------------------------------------------------------------------------------------------------


# -- the task -------------------------------------------------------------------------------------------------


def make_prompts(cfg: StudyConfig, n_prompts: int, g: torch.Generator):
    """Left-padded prompts [n, P] (BOS numbers SEP), their valid mask and the sorted targets (lists)."""
    P = cfg.prompt_width
    counts = torch.randint(cfg.min_items, cfg.max_items + 1, (n_prompts,), generator=g)
    numbers = torch.randint(FIRST_NUMBER, FIRST_NUMBER + cfg.values, (n_prompts, cfg.max_items), generator=g)
    prompts = torch.full((n_prompts, P), PAD, dtype=torch.long)
    targets = []
    for i, n in enumerate(counts.tolist()):
        row = [BOS] + numbers[i, :n].tolist() + [SEP]
        prompts[i, P - len(row):] = torch.tensor(row)
        targets.append(sorted(numbers[i, :n].tolist()))
    return prompts, prompts != PAD, targets


# -- rollouts -------------------------------------------------------------------------------------------------


# -- one arm --------------------------------------------------------------------------------------------------

MEASURES = ("reward", "loss", "grad_norm", "entropy", "response_length", "rejected_seq_fraction", "is_zeroed_fraction",
            "is_weight_mean",
            "kl", "k3_kl", "chi2_token", "chi2_seq", "tv_token", "out_of_band_fraction", "log_ppl_abs_diff",
            "collapsed", "seconds", "rss_mib", "sample_hash")


def run_arm(cfg: StudyConfig, arm: dict, start: TinyLM, seed: int, check_naive: bool = False) -> dict:
    cfg = dataclasses.replace(cfg, **{k: arm[k] for k in ("sampler", "staleness") if k in arm})
    model = copy.deepcopy(start)
    opt = torch.optim.Adam(model.parameters(), lr=cfg.lr)
    schedule = rlkernels.schedules.ResponseLengthLR(opt) if arm.get("length_lr") else None
    config = PolicyLossConfig(rollout_correction=arm["rc"], compute_entropy=True, backend=cfg.backend)
    g_prompts = torch.Generator().manual_seed(20_000 + seed)
    g_sample = torch.Generator().manual_seed(30_000 + seed)
    served = sampler_model(model, cfg.sampler)
    lagged: List[dict] = []
    curves: Dict[str, list] = {k: [] for k in ("step",) + MEASURES + ("lr_scale",)}
    peak, window = -math.inf, []
    first_check = None
    for step in range(cfg.rl_steps):
        t0 = time.perf_counter()
        lagged.append({k: v.detach().clone() for k, v in model.state_dict().items()})
        lagged = lagged[-(cfg.staleness + 1):]  # asynchronous rollouts: the sampler holds the weights of k steps ago
        load_served(served, lagged[0], cfg.sampler)

        prompts, valid, targets = make_prompts(cfg, cfg.prompts_per_step, g_prompts)
        G = cfg.group_size
        prompts, valid = prompts.repeat_interleave(G, 0), valid.repeat_interleave(G, 0)
        targets = [t for t in targets for _ in range(G)]
        responses, lengths, rollout_lp, (topk_ids, topk_lp) = generate(served, cfg, prompts, valid, g_sample)
        reward = rewards_of(responses, lengths, targets)
        tokens, seq_valid, mask = trainer_inputs(cfg, prompts, valid, responses, lengths)
        group = torch.arange(len(targets)) // G

        with torch.no_grad():  # π_old: the trainer's own pass before the update (and Σπ² for the OTB)
            old = rlkernels.linear_token_logprobs(response_hidden(model, cfg, tokens, seq_valid), model.head.weight,
                                                  responses, bias=model.head.bias, backend=cfg.backend,
                                                  compute_sum_pi_squared=arm["baseline"] == "otb")
        old_lp = torch.where(mask, old.logprobs, torch.zeros(()))
        if arm["baseline"] == "otb":
            token_rewards = torch.zeros(mask.shape)
            token_rewards[torch.arange(len(targets)), lengths - 1] = reward
            advantages = rlkernels.optimal_token_baseline(token_rewards, mask, group, old_lp,
                                                          old.sum_pi_squared).advantages
        else:
            group_mean = torch.zeros(cfg.prompts_per_step).index_add_(0, group, reward) / G
            advantages = (reward - group_mean[group])[:, None].expand_as(mask) * mask

        order = torch.randperm(len(targets), generator=g_prompts)
        recorded = None
        grad_norms = []
        for part in order.chunk(cfg.minibatches):
            h = response_hidden(model, cfg, tokens[part], seq_valid[part])
            sampler = dict(sampler_topk_ids=topk_ids[part], sampler_topk_logprobs=topk_lp[part]) \
                if arm.get("sampler_topk") else {}
            out = rlkernels.linear_decoupled_ppo_loss(
                h, model.head.weight, responses[part], advantages[part], mask[part], bias=model.head.bias,
                old_logprobs=old_lp[part], rollout_logprobs=rollout_lp[part], config=config, **sampler)
            if check_naive and first_check is None:
                first_check = naive_check(model, cfg, h, responses[part], advantages[part], mask[part],
                                          old_lp[part], rollout_lp[part], arm["rc"], out.loss)
            opt.zero_grad()
            out.loss.backward()
            grad_norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)))
            opt.step()
            recorded = out if recorded is None else recorded

        m = rlkernels.metrics_to_floats(recorded.metrics)  # the step's one host read of the metrics
        if schedule is not None:
            schedule.step(m["response_length/mean"])
        delta = (old_lp - rollout_lp)[mask]
        ratio = delta.exp()
        mean_reward = float(reward.mean())
        window = (window + [mean_reward])[-10:]
        smoothed = sum(window) / len(window)
        peak = max(peak, smoothed)
        finite = math.isfinite(mean_reward) and all(math.isfinite(x) for x in grad_norms)
        values = dict(
            reward=mean_reward, loss=float(recorded.loss.detach()), grad_norm=sum(grad_norms) / len(grad_norms),
            entropy=m.get("actor/entropy", math.nan), response_length=m.get("response_length/mean", math.nan),
            rejected_seq_fraction=m.get("rollout_corr/rollout_rs_seq_masked_fraction", 0.0),
            # seq-MIS zeroes a sequence's weight instead of rejecting it (IcePop's out-of-band share)
            is_zeroed_fraction=m.get("rollout_corr/rollout_is_oob_ratio", 0.0),
            is_weight_mean=m.get("rollout_corr/rollout_is_mean", 1.0),
            kl=m["rollout_corr/kl"], k3_kl=m["rollout_corr/k3_kl"], chi2_token=m["rollout_corr/chi2_token"],
            chi2_seq=m["rollout_corr/chi2_seq"], tv_token=m["rollout_corr/tv_token"],
            out_of_band_fraction=float(((ratio < 0.9) | (ratio > 1.1)).float().mean()),
            log_ppl_abs_diff=m["rollout_corr/log_ppl_abs_diff"],
            collapsed=bool((not finite) or (step >= 10 and smoothed < peak - cfg.collapse_margin)),
            seconds=time.perf_counter() - t0, rss_mib=rss_bytes() / 2**20,
            sample_hash=hashlib.sha1(responses.numpy().tobytes()).hexdigest()[:12],
            lr_scale=1.0 if schedule is None else schedule.scale)
        curves["step"].append(step)
        for k, v in values.items():
            curves[k].append(v)
    result = {"seed": seed, **curves}
    if first_check is not None:
        result["first_step_naive_check"] = first_check
    return result


def naive_check(model, cfg, h, labels, advantages, mask, old_lp, rollout_lp, rc, loss) -> dict:
    """The first step's loss against benchmarks/naive.py (plain PyTorch over the full logits), where the arm's
    correction is one the naive function writes."""
    from .naive import naive_decoupled_ppo_loss

    if rc is not None and (rc.is_mode == "mask" or any(o.startswith("seq_max") for o, _ in rc.rs)):
        return {"skipped": "the naive baseline writes truncation and sum/mean rejection only"}
    B, R = labels.shape
    flat = lambda t: t.reshape(B * R)  # noqa: E731
    cu = torch.arange(0, B * R + 1, R)
    with torch.no_grad():
        logits = model.head(h.reshape(B * R, -1))
        naive = naive_decoupled_ppo_loss(
            logits, flat(labels), flat(advantages), flat(mask), flat(old_lp), flat(rollout_lp), cu,
            is_level=None if rc is None else rc.is_level, is_threshold=2.0 if rc is None else rc.is_threshold,
            rs=() if rc is None else rc.rs)
    loss = float(loss.detach())
    return {"rlkernels": loss, "naive": float(naive), "abs_diff": abs(loss - float(naive))}


# -- the mismatch before the study --------------------------------------------------------------------------


@torch.no_grad()
def measure_mismatch(cfg: StudyConfig, start: TinyLM, n_prompts: int = 64) -> dict:
    """Each sampler path at the supervised start: sample, then compare with the trainer's float32 pass. Exact
    per-token KL(mu || pi) over the vocabulary (teacher-forced on the samples), the sampled-token chi2 and the
    fraction of ratios outside [0.9, 1.1]."""
    out = {}
    for path in ("fp32", "bf16", "fp16", "fp8"):
        for top_p in sorted({1.0, 0.95, cfg.top_p}, reverse=True):
            c = dataclasses.replace(cfg, sampler=path, top_p=top_p)
            served = sampler_model(start, path)
            g = torch.Generator().manual_seed(7)
            prompts, valid, _ = make_prompts(c, n_prompts, g)
            responses, lengths, rollout_lp, _ = generate(served, c, prompts, valid, g)
            tokens, seq_valid, mask = trainer_inputs(c, prompts, valid, responses, lengths)
            trainer_logp = torch.log_softmax(start.head(response_hidden(start, c, tokens, seq_valid)), -1)
            lp = trainer_logp.gather(-1, responses[..., None])[..., 0]
            delta = (lp - rollout_lp)[mask]
            # the sampler's distribution at the same positions, teacher-forced through its own (full) pass
            sampler_logp = torch.log_softmax(
                served.head(response_hidden(served, c, tokens, seq_valid)).float() / c.temperature, -1)
            if top_p < 1.0:
                sampler_logp = top_p_logprobs(sampler_logp, top_p)
            mu = sampler_logp.exp()
            kl = torch.where(mu > 0, mu * (sampler_logp - trainer_logp), torch.zeros(())).sum(-1)[mask]
            ratio = delta.exp()
            out[f"{path}/top_p={top_p:g}"] = dict(
                exact_kl_mu_pi_token_mean=float(kl.mean()), exact_kl_mu_pi_token_max=float(kl.max()),
                sampled_k1=float(-delta.mean()), chi2_token=float((ratio ** 2).mean() - 1),
                out_of_band_fraction=float(((ratio < 0.9) | (ratio > 1.1)).float().mean()),
                max_abs_log_ratio=float(delta.abs().max()),
                seq_log_ratio_std=float(torch.zeros(len(lengths)).index_add_(
                    0, torch.nonzero(mask)[:, 0], delta).std()))
    return out


# -- the study ------------------------------------------------------------------------------------------------


def run_study(cfg: StudyConfig, out_dir: str, selected: Optional[List[str]] = None, check_naive: bool = True) -> dict:
    t0 = time.perf_counter()
    chosen = {k: v for k, v in arms().items() if selected is None or k in selected}
    starts = {seed: supervised_start(cfg, seed, make_prompts) for seed in range(cfg.seeds)}
    result = {"config": dataclasses.asdict(cfg), "environment": environment("cpu"),
              "arms_config": {k: {**v, "rc": repr(v["rc"])} for k, v in chosen.items()},
              "mismatch": measure_mismatch(cfg, starts[0]), "arms": {}}
    result["config"]["backend_resolved"] = backend_name(cfg.backend)
    for name, arm in chosen.items():
        result["arms"][name] = {"seeds": [run_arm(cfg, arm, starts[s], s, check_naive) for s in range(cfg.seeds)]}
        print(f"{name}: {json.dumps(summarise(result['arms'][name]))}", flush=True)
    result["summary"] = {k: summarise(v) for k, v in result["arms"].items()}
    result["wall_seconds"] = time.perf_counter() - t0
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, "mismatch-study.json")
    with open(path, "w") as f:
        json.dump(_rounded(result), f, separators=(",", ":"))
    plot(result, os.path.join(out_dir, "mismatch-study.png"))
    print(f"wrote {path} ({result['wall_seconds']:.0f} s)")
    return result


def plot(result: dict, path: str) -> None:
    """Reward, the share of ratios outside [0.9, 1.1], the rejected sequences and the gradient norm per arm:
    the mean over seeds of 10-step trailing means, with the seeds' min-max band."""
    plt = pyplot()
    if plt is None:
        return
    panels = (("reward", "reward (10-step mean)", False), ("out_of_band_fraction", "ratios outside [0.9, 1.1]", False),
              ("rejected_seq_fraction", "rejected sequences", False), ("grad_norm", "gradient norm", True))
    fig, axes = plt.subplots(2, 2, figsize=(12, 8))
    for name, arm in result["arms"].items():
        for ax, (key, title, log) in zip(axes.flat, panels):
            series = _smoothed(torch.tensor([s[key] for s in arm["seeds"]], dtype=torch.float64))
            steps = arm["seeds"][0]["step"]
            (line,) = ax.plot(steps, series.mean(0), label=name, lw=1.3)
            ax.fill_between(steps, series.min(0).values, series.max(0).values, alpha=0.12, color=line.get_color())
            ax.set_title(title)
            ax.set_xlabel("RL step")
            if log:
                ax.set_yscale("log")
    axes[0, 0].legend(fontsize=8)
    cfg = result["config"]
    fig.suptitle(f"sampler {cfg['sampler']}, {cfg['staleness']}-step stale weights, top-p {cfg['top_p']:g}; "
                 f"{cfg['seeds']} seeds; backend {cfg.get('backend_resolved', cfg['backend'])}")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _max_abs_diff(a: List[float], b: List[float]) -> float:
    return max((abs(x - y) for x, y in zip(a, b)), default=0.0)


def compare(path_a: str, path_b: str) -> dict:
    """Two runs of the study (the soak: backend cpu against torch). Per arm and seed: the number of leading steps
    whose sampled tokens are identical, the first step's loss difference (the same weights and samples: the
    backends' own error, within the parity tests' float32 tolerance, 2e-5 relative + 1e-5 absolute) and the
    largest loss / grad-norm / reward difference over the identical steps (there the weights have drifted by the
    earlier steps' rounding as well). Once a sampled token differs the runs are two samples of one process,
    compared by their final rewards."""
    with open(path_a) as f:
        a = json.load(f)
    with open(path_b) as f:
        b = json.load(f)
    report = {"backends": [a["config"]["backend_resolved"], b["config"]["backend_resolved"]], "arms": {}}
    for name in a["arms"]:
        if name not in b["arms"]:
            continue
        rows = []
        for sa, sb in zip(a["arms"][name]["seeds"], b["arms"][name]["seeds"]):
            same = [x == y for x, y in zip(sa["sample_hash"], sb["sample_hash"])]
            n = same.index(False) if False in same else len(same)
            step0 = abs(sa["loss"][0] - sb["loss"][0])
            rows.append(dict(seed=sa["seed"], steps=len(same), identical_steps=n, first_step_loss_abs_diff=step0,
                             first_step_within_tolerance=step0 <= 1e-5 * max(1.0, abs(sb["loss"][0]))
                             + 2e-5 * abs(sb["loss"][0]),
                             **{f"{k}_max_abs_diff": _max_abs_diff(sa[k][:n], sb[k][:n])
                                for k in ("loss", "grad_norm", "reward")}))
        report["arms"][name] = dict(seeds=rows, final_reward=[a["summary"][name]["final_reward_mean"],
                                                              b["summary"][name]["final_reward_mean"]])
    return report


def main(argv=None) -> int:
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--regime", choices=("mismatch", "collapse"), default="mismatch")
    regime, argv = pre.parse_known_args(argv)
    if regime.regime == "collapse":  # the second study: benchmarks/collapse_study.py, its own options
        from . import collapse_study

        return collapse_study.main(argv)
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--regime", choices=("mismatch", "collapse"), default="mismatch",
                   help="collapse: the collapse study (benchmarks/collapse_study.py, docs/study.md)")
    p.add_argument("--smoke", action="store_true", help="a one-minute run (the CI test)")
    p.add_argument("--out", default="benchmarks/results")
    p.add_argument("--backend", default="auto")
    p.add_argument("--seeds", type=int)
    p.add_argument("--rl-steps", type=int)
    p.add_argument("--sampler", choices=("fp32", "bf16", "fp16", "fp8"))
    p.add_argument("--top-p", type=float)
    p.add_argument("--staleness", type=int)
    p.add_argument("--arms", help="comma list of arm names (default: all)")
    p.add_argument("--plot", metavar="JSON", help="redraw the PNG of a study JSON (beside it) and exit")
    p.add_argument("--compare", nargs=2, metavar=("A", "B"),
                   help="compare two study JSONs (written to DIR/mismatch-study-backends.json) and exit")
    args = p.parse_args(argv)
    if args.plot:
        with open(args.plot) as f:
            plot(json.load(f), os.path.splitext(args.plot)[0] + ".png")
        return 0
    if args.compare:
        report = compare(*args.compare)
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "mismatch-study-backends.json"), "w") as f:
            json.dump(report, f, indent=1)
        print(json.dumps(report, indent=1))
        return 0
    torch.set_num_threads(min(2, torch.get_num_threads()))
    cfg = StudyConfig(**(SMOKE if args.smoke else {}), backend=args.backend)
    for field in ("seeds", "rl_steps", "sampler", "top_p", "staleness"):
        if getattr(args, field) is not None:
            cfg = dataclasses.replace(cfg, **{field: getattr(args, field)})
    run_study(cfg, args.out, args.arms.split(",") if args.arms else None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
