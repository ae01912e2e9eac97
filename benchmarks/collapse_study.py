"""The collapse study: the mismatch study (benchmarks/mismatch_study.py) in the regime where published runs
collapse. Sampler-anchored objectives (bypass mode: π_old := μ, REINFORCE / vanilla policy gradient with the
rollout correction as its IS weight), answers of 193-249 tokens, and a small mixture-of-experts variant whose
sampler routes in bfloat16, so that routing flips give the mismatch a heavy tail.

    python -m benchmarks.mismatch_study --regime collapse                      # the study (see docs/study.md)
    python -m benchmarks.mismatch_study --regime collapse --smoke --out /tmp/c # the CI test's run (seconds)

Everything not written here is the mismatch study's: the transformer (`TinyLM`, `Block`), the served copy of it
(FP8 E4M3 weights per output row, bf16 activations, token-by-token decoding from a KV cache), `generate` with the
sampler's top-20, the trainer's float32 pass and the reward (`rewards_of`: the fraction of positions right, over
max(response length, target length)).

The task: a walk of n numbers, n = 192..248 in steps of 8: the prompt is BOS a d L SEP (a start value of 32,
a step d of 1..7, a length token L of 8), the answer a, a + d, a + 2d, ... mod 32 (ids 4-35 of a 256-id
vocabulary; the other ids are a tail the model must learn to avoid), then EOS. The reward is the fraction of
positions equal to the walk, over max(response length, n): one wrong token shifts the rest of a walk the model
continues from its own last token, so the reward rewards long error-free stretches. Answers are 193-249 tokens.
A supervised phase of 250 steps (teacher forcing) leaves the model partly right (reward about 0.2).

Design fixed before any run (docs/study.md, "The collapse regime"):
- staleness 0: the published collapses are synchronous runs whose mismatch is the numerics alone;
- one batch: 4 prompts x 8 samples, two minibatches (two Adam steps), gradient clip 1, group-mean advantages
  (Dr. GRPO), token-mean aggregation; lr 3e-4, the only setting chosen by a run: the on-policy control alone fell
  from 0.21 to 0.04 within 50 steps at the mismatch study's 1e-3, and kept its reward at 1e-4 and 3e-4 over 60
  steps (3e-4 the larger);
- the geo-RS band and the TRM bound come from the lr = 0 calibration of the arm's sampler path: the 99th
  percentile of |mean_t log rho_t| and of max_t KL_topk(mu_t || pi_t) over the calibration's sequences, so that
  each rejects about 1 % of the sequences at the start, and more only if the mismatch grows;
- collapse: the COLLAPSE_WINDOW-step mean reward falls COLLAPSE_MARGIN below its running peak (both over full
  windows only), or a NaN; the margin is set from the control arm's reward noise (`margin_from_control`) so that
  the control is flagged in FALSE_ALARM of its seeds. Predictors: an ESS fall: the 10-step mean sequence ESS below
  ESS_FALL x its mean over steps 0-9; a gradient spike: a gradient norm above GRAD_SPIKE x the median of every
  earlier step's; a KL rise: the 10-step mean top-k KL(mu || pi) above KL_RISE x its mean over steps 0-9.

Output: DIR/collapse-study.json ({"config", "calibration", "thresholds", "arms": {arm: {"seeds": [{"seed",
"step": [...], ...}]}}, "summary", "predictors"}), the mismatch study's schema, and DIR/collapse-study.png.
"""

import argparse
import copy
import dataclasses
import hashlib
import json
import math
import multiprocessing
import os
import sys
import time
from typing import Dict, List, Optional

import torch
import torch.nn.functional as F

import rlkernels
from rlkernels import PolicyLossConfig, RolloutCorrection

from . import study_model as ms
from .harness import environment, rss_bytes
from .study_model import BOS, FIRST_NUMBER, PAD, SEP

# The collapse criterion, calibrated before each run on the control arms' seeds then recorded. Before the run of
# 2026-12-05 (full regime, 200 steps): `--calibrate-margin benchmarks/results/collapse-study.json
# benchmarks/results/collapse-study-moe.json --rl-steps 200` (`margin_from_control`): 6 distinct control seeds (the
# dense and the MoE control, 3 each), the 95th percentile of the criterion's statistic over 20,000 simulated seeds
# built on each seed's own curve, so that a control seed, its own drift included, is flagged in 5 % of cases
# (simulated on the mean curve, 0.1 %). The MoE and dense runs of 2026-12-05 used 0.077, the same quantile on the mean
# curve of the 2 control seeds of 2026-12-04 over 250 steps, and it flagged 3 of their 6 control seeds: a seed's own
# drift is the larger part of the control's noise. The run of 2026-12-04 used a 10-step window, a peak that counted
# the first, shorter windows, and a fixed margin of 0.15. Each run's JSON records its definitions.
COLLAPSE_WINDOW = 25
COLLAPSE_MARGIN = 0.110
FALSE_ALARM = 0.05  # the control's flagged share of seeds the margin is set for
ESS_FALL = 0.5
GRAD_SPIKE = 3.0
KL_RISE = 2.0  # the top-k KL predictor: its 10-step mean above KL_RISE x its mean over steps 0-9
CLIP_BAND = (0.8, 1.2)  # the PPO clip band (clip 0.2) the calibration counts tokens outside of
CALIBRATION_QUANTILE = 0.99


@dataclasses.dataclass
class CollapseConfig(ms.StudyConfig):
    min_items: int = 192
    max_items: int = 248
    d_model: int = 48
    layers: int = 2
    heads: int = 4
    sft_steps: int = 250
    sft_batch: int = 32
    rl_steps: int = 200  # 400 on 2026-12-04, 250 in the MoE and dense runs of 2026-12-05 (118 min in all); 200
    # with the served copies' float32 arithmetic keeps 3 seeds of every arm within 90 minutes (83 min)
    prompts_per_step: int = 4
    lr: float = 3e-4  # chosen on the on-policy control alone: at 1e-3 the control itself fell 0.21 -> 0.04 by step 50
    group_size: int = 8
    minibatches: int = 2
    sampler: str = "fp8"
    staleness: int = 0
    seeds: int = 3
    collapse_margin: float = COLLAPSE_MARGIN
    collapse_window: int = COLLAPSE_WINDOW
    experts: int = 4  # the MoE variant: top-1 of 4 experts per block (Switch-style gate: softmax prob x expert)
    expert_hidden: int = 96
    calibration_prompts: int = 8
    workers: int = 2
    served_float32_arithmetic: bool = True  # `served_model`; False up to the MoE and dense runs of 2026-12-05

    @property
    def prompt_width(self) -> int:
        return 5  # BOS a d L SEP


SMOKE = dict(min_items=12, max_items=19, d_model=32, sft_steps=10, sft_batch=16, rl_steps=2, prompts_per_step=2,
             group_size=4, seeds=1, calibration_prompts=16, workers=1)


def arms(thresholds: Dict[str, dict]) -> Dict[str, dict]:
    """Arm name -> how it trains. `mode`: bypass (loss_type reinforce, rollout_logprobs only) or decoupled (PPO
    clip against the trainer's own π_old); `model`: dense or moe; `sampler`: the served path."""
    def geo(path):
        return RolloutCorrection(rs={"seq_mean_k1": thresholds[path]["geo_rs_band"]})

    def trm(path):
        return RolloutCorrection.trm(thresholds[path]["trm_eps"])

    unbounded = dict(is_level="sequence", is_threshold=(0, math.inf), is_mode="mask")  # PG-Seq-IS's weight
    seq_is = RolloutCorrection(**unbounded)
    dense = dict(mode="bypass", model="dense", sampler="fp8")
    moe = dict(mode="bypass", model="moe", sampler="fp8")
    return {
        # the control: the same objective with no mismatch (the sampler is the trainer: float32, the same weights)
        "on_policy_bypass_none": dict(dense, rc=None, sampler="fp32"),
        "bypass_none": dict(dense, rc=None),
        "bypass_token_tis": dict(dense, rc=RolloutCorrection(is_level="token", is_threshold=2.0)),
        "bypass_seq_tis": dict(dense, rc=RolloutCorrection(is_level="sequence", is_threshold=2.0)),
        "bypass_seq_mis": dict(dense, rc=RolloutCorrection(is_level="sequence", is_threshold=(0, 2.0),
                                                           is_mode="mask")),
        "bypass_geo_rs": dict(dense, rc=geo("dense/fp8")),
        "bypass_trm_kl": dict(dense, rc=trm("dense/fp8")),
        "bypass_pg_seq_is": dict(dense, rc=seq_is),
        "decoupled_none": dict(dense, rc=None, mode="decoupled"),
        "moe_bypass_none": dict(moe, rc=None),
        "moe_bypass_pg_seq_is": dict(moe, rc=seq_is),
        "moe_replay_bypass_none": dict(moe, rc=None, replay=True),
        # the causal arms (2026-12-05): the failing MoE objective, PG-Seq-IS, with each correction in turn: its
        # sequence weight truncated, masked, or replaced by the truncated token weight; or kept, with the
        # sequences outside the calibrated geo-RS band or over the TRM bound rejected
        "moe_bypass_seq_tis": dict(moe, rc=RolloutCorrection(is_level="sequence", is_threshold=2.0)),
        "moe_bypass_seq_mis": dict(moe, rc=RolloutCorrection(is_level="sequence", is_threshold=(0, 2.0),
                                                             is_mode="mask")),
        "moe_bypass_token_tis": dict(moe, rc=RolloutCorrection(is_level="token", is_threshold=2.0)),
        "moe_bypass_pg_seq_is_geo_rs": dict(moe, rc=RolloutCorrection(
            **unbounded, rs={"seq_mean_k1": thresholds["moe/fp8"]["geo_rs_band"]})),
        "moe_bypass_pg_seq_is_trm": dict(moe, rc=RolloutCorrection.trm(thresholds["moe/fp8"]["trm_eps"],
                                                                       **unbounded)),
        # ... with routing replay; with the router's own rounding removed (float32 on the served copy: the flips'
        # other sources, the served activations, remain; docs/study.md); and with no mismatch at all (the sampler
        # is the trainer), beside that path's control
        "moe_replay_bypass_pg_seq_is": dict(moe, rc=seq_is, replay=True),
        "moe_router32_bypass_pg_seq_is": dict(moe, rc=seq_is, sampler="fp8_router32"),
        "moe_on_policy_bypass_pg_seq_is": dict(moe, rc=seq_is, sampler="fp32"),
        "moe_on_policy_bypass_none": dict(moe, rc=None, sampler="fp32"),
    }


# -- the MoE variant --------------------------------------------------------------------------------------------


class MoEBlock(ms.Block):
    """The mismatch study's block with its MLP replaced by top-1 routing over `experts` MLPs (gate: the chosen
    expert's softmax probability, so the router trains). `record` (a list) collects each call's choices [B, T];
    `replay` ([B, T] expert ids, -1: the block's own choice) routes as another pass did (routing replay, R3)."""

    def __init__(self, d: int, heads: int, experts: int, hidden: int):
        super().__init__(d, heads)
        del self.up, self.down
        self.router = torch.nn.Linear(d, experts, bias=False)
        self.ups = torch.nn.ModuleList(torch.nn.Linear(d, hidden) for _ in range(experts))
        self.downs = torch.nn.ModuleList(torch.nn.Linear(hidden, d) for _ in range(experts))
        self.record: Optional[list] = None
        self.replay: Optional[torch.Tensor] = None

    def forward(self, x, mask, cache=None):
        x = x + self.attend(x, mask, cache)
        z = self.ln2(x)
        logits = self.router(z.to(self.router.weight.dtype))  # bf16 on the served copy; float32 on fp8_router32
        choice = logits.argmax(-1)
        if self.record is not None:
            self.record.append(choice)
        if self.replay is not None:
            choice = torch.where(self.replay >= 0, self.replay, choice)
        gate = torch.softmax(logits.float(), -1).gather(-1, choice[..., None]).to(z.dtype)
        out = torch.zeros_like(z)
        for e, (up, down) in enumerate(zip(self.ups, self.downs)):
            out = torch.where((choice == e)[..., None], down(F.gelu(up(z))), out)
        return x + gate * out


class MoELM(ms.TinyLM):
    def __init__(self, cfg: CollapseConfig):
        super().__init__(cfg)
        self.blocks = torch.nn.ModuleList(MoEBlock(cfg.d_model, cfg.heads, cfg.experts, cfg.expert_hidden)
                                          for _ in range(cfg.layers))


def build(cfg: CollapseConfig, kind: str) -> ms.TinyLM:
    return MoELM(cfg) if kind == "moe" else ms.TinyLM(cfg)


ROUTER32 = "_router32"  # a served path's suffix: the same path with each MoE router kept in float32


@torch.no_grad()
def load_served(served: ms.TinyLM, state: Dict[str, torch.Tensor], path: str) -> None:
    """The mismatch study's weight update; the router stays unquantised (in the served dtype, bf16 on the fp8 path,
    or float32 with the _router32 suffix), as vLLM serves MoE gates."""
    ms.load_served(served, state, path.removesuffix(ROUTER32))
    for name, param in served.named_parameters():
        if ".router." in name:
            param.copy_(state[name])
    for module in served.modules():  # a float32 GEMM's weights: its served dtype's values
        if hasattr(module, "served_dtype"):
            for param in module.parameters():
                param.copy_(param.to(module.served_dtype))


def served_model(model: ms.TinyLM, path: str, float32_arithmetic: bool = True) -> ms.TinyLM:
    """The served copy of the trainer's model on a path. `float32_arithmetic` (CollapseConfig): its reduced-precision
    attention and GEMMs computed in float32 on the reduced dtype's values, each output rounded once, as a GPU kernel
    computes them (`ms.flash_attention_arithmetic`, `_float32_gemm`); the CPU's own bfloat16 kernels (the runs up to
    the MoE and dense runs of 2026-12-05) take 2-4x as long at the study's shapes. A float32 path is unchanged."""
    served = copy.deepcopy(model).to(ms.SAMPLER_DTYPES[path.removesuffix(ROUTER32)]).requires_grad_(False)
    if path.endswith(ROUTER32):
        for block in moe_blocks(served):
            block.router.float()
    if float32_arithmetic:
        for block in served.blocks:
            block.float32_attention = block.qkv.weight.dtype != torch.float32
        for module in served.modules():
            if isinstance(module, torch.nn.Linear) and module.weight.dtype != torch.float32:
                _float32_gemm(module)
    load_served(served, model.state_dict(), path)
    return served


def _float32_gemm(linear: torch.nn.Linear) -> None:
    """A served linear layer as a GPU's GEMM in its dtype computes: the dtype's values (kept in float32: the products
    are exact), float32 accumulation and bias, the output rounded once to the dtype."""
    linear.served_dtype = linear.weight.dtype
    linear.float()
    linear.forward = lambda x: F.linear(x.float(), linear.weight, linear.bias).to(linear.served_dtype)


def moe_blocks(model) -> List[MoEBlock]:
    return [b for b in model.blocks if isinstance(b, MoEBlock)]


def set_routing(model, record: bool = False, replay: Optional[torch.Tensor] = None) -> List[list]:
    """Start recording each MoE block's choices (returns the lists) and / or replaying [B, T, layers] routes."""
    lists = []
    for i, block in enumerate(moe_blocks(model)):
        block.record = [] if record else None
        block.replay = None if replay is None else replay[..., i]
        lists.append(block.record)
    return lists


def routes_of(lists: List[list], width: int) -> Optional[torch.Tensor]:
    """Recorded choices -> [B, width, layers] (-1 where nothing was recorded), or None for a dense model."""
    if not lists or lists[0] is None:
        return None
    out = []
    for calls in lists:
        r = torch.cat(calls, 1)[:, :width]
        out.append(F.pad(r, (0, width - r.shape[1]), value=-1))
    return torch.stack(out, -1)


# -- the task -------------------------------------------------------------------------------------------------


LENGTHS = 8  # the prompt's length token picks n = min_items + i * length_step, i < LENGTHS
STEPS = 7  # the step d is 1..STEPS


def make_prompts(cfg: CollapseConfig, n_prompts: int, g: torch.Generator):
    """Prompts [n, 5] (BOS a d L SEP), their valid mask and the targets: the n-item walk a, a + d, a + 2d, ...
    (mod `values`), n set by the length token L."""
    a = torch.randint(0, cfg.values, (n_prompts,), generator=g)
    d = torch.randint(1, STEPS + 1, (n_prompts,), generator=g)
    L = torch.randint(0, LENGTHS, (n_prompts,), generator=g)
    length_ids = FIRST_NUMBER + cfg.values + L  # just past the values: ids the response must never use
    prompts = torch.stack([torch.full_like(a, BOS), FIRST_NUMBER + a, FIRST_NUMBER + d, length_ids,
                           torch.full_like(a, SEP)], 1)
    step = (cfg.max_items - cfg.min_items) // (LENGTHS - 1)
    targets = [[FIRST_NUMBER + (ai + k * di) % cfg.values for k in range(cfg.min_items + li * step)]
               for ai, di, li in zip(a.tolist(), d.tolist(), L.tolist())]
    return prompts, prompts != PAD, targets


def supervised_start(cfg: CollapseConfig, seed: int, kind: str) -> ms.TinyLM:
    """The mismatch study's supervised phase on correct walks; the same data for both kinds."""
    return ms.supervised_start(cfg, seed, make_prompts, build=lambda c: build(c, kind))


def rollout(served, cfg, prompts, valid, g):
    """`generate` with each MoE block's choices recorded: (responses, lengths, logprobs, top-k, routes)."""
    lists = set_routing(served, record=True)
    responses, lengths, logprobs, topk = ms.generate(served, cfg, prompts, valid, g)
    routes = routes_of(lists, cfg.prompt_width + cfg.max_response)
    set_routing(served)
    return responses, lengths, logprobs, topk, routes


def trainer_hidden(model, cfg, tokens, seq_valid, replay=None):
    """The trainer's float32 pass; for a MoE model also its own routes [B, P + R, layers] (before any replay)."""
    lists = set_routing(model, record=True, replay=replay)
    h = ms.response_hidden(model, cfg, tokens, seq_valid)
    own = routes_of(lists, tokens.shape[1])
    set_routing(model)
    return h, own


def flip_rate(sampler_routes, trainer_routes, mask, cfg) -> float:
    """The share of (response token, block) pairs whose expert differs between the sampler and the trainer, at the
    positions that predict the response tokens."""
    if sampler_routes is None:
        return 0.0
    P = cfg.prompt_width
    s = sampler_routes[:, P - 1:P - 1 + mask.shape[1]]
    t = trainer_routes[:, P - 1:P - 1 + mask.shape[1]]
    valid = mask[..., None] & (s >= 0)
    return float(((s != t) & valid).sum() / valid.sum().clamp_min(1))


def sequence_ess(seq_log_ratio: torch.Tensor) -> float:
    """(Σ ρ)² / (N Σ ρ²) of the sequence ratios ρ = exp(Σ_t log π/μ), in [1/N, 1]."""
    s = seq_log_ratio.double()
    if s.numel() == 0:
        return math.nan
    return float(torch.exp(2 * torch.logsumexp(s, 0) - torch.logsumexp(2 * s, 0)) / s.numel())


def topk_kl(trainer_logp, topk_ids, topk_lp):
    """KL(μ_t ‖ π_t) over the partition {the sampler's top-k ids, the tail} (SPEC §9.2), per token [B, R]."""
    ids = topk_ids.clamp_min(0)
    valid = topk_ids >= 0
    mu = torch.where(valid, topk_lp.exp(), torch.zeros(()))
    pi = torch.where(valid, trainer_logp.gather(-1, ids).exp(), torch.zeros(()))
    head = torch.where(valid & (mu > 0), mu * (topk_lp - torch.log(pi)), torch.zeros(())).sum(-1)
    mu_tail, pi_tail = (1 - mu.sum(-1)).clamp_min(0), (1 - pi.sum(-1)).clamp_min(1e-30)
    tail = torch.where(mu_tail > 0, mu_tail * (torch.log(mu_tail.clamp_min(1e-30)) - torch.log(pi_tail)),
                       torch.zeros(()))
    return head + tail


# -- calibration: lr = 0 ----------------------------------------------------------------------------------------


@torch.no_grad()
def calibrate(cfg: CollapseConfig, start: ms.TinyLM, path: str) -> dict:
    """No learning: sample from the served path, then the trainer's float32 pass on the same weights and tokens.
    The mismatch every arm on this path starts from, from the numerics alone."""
    served = served_model(start, path, cfg.served_float32_arithmetic)
    g = torch.Generator().manual_seed(7)
    prompts, valid, targets = make_prompts(cfg, cfg.calibration_prompts, g)
    G = cfg.group_size
    prompts, valid = prompts.repeat_interleave(G, 0), valid.repeat_interleave(G, 0)
    responses, lengths, rollout_lp, (topk_ids, topk_lp), routes = rollout(served, cfg, prompts, valid, g)
    reward = ms.rewards_of(responses, lengths, [t for t in targets for _ in range(G)])
    tokens, seq_valid, mask = ms.trainer_inputs(cfg, prompts, valid, responses, lengths)
    h, own = trainer_hidden(start, cfg, tokens, seq_valid)
    trainer_logp = torch.log_softmax(start.head(h), -1)
    lp = trainer_logp.gather(-1, responses[..., None])[..., 0]
    delta = torch.where(mask, lp - rollout_lp, torch.zeros(()))
    ratio = delta[mask].exp()
    sampler_logp = torch.log_softmax(served.head(ms.response_hidden(served, cfg, tokens, seq_valid)).float(), -1)
    mu = sampler_logp.exp()
    exact_kl = torch.where(mu > 0, mu * (sampler_logp - trainer_logp), torch.zeros(())).sum(-1)
    tkl = torch.where(mask, topk_kl(trainer_logp, topk_ids, topk_lp), torch.zeros(()))
    n = mask.sum(1).clamp_min(1)
    seq_sum = delta.sum(1)
    seq_mean_abs = (seq_sum / n).abs()
    seq_max_kl = tkl.max(1).values
    q = CALIBRATION_QUANTILE
    return dict(
        tokens=int(mask.sum()), sequences=int(len(lengths)), reward=float(reward.mean()),
        response_length=float(lengths.float().mean()),
        out_of_clip_band_fraction=float(((ratio < CLIP_BAND[0]) | (ratio > CLIP_BAND[1])).float().mean()),
        out_of_band_fraction=float(((ratio < 0.9) | (ratio > 1.1)).float().mean()),
        exact_kl_mu_pi_token_mean=float(exact_kl[mask].mean()), exact_kl_mu_pi_token_max=float(exact_kl[mask].max()),
        topk_kl_token_mean=float(tkl[mask].mean()), sampled_k1=float(-delta[mask].mean()),
        k3_kl=float((ratio - delta[mask] - 1).mean()), max_abs_log_ratio=float(delta[mask].abs().max()),
        seq_log_ratio_std=float(seq_sum.std()), seq_log_ratio_max_abs=float(seq_sum.abs().max()),
        seq_ess=sequence_ess(seq_sum), routing_flip_rate=flip_rate(routes, own, mask, cfg),
        seq_mean_abs_log_ratio_q99=float(torch.quantile(seq_mean_abs.double(), q)),
        seq_max_topk_kl_q99=float(torch.quantile(seq_max_kl.double(), q)))


def thresholds_from(calibration: dict) -> Dict[str, dict]:
    """Each served path's geo-RS band and TRM bound, from its calibration (module docstring)."""
    out = {}
    for path, c in calibration.items():
        b = max(c["seq_mean_abs_log_ratio_q99"], 1e-6)
        out[path] = dict(geo_rs_band=(math.exp(-b), math.exp(b)), trm_eps=max(c["seq_max_topk_kl_q99"], 1e-8))
    return out


# -- one arm ----------------------------------------------------------------------------------------------------

MEASURES = ("reward", "loss", "grad_norm", "entropy", "response_length", "seq_ess", "is_ess", "topk_kl_mean",
            "topk_kl_seq_max_mean", "topk_kl_max", "k3_kl", "kl", "chi2_token", "chi2_seq", "tv_token",
            "rejected_seq_fraction", "is_zeroed_fraction", "is_weight_mean", "out_of_band_fraction",
            "out_of_clip_fraction", "max_abs_log_ratio", "seq_log_ratio_std", "routing_flip_rate",
            "log_ppl_abs_diff", "collapsed", "seconds", "rss_mib", "sample_hash")


def run_arm(cfg: CollapseConfig, name: str, arm: dict, start: ms.TinyLM, seed: int, check_naive: bool) -> dict:
    cfg = dataclasses.replace(cfg, sampler=arm["sampler"])
    model = copy.deepcopy(start)
    opt = torch.optim.Adam(model.parameters(), lr=cfg.lr)
    bypass = arm["mode"] == "bypass"
    config = PolicyLossConfig(loss_type="reinforce" if bypass else "ppo_clip", rollout_correction=arm["rc"],
                              compute_entropy=True, backend=cfg.backend)
    g_prompts = torch.Generator().manual_seed(20_000 + seed)
    g_sample = torch.Generator().manual_seed(30_000 + seed)
    served = served_model(model, cfg.sampler, cfg.served_float32_arithmetic)
    curves: Dict[str, list] = {k: [] for k in ("step",) + MEASURES}
    peak, window = -math.inf, []
    first_check = None
    for step in range(cfg.rl_steps):
        t0 = time.perf_counter()
        load_served(served, model.state_dict(), cfg.sampler)  # staleness 0: this step's weights
        prompts, valid, targets = make_prompts(cfg, cfg.prompts_per_step, g_prompts)
        G = cfg.group_size
        prompts, valid = prompts.repeat_interleave(G, 0), valid.repeat_interleave(G, 0)
        targets = [t for t in targets for _ in range(G)]
        responses, lengths, rollout_lp, (topk_ids, topk_lp), routes = rollout(served, cfg, prompts, valid, g_sample)
        reward = ms.rewards_of(responses, lengths, targets)
        tokens, seq_valid, mask = ms.trainer_inputs(cfg, prompts, valid, responses, lengths)
        group = torch.arange(len(targets)) // G
        group_mean = torch.zeros(cfg.prompts_per_step).index_add_(0, group, reward) / G
        advantages = (reward - group_mean[group])[:, None].expand_as(mask) * mask
        old_lp = None
        if not bypass:  # π_old: the trainer's own pass before the update
            with torch.no_grad():
                h_old, _ = trainer_hidden(model, cfg, tokens, seq_valid)
                old = rlkernels.linear_token_logprobs(h_old, model.head.weight, responses, bias=model.head.bias,
                                                      backend=cfg.backend)
            old_lp = torch.where(mask, old.logprobs, torch.zeros(()))
        replay = routes if arm.get("replay") else None

        order = torch.randperm(len(targets), generator=g_prompts)
        grad_norms, metrics, seq_log_ratio, deltas, flips = [], [], [], [], []
        loss0 = None
        for part in order.chunk(cfg.minibatches):
            h, own = trainer_hidden(model, cfg, tokens[part], seq_valid[part],
                                    None if replay is None else replay[part])
            if routes is not None:
                flips.append(flip_rate(routes[part], own, mask[part], cfg))
            anchors = dict(rollout_logprobs=rollout_lp[part]) if bypass else \
                dict(old_logprobs=old_lp[part], rollout_logprobs=rollout_lp[part])
            out = rlkernels.linear_decoupled_ppo_loss(
                h, model.head.weight, responses[part], advantages[part], mask[part], bias=model.head.bias,
                config=config, sampler_topk_ids=topk_ids[part], sampler_topk_logprobs=topk_lp[part], **anchors)
            if check_naive and first_check is None:
                args = (responses[part], mask[part], None if bypass else old_lp[part], rollout_lp[part],
                        topk_ids[part], topk_lp[part], arm["rc"])
                first_check = naive_check(model, h, advantages[part], *args, out.loss)
                # the same inputs with advantages +-1 by sequence, so that the check cannot pass on a batch
                # whose advantages are all 0 (every sample of a group scored alike)
                probe_adv = ((torch.arange(len(part)) % 2) * 2 - 1.0)[:, None] * mask[part]
                with torch.no_grad():
                    probe = rlkernels.linear_decoupled_ppo_loss(
                        h, model.head.weight, responses[part], probe_adv, mask[part], bias=model.head.bias,
                        config=config, sampler_topk_ids=topk_ids[part], sampler_topk_logprobs=topk_lp[part],
                        **anchors)
                first_check["probe"] = naive_check(model, h, probe_adv, *args, probe.loss)
            opt.zero_grad()
            out.loss.backward()
            grad_norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)))
            opt.step()
            metrics.append(rlkernels.metrics_to_floats(out.metrics))
            # the ratio the arm faces: π (this minibatch's pass, before its update) against μ
            m = mask[part]
            d = torch.where(m, out.logprobs - rollout_lp[part], torch.zeros(()))
            seq_log_ratio.append(d.sum(1))
            deltas.append(d[m])
            loss0 = float(out.loss.detach()) if loss0 is None else loss0

        def avg(key, default=math.nan, metrics=metrics):
            return _mean_or(m.get(key, default) for m in metrics)

        delta = torch.cat(deltas)
        ratio = delta.exp()
        seq = torch.cat(seq_log_ratio)
        mean_reward = float(reward.mean())
        window = (window + [mean_reward])[-cfg.collapse_window:]
        smoothed = sum(window) / len(window)
        full = len(window) == cfg.collapse_window  # the peak and the test over full windows only
        peak = max(peak, smoothed) if full else peak
        finite = math.isfinite(mean_reward) and all(math.isfinite(x) for x in grad_norms) and math.isfinite(loss0)
        values = dict(
            reward=mean_reward, loss=loss0, grad_norm=sum(grad_norms) / len(grad_norms),
            entropy=avg("actor/entropy"), response_length=float(lengths.float().mean()),
            seq_ess=sequence_ess(seq), is_ess=avg("rollout_corr/rollout_is_eff_sample_size"),
            topk_kl_mean=avg("rollout_corr/topk_kl_mean"),
            topk_kl_seq_max_mean=avg("rollout_corr/topk_kl_seq_max_mean"),
            topk_kl_max=max(m["rollout_corr/topk_kl_max"] for m in metrics), k3_kl=avg("rollout_corr/k3_kl"),
            kl=avg("rollout_corr/kl"), chi2_token=avg("rollout_corr/chi2_token"), chi2_seq=avg("rollout_corr/chi2_seq"),
            tv_token=avg("rollout_corr/tv_token"),
            rejected_seq_fraction=avg("rollout_corr/rollout_rs_seq_masked_fraction", 0.0),
            is_zeroed_fraction=avg("rollout_corr/rollout_is_oob_ratio", 0.0),
            is_weight_mean=avg("rollout_corr/rollout_is_mean", 1.0),
            out_of_band_fraction=float(((ratio < 0.9) | (ratio > 1.1)).float().mean()),
            out_of_clip_fraction=float(((ratio < CLIP_BAND[0]) | (ratio > CLIP_BAND[1])).float().mean()),
            max_abs_log_ratio=float(delta.abs().max()), seq_log_ratio_std=float(seq.std()),
            routing_flip_rate=_mean_or(flips, 0.0), log_ppl_abs_diff=avg("rollout_corr/log_ppl_abs_diff"),
            collapsed=bool((not finite) or (full and smoothed < peak - cfg.collapse_margin)),
            seconds=time.perf_counter() - t0, rss_mib=rss_bytes() / 2**20,
            sample_hash=hashlib.sha1(responses.numpy().tobytes()).hexdigest()[:12])
        curves["step"].append(step)
        for k, v in values.items():
            curves[k].append(v)
        if (step + 1) % 50 == 0:
            print(f"  {name} seed {seed} step {step + 1}: reward {smoothed:.3f}, "
                  f"{_mean_or(curves['seconds'][-50:]):.2f} s/step", file=sys.stderr, flush=True)
    result = {"seed": seed, **curves}
    if first_check is not None:
        result["first_step_naive_check"] = first_check
    return result


def _mean_or(xs, default=math.nan) -> float:
    xs = [x for x in xs if x is not None and not (isinstance(x, float) and math.isnan(x))]
    return sum(xs) / len(xs) if xs else default


def naive_check(model, h, advantages, labels, mask, old_lp, rollout_lp, topk_ids, topk_lp, rc, loss) -> dict:
    """The first step's loss against the loss written in plain PyTorch over the full logits: REINFORCE with the
    arm's IS weight and rejection in bypass mode (below), decoupled PPO through benchmarks/naive.py."""
    with torch.no_grad():
        logits = model.head(h).float()
        if old_lp is not None:
            from .naive import naive_decoupled_ppo_loss

            B, R = labels.shape
            flat = lambda t: t.reshape(B * R)  # noqa: E731
            naive = naive_decoupled_ppo_loss(logits.reshape(B * R, -1), flat(labels), flat(advantages), flat(mask),
                                             flat(old_lp), flat(rollout_lp), torch.arange(0, B * R + 1, R),
                                             is_level=None)
        else:
            naive = naive_bypass_loss(logits, labels, advantages, mask, rollout_lp, topk_ids, topk_lp, rc)
    loss = float(loss.detach())
    return {"rlkernels": loss, "naive": float(naive), "abs_diff": abs(loss - float(naive))}


def naive_bypass_loss(logits, labels, advantages, mask, rollout_lp, topk_ids, topk_lp, rc) -> torch.Tensor:
    """Bypass REINFORCE, token-mean over the kept tokens: Σ -A·w·log π / Σ kept, with Δ = log π - log μ, w = 1,
    min(e^Δ_t, C), min(e^S, C), or e^S inside (lo, hi) and 0 outside, where Δ_t and the sequence sum S = ΣΔ are each
    clamped to ±20 (SPEC §4); a sequence is rejected when its geometric-mean ratio exp(mean Δ) leaves the
    seq_mean_k1 band, or its max top-k KL exceeds seq_max_kl."""
    logp = torch.log_softmax(logits.float(), -1)
    lp = logp.gather(-1, labels[..., None])[..., 0]
    m = mask.float()
    delta = ((lp - rollout_lp) * m).clamp(-20, 20)
    S = ((lp - rollout_lp) * m).sum(1, keepdim=True).clamp(-20, 20)  # the sequence sum, clamped as a whole
    w = torch.ones_like(lp)
    if rc is not None and rc.is_level == "token":
        w = torch.minimum(delta.exp(), torch.tensor(rc.is_threshold))
    elif rc is not None and rc.is_level == "sequence":
        rho = S.exp().expand_as(lp)
        if rc.is_mode == "mask":
            lo, hi = rc.is_threshold
            w = torch.where((rho >= lo) & (rho <= hi), rho, torch.zeros(()))
        else:
            w = torch.minimum(rho, torch.tensor(rc.is_threshold))
    keep = m.clone()
    for option, bound in (() if rc is None else rc.rs):
        if option == "seq_mean_k1":
            geo = (S[:, 0] / m.sum(1).clamp_min(1)).exp()
            keep = keep * ((geo >= bound[0]) & (geo <= bound[1])).float()[:, None]
        elif option == "seq_max_kl":
            kl = torch.where(mask, topk_kl(logp, topk_ids, topk_lp), torch.zeros(()))
            keep = keep * (kl.max(1).values <= bound).float()[:, None]
        else:
            raise ValueError(f"the naive loss does not write {option}")
    return (-advantages * w * lp * keep).sum() / keep.sum().clamp_min(1)


# -- collapse and its predictors --------------------------------------------------------------------------------


def first_step(flags: List[bool]) -> Optional[int]:
    return next((i for i, c in enumerate(flags) if c), None)


PREDICTORS = ("ess_fall", "grad_spike", "kl_rise")


def predictors(seed: dict) -> dict:
    """The collapse step and the first ESS fall, gradient spike and KL rise (module docstring), and how many steps
    each came before the collapse (positive: before)."""
    ess, grad, kl = seed["seq_ess"], seed["grad_norm"], seed["topk_kl_mean"]
    ess_base, kl_base = _mean_or(ess[:10]), _mean_or(kl[:10])
    fall, spike, rise = [], [], []
    for t in range(len(ess)):
        ess_mean, kl_mean = _mean_or(ess[max(0, t - 9):t + 1]), _mean_or(kl[max(0, t - 9):t + 1])
        fall.append(t >= 10 and ess_mean < ESS_FALL * ess_base)
        rise.append(t >= 10 and kl_mean > KL_RISE * kl_base)
        earlier = sorted(grad[:t])
        spike.append(t >= 10 and grad[t] > GRAD_SPIKE * earlier[len(earlier) // 2])
    collapse = first_step(seed["collapsed"])
    out = dict(seed=seed["seed"], collapse_step=collapse)
    for name, flags in zip(PREDICTORS, (fall, spike, rise)):
        step = first_step(flags)
        out[f"{name}_step"] = step
        out[f"{name}_lead"] = None if collapse is None or step is None else collapse - step
    return out


def predictor_rates(all_predictors: Dict[str, List[dict]]) -> dict:
    """Over every seed of every arm: the collapses, and for each predictor its lead times before them (those it
    preceded, of all collapses) and its false-alarm rate (the seeds without a collapse in which it fired)."""
    seeds = [p for ps in all_predictors.values() for p in ps]
    collapsed = [p for p in seeds if p["collapse_step"] is not None]
    calm = [p for p in seeds if p["collapse_step"] is None]
    out = dict(seeds=len(seeds), collapsed=len(collapsed))
    for name in PREDICTORS:
        leads = [p[f"{name}_lead"] for p in collapsed if p[f"{name}_lead"] is not None and p[f"{name}_lead"] > 0]
        fired = sum(p[f"{name}_step"] is not None for p in calm)
        out[name] = dict(leads=sorted(leads), preceded=len(leads), false_alarms=fired,
                         false_alarm_rate=fired / len(calm) if calm else math.nan)
    return out


def _trailing(x: torch.Tensor, width: int) -> torch.Tensor:
    """Trailing means over `width` steps along the last axis (shorter windows at the start)."""
    c = torch.cumsum(F.pad(x, (1, 0)), -1)
    t = torch.arange(x.shape[-1])
    lo = (t - width + 1).clamp_min(0)
    return (c[..., t + 1] - c[..., lo]) / (t + 1 - lo)


def criterion_statistic(rewards: torch.Tensor, width: int = COLLAPSE_WINDOW) -> torch.Tensor:
    """The collapse criterion's statistic per row of [seeds, steps] rewards: the largest fall of the width-step mean
    below its running peak, over full windows (a seed collapses when it exceeds the margin)."""
    m = _trailing(rewards, width)[..., width - 1:]
    if m.shape[-1] == 0:  # fewer steps than one window: nothing to compare
        return torch.full(m.shape[:-1], math.nan, dtype=m.dtype)
    return (torch.cummax(m, -1).values - m).max(-1).values


def margin_from_control(control: List[List[float]], steps: int, false_alarm: float = FALSE_ALARM,
                        trials: int = 20_000, width: int = COLLAPSE_WINDOW) -> dict:
    """The margin at which a seed of the control arm is flagged with probability `false_alarm`. A simulated control
    seed is the control's mean curve (each seed's 41-step centred mean, averaged over seeds) plus noise drawn with
    replacement from every seed's residuals about its own centred mean (independent steps: the reward is a fresh
    batch of 32 samples each step); the margin is the (1 - false_alarm) quantile of `criterion_statistic` over
    `trials` such seeds of `steps` steps. Also reported: the same with each seed's own curve in place of the mean
    one (`margin_own_curves`), and the margin's false-alarm rate there, since a seed's own drift is noise too."""
    r = torch.tensor(control, dtype=torch.float64)
    c = torch.cumsum(F.pad(r, (1, 0)), -1)
    t = torch.arange(r.shape[-1])
    lo, hi = (t - 20).clamp_min(0), (t + 21).clamp_max(r.shape[-1])
    trend = (c[..., hi] - c[..., lo]) / (hi - lo)
    residuals = (r - trend).flatten()
    g = torch.Generator().manual_seed(0)
    noise = residuals[torch.randint(0, residuals.numel(), (trials, steps), generator=g)]
    simulated = criterion_statistic(trend.mean(0)[:steps] + noise, width)
    # the same with each seed's own curve (seeds in turn): a seed's own drift counts as noise too
    own = criterion_statistic(trend[torch.arange(trials) % len(control), :steps] + noise, width)
    margin = float(torch.quantile(simulated, 1 - false_alarm))
    margin_own = float(torch.quantile(own, 1 - false_alarm))
    return dict(margin=margin, false_alarm=false_alarm, steps=steps, width=width, trials=trials,
                control_seeds=len(control), residual_std=float(residuals.std()),
                control_statistic=criterion_statistic(r[:, :steps], width).tolist(),
                margin_own_curves=margin_own, false_alarm_own_curves=float((own > margin).double().mean()),
                false_alarm_mean_curve_at_own=float((simulated > margin_own).double().mean()))


def _betainc(a: float, b: float, x: float) -> float:
    """The regularised incomplete beta I_x(a, b), by its continued fraction (modified Lentz)."""
    if x <= 0.0 or x >= 1.0:
        return min(max(x, 0.0), 1.0)
    if x > (a + 1) / (a + b + 2):
        return 1.0 - _betainc(b, a, 1.0 - x)
    front = math.exp(math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x)) / a
    f, c, d = 1.0, 1.0, 0.0
    for i in range(400):
        m = i // 2
        if i == 0:
            num = 1.0
        elif i % 2 == 0:
            num = m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m))
        else:
            num = -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1))
        d = 1.0 + num * d
        d = 1.0 / (d if abs(d) > 1e-300 else 1e-300)
        c = 1.0 + num / c
        c = c if abs(c) > 1e-300 else 1e-300
        f *= c * d
        if abs(1.0 - c * d) < 1e-12:
            break
    return front * (f - 1.0)


def welch_test(a: List[float], b: List[float]) -> dict:
    """Welch's t-test of mean(a) != mean(b) (seeds' final rewards): the difference, t, its degrees of freedom and
    the two-sided p-value (Student's t tail, I_{df / (df + t^2)}(df / 2, 1 / 2))."""
    na, nb = len(a), len(b)
    ma, mb = sum(a) / na, sum(b) / nb
    va = sum((x - ma) ** 2 for x in a) / (na - 1) if na > 1 else math.nan
    vb = sum((x - mb) ** 2 for x in b) / (nb - 1) if nb > 1 else math.nan
    se2 = va / na + vb / nb
    if not se2 > 0:
        return dict(diff=ma - mb, t=math.nan, df=math.nan, p=math.nan)
    t = (ma - mb) / math.sqrt(se2)
    df = se2 ** 2 / ((va / na) ** 2 / (na - 1) + (vb / nb) ** 2 / (nb - 1))
    return dict(diff=ma - mb, t=t, df=df, p=_betainc(df / 2, 0.5, df / (df + t * t)))


FAILING, CONTROL, MOE_CONTROL = "moe_bypass_pg_seq_is", "on_policy_bypass_none", "moe_on_policy_bypass_none"


def final_rewards(arm_result: dict) -> List[float]:
    """Each seed's final reward: the mean of its last tenth of steps."""
    return [_mean_or(s["reward"][-max(1, len(s["reward"]) // 10):]) for s in arm_result["seeds"]]


def comparisons(arms_result: Dict[str, dict]) -> Dict[str, dict]:
    """Each arm's seeds' final rewards (the last tenth's mean) against the failing arm's and the controls'."""
    finals = {name: final_rewards(arm) for name, arm in arms_result.items()}
    out = {}
    for name, values in finals.items():
        out[name] = {f"vs_{other}": welch_test(values, finals[other])
                     for other in (FAILING, CONTROL, MOE_CONTROL) if other in finals and other != name}
    return out


def summarise(arm_result: dict) -> dict:
    out = ms.summarise(arm_result)
    seeds = arm_result["seeds"]
    tenth = max(1, len(seeds[0]["reward"]) // 10)
    for key in ("seq_ess", "topk_kl_mean", "k3_kl", "entropy", "response_length", "grad_norm",
                "out_of_clip_fraction", "routing_flip_rate", "is_zeroed_fraction"):
        out[f"{key}_first_tenth"] = _mean_or(_mean_or(s[key][:tenth]) for s in seeds)
        out[f"{key}_last_tenth"] = _mean_or(_mean_or(s[key][-tenth:]) for s in seeds)
    rewards = torch.tensor([s["reward"] for s in seeds], dtype=torch.float64)
    out["peak_reward_10_step"] = _trailing(rewards, 10).max(-1).values.tolist()
    return out


def _fmt_p(test: Optional[dict]) -> str:
    if not test or test.get("p") is None or not math.isfinite(test["p"]):
        return "—"
    return f"{test['diff']:+.3f} (p {test['p']:.2g})"


def table(result: dict) -> str:
    """The docs' table of a study JSON (docs/study.md): per arm its seeds' final rewards (the last tenth), the Welch
    tests against the failing arm and the controls, the collapse steps, each seed's criterion statistic (the largest
    fall of the windowed mean reward below its peak, which the margin is compared with), and the mismatch first ->
    last tenth."""
    summary, tests = result["summary"], result.get("comparisons", {})
    head = ("| arm | reward, first tenth | reward, last tenth (seeds) | vs `moe_bypass_pg_seq_is` | vs control | "
            "vs MoE control | collapse | fall below peak | seq ESS | top-k KL | rej. / zeroed | flips |")
    rows = [head, "|" + "---|" * (head.count("|") - 1)]
    for name, arm in result["arms"].items():
        s, t = summary[name], tests.get(name, {})
        finals = final_rewards(arm)
        collapse = ", ".join("—" if c is None else str(c) for c in s["steps_to_collapse"])
        width = result["definitions"].get("collapse_window", COLLAPSE_WINDOW)
        falls = criterion_statistic(torch.tensor([x["reward"] for x in arm["seeds"]], dtype=torch.float64), width)
        flips = s.get("routing_flip_rate_last_tenth")
        rows.append(
            f"| `{name}` | {s['initial_reward']:.3f} | **{s['final_reward_mean']:.3f}** "
            f"({', '.join(f'{x:.3f}' for x in finals)}) | {_fmt_p(t.get('vs_' + FAILING))} | "
            f"{_fmt_p(t.get('vs_' + CONTROL))} | {_fmt_p(t.get('vs_' + MOE_CONTROL))} | {collapse} | "
            f"{', '.join(f'{x:.3f}' for x in falls.tolist())} | "
            f"{s['seq_ess_first_tenth']:.2f} → {s['seq_ess_last_tenth']:.2f} | "
            f"{s['topk_kl_mean_first_tenth']:.1e} → {s['topk_kl_mean_last_tenth']:.1e} | "
            f"{100 * s['rejected_seq_fraction']:.1f} % / {100 * s['is_zeroed_fraction_last_tenth']:.1f} % | "
            f"{'—' if not name.startswith('moe') else f'{100 * flips:.2f} %'} |")
    rates = result.get("predictor_rates")
    if rates:
        rows.append("")
        rows.append(f"Predictors over {rates['seeds']} seeds, {rates['collapsed']} collapsed:")
        for name in PREDICTORS:
            r = rates[name]
            calm = rates["seeds"] - rates["collapsed"]
            rows.append(f"- {name}: preceded {r['preceded']} of {rates['collapsed']} collapses (leads "
                        f"{r['leads'] or '—'} steps); fired in {r['false_alarms']} of {calm} seeds without one "
                        f"({100 * r['false_alarm_rate']:.0f} %)")
    return "\n".join(rows)


# -- the study ----------------------------------------------------------------------------------------------------


def _start_job(args):
    cfg, seed, kind = args
    torch.set_num_threads(1)
    t0 = time.perf_counter()
    model = supervised_start(cfg, seed, kind)
    return (seed, kind), model.state_dict(), time.perf_counter() - t0


def _arm_job(args):
    cfg, name, arm, state, seed, check_naive = args
    torch.set_num_threads(1)
    start = build(cfg, arm["model"])
    start.load_state_dict(state)
    t0 = time.perf_counter()
    result = run_arm(cfg, name, arm, start, seed, check_naive)
    print(f"{name} seed {seed}: {time.perf_counter() - t0:.0f} s, final reward "
          f"{_mean_or(final_rewards({'seeds': [result]})):.3f}, collapse "
          f"{first_step(result['collapsed'])}", flush=True)
    return name, result


def _pool(cfg):
    if cfg.workers <= 1:
        return None
    return multiprocessing.get_context("spawn").Pool(cfg.workers)


def run_study(cfg: CollapseConfig, out_dir: str, selected: Optional[List[str]] = None,
              name_of_run: str = "collapse-study") -> dict:
    t0 = time.perf_counter()
    kinds = sorted({a["model"] for a in arms(_placeholder_thresholds()).values()})
    jobs = [(cfg, s, k) for s in range(cfg.seeds) for k in kinds]
    pool = _pool(cfg)
    done = (pool.map(_start_job, jobs) if pool else [_start_job(j) for j in jobs])
    states = {key: state for key, state, _ in done}
    sft_seconds = {f"{k}/seed{s}": sec for (s, k), _, sec in done}
    torch.set_num_threads(max(1, cfg.workers))
    starts = {key: build(cfg, key[1]) for key in states}
    for key, model in starts.items():
        model.load_state_dict(states[key])
    calibration = {}
    for kind in kinds:
        for path in ("fp32", "fp8") + (("fp8" + ROUTER32,) if kind == "moe" else ()):
            calibration[f"{kind}/{path}"] = calibrate(cfg, starts[(0, kind)], path)
    print("calibration:", json.dumps(calibration), flush=True)
    thresholds = thresholds_from(calibration)
    chosen = {k: v for k, v in arms(thresholds).items() if selected is None or k in selected}
    arm_jobs = [(cfg, name, arm, states[(s, arm["model"])], s, True) for name, arm in chosen.items()
                for s in range(cfg.seeds)]
    results = pool.map(_arm_job, arm_jobs, chunksize=1) if pool else [_arm_job(j) for j in arm_jobs]
    if pool:
        pool.close()
        pool.join()
    result = {"config": dataclasses.asdict(cfg), "environment": environment("cpu"),
              "regime": "collapse", "definitions": dict(
                  collapse_margin=cfg.collapse_margin, collapse_window=cfg.collapse_window,
                  false_alarm=FALSE_ALARM, ess_fall=ESS_FALL, grad_spike=GRAD_SPIKE, kl_rise=KL_RISE,
                  clip_band=CLIP_BAND, calibration_quantile=CALIBRATION_QUANTILE),
              "arms_config": {k: {**v, "rc": repr(v["rc"])} for k, v in chosen.items()},
              "calibration": calibration, "thresholds": thresholds, "sft_seconds": sft_seconds, "arms": {}}
    result["config"]["backend_resolved"] = ms.backend_name(cfg.backend)
    for name in chosen:
        seeds = sorted((r for n, r in results if n == name), key=lambda r: r["seed"])
        result["arms"][name] = {"seeds": seeds}
    result["summary"] = {k: summarise(v) for k, v in result["arms"].items()}
    result["predictors"] = {k: [predictors(s) for s in v["seeds"]] for k, v in result["arms"].items()}
    result["predictor_rates"] = predictor_rates(result["predictors"])
    result["comparisons"] = comparisons(result["arms"])
    result["wall_seconds"] = time.perf_counter() - t0
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, f"{name_of_run}.json")
    with open(path, "w") as f:
        json.dump(_no_nan(ms._rounded(result)), f, separators=(",", ":"))
    plot(result, os.path.join(out_dir, f"{name_of_run}.png"))
    for name, s in result["summary"].items():
        print(f"{name}: final {s['final_reward_mean']:.3f} ({s['final_reward_min']:.3f}-{s['final_reward_max']:.3f}) "
              f"collapse {s['steps_to_collapse']} predictors {result['predictors'][name]}", flush=True)
    print(f"wrote {path} ({result['wall_seconds']:.0f} s)")
    return result


def _no_nan(value):
    """NaN (a measure an arm does not have, as `is_ess` without IS weights) -> null: strict JSON."""
    if isinstance(value, float) and math.isnan(value):
        return None
    if isinstance(value, dict):
        return {k: _no_nan(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_no_nan(v) for v in value]
    return value


def _placeholder_thresholds():
    return {p: dict(geo_rs_band=(0.5, 2.0), trm_eps=1.0) for p in ("dense/fp8", "moe/fp8")}


def plot(result: dict, path: str) -> None:
    """Reward, sequence ESS, top-k KL(μ‖π), gradient norm, rejected / zeroed sequences and routing flips per arm:
    the mean over seeds of 10-step trailing means, with the seeds' min-max band."""
    plt = ms.pyplot()
    if plt is None:
        return
    panels = (("reward", "reward (10-step mean)", False), ("seq_ess", "sequence-ratio ESS", False),
              ("topk_kl_mean", "top-k KL(mu || pi) per token", True), ("grad_norm", "gradient norm", True),
              ("rejected_seq_fraction", "rejected sequences (RS)", False),
              ("routing_flip_rate", "routing flips per (token, block), MoE", False))
    fig, axes = plt.subplots(3, 2, figsize=(13, 12))
    styles = {}  # the same colour for an arm in every panel (the flips panel draws the MoE arms only)
    for i, (name, arm) in enumerate(result["arms"].items()):
        style = "--" if name.startswith("moe") else (":" if "on_policy" in name or "decoupled" in name else "-")
        styles[name] = style
        color = f"C{i}" if i < 10 else plt.get_cmap("tab20b")(i - 10)  # distinct for up to 30 arms (21 today)
        for ax, (key, title, log) in zip(axes.flat, panels):
            if key == "routing_flip_rate" and not name.startswith("moe"):
                continue
            data = [[x if x is not None and math.isfinite(x) else math.nan for x in s[key]] for s in arm["seeds"]]
            series = ms._smoothed(torch.tensor(data, dtype=torch.float64))
            steps = arm["seeds"][0]["step"]
            ax.plot(steps, series.mean(0), label=name, lw=1.2, ls=style, color=color)
            ax.fill_between(steps, series.min(0).values, series.max(0).values, alpha=0.10, color=color)
            ax.set_title(title)
            ax.set_xlabel("RL step")
            if log:
                ax.set_yscale("log")
    axes[0, 0].legend(fontsize=7, ncol=2)
    cfg = result["config"]
    fig.suptitle(f"collapse regime: {cfg['min_items']}-{cfg['max_items']}-item walks, bypass REINFORCE unless named, "
                 f"sampler fp8 (MoE: bf16 router), {cfg['seeds']} seeds; backend "
                 f"{cfg.get('backend_resolved', cfg['backend'])}")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--smoke", action="store_true", help="a seconds-long run (the CI test)")
    p.add_argument("--out", default="benchmarks/results")
    p.add_argument("--backend", default="auto")
    p.add_argument("--seeds", type=int)
    p.add_argument("--rl-steps", type=int)
    p.add_argument("--sft-steps", type=int)
    p.add_argument("--workers", type=int)
    p.add_argument("--arms", help="comma list of arm names (default: all)")
    p.add_argument("--plot", metavar="JSON", help="redraw the PNG of a study JSON (beside it) and exit")
    p.add_argument("--name", default="collapse-study", help="the output files' name (NAME.json, NAME.png)")
    p.add_argument("--table", metavar="JSON", help="print the docs' markdown table of a study JSON, and exit")
    p.add_argument("--calibrate-margin", metavar="JSON", nargs="+",
                   help="print the collapse margin set from the control arms' seeds in study JSONs (each seed's "
                        "first --rl-steps steps; a seed another run repeated counts once), and exit")
    args = p.parse_args(argv)
    if args.calibrate_margin:
        steps = args.rl_steps or CollapseConfig.rl_steps
        control = []
        for path in args.calibrate_margin:
            with open(path) as f:
                arms_of_run = json.load(f)["arms"]
            for name in (CONTROL, MOE_CONTROL):
                # the runs are deterministic: a control seed rerun under another run's name is the same curve
                control += [c for c in (s["reward"][:steps] for s in arms_of_run.get(name, {}).get("seeds", []))
                            if c not in control]
        if any(len(c) < steps for c in control):
            p.error(f"--calibrate-margin: every control seed needs {steps} steps (--rl-steps)")
        print(json.dumps(margin_from_control(control, steps)))
        return 0
    if args.table:
        with open(args.table) as f:
            print(table(json.load(f)))
        return 0
    if args.plot:
        with open(args.plot) as f:
            plot(json.load(f), os.path.splitext(args.plot)[0] + ".png")
        return 0
    torch.set_num_threads(min(2, torch.get_num_threads()))
    cfg = CollapseConfig(**(SMOKE if args.smoke else {}), backend=args.backend)
    for field in ("seeds", "rl_steps", "sft_steps", "workers"):
        if getattr(args, field) is not None:
            cfg = dataclasses.replace(cfg, **{field: getattr(args, field)})
    run_study(cfg, args.out, args.arms.split(",") if args.arms else None, args.name)
    return 0


if __name__ == "__main__":
    sys.exit(main())
