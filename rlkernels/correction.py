"""Rollout correction on per-token scalars: IS weights (SPEC §4), rejection masks (§5) and the
rollout_corr/* diagnostics (§8). Vectorised torch on [N] tensors; the same code serves every
backend, since none of it touches the vocabulary.
"""

from typing import Dict, NamedTuple, Optional

import torch

from .config import RolloutCorrection
from .segments import Segments, hyper, log_hyper, masked_extreme, masked_mean, masked_mean_exp

CLAMP = 20.0  # SPEC §4: clamp every log-ratio before exp


class ISWeights(NamedTuple):
    weights: torch.Tensor  # [N] applied weights, 0 off the mask
    truncated: torch.Tensor  # [N] before batch normalisation (what the metrics describe)
    norm_factor: torch.Tensor  # 0-d, 1 when not normalised


def is_weights(delta: torch.Tensor, mask: torch.Tensor, seg: Segments, rc: RolloutCorrection) -> ISWeights:
    """delta: [N] log(pi_train / mu), already 0 off the mask."""
    if rc.is_level == "token":
        raw = torch.exp(delta.clamp(-CLAMP, CLAMP))
    else:  # the unclamped sequence sum, clamped once (SPEC §4)
        raw = seg.expand(torch.exp(seg.sum(delta).clamp(-CLAMP, CLAMP)))
    if rc.is_icepop:
        lo, hi = rc.is_threshold
        w = torch.where((raw >= lo) & (raw <= hi), raw, torch.zeros_like(raw))
    else:
        w = torch.minimum(raw, hyper(raw, rc.is_threshold))
    w = torch.where(mask, w, torch.zeros_like(w))
    factor = torch.ones((), dtype=w.dtype, device=w.device)
    if rc.is_batch_normalize:
        if rc.is_level == "token":
            mean = masked_mean(w, mask)
        else:  # over non-empty sequences, one weight each
            lengths = seg.sum(mask.to(w.dtype))
            per_seq = seg.sum(w) / lengths.clamp_min(1)
            mean = masked_mean(per_seq, lengths > 0)
        factor = torch.where(mean > 1e-8, mean, factor)
    return ISWeights(w / factor, w, factor)


def _k_stat(kind: str, delta_hat: torch.Tensor) -> torch.Tensor:
    if kind == "k1":
        return -delta_hat
    if kind == "k2":
        return 0.5 * delta_hat * delta_hat
    return torch.exp(delta_hat) - 1 - delta_hat


def _keeps(kind: str, stat: torch.Tensor, bound) -> torch.Tensor:
    if kind == "k1":  # keep lo <= rho <= hi, rho = exp(-k1), compared in log space (SPEC §5)
        lo, hi = bound
        return (-stat >= log_hyper(stat, lo)) & (-stat <= log_hyper(stat, hi))
    return stat <= bound


class Rejection(NamedTuple):
    mask: torch.Tensor  # [N] final mask m'
    metrics: Dict[str, torch.Tensor]


def rejection(delta: torch.Tensor, mask: torch.Tensor, seg: Segments, rc: RolloutCorrection) -> Rejection:
    """SPEC §5: every option keeps or drops tokens; options combine by AND."""
    delta_hat = delta.clamp(-CLAMP, CLAMP)
    maskf = mask.to(delta.dtype)
    lengths = seg.sum(maskf)
    nonempty = lengths > 0
    keep_all = mask
    metrics = {}
    for option, bound in rc.rs:
        kind = option[-2:]
        k = torch.where(mask, _k_stat(kind, delta_hat), torch.zeros_like(delta))
        if option.startswith("token_"):
            values, valid = k, mask
            keep = _keeps(kind, k, bound)
        else:
            if option.startswith("seq_sum_"):
                values = seg.sum(k)
            elif option.startswith("seq_mean_"):
                values = seg.sum(k) / lengths.clamp_min(1)
            else:
                values = seg.max(k, mask)
            valid = nonempty
            keep = seg.expand(_keeps(kind, values, bound))
        prefix = f"rollout_corr/rollout_rs_{option}"
        metrics[f"{prefix}_mean"] = masked_mean(values, valid)
        metrics[f"{prefix}_max"] = masked_extreme(values, valid, largest=True)
        metrics[f"{prefix}_min"] = masked_extreme(values, valid, largest=False)
        metrics[f"{prefix}_masked_fraction"] = masked_mean((~keep).to(delta.dtype), mask)
        keep_all = keep_all & keep
    rejected = (mask & ~keep_all).to(delta.dtype)
    metrics["rollout_corr/rollout_rs_masked_fraction"] = masked_mean(rejected, mask)
    seq_rejected = (seg.sum(rejected) > 0).to(delta.dtype)
    metrics["rollout_corr/rollout_rs_seq_masked_fraction"] = masked_mean(seq_rejected, nonempty)
    return Rejection(keep_all, metrics)


def offpolicy_metrics(
    train_lp: torch.Tensor, rollout_lp: torch.Tensor, mask: torch.Tensor, seg: Segments,
    rc: Optional[RolloutCorrection], weights: Optional[ISWeights],
) -> Dict[str, torch.Tensor]:
    """The rollout_corr/* diagnostics of SPEC §8 on the original mask (inputs already 0 off it)."""
    dt = train_lp.dtype
    delta = train_lp - rollout_lp
    delta_hat = delta.clamp(-CLAMP, CLAMP)
    rho = torch.exp(delta_hat)
    lengths = seg.sum(mask.to(dt))
    nonempty = lengths > 0
    mean_tr = seg.sum(train_lp) / lengths.clamp_min(1)
    mean_ro = seg.sum(rollout_lp) / lengths.clamp_min(1)
    diff = mean_ro - mean_tr
    rho_seq_sq = torch.exp(2 * seg.sum(delta).clamp(-CLAMP, CLAMP))
    out = {
        "kl": masked_mean(-delta, mask),
        "k3_kl": masked_mean(rho - delta_hat - 1, mask),
        # chi2 = E[rho^2] - 1 written as E[rho^2 - 1]: equal, but 0 (not -1) on an empty batch
        "chi2_token": masked_mean(rho * rho - 1, mask),
        "chi2_seq": masked_mean(rho_seq_sq - 1, nonempty),
        "tv_token": masked_mean(0.5 * (rho - 1).abs(), mask),
        "training_ppl": masked_mean_exp(-mean_tr, nonempty),
        "rollout_ppl": masked_mean_exp(-mean_ro, nonempty),
        "training_log_ppl": masked_mean(-mean_tr, nonempty),
        "rollout_log_ppl": masked_mean(-mean_ro, nonempty),
        "log_ppl_diff": masked_mean(diff, nonempty),
        "log_ppl_abs_diff": masked_mean(diff.abs(), nonempty),
        "log_ppl_diff_max": masked_extreme(diff, nonempty, largest=True),
        "log_ppl_diff_min": masked_extreme(diff, nonempty, largest=False),
        "ppl_ratio": masked_mean_exp(diff, nonempty),
    }
    # sqrt(2 (1 + chi2_seq)) taken as sqrt(2 E[rho_seq^2]): 1 + (E[rho^2] - 1) rounds to 0 in
    # float32 when every rho_seq is tiny, E[rho^2] itself does not
    out["c_star"] = torch.sqrt(2 * masked_mean(rho_seq_sq, nonempty))
    if rc is not None and rc.is_level is not None:
        lo, hi = rc.is_bounds
        w = weights.truncated
        x = torch.minimum(w.clamp_min(0), hyper(w, hi))
        mean_x = masked_mean(x, mask)
        out["rollout_is_mean"] = masked_mean(w, mask)
        # two-pass variance: E[x^2] - E[x]^2 cancels catastrophically in float32 when w ~ 1
        out["rollout_is_std"] = torch.sqrt(masked_mean((x - mean_x) ** 2, mask))
        out["rollout_is_min"] = masked_extreme(w, mask, largest=False)
        out["rollout_is_max"] = masked_extreme(w, mask, largest=True)
        if rc.is_level == "token":
            log_ratio, valid = delta_hat, mask
        else:
            log_ratio, valid = seg.sum(delta).clamp(-CLAMP, CLAMP), nonempty
        out["rollout_is_ratio_fraction_high"] = masked_mean((log_ratio > log_hyper(log_ratio, hi)).to(dt), valid)
        out["rollout_is_ratio_fraction_low"] = masked_mean((log_ratio < log_hyper(log_ratio, lo)).to(dt), valid)
        # ESS = 1 / mean((x / mean x)^2); 0 when every weight is 0 or nothing is valid
        ess = 1.0 / masked_mean((x / mean_x.clamp_min(torch.finfo(dt).tiny)) ** 2, mask).clamp_min(torch.finfo(dt).tiny)
        out["rollout_is_eff_sample_size"] = torch.where(mean_x > 0, ess, torch.zeros_like(ess))
        if rc.is_batch_normalize:
            out["rollout_is_batch_norm_factor"] = weights.norm_factor
    return {f"rollout_corr/{k}": v for k, v in out.items()}
