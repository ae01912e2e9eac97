"""SPEC §4 (IS weights), §5 (rejection masks) and the rollout_corr/* diagnostics of §8, unfused.

Everything here is float64 and loops over sequences in Python, so that each line can be checked
against the spec. Inputs are flat [N] tensors; `seqs` lists each sequence's token indices.
"""

import math
from typing import Dict, List

import torch

from .sequences import masked_mean, mean_or_zero

CLAMP = 20.0  # SPEC §4 safety clamp before any exp


def _log(x):
    return math.log(x) if x > 0 else -math.inf


def _spread(prefix, values, centre, device):
    """{prefix}_mean|std|max|min|max_deviation of one value per sequence (std with Bessel's correction)."""
    if not values:
        return {f"{prefix}_{k}": _zero(device) for k in ("mean", "std", "max", "min", "max_deviation")}
    x = torch.stack(values)
    return {f"{prefix}_mean": x.mean(), f"{prefix}_std": x.std() if len(values) > 1 else _zero(device),
            f"{prefix}_max": x.max(), f"{prefix}_min": x.min(), f"{prefix}_max_deviation": (x - centre).abs().max()}


def _zero(device):
    return torch.zeros((), dtype=torch.float64, device=device)


def sequence_log_ratio(delta, mask, idx, rc, token_kept=None):
    """The clamped log-ratio of sequence `idx`'s weight: the sum (is_level="sequence") or the mean ("geometric") of
    its tokens' log-ratios, over m or over the tokens the token-level rejection options keep (seq_tokens)."""
    over = token_kept if rc.seq_tokens == "kept" else mask
    S = torch.where(over[idx], delta[idx], torch.zeros_like(delta[idx])).sum()
    if rc.is_level == "geometric":  # the geometric mean of the ratios: the mean log-ratio
        S = S / max(int(over[idx].sum()), 1)
    return S.clamp(-CLAMP, CLAMP)


def is_weights(delta, mask, seqs: List[torch.Tensor], rc, token_kept=None):
    """SPEC §4. Returns (w, truncated, norm_factor): the applied weights (0 off the mask), the weights
    before batch normalisation, and the mean they were divided by (1 when normalisation is off or
    skipped). `token_kept`: the tokens the token-level rejection options keep (seq_tokens="kept")."""
    device = delta.device
    delta_hat = delta.clamp(-CLAMP, CLAMP)
    if rc.is_level == "token":
        raw = torch.exp(delta_hat)
    else:
        raw = torch.zeros_like(delta)
        for idx in seqs:
            raw[idx] = torch.exp(sequence_log_ratio(delta, mask, idx, rc, token_kept))
    lo, hi = rc.is_range
    if rc.is_icepop:
        w = torch.where((raw >= lo) & (raw <= hi), raw, torch.zeros_like(raw))
    else:
        w = raw.clamp(lo, hi)
    w = torch.where(mask, w, torch.zeros_like(w))
    factor = torch.ones((), dtype=torch.float64, device=device)
    if rc.is_batch_normalize:
        if rc.is_level == "token":
            mean = masked_mean(w, mask)
        else:  # one weight per non-empty sequence
            mean = mean_or_zero([w[idx][mask[idx]][0] for idx in seqs if mask[idx].any()], device)
        if mean > 1e-8:
            factor = mean
    return w / factor, w, factor


BINARY_EPS = 1e-6  # the binary divergences' probabilities are clamped to [eps, 1 - eps]


def _binary_kl(mu, pi):
    """KL(Bern(mu) || Bern(pi)), both clamped to [eps, 1 - eps]: the sampled token against the rest."""
    mu, pi = mu.clamp(BINARY_EPS, 1 - BINARY_EPS), pi.clamp(BINARY_EPS, 1 - BINARY_EPS)
    return mu * torch.log(mu / pi) + (1 - mu) * torch.log((1 - mu) / (1 - pi))


def _k_stats(delta_hat, train_lp, rollout_lp):
    k1 = -delta_hat
    k2 = 0.5 * delta_hat**2
    k3 = torch.exp(delta_hat) - 1 - delta_hat
    mu, pi = torch.exp(rollout_lp.clamp(max=0)), torch.exp(train_lp.clamp(max=0))  # probabilities: at most 1
    btv = (mu.clamp(BINARY_EPS, 1 - BINARY_EPS) - pi.clamp(BINARY_EPS, 1 - BINARY_EPS)).abs()
    return {"k1": k1, "k2": k2, "k3": k3, "bkl": _binary_kl(mu, pi), "btv": btv}


def token_rejection(delta, mask, rc, train_lp, rollout_lp):
    """The tokens the token-level options (token_*) keep: the mask a sequence weight is taken over with
    seq_tokens="kept"."""
    delta_hat = delta.clamp(-CLAMP, CLAMP)
    stats = _k_stats(delta_hat, train_lp, rollout_lp)
    keep = mask.clone()
    for option, bound in rc.rs:
        if not option.startswith("token_"):
            continue
        stat = stats[option.split("_")[-1]]
        keep &= ((-stat >= _log(bound[0])) & (-stat <= _log(bound[1]))) if option == "token_k1" else stat <= bound
    return keep


def rejection(delta, mask, seqs, rc, train_lp, rollout_lp):
    """SPEC §5. Returns (new_mask, per-option info for the metrics)."""
    delta_hat = delta.clamp(-CLAMP, CLAMP)
    stats = _k_stats(delta_hat, train_lp, rollout_lp)
    keep_all = mask.clone()
    info = {}
    for option, bound in rc.rs:
        kind = option.split("_")[-1]
        k = stats[kind]
        if option.startswith("token_") or option == "seq_all_k1":
            stat = k
            if kind == "k1":
                lo, hi = bound
                # keep lo <= rho <= hi with rho = exp(-k1), compared in log space
                keep = (-stat >= _log(lo)) & (-stat <= _log(hi))
            else:
                keep = stat <= bound
            if option == "seq_all_k1":  # a sequence with any token outside the bounds is dropped whole
                for idx in seqs:
                    keep[idx] = bool(keep[idx][mask[idx]].all())
            values = stat[mask]
        else:
            keep = torch.ones_like(mask)
            values = []
            over = token_rejection(delta, mask, rc, train_lp, rollout_lp) if rc.seq_tokens == "kept" else mask
            for idx in seqs:
                m = over[idx]
                km = k[idx][m]
                if option.startswith("seq_sum_"):
                    s = km.sum()
                elif option.startswith("seq_mean_"):
                    s = km.mean() if m.any() else _zero(delta.device)
                else:  # seq_max_
                    s = km.max() if m.any() else _zero(delta.device)
                if kind == "k1":
                    lo, hi = bound
                    ok = bool((-s >= _log(lo)) & (-s <= _log(hi)))
                else:
                    ok = bool(s <= bound)
                keep[idx] = ok
                if mask[idx].any():  # one value per sequence of m (0 where the token options keep nothing)
                    values.append(s)
            values = torch.stack(values) if values else torch.zeros(0, dtype=torch.float64, device=delta.device)
        option_keep = keep & mask
        # each non-empty sequence's value: the sequence statistic, or the mean of the token statistic
        per_token = option.startswith("token_") or option == "seq_all_k1"  # metrics over the token statistic
        seq_values = [k[idx][mask[idx]].mean() if per_token else None for idx in seqs if mask[idx].any()]
        if not per_token:
            seq_values = list(values)
        rejected = [(mask[idx] & ~keep[idx]).any() for idx in seqs if mask[idx].any()]
        info[option] = {
            "values": values,
            "masked_fraction": masked_mean((mask & ~option_keep).double(), mask),
            "seq_values": seq_values,
            "seq_rejected": rejected,
            # the kept range of the statistic: k1 keeps lo <= rho <= hi, i.e. -log hi <= k1 <= -log lo
            "bounds": (-_log(bound[1]), -_log(bound[0])) if kind == "k1" else (0.0, bound),
        }
        keep_all = keep_all & keep
    return keep_all, info


def response_length_metrics(mask, seqs: List[torch.Tensor]) -> Dict[str, torch.Tensor]:
    """SPEC §8.1: the mean, max and 0.9 quantile of every sequence's token count in m (empty ones included), the
    quantile interpolated linearly between the order statistics at 0.9 (n - 1)."""
    device = mask.device
    lengths = sorted(float(mask[idx].sum()) for idx in seqs)
    if not lengths:
        return {f"response_length/{k}": _zero(device) for k in ("mean", "max", "p90")}
    position = 0.9 * (len(lengths) - 1)
    below = math.floor(position)
    above = min(below + 1, len(lengths) - 1)
    p90 = lengths[below] + (lengths[above] - lengths[below]) * (position - below)
    values = {"mean": sum(lengths) / len(lengths), "max": lengths[-1], "p90": p90}
    return {f"response_length/{k}": torch.tensor(v, dtype=torch.float64, device=device) for k, v in values.items()}


def diagnostics(
    train_lp, rollout_lp, mask, seqs, rc, w=None, norm_factor=None, new_mask=None, rs_info=None, token_kept=None
) -> Dict[str, torch.Tensor]:
    """The rollout_corr/* metrics of SPEC §8, on the original mask.

    `w` are the IS weights before batch normalisation (what verl reports as well)."""
    # Long on purpose: the oracle reads top to bottom in the spec's order, so that it can be checked against
    # docs/spec.md line by line; helpers would hide the order the steps run in.
    device = train_lp.device
    delta = torch.where(mask, train_lp - rollout_lp, torch.zeros_like(train_lp))
    delta_hat = delta.clamp(-CLAMP, CLAMP)
    out = {}
    out["kl"] = masked_mean(rollout_lp - train_lp, mask)
    out["k3_kl"] = masked_mean(torch.exp(delta_hat) - delta_hat - 1, mask)
    # chi2 = E[rho^2] - 1, written as E[rho^2 - 1] so that an empty batch gives 0, not -1
    out["chi2_token"] = masked_mean(torch.exp(2 * delta_hat) - 1, mask)
    out["tv_token"] = masked_mean(0.5 * (torch.exp(delta_hat) - 1).abs(), mask)

    rho_seq_sq, chi2_seq, tr_ppl, ro_ppl, tr_log_ppl, ro_log_ppl, diffs = [], [], [], [], [], [], []
    for idx in seqs:
        m = mask[idx]
        if not m.any():
            continue
        S = delta[idx][m].sum()
        rho_seq_sq.append(torch.exp(2 * S.clamp(-CLAMP, CLAMP)))
        chi2_seq.append(rho_seq_sq[-1] - 1)
        mean_tr = train_lp[idx][m].mean()
        mean_ro = rollout_lp[idx][m].mean()
        tr_ppl.append(torch.exp(-mean_tr))
        ro_ppl.append(torch.exp(-mean_ro))
        tr_log_ppl.append(-mean_tr)
        ro_log_ppl.append(-mean_ro)
        diffs.append(mean_ro - mean_tr)
    out["chi2_seq"] = mean_or_zero(chi2_seq, device)
    out["c_star"] = torch.sqrt(2 * mean_or_zero(rho_seq_sq, device))  # = sqrt(2 (1 + chi2_seq))
    out["training_ppl"] = mean_or_zero(tr_ppl, device)
    out["rollout_ppl"] = mean_or_zero(ro_ppl, device)
    out["training_log_ppl"] = mean_or_zero(tr_log_ppl, device)
    out["rollout_log_ppl"] = mean_or_zero(ro_log_ppl, device)
    out["log_ppl_diff"] = mean_or_zero(diffs, device)
    out["log_ppl_abs_diff"] = mean_or_zero([d.abs() for d in diffs], device)
    out["log_ppl_diff_max"] = torch.stack(diffs).max() if diffs else _zero(device)
    out["log_ppl_diff_min"] = torch.stack(diffs).min() if diffs else _zero(device)
    out["ppl_ratio"] = mean_or_zero([torch.exp(d) for d in diffs], device)

    if rc is not None and rc.is_level is not None:
        lo, hi = rc.is_bounds
        out["rollout_is_mean"] = masked_mean(w, mask)
        x = w.clamp(0, hi)
        mean_x = masked_mean(x, mask)
        out["rollout_is_std"] = torch.sqrt(masked_mean((x - mean_x) ** 2, mask))
        out["rollout_is_min"] = w[mask].min() if mask.any() else _zero(device)
        out["rollout_is_max"] = w[mask].max() if mask.any() else _zero(device)
        if rc.is_level == "token":
            out["rollout_is_ratio_fraction_high"] = masked_mean((delta_hat > _log(hi)).double(), mask)
            out["rollout_is_ratio_fraction_low"] = masked_mean((delta_hat < _log(lo)).double(), mask)
        else:
            sums = [sequence_log_ratio(delta, mask, idx, rc, token_kept) for idx in seqs if mask[idx].any()]
            out["rollout_is_ratio_fraction_high"] = mean_or_zero([(s > _log(hi)).double() for s in sums], device)
            out["rollout_is_ratio_fraction_low"] = mean_or_zero([(s < _log(lo)).double() for s in sums], device)
        # ESS = 1 / mean(x~^2), x~ = x / mean(x); 0 when every weight is 0 or nothing is valid
        if mean_x > 0:
            out["rollout_is_eff_sample_size"] = 1.0 / masked_mean((x / mean_x) ** 2, mask)
        else:
            out["rollout_is_eff_sample_size"] = _zero(device)
        if rc.is_batch_normalize:
            out["rollout_is_batch_norm_factor"] = norm_factor
        nonempty = [idx for idx in seqs if mask[idx].any()]
        if rc.is_level == "token":
            raw_seq = [torch.exp(delta_hat[idx][mask[idx]]).mean() for idx in nonempty]
            log_raw = delta_hat
        else:
            raw_seq = [torch.exp(sequence_log_ratio(delta, mask, idx, rc, token_kept)) for idx in nonempty]
            log_raw = None
        if rc.is_icepop:
            lo_m, hi_m = rc.is_range
            if log_raw is not None:
                out["rollout_is_oob_ratio"] = masked_mean(((log_raw < _log(lo_m)) | (log_raw > _log(hi_m))).double(),
                                                          mask)
            else:
                out["rollout_is_oob_ratio"] = mean_or_zero(
                    [((torch.log(r) < _log(lo_m)) | (torch.log(r) > _log(hi_m))).double() for r in raw_seq], device)
        seq_w = [w[idx][mask[idx]].mean() for idx in nonempty]
        out.update(_spread("rollout_is_seq", seq_w, 1.0, device))
        out["rollout_is_seq_fraction_high"] = mean_or_zero([(r > hi).double() for r in raw_seq], device)
        out["rollout_is_seq_fraction_low"] = mean_or_zero([(r < lo).double() for r in raw_seq], device)

    if rc is not None and rc.rs:
        out["rollout_rs_masked_fraction"] = masked_mean((mask & ~new_mask).double(), mask)
        rejected = [(mask[idx] & ~new_mask[idx]).any().double() for idx in seqs if mask[idx].any()]
        out["rollout_rs_seq_masked_fraction"] = mean_or_zero(rejected, device)
        out["rollout_rs_all_rejected"] = (mask.any() & ~(mask & new_mask).any()).double()
        for option, info in rs_info.items():
            v = info["values"]
            out[f"rollout_rs_{option}_mean"] = v.mean() if v.numel() else _zero(device)
            out[f"rollout_rs_{option}_max"] = v.max() if v.numel() else _zero(device)
            out[f"rollout_rs_{option}_min"] = v.min() if v.numel() else _zero(device)
            out[f"rollout_rs_{option}_masked_fraction"] = info["masked_fraction"]
            lo, hi = info["bounds"]
            k1 = option.endswith("k1")
            stat = v  # over valid tokens (token options) or non-empty sequences (sequence options)
            out[f"rollout_rs_{option}_fraction_high"] = (stat > hi).double().mean() if stat.numel() else _zero(device)
            out[f"rollout_rs_{option}_fraction_low"] = ((stat < lo).double().mean() if (stat.numel() and k1)
                                                       else _zero(device))
            clamped = stat.clamp(lo, hi)
            out[f"rollout_rs_{option}_std"] = (clamped.var(unbiased=False).sqrt() if stat.numel()
                                              else _zero(device))
            seq_values = info["seq_values"]
            out.update(_spread(f"rollout_rs_{option}_seq", seq_values, 0.0, device))
            out[f"rollout_rs_{option}_seq_fraction_high"] = mean_or_zero([(x > hi).double() for x in seq_values],
                                                                         device)
            if k1:
                out[f"rollout_rs_{option}_seq_fraction_low"] = mean_or_zero(
                    [(x < lo).double() for x in seq_values], device)
            out[f"rollout_rs_{option}_seq_masked_fraction"] = mean_or_zero(
                [r.double() for r in info["seq_rejected"]], device)
    return {f"rollout_corr/{k}": v for k, v in out.items()}
