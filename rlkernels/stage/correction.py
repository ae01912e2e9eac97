"""Rollout correction on per-token scalars: IS weights (SPEC §4), rejection masks (§5) and the
rollout_corr/* diagnostics (§8). Vectorised torch on [N] tensors; the same code serves every
backend, since none of it touches the vocabulary.

It runs in the stage's three steps, each ending where a split batch must communicate:
  1. `token_terms`: everything that needs only a token (log-ratios, k-statistics, token-level
     rejection and truncation), and the per-sequence columns the later steps read;
  2. `decide` after the per-sequence sums are whole: sequence-level weights and rejection, the final
     mask; then `normalisers`, the batch-wide counts and means (whole after one combine);
  3. `weights` and `record_metrics` with those global normalisers.
"""

from __future__ import annotations

import math
import struct
from typing import TYPE_CHECKING, Dict, List, NamedTuple, Optional, Tuple

import torch

from .metrics import Metrics
from .policy_terms import binary_kl
from .segments import Segments, SequenceTable, hyper_scalar, log_hyper_scalar

if TYPE_CHECKING:  # duck-typed: rlkernels.config reads the stage's loss table, so the stage imports no config
    from ..config import RolloutCorrection

CLAMP = 20.0  # SPEC §4: clamp every log-ratio before exp
ALL_REJECTED = "rollout_corr/rollout_rs_all_rejected"  # 1 when rejection kept none of m's tokens (notices.py reads it)
DIVERGENCE_METRICS = ("kl", "reverse_kl", "chi2", "tv")  # SPEC §9: token mean, sequence max and batch max of each


# The probabilities of the binary divergences (bkl) are clamped to [eps, 1 - eps], as OpenRLHF clamps them
BINARY_EPS = 1e-6


def rs_kind(option: str) -> str:
    """The statistic a rejection option bounds: its name's last part (token_k1 -> k1, seq_mean_bkl -> bkl)."""
    return option.rsplit("_", 1)[1]


def rs_scope(option: str) -> str:
    """How a rejection option reduces its statistic: "token", "all" (every token of the sequence in the bounds),
    "sum", "mean" or "max" over the sequence."""
    return "token" if option.startswith("token_") else option.split("_")[1]


def _k_stat(kind: str, train: torch.Tensor, rollout: torch.Tensor, delta_hat: torch.Tensor,
            divergences: Optional["DivergenceRecord"]) -> torch.Tensor:
    if kind == "kl":  # TRM: the vocabulary-level KL(μ_t || π_t) of SPEC §9, not a function of the sampled token
        return divergences.values["kl"]
    if kind == "k1":
        return -delta_hat
    if kind == "k2":
        return 0.5 * delta_hat * delta_hat
    if kind == "k3":
        return torch.exp(delta_hat) - 1 - delta_hat
    if kind == "bkl":  # the sampled token's binary KL(μ || π) of (token, rest), OpenRLHF's binary_kl gate
        return binary_kl(rollout, train, BINARY_EPS)
    # btv: |μ - π| of the sampled token, both clamped to [eps, 1 - eps] as OpenRLHF's tv gate clamps them
    def clamped(log_p):
        return torch.exp(log_p.clamp(math.log(BINARY_EPS), math.log1p(-BINARY_EPS)))
    return (clamped(rollout) - clamped(train)).abs()


def _keeps(kind: str, stat: torch.Tensor, bound) -> torch.Tensor:
    if kind == "k1":  # keep lo <= rho <= hi, rho = exp(-k1), compared in log space (SPEC §5)
        lo, hi = bound
        # -k1 in [log lo, log hi], written on k1 itself: negation is exact
        return (stat <= -log_hyper_scalar(stat, lo)) & (stat >= -log_hyper_scalar(stat, hi))
    return stat <= bound


def _truncate(raw: torch.Tensor, mask: torch.Tensor, rc: RolloutCorrection, zero: torch.Tensor) -> torch.Tensor:
    """SPEC §4: truncation (clamp to [lo, hi]) or IcePop masking (0 outside [lo, hi]); 0 off the mask."""
    lo, hi = rc.is_range
    if rc.is_icepop:
        return torch.where(mask & (raw >= lo) & (raw <= hi), raw, zero)
    return torch.where(mask, torch.clamp(raw, hyper_scalar(raw, lo), hyper_scalar(raw, hi)), zero)


class TokenTerms(NamedTuple):
    train: torch.Tensor  # [N] log-probs of the training policy, 0 off the mask
    rollout: torch.Tensor  # [N] behaviour log-probs, 0 off the mask
    delta: torch.Tensor  # [N] train - rollout
    delta_hat: torch.Tensor  # [N] delta clamped to [-20, 20] (SPEC §4)
    k_stats: Dict[str, torch.Tensor]  # kind -> [N] k-statistic, 0 off the mask (the kinds rejection uses)
    token_keep: torch.Tensor  # [N] mask minus the tokens a token_* rejection option drops
    token_weights: Optional[torch.Tensor]  # [N] truncated token-level IS weights (is_level='token')


class DivergenceRecord(NamedTuple):
    """The per-token divergences between the trainer and the sampler of SPEC §9, for rejection and metrics."""
    form: str  # "full" or "topk" (the metric names' prefix)
    values: Dict[str, torch.Tensor]  # name -> [N] detached: kl, reverse_kl, chi2, tv, head masses, membership


def token_terms(train: torch.Tensor, rollout: torch.Tensor, mask: torch.Tensor, rc: Optional[RolloutCorrection],
                table: SequenceTable, divergences: Optional[DivergenceRecord] = None) -> TokenTerms:
    """Step 1. train, rollout: [N], already 0 off the mask. Registers the per-sequence columns."""
    delta = train - rollout
    delta_hat = delta.clamp(-CLAMP, CLAMP)
    table.add_sum("train", train)
    table.add_sum("rollout", rollout)
    table.add_sum("delta", delta)  # the unclamped sequence sum, clamped once (SPEC §4)
    k_stats, keep, token_weights = {}, mask, None
    options = rc.rs if rc is not None else ()
    for option, bound in options:
        kind = rs_kind(option)
        if kind not in k_stats:
            stat = _k_stat(kind, train, rollout, delta_hat, divergences)
            k_stats[kind] = torch.where(mask, stat, table.zero)
        if rs_scope(option) in ("token", "all"):
            option_keep = _keeps(kind, k_stats[kind], bound)
            if rs_scope(option) == "token":
                keep = keep & option_keep
            table.add_sum(kind, k_stats[kind])  # the per-sequence means of the option's metrics
            # the tokens outside the bounds: rejected themselves (token), or rejecting their sequence (all)
            table.add_sum(f"rejected_{option}", (mask & ~option_keep).to(delta.dtype))
    # the sequence statistics, over m or over the tokens the token options keep (seq_tokens="kept": SkyRL's order)
    kept = rc is not None and rc.seq_tokens == "kept"
    over = keep if kept else mask
    for option, _ in options:
        kind, scope, suffix = rs_kind(option), rs_scope(option), "_kept" if kept else ""
        if scope in ("sum", "mean", "max"):
            values = torch.where(over, k_stats[kind], table.zero) if kept else k_stats[kind]
            (table.add_max if scope == "max" else table.add_sum)(kind + suffix, values)
    if options:
        table.add_sum("kept", keep.to(delta.dtype))
    if rc is not None and rc.is_level in ("sequence", "geometric") and kept:
        table.add_sum("delta_kept", torch.where(keep, delta, table.zero))
    if rc is not None and rc.is_level == "token":
        raw = torch.exp(delta_hat)
        token_weights = _truncate(raw, mask, rc, table.zero)
        # batch normalisation and the rollout_is_seq_* metrics (with rs_mode="zero_weight": 0 where rejected)
        kept_weights = torch.where(keep, token_weights, table.zero) if rc.rs_mode == "zero_weight" \
            else token_weights
        table.add_sum("weights", kept_weights)
        table.add_sum("raw_weights", torch.where(mask, raw, table.zero))
    return TokenTerms(train, rollout, delta, delta_hat, k_stats, keep, token_weights)


class Option(NamedTuple):
    """One rejection option's values and verdict, for its metrics."""
    name: str
    values: torch.Tensor  # [N] token statistics, or [S] sequence statistics
    per_sequence: bool
    keep: torch.Tensor  # [N] bool, the tokens this option keeps
    bounds: Tuple[float, float]  # the kept range of the statistic (k1: -log hi <= k1 <= -log lo; else 0 <= stat <= u)
    seq_keep: Optional[torch.Tensor] = None  # [S] bool, sequence options: the sequences kept


class Decisions(NamedTuple):
    truncated: Optional[torch.Tensor]  # [N] IS weights before batch normalisation, 0 off the mask
    sequence_weights: Optional[torch.Tensor]  # [S] truncated weight of each sequence (is_level='sequence')
    log_ratio: Optional[torch.Tensor]  # [N] or [S] the clamped log-ratio the IS weights come from
    mask: torch.Tensor  # [N] bool, the final mask m'
    final_lengths: torch.Tensor  # [S] tokens of each sequence in m'
    options: List[Option]
    # the tokens and lengths the rejection options keep: m' itself, or, with rs_mode="zero_weight" (where m' = m
    # and the rejected tokens get weight 0), what the rollout_rs_* fractions describe
    kept: Optional[torch.Tensor] = None
    kept_lengths: Optional[torch.Tensor] = None


def decide(terms: Optional[TokenTerms], mask: torch.Tensor, table: SequenceTable,
           rc: Optional[RolloutCorrection]) -> Decisions:
    """Step 2: sequence-level IS weights and rejection on whole sequences; the final mask."""
    lengths = table.sum("len")
    if terms is None or rc is None:
        return Decisions(None, None, None, mask, lengths, [])
    seg = table.seg
    truncated = seq_weights = log_ratio = None
    kept = rc.seq_tokens == "kept"
    count = table.sum("kept") if kept and rc.rs else lengths  # the tokens a sequence statistic runs over
    suffix = "_kept" if kept else ""
    if rc.is_level == "token":
        truncated, log_ratio = terms.token_weights, terms.delta.clamp(-CLAMP, CLAMP)
    elif rc.is_level is not None:
        # the sequence's log-ratio: its sum, or its mean (the geometric-mean ratio), over m or over the tokens the
        # token-level rejection options keep (seq_tokens="kept")
        log_ratio = table.sum("delta_kept" if kept else "delta")
        if rc.is_level == "geometric":
            log_ratio = log_ratio / count.clamp_min(1)
        log_ratio = log_ratio.clamp(-CLAMP, CLAMP)
        seq_weights = _truncate(torch.exp(log_ratio), lengths > 0, rc, table.zero)
        truncated = torch.where(mask, seg.expand(seq_weights), table.zero)
    options, keep_seq = [], None  # None: every sequence kept so far
    for option, bound in rc.rs:
        kind, scope = rs_kind(option), rs_scope(option)
        stat_bounds = (-math.log(bound[1]), -math.log(bound[0]) if bound[0] > 0 else math.inf) if kind == "k1" \
            else (0.0, bound)
        if scope in ("token", "all"):
            stat = terms.k_stats[kind]
            if scope == "token":
                options.append(Option(option, stat, False, _keeps(kind, stat, bound) | ~mask, stat_bounds))
                continue
            keep = table.sum(f"rejected_{option}") == 0  # every token of the sequence inside the bounds
            keep_seq = keep if keep_seq is None else keep_seq & keep
            options.append(Option(option, stat, False, seg.expand(keep) | ~mask, stat_bounds, keep))
            continue
        if scope == "sum":
            values = table.sum(kind + suffix)
        elif scope == "mean":
            values = table.sum(kind + suffix) / count.clamp_min(1)
        else:
            values = table.max(kind + suffix)
        keep = _keeps(kind, values, bound)
        keep_seq = keep if keep_seq is None else keep_seq & keep
        options.append(Option(option, values, True, seg.expand(keep), stat_bounds, keep))
    if not rc.rs:
        return Decisions(truncated, seq_weights, log_ratio, mask, lengths, [])
    # the final lengths from whole-sequence values: a token rejection is local, a sequence one global
    if keep_seq is None:  # token options only
        final_mask, final_lengths = terms.token_keep, table.sum("kept")
    else:
        final_mask = terms.token_keep & seg.expand(keep_seq)
        final_lengths = torch.where(keep_seq, table.sum("kept"), table.zero)
    if rc.rs_mode == "zero_weight":  # OpenRLHF's, NeMo-RL's: rejected tokens stay in m', their weight 0
        truncated = torch.where(final_mask, truncated, table.zero)
        if seq_weights is not None and keep_seq is not None:
            seq_weights = torch.where(keep_seq, seq_weights, table.zero)
        return Decisions(truncated, seq_weights, log_ratio, mask, lengths, options, final_mask, final_lengths)
    return Decisions(truncated, seq_weights, log_ratio, final_mask, final_lengths, options, final_mask, final_lengths)


class Normalisers(NamedTuple):
    """Batch-wide counts and means, whole over the split (SPEC §7, §8)."""
    tokens: torch.Tensor  # |m|
    kept_tokens: torch.Tensor  # |m'|
    seqs: torch.Tensor  # sequences with a token in m
    kept_seqs: torch.Tensor  # sequences with a token in m' (G)
    width: Optional[torch.Tensor]  # K default of seq-mean-token-sum-norm (None: the segments' own width)
    weight_mean: Optional[torch.Tensor]  # the batch mean of the truncated IS weights (is_batch_normalize)
    all_seqs: Optional[torch.Tensor] = None  # every sequence, empty ones included (GMPO's mean)


def normalisers(table: SequenceTable, decisions: Decisions, rc: Optional[RolloutCorrection], split) -> Normalisers:
    """From whole per-sequence values; one combine across a data-parallel split. The counts are exact in any
    order (integers in the statistics' dtype), so they are taken as two row sums of one [2, S] stack."""
    lengths = table.sum("len")
    dt = lengths.dtype
    per_seq = torch.stack([lengths, decisions.final_lengths])
    counts = [per_seq.sum(1), (per_seq > 0).sum(1, dtype=dt), lengths.new_full((1,), float(lengths.numel()))]
    normalise = rc is not None and rc.is_level is not None and rc.is_batch_normalize
    if normalise:  # token level: the mean over m; sequence level: over non-empty sequences, one weight each
        weights = table.sum("weights") if rc.is_level == "token" else decisions.sequence_weights
        counts.append(weights.sum().reshape(1))
    width = None  # without a split the segments' own (read only by seq-mean-token-sum-norm), else the widest rank's
    if split.dp_group is not None:
        width = table.seg.width_like(lengths).reshape(1)
    total, widest = split.combine_normalisers(torch.cat(counts), width)
    tokens, kept_tokens, seqs, kept_seqs, all_seqs = total[:5].unbind()
    weight_mean = None
    if normalise:
        weight_mean = total[5] / (tokens if rc.is_level == "token" else seqs).clamp_min(1)
    return Normalisers(tokens, kept_tokens, seqs, kept_seqs, None if widest is None else widest[0], weight_mean,
                       all_seqs)


class ISWeights(NamedTuple):
    weights: torch.Tensor  # [N] applied weights, 0 off the mask
    truncated: torch.Tensor  # [N] before batch normalisation (what the metrics describe)
    norm_factor: torch.Tensor  # 0-d, 1 when not normalised


def weights(decisions: Decisions, norms: Normalisers) -> Optional[ISWeights]:
    """Step 3: the applied IS weights (batch-normalised by the global mean when asked)."""
    w = decisions.truncated
    if w is None:
        return None
    one = torch.ones((), dtype=w.dtype, device=w.device)
    if norms.weight_mean is None:  # w / 1 is w
        return ISWeights(w, w, one)
    factor = torch.where(norms.weight_mean > 1e-8, norms.weight_mean, one)
    return ISWeights(w / factor, w, factor)


class _Sets(NamedTuple):
    """The sets the rollout_corr/* means run over (the original mask, SPEC §8) and their whole-batch sizes."""
    mask: torch.Tensor  # [N] tokens of m
    n_tok: torch.Tensor  # |m|
    lengths: torch.Tensor  # [S] tokens of each sequence in m
    divisor: torch.Tensor  # [S] lengths.clamp_min(1): a sequence's mean divides by it
    nonempty: torch.Tensor  # [S] sequences with a token in m
    n_seq: torch.Tensor  # their number
    table: SequenceTable
    dt: torch.dtype


def record_metrics(metrics: Metrics, terms: TokenTerms, mask: torch.Tensor, table: SequenceTable,
                   decisions: Decisions, norms: Normalisers, rc: Optional[RolloutCorrection],
                   weights: Optional[ISWeights]) -> None:
    """The rollout_rs_* metrics of every rejection option and the rollout_corr/* diagnostics of SPEC
    §8, on the original mask."""
    lengths = table.sum("len")
    sets = _Sets(mask, norms.tokens, lengths, lengths.clamp_min(1), lengths > 0, norms.seqs, table, terms.delta.dtype)
    _rejection_metrics(metrics, decisions, sets)
    _mismatch_metrics(metrics, terms, sets)
    if weights is not None:
        _weight_metrics(metrics, weights, decisions, rc, sets)


def record_divergence_metrics(metrics: Metrics, divergences: DivergenceRecord, mask: torch.Tensor,
                              table: SequenceTable, norms: Normalisers) -> None:
    """rollout_corr/{form}_{name}_mean (token mean), _seq_max_mean (the mean over sequences of each one's max) and
    _max (the batch max) of every divergence of SPEC §9, and the top-k form's head masses and membership, on the
    original mask."""
    lengths = table.sum("len")
    n_tok, nonempty, n_seq = norms.tokens, lengths > 0, norms.seqs
    for name in DIVERGENCE_METRICS:
        x = divergences.values.get(name)
        if x is None:
            continue
        prefix = f"rollout_corr/{divergences.form}_{name}"
        metrics.mean(f"{prefix}_mean", x, mask, n_tok)
        metrics.mean(f"{prefix}_seq_max_mean", table.max(f"divergence_{name}"), nonempty, n_seq, True)
        metrics.extreme(f"{prefix}_max", x, mask, n_tok, largest=True)
    for name in ("trainer_head_mass", "sampler_head_mass"):
        if name in divergences.values:
            metrics.mean(f"rollout_corr/{divergences.form}_{name}_mean", divergences.values[name], mask, n_tok)
            metrics.extreme(f"rollout_corr/{divergences.form}_{name}_min", divergences.values[name], mask, n_tok,
                            largest=False)
    if "sampled_in_head" in divergences.values:
        metrics.mean(f"rollout_corr/{divergences.form}_sampled_in_head_fraction",
                     divergences.values["sampled_in_head"], mask, n_tok)


LENGTH_QUANTILE = 0.9


def record_length_metrics(metrics: Metrics, table: SequenceTable, norms: Normalisers, split) -> None:
    """response_length/mean, /max and /p90 (SPEC §8.1): of every sequence's tokens in m, empty ones included.
    The quantile interpolates linearly between order statistics (numpy's default); it needs every sequence's
    length, which a data-parallel split does not gather: there it is not reported."""
    lengths = table.sum("len")
    everyone = torch.ones_like(lengths, dtype=torch.bool)
    metrics.mean("response_length/mean", lengths, everyone, norms.all_seqs, per_sequence=True)
    metrics.extreme("response_length/max", lengths, everyone, norms.all_seqs, largest=True, per_sequence=True)
    if split.dp_group is None:
        p90 = _quantile(lengths, LENGTH_QUANTILE) if lengths.numel() else lengths.new_zeros(())
        metrics.sequence_statistic("response_length/p90", p90)


def _quantile(values: torch.Tensor, q: float) -> torch.Tensor:
    """torch.quantile(values, q) of a non-empty 1-D tensor, the same operations in the same order (sort, rank
    q (n - 1) in the values' dtype, lerp between the order statistics at its floor and ceiling). torch.quantile
    itself reads numel() in C++, which fails under torch.compile with a symbolic length before torch 2.13
    (seen on 2.11: every compiled stage with a response-length metric stopped there). Eagerly the length is a host
    number, and so are the rank and the weight (rounded as the tensor arithmetic would round them): a sort and a
    lerp, no gathers."""
    ordered = values.sort().values
    n = values.shape[0]
    if isinstance(n, int) and not torch.compiler.is_compiling():
        rank = _rounded(_rounded(q, values.dtype) * (n - 1), values.dtype)
        below = math.floor(rank)
        return torch.lerp(ordered[below], ordered[math.ceil(rank)], rank - below)  # rank - below: exact
    rank = values.new_full((), q) * (n - 1)
    below, above = rank.floor().long().reshape(1), rank.ceil().long().reshape(1)  # gathered: no data-dependent int
    return torch.lerp(ordered.gather(0, below), ordered.gather(0, above), rank - below.to(rank.dtype)).squeeze(0)


def _rounded(x: float, dtype: torch.dtype) -> float:
    """x rounded to `dtype` (float32 or float64), as a 0-d tensor of it holds x."""
    return struct.unpack("f", struct.pack("f", x))[0] if dtype == torch.float32 else float(x)


def _rejection_metrics(metrics: Metrics, decisions: Decisions, sets: _Sets) -> None:
    mask, n_tok, dt = sets.mask, sets.n_tok, sets.dt
    for option in decisions.options:
        prefix = f"rollout_corr/rollout_rs_{option.name}"
        valid, n = (sets.nonempty, sets.n_seq) if option.per_sequence else (mask, n_tok)
        metrics.mean(f"{prefix}_mean", option.values, valid, n, option.per_sequence)
        metrics.extreme(f"{prefix}_max", option.values, valid, n, largest=True, per_sequence=option.per_sequence)
        metrics.extreme(f"{prefix}_min", option.values, valid, n, largest=False, per_sequence=option.per_sequence)
        metrics.mean(f"{prefix}_masked_fraction", ~option.keep, mask, n_tok)
        _option_spread(metrics, prefix, option, valid, n, sets)
    if decisions.options:
        metrics.mean("rollout_corr/rollout_rs_masked_fraction", mask & ~decisions.kept, mask, n_tok)
        seq_rejected = decisions.kept_lengths < sets.lengths
        metrics.mean("rollout_corr/rollout_rs_seq_masked_fraction", seq_rejected, sets.nonempty, sets.n_seq, True)
        # 1 when the batch had response tokens and rejection kept none of them: a step that learns nothing
        # (a count, not the fraction above, whose sum of 1/n terms need not round to exactly 1)
        metrics.total("_rs_kept_tokens", (mask & decisions.kept).sum().to(dt))
        metrics.derive(ALL_REJECTED, lambda kept: ((kept == 0) & (n_tok > 0)).to(dt),
                       "_rs_kept_tokens")


def _mismatch_metrics(metrics: Metrics, terms: TokenTerms, sets: _Sets) -> None:
    """The training-vs-rollout divergences and perplexities (SPEC §8)."""
    name = lambda k: f"rollout_corr/{k}"  # noqa: E731
    mask, n_tok, nonempty, n_seq, table = sets.mask, sets.n_tok, sets.nonempty, sets.n_seq, sets.table
    delta, delta_hat = terms.delta, terms.delta_hat
    rho = torch.exp(delta_hat)
    mean_tr = table.sum("train") / sets.divisor
    mean_ro = table.sum("rollout") / sets.divisor
    diff = mean_ro - mean_tr
    rho_seq_sq = torch.exp(2 * table.sum("delta").clamp(-CLAMP, CLAMP))
    metrics.mean(name("kl"), -delta, mask, n_tok)
    metrics.mean(name("k3_kl"), rho - delta_hat - 1, mask, n_tok)
    # chi2 = E[rho^2] - 1 written as E[rho^2 - 1]: equal, but 0 (not -1) on an empty batch
    metrics.mean(name("chi2_token"), rho * rho - 1, mask, n_tok)
    metrics.mean(name("chi2_seq"), rho_seq_sq - 1, nonempty, n_seq, True)
    metrics.mean(name("tv_token"), 0.5 * (rho - 1).abs(), mask, n_tok)
    log_ppl_tr, log_ppl_ro = -mean_tr, -mean_ro
    metrics.mean_exp(name("training_ppl"), log_ppl_tr, nonempty, n_seq)
    metrics.mean_exp(name("rollout_ppl"), log_ppl_ro, nonempty, n_seq)
    metrics.mean(name("training_log_ppl"), log_ppl_tr, nonempty, n_seq, True)
    metrics.mean(name("rollout_log_ppl"), log_ppl_ro, nonempty, n_seq, True)
    metrics.mean(name("log_ppl_diff"), diff, nonempty, n_seq, True)
    metrics.mean(name("log_ppl_abs_diff"), diff.abs(), nonempty, n_seq, True)
    metrics.extreme(name("log_ppl_diff_max"), diff, nonempty, n_seq, largest=True, per_sequence=True)
    metrics.extreme(name("log_ppl_diff_min"), diff, nonempty, n_seq, largest=False, per_sequence=True)
    metrics.mean_exp(name("ppl_ratio"), diff, nonempty, n_seq)
    # sqrt(2 (1 + chi2_seq)) taken as sqrt(2 E[rho_seq^2]): 1 + (E[rho^2] - 1) rounds to 0 in
    # float32 when every rho_seq is tiny, E[rho^2] itself does not
    metrics.mean("_rho_seq_sq", rho_seq_sq, nonempty, n_seq, True)
    metrics.derive(name("c_star"), lambda m: torch.sqrt(2 * m), "_rho_seq_sq")


def _weight_metrics(metrics: Metrics, weights: ISWeights, decisions: Decisions, rc: RolloutCorrection,
                    sets: _Sets) -> None:
    """The rollout_is_* metrics of the truncated IS weights (before batch normalisation)."""
    name = lambda k: f"rollout_corr/{k}"  # noqa: E731
    mask, n_tok, nonempty, n_seq, table = sets.mask, sets.n_tok, sets.nonempty, sets.n_seq, sets.table
    lo, hi = rc.is_bounds
    w = weights.truncated
    cap = hyper_scalar(w, hi)
    x = w.clamp(0.0, cap) if isinstance(cap, float) else torch.clamp(w.clamp_min(0), max=cap)
    metrics.mean(name("rollout_is_mean"), w, mask, n_tok)
    metrics.std(name("rollout_is_std"), x, mask, moments="_is_x")
    metrics.extreme(name("rollout_is_min"), w, mask, n_tok, largest=False)
    metrics.extreme(name("rollout_is_max"), w, mask, n_tok, largest=True)
    per_sequence = rc.is_level != "token"
    valid, n = (nonempty, n_seq) if per_sequence else (mask, n_tok)
    log_ratio = decisions.log_ratio
    metrics.mean(name("rollout_is_ratio_fraction_high"), log_ratio > log_hyper_scalar(log_ratio, hi), valid, n,
                 per_sequence)
    metrics.mean(name("rollout_is_ratio_fraction_low"), log_ratio < log_hyper_scalar(log_ratio, lo), valid, n,
                 per_sequence)
    metrics.derive(name("rollout_is_eff_sample_size"), _effective_sample_size, "_is_x", name("rollout_is_std"))
    if rc.is_batch_normalize:
        metrics.derive(name("rollout_is_batch_norm_factor"), lambda: weights.norm_factor)
    if rc.is_icepop:  # the weights IcePop zeroes (verl's rollout_is_oob_ratio)
        lo_m, hi_m = rc.is_range
        outside = (log_ratio < log_hyper_scalar(log_ratio, lo_m)) | (log_ratio > log_hyper_scalar(log_ratio, hi_m))
        metrics.mean(name("rollout_is_oob_ratio"), outside, valid, n, per_sequence)
    # each sequence's mean weight (verl's rollout_is_seq_*); its raw (untruncated) mean against the bounds
    if per_sequence:
        seq_w, seq_raw = decisions.sequence_weights, torch.exp(log_ratio)
    else:
        seq_w = table.sum("weights") / sets.divisor
        if rc.rs_mode == "zero_weight":  # a sequence the options drop has every weight 0
            seq_w = torch.where(decisions.kept_lengths > 0, seq_w, torch.zeros_like(seq_w))
        seq_raw = table.sum("raw_weights") / sets.divisor
    _sequence_spread(metrics, name("rollout_is_seq"), seq_w, nonempty, n_seq, centre=1.0)
    metrics.mean(name("rollout_is_seq_fraction_high"), seq_raw > hyper_scalar(seq_raw, hi), nonempty, n_seq, True)
    metrics.mean(name("rollout_is_seq_fraction_low"), seq_raw < hyper_scalar(seq_raw, lo), nonempty, n_seq, True)


def _sequence_spread(metrics: Metrics, prefix: str, values: torch.Tensor, valid: torch.Tensor, n: torch.Tensor,
                     centre: float) -> None:
    """{prefix}_mean|std|max|min|max_deviation of one value per sequence over `valid` sequences
    (std with Bessel's correction, |value - centre| for the deviation), as verl's *_seq_* metrics."""
    metrics.mean(f"{prefix}_mean", values, valid, n, True)
    metrics.std(f"{prefix}_std", values, valid, per_sequence=True, bessel=True)
    metrics.extreme(f"{prefix}_max", values, valid, n, largest=True, per_sequence=True)
    metrics.extreme(f"{prefix}_min", values, valid, n, largest=False, per_sequence=True)
    deviation = values.abs() if centre == 0 else (values - centre).abs()  # x - 0 is x, -0 included
    metrics.extreme(f"{prefix}_max_deviation", deviation, valid, n, largest=True, per_sequence=True)


def _option_spread(metrics: Metrics, prefix: str, option: "Option", valid, n, sets: _Sets) -> None:
    """verl's further per-option metrics: fractions beyond the kept range, the spread of the statistic
    clamped to it, and the same over each sequence's value (the sequence statistic, or the mean of a
    token statistic over the sequence)."""
    lo, hi = option.bounds
    k1 = option.name.endswith("k1")
    values, nonempty, n_seq = option.values, sets.nonempty, sets.n_seq
    metrics.mean(f"{prefix}_fraction_high", values > hyper_scalar(values, hi), valid, n, option.per_sequence)
    low = (values < hyper_scalar(values, lo)) if k1 else torch.zeros_like(values, dtype=torch.bool)
    metrics.mean(f"{prefix}_fraction_low", low, valid, n, option.per_sequence)
    clamped = torch.clamp(values, hyper_scalar(values, lo), hyper_scalar(values, hi))
    metrics.std(f"{prefix}_std", clamped, valid, option.per_sequence)
    kind = rs_kind(option.name)
    seq_values = values if option.per_sequence else sets.table.sum(kind) / sets.divisor
    _sequence_spread(metrics, f"{prefix}_seq", seq_values, nonempty, n_seq, centre=0.0)
    metrics.mean(f"{prefix}_seq_fraction_high", seq_values > hyper_scalar(seq_values, hi), nonempty, n_seq, True)
    if k1:
        metrics.mean(f"{prefix}_seq_fraction_low", seq_values < hyper_scalar(seq_values, lo), nonempty, n_seq,
                     True)
    rejected = ~option.seq_keep if option.per_sequence else sets.table.sum(f"rejected_{option.name}") > 0
    metrics.mean(f"{prefix}_seq_masked_fraction", rejected, nonempty, n_seq, True)


def _effective_sample_size(moments: torch.Tensor, spread: torch.Tensor) -> torch.Tensor:
    """ESS = 1 / mean((x / mean x)^2) = 1 / (1 + (std / mean)^2) from the moments and the std (`spread`) of x; 0 when
    every weight is 0 or nothing is valid. Written with the ratio std / mean so that tiny weights do not underflow a
    square."""
    _, mean, _ = moments.unbind()
    tiny = torch.finfo(mean.dtype).tiny
    ratio = spread / mean.clamp_min(tiny)
    return torch.where(mean > 0, 1.0 / (1 + ratio * ratio), torch.zeros_like(mean))


def correct(train: torch.Tensor, rollout: torch.Tensor, mask: torch.Tensor, seg: Segments,
            rc: Optional[RolloutCorrection], split, kept_sums: Optional[Dict[str, torch.Tensor]] = None,
            divergences: Optional[DivergenceRecord] = None,
            ) -> Tuple[Optional[TokenTerms], SequenceTable, Decisions, Normalisers, Optional[ISWeights]]:
    """Steps 1-2 and the weights, for `rollout_correction` and the loss stage alike. rollout=None:
    no correction (the normalisers are still computed, for the loss). `kept_sums`: per-token values
    the loss needs summed per sequence over the tokens no token-level rejection drops (a sequence
    that a sequence-level option drops has no token left to use them); a callable under the key
    "log_weights" is applied to the log of the token-level truncated IS weights computed here. `divergences`:
    SPEC §9's per-token values (TRM's kl options read them; their sequence maxima feed the metrics)."""
    table = SequenceTable(seg, mask, train.dtype)
    terms = None if rollout is None else token_terms(train, rollout, mask, rc, table, divergences)
    # the tokens the loss's per-sequence sums run over: those no token-level rejection drops from m'
    zero_weight = rc is not None and rc.rs_mode == "zero_weight"
    token_keep = mask if terms is None or zero_weight else terms.token_keep
    kept_sums = dict(kept_sums or {})
    transform = kept_sums.get("log_weights")
    if callable(transform):  # of the token-level weights computed here, or nothing when there are none
        has_weights = terms is not None and terms.token_weights is not None
        kept_sums["log_weights"] = transform(torch.log(terms.token_weights)) if has_weights else None
    for name, x in kept_sums.items():
        if x is not None:
            table.add_sum(name, torch.where(token_keep, x, table.zero))
    if divergences is not None:  # the sequence maxima of the divergence metrics
        for name in DIVERGENCE_METRICS:
            if divergences.values.get(name) is not None:
                table.add_max(f"divergence_{name}", divergences.values[name])
    table.reduce(split)
    decisions = decide(terms, mask, table, rc)
    norms = normalisers(table, decisions, rc, split)
    return terms, table, decisions, norms, weights(decisions, norms)
