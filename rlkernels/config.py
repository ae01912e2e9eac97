"""Frozen option objects: `PolicyLossConfig`, `RolloutCorrection` and the SPEC §5 presets.

Every field is checked in ``__post_init__`` so a bad configuration fails where it is written, not
deep inside a training step. Thresholds are plain Python floats: they reach kernels as run-time
arguments and never force a recompilation.
"""

from __future__ import annotations

import difflib
import math
from dataclasses import dataclass, field, replace
from typing import Mapping, Optional, Tuple, Union

import torch

from .stage.policy_terms import LOSS_TERMS, TOKEN_MASKS, Option

# Option names of SPEC §5. k1 options take ratio bounds (lo, hi); k2/k3 options an upper bound. The kl options are
# Trust Region Masking's criterion on the vocabulary-level KL(μ_t || π_t) of SPEC §9 (the sampler's distribution to
# the trainer's), which needs the sampler's top-k or logits; they take an upper bound ε.
# bkl / btv: the sampled token's binary KL(μ || π) and probability gap |μ - π| (OpenRLHF's binary_kl and tv gates);
# seq_all_k1: keep a sequence iff every token's ratio lies in the bounds (SkyRL's outlier-token veto)
TOKEN_RS_OPTIONS = ("token_k1", "token_k2", "token_k3", "token_bkl", "token_btv")
SEQ_RS_OPTIONS = (
    "seq_sum_k1", "seq_sum_k2", "seq_sum_k3",
    "seq_mean_k1", "seq_mean_k2", "seq_mean_k3",
    "seq_max_k2", "seq_max_k3",
    "seq_all_k1",
    "seq_mean_bkl", "seq_max_bkl", "seq_mean_btv", "seq_max_btv",
    "seq_max_kl", "seq_mean_kl",
)
DIVERGENCE_RS_OPTIONS = ("seq_max_kl", "seq_mean_kl")
RS_OPTIONS = TOKEN_RS_OPTIONS + SEQ_RS_OPTIONS
# the options computed from the sampled tokens' log-probs alone (the others need the sampler's distribution)
LOG_RATIO_RS_OPTIONS = tuple(o for o in RS_OPTIONS if o not in DIVERGENCE_RS_OPTIONS)
IS_LEVELS = (None, "token", "sequence", "geometric")
SEQ_TOKENS = ("mask", "kept")
RS_MODES = ("mask", "zero_weight")
# policy losses, named as verl 0.9.1 registers them ("ppo_clip" is this library's older name of "vanilla"), read
# off the stage's table (rlkernels/stage/policy_terms.py: one function per loss type)
LOSS_TYPES = tuple(LOSS_TERMS)
# losses whose ratio may be taken per sequence (TRL's importance_sampling_level="sequence"; VESPO's own
# weight is per sequence anyway, there the level sets the ratio of a bias-corrected KL, as in TRL)
SEQUENCE_RATIO_LOSSES = tuple(name for name, entry in LOSS_TERMS.items() if entry.ratio_levels)
# losses whose selection is batch-global (a host sync, as in verl; no split batches)
COVARIANCE_LOSSES = tuple(name for name, entry in LOSS_TERMS.items() if entry.batch_global)
# losses that read the sampler's top-k (SPEC §9: score centering)
SAMPLER_HEAD_LOSSES = tuple(name for name, entry in LOSS_TERMS.items() if entry.sampler_head)
# the fields of single loss types, each once (several losses may read one: the IPO family's ipo_kl_tau)
LOSS_OPTIONS = {option.name: option for entry in LOSS_TERMS.values() for option in entry.options}
VACO_DIVERGENCES = ("tv", "kl")
IS_MODES = ("truncate", "mask")
SEQ_MEAN_OVER = ("nonempty", "all")
LOSS_AGG_MODES = (
    "token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm",
)
# KL estimators, verl's names and aliases; "<name>+" keeps the value and takes k2's gradient (verl's
# straight-through variants)
_KL_BASE = ("k1", "k2", "k3", "k3_unclamped", "abs", "low_var_kl", "kl", "mse")
KL_TYPES = _KL_BASE + tuple(f"{k}+" for k in _KL_BASE)
_KL_ALIASES = {"low_var_kl": "k3", "kl": "k1", "mse": "k2"}
BACKENDS = ("auto", "torch", "cpu", "triton", "cuda")
METRICS_MODES = ("all", "loss_only")  # PolicyLossConfig.metrics

Threshold = Union[float, Tuple[float, float]]


def is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _checking_values() -> bool:
    """False while torch.compile traces: a per-step hyperparameter is then a symbolic float, and
    math.isfinite or a Python comparison on it would fail or specialise the graph on its value.
    Types are still checked; the values of overrides given inside a compiled region are not
    (SPEC §18)."""
    return not torch.compiler.is_compiling()


def check_finite_positive(name: str, value, *, allow_zero: bool = False) -> float:
    if not is_number(value):
        raise TypeError(f"{name}: expected a number, got {value!r} ({type(value).__name__})")
    if not _checking_values():
        return value
    value = float(value)
    ok = value >= 0 if allow_zero else value > 0
    if not (ok and math.isfinite(value)):
        bound = ">= 0" if allow_zero else "> 0"
        raise ValueError(f"{name}: expected a finite number {bound}, got {value!r}")
    return value


def _ratio_bounds(name: str, value, open_ends: bool = False) -> Tuple[float, float]:
    """A k1 / IcePop bound: (lo, hi) with 0 < lo <= hi, or a single hi meaning (1/hi, hi).
    `open_ends` (IS thresholds): lo may be 0 and hi may be inf (TRL's unset C_min / C_max)."""
    if is_number(value):
        hi = check_finite_positive(name, value)
        if not _checking_values():
            return (1.0 / hi, hi)
        if hi < 1.0:
            raise ValueError(f"{name}: expected hi >= 1 (a single ratio bound hi means (1/hi, hi)), got {hi!r}")
        return (1.0 / hi, hi)
    if isinstance(value, (tuple, list)) and len(value) == 2:
        lo = check_finite_positive(f"{name}[0] (lo)", value[0], allow_zero=open_ends)
        if open_ends and is_number(value[1]) and value[1] == math.inf:
            hi = math.inf
        else:
            hi = check_finite_positive(f"{name}[1] (hi)", value[1])
        if _checking_values() and lo > hi:
            raise ValueError(f"{name}: expected lo <= hi, got lo={lo!r} > hi={hi!r}")
        return (lo, hi)
    raise TypeError(f"{name}: expected a number or a (lo, hi) pair, got {value!r}")


def _checked_option(option: Option, value):
    """A loss type's field checked by its declared rule (stage/policy_terms.Option), normalised to a float."""
    if option.rule == "number":
        if not is_number(value):
            raise TypeError(f"{option.name}: expected a number, got {value!r}")
        return value
    if option.rule == "optional_positive" and value is None:
        return None
    return check_finite_positive(option.name, value, allow_zero=option.rule == "non_negative")


@dataclass(frozen=True)
class RolloutCorrection:
    """Importance weights (SPEC §4) and rejection masks (SPEC §5) against the rollout policy.

    Args:
        is_level: None (no weights), "token", "sequence" (the product of the sequence's token ratios) or
            "geometric" (their geometric mean, every token of the sequence weighted by it: AReaL's sequence level).
        is_threshold: C > 0, or bounds (lo, hi) with 0 <= lo <= hi (hi may be inf).
        is_mode: "truncate": w = clamp(raw, lo, hi) (a single C: w = min(raw, C)); "mask" (IcePop,
            TRL's *_mask): w = raw inside [lo, hi], 0 outside, the mask unchanged (a single C: [0, C]).
            None (default): "mask" for bounds, "truncate" for a single C.
        is_batch_normalize: divide the weights by their batch mean (skipped if that mean <= 1e-8).
        rs: rejection options, a mapping ``{option: threshold}`` (or a sequence of pairs). k1 options
            take ratio bounds (lo, hi) or a single hi meaning (1/hi, hi) and keep lo <= rho <= hi;
            k2/k3 options take an upper bound u and keep stat <= u; "seq_max_kl" / "seq_mean_kl" (Trust Region
            Masking) an upper bound ε on the max / mean over the sequence of the per-token KL(μ_t || π_t) (SPEC
            §9), computed from the sampler's top-k or logits given to the loss; bkl / btv options (the sampled
            token's binary KL(μ || π) or |μ - π|) an upper bound. "seq_all_k1" keeps a sequence iff every token's
            ratio lies in (lo, hi). A k1 pair's ends may be open (None, 0 or inf). Options combine by logical AND.
        seq_tokens: the tokens a sequence's statistics run over (its IS weight at the sequence / geometric level,
            and the seq_sum / seq_mean / seq_max rejection statistics): "mask" (every token of m) or "kept" (those
            the token-level rejection options keep: SkyRL's order, token masks first; seq_all_k1 reads m).
        rs_mode: what rejection does to a token: "mask" (it leaves m': every denominator and term loses it) or
            "zero_weight" (it stays in m' with IS weight 0: the denominators, the KL and entropy terms keep it;
            OpenRLHF's mask mode, NeMo-RL's seq-mask-tis). "zero_weight" needs an IS level and decoupled mode.
    """

    is_level: Optional[str] = None
    is_threshold: Threshold = 2.0
    is_batch_normalize: bool = False
    rs: Tuple[Tuple[str, Threshold], ...] = field(default=())
    is_mode: Optional[str] = None
    seq_tokens: str = "mask"
    rs_mode: str = "mask"

    def __post_init__(self):
        if self.is_level not in IS_LEVELS:
            raise ValueError(f"is_level: expected one of {IS_LEVELS}, got {self.is_level!r}")
        if is_number(self.is_threshold):
            threshold: Threshold = check_finite_positive("is_threshold", self.is_threshold)
        else:
            threshold = _ratio_bounds("is_threshold", self.is_threshold, open_ends=True)
        object.__setattr__(self, "is_threshold", threshold)
        if self.is_mode is None:
            object.__setattr__(self, "is_mode", "mask" if isinstance(threshold, tuple) else "truncate")
        elif self.is_mode not in IS_MODES:
            raise ValueError(f"is_mode: expected one of {IS_MODES} or None, got {self.is_mode!r}")
        if not isinstance(self.is_batch_normalize, bool):
            raise TypeError(f"is_batch_normalize: expected a bool, got {self.is_batch_normalize!r}")
        pairs = self.rs.items() if isinstance(self.rs, Mapping) else self.rs
        normalized = []
        seen = set()
        for item in pairs:
            if not (isinstance(item, (tuple, list)) and len(item) == 2):
                raise TypeError(f"rs: expected {{option: threshold}} or (option, threshold) pairs, got {item!r}")
            option, bound = item
            if option not in RS_OPTIONS:
                raise ValueError(f"rs: unknown option {option!r}; expected one of {RS_OPTIONS}")
            if option in seen:
                raise ValueError(f"rs: option {option!r} given twice")
            seen.add(option)
            name = f"rs[{option!r}]"
            if option.endswith("k1") and isinstance(bound, (tuple, list)) and len(bound) == 2:
                # either end may be open (None, 0, inf): SkyRL's and AReaL's bounds are set independently
                lo, hi = (0.0 if bound[0] is None else bound[0]), (math.inf if bound[1] is None else bound[1])
                normalized.append((option, _ratio_bounds(name, (lo, hi), open_ends=True)))
            elif option.endswith("k1"):
                normalized.append((option, _ratio_bounds(name, bound)))
            else:
                if not is_number(bound):
                    raise TypeError(f"{name}: expected one upper bound u (keep stat <= u) for {option}, got {bound!r}")
                normalized.append((option, check_finite_positive(name, bound)))
        object.__setattr__(self, "rs", tuple(normalized))
        if self.seq_tokens not in SEQ_TOKENS:
            raise ValueError(f"seq_tokens: expected one of {SEQ_TOKENS}, got {self.seq_tokens!r}")
        if self.rs_mode not in RS_MODES:
            raise ValueError(f"rs_mode: expected one of {RS_MODES}, got {self.rs_mode!r}")
        if self.rs_mode == "zero_weight":
            if self.is_level is None:
                raise ValueError("rs_mode: 'zero_weight' expected an is_level (it zeroes the rejected tokens' IS "
                                 "weights; is_threshold=(0, inf), is_mode='mask' leaves the others untruncated)")
            if self.is_batch_normalize:
                raise ValueError("rs_mode: 'zero_weight' expected is_batch_normalize=False (a mean of weights some "
                                 "of which rejection zeroed has no agreed meaning)")
            if self.is_level != "token" and any(o.startswith("token_") for o, _ in self.rs):
                raise ValueError(f"rs_mode: 'zero_weight' expected no token-level option with is_level="
                                 f"{self.is_level!r} (one weight per sequence cannot be zero on some of its tokens)")

    # -- derived views ---------------------------------------------------------------------------
    @property
    def is_icepop(self) -> bool:
        return self.is_mode == "mask"

    @property
    def is_range(self) -> Tuple[float, float]:
        """(lo, hi) the weights are truncated to or masked outside of."""
        if isinstance(self.is_threshold, tuple):
            return self.is_threshold
        return (0.0, self.is_threshold)

    @property
    def is_bounds(self) -> Tuple[float, float]:
        """(lo, hi) used by the diagnostics: the given bounds, or (1/C, C) for a single C (verl's)."""
        if isinstance(self.is_threshold, tuple):
            return self.is_threshold
        return (1.0 / self.is_threshold, self.is_threshold)  # type: ignore[operator]

    @property
    def enabled(self) -> bool:
        return self.is_level is not None or bool(self.rs)

    @property
    def needs_divergence(self) -> bool:
        """Whether a rejection option reads the per-token KL(μ || π) of SPEC §9 (the sampler's distribution)."""
        return any(option in DIVERGENCE_RS_OPTIONS for option, _ in self.rs)

    # -- presets of SPEC §5; keyword arguments override the preset's values ------------------------
    @classmethod
    def token_tis(cls, threshold: float = 2.0, **kw) -> "RolloutCorrection":
        return cls(**{"is_level": "token", "is_threshold": threshold, **kw})

    @classmethod
    def seq_tis(cls, threshold: float = 2.0, **kw) -> "RolloutCorrection":
        return cls(**{"is_level": "sequence", "is_threshold": threshold, **kw})

    @classmethod
    def seq_mis(cls, threshold: float = 2.0, bounds: Threshold = (0.5, 2.0), **kw) -> "RolloutCorrection":
        return cls(**{"is_level": "sequence", "is_threshold": threshold, "rs": {"seq_sum_k1": bounds}, **kw})

    @classmethod
    def geo_rs(cls, bounds: Threshold = (0.999, 1.001), **kw) -> "RolloutCorrection":
        return cls(**{"rs": {"seq_mean_k1": bounds}, **kw})

    @classmethod
    def geo_rs_token_tis(
        cls, bounds: Threshold = (0.999, 1.001), threshold: float = 2.0, **kw
    ) -> "RolloutCorrection":
        return cls(**{"is_level": "token", "is_threshold": threshold, "rs": {"seq_mean_k1": bounds}, **kw})

    @classmethod
    def k3_rs(cls, threshold: float = 0.01, **kw) -> "RolloutCorrection":
        return cls(**{"rs": {"seq_mean_k3": threshold}, **kw})

    @classmethod
    def trm(cls, threshold: float = 0.01, criterion: str = "max", **kw) -> "RolloutCorrection":
        """Trust Region Masking (arXiv 2512.23075) in its exact form: reject a sequence whose max (or mean) over
        its tokens of KL(μ_t || π_t) exceeds ε; needs the sampler's top-k or logits (SPEC §9)."""
        if criterion not in ("max", "mean"):
            raise ValueError(f"criterion: expected 'max' or 'mean', got {criterion!r}")
        return cls(**{"rs": {f"seq_{criterion}_kl": threshold}, **kw})

    @classmethod
    def icepop(cls, bounds: Tuple[float, float] = (0.5, 5.0), **kw) -> "RolloutCorrection":
        return cls(**{"is_level": "token", "is_threshold": tuple(bounds), **kw})

    @classmethod
    def from_verl(cls, rollout_is=None, rollout_is_threshold: Union[float, str, None] = 2.0,
                  rollout_rs: Optional[str] = None, rollout_rs_threshold: Union[float, str, None] = None,
                  rollout_is_batch_normalize: bool = False) -> "RolloutCorrection":
        """Build from verl's ``algorithm.rollout_correction`` strings, or from that config node itself (a dict,
        an OmegaConf node or verl's ``RolloutCorrectionConfig``, read as verl's loss functions read it:
        ``get(key, default)`` with the defaults of this signature; its other keys, such as ``loss_type``, are
        the actor's business).

        ``rollout_is_threshold`` is a float C or "lo_hi" (IcePop); ``rollout_rs`` is a comma list
        ("seq_mean_k1,token_k3") and ``rollout_rs_threshold`` one spec shared by all options or one per
        option ("0.999_1.001,0.01"). k1 bounds keep lo <= rho <= hi as verl's docs state (verl's code
        keeps 1/hi <= rho <= 1/lo; the two agree for symmetric bounds such as (1/h, h)).
        ``rollout_is_threshold=None`` means no weights, as in verl, whatever ``rollout_is`` says. Types are
        checked whether or not an option is in use (a bool threshold raises in every form). Every error
        names the argument of this function that caused it.
        """
        from .integrations.configs import rollout_correction_from_verl

        return rollout_correction_from_verl(rollout_is, rollout_is_threshold, rollout_rs, rollout_rs_threshold,
                                            rollout_is_batch_normalize)

    @classmethod
    def from_trl(cls, vllm_importance_sampling_mode: str = "sequence_mask",
                 vllm_importance_sampling_clip_min: Optional[float] = None,
                 vllm_importance_sampling_clip_max: Optional[float] = 3.0) -> "RolloutCorrection":
        """Build from TRL 1.16's ``GRPOConfig`` vLLM importance-sampling options: token_ / sequence_
        level (a sequence weight is the product of its tokens' ratios, as in TRL), *_truncate
        (clamp to [C_min, C_max]) or *_mask (0 outside [C_min, C_max]); an unset bound is open."""
        from .integrations.configs import rollout_correction_from_trl

        return rollout_correction_from_trl(vllm_importance_sampling_mode, vllm_importance_sampling_clip_min,
                                           vllm_importance_sampling_clip_max)


@dataclass(frozen=True)
class PolicyLossConfig:
    """Options of the decoupled PPO / REINFORCE loss (SPEC §6-§7).

    Args:
        loss_type: the per-token policy objective (SPEC §6, §6.1):
            "vanilla" (PPO clip, with dual clip; "ppo_clip" is the same), "reinforce" (bypass mode
            only), "gpg", "sapo" (soft gates), "gspo" (sequence-level ratio, token form), "geo_mean"
            (GMPO: geometric-mean sequence ratio, its own mean over sequences), "cispo"
            (clipped, stop-gradient IS weight on the log-prob), "dro" (quadratic log-ratio penalty),
            "dppo_tv" / "dppo_kl" (DPPO: a trust region on the probability's total-variation / binary-KL
            divergence; clip_ratio_c truncates their stop-gradient ratio, 20 when None),
            each as verl 0.9.1's registered loss of that name computes it; "clip_cov" / "kl_cov" (verl's
            covariance-selected tokens), "topr" (verl PR #6986), "luspo" and "vespo" (TRL's); "ipo",
            "kpop", "dppo_binary_tv" and "dppo_binary_tv_signed" (prime-rl's trust regions on the rollout
            policy: -A p/q on the tokens they keep, q the sampler's probability; the last one conditioned on the
            advantage's sign, prime-rl's default).
        tau_pos: SAPO's gate temperature for tokens with a positive advantage.
        tau_neg: SAPO's gate temperature for tokens with a non-positive advantage.
        ratio_level: "token" (default) or "sequence" (TRL's importance_sampling_level: the ratio of each
            sequence's mean log-ratio, for vanilla / cispo / sapo / luspo, and a bias-corrected KL).
        log_ratio_clamp: the ratio losses exponentiate clamp(log-ratio, +-this) (20, verl); None: unclamped (TRL).
        cispo_cap: CISPO's weight min(r, cap) (TRL's epsilon_high); None: clip(r, 1 - eps_lo, 1 + eps_hi) (verl).
        seq_mean_over: "nonempty" (verl) or "all" (TRL): which sequences a sequence mean divides by.
        entropy_agg_mode: the entropy bonus's aggregation (None: loss_agg_mode; TRL: "token-mean").
        kl_bias_correction: the KL term times the policy ratio, with its gradient (DeepSeek-V3.2, TRL).
        kl_score_gradient: the KL term times exp(lp - sg lp): its value unchanged, its gradient plus KL x grad(lp)
            (the score-function term of grad E_pi[KL]; NeMo-RL's reference-policy KL).
        off_policy_mask_threshold: DeepSeek-V3.2's off-policy sequence mask delta (zero policy term for
            A < 0 in sequences whose mean rollout-minus-current log-ratio exceeds delta).
        seq_mean_advantages: each token's advantage replaced by its sequence's mean over the final mask m'
            (AReaL's GSPO, importance_sampling_level="sequence").
        m2po_threshold: M2PO's second-moment mask tau (None: off).
        m2po_quadrant: M2PO's mask over the trust-region quadrants only (else every token).
        vaco_threshold: VACO's bound on a sequence's mean binary divergence between the training policy and the
            sampler (open-instruct): beyond it, tokens whose update moves away from the sampler get no policy
            term (None: off).
        vaco_divergence: VACO's divergence, "tv" (|mu - pi|) or "kl" (binary KL(mu || pi)).
        log_ratio_sq_coef: the Kimi-K2.5 term tau * (log p/q)^2 per token, aggregated as the loss (0: off).
        ipo_eps: IPO's trust region |p - q| <= eps (prime-rl's default 0.3).
        ipo_kl_tau: the IPO family's tau * (log p/q)^2 on the kept tokens (0: off).
        kpop_phi: KPop's bound on both binary KLs between p and q (0.1).
        binary_tv_low: symmetric DPPO binary-TV keeps p - q >= -this (0.2).
        binary_tv_high: symmetric DPPO binary-TV keeps p - q <= this (0.2).
        adaptive_entropy: entropy_coeff is set per step by a controller (TRL's adaptive entropy) and may be 0:
            the entropy term stays in the graph, so no value recompiles a compiled step.
        vespo_k_pos: VESPO's gamma-weight exponent k for A >= 0 (TRL's default 2).
        vespo_lambda_pos: VESPO's lambda for A >= 0 (3).
        vespo_k_neg: VESPO's k for A < 0 (3).
        vespo_lambda_neg: VESPO's lambda for A < 0 (2).
        clip_cov_ratio: verl's Clip-Cov share of the candidate tokens whose gradient is dropped.
        clip_cov_lb: Clip-Cov's lower covariance bound.
        clip_cov_ub: Clip-Cov's upper covariance bound.
        kl_cov_ratio: verl's KL-Cov share of the tokens that get the penalty.
        ppo_kl_coef: KL-Cov's penalty coefficient.
        topr_negative_ratio_lower: TOPR's lower taper bound (0).
        topr_negative_ratio_upper: TOPR's upper taper bound (1).
        dro_beta: DRO's penalty weight beta > 0 (required with loss_type="dro").
        clip_ratio_low: eps_lo of the clip range (1 - eps_lo, 1 + eps_hi).
        clip_ratio_high: eps_hi of the clip range.
        clip_ratio_c: dual-clip constant c > 1 (default 3.0), or None to disable dual clip.
        loss_agg_mode: one of token-mean (default), token-sum, seq-mean-token-sum,
            seq-mean-token-mean, seq-mean-token-sum-norm.
        loss_scale_factor: K for seq-mean-token-sum-norm (default: padded width T, or the longest
            packed sequence).
        global_num_tokens: the token count to divide by instead of the local one (data-parallel training
            where every rank must divide by the global count).
        global_num_seqs: the same for the sequence count.
        temperature: T > 0; log-probs are those of softmax(logits / T).
        entropy_coeff: weight of the entropy bonus (Loss -= entropy_coeff * agg(H)).
        compute_entropy: return per-token entropy even when entropy_coeff == 0.
        kl_coef: beta of the KL penalty beta * agg(KL) against ref_logprobs.
        kl_type: k1, k2, k3, k3_unclamped, abs, or any of them with "+" (the value of that estimator,
            the gradient of k2), as verl's kl_penalty; verl's names "kl", "mse" and "low_var_kl" are
            aliases of k1, k2 and k3.
        rollout_correction: a `RolloutCorrection` or None.
        backend: "auto", "torch", "cpu", "triton" or "cuda".
        validate: run the value checks of SPEC §11: one device sync before the vocabulary pass (labels, NaN
            log-probs and advantages, masks, offsets) and one after it (a row of logits or hidden states holding a
            NaN or +inf, read from the pass's [N] log-probs). False for sync-free steps: no public path then reads
            the device from the host (a step can be captured in a CUDA graph); the fused-linear path, whose row
            selection is such a read, then runs every row through its head instead (the same values up to the
            GEMMs' rounding of other chunk shapes; `select_loss_rows` decides apart).
        chunk_rows: rows per chunk of the torch backend (None = sized from the vocabulary).
        inplace_backward: let fused backends write dlogits into the logits' storage.
        compile_stage: run the per-sequence stage through torch.compile (None: on CUDA tensors only).
        fused_stage: run the per-sequence stage as kernels (stage/fused.py: two Triton launches on CUDA, one op of
            the CPU kernels on the CPU) where they cover the call: PPO's clip per token, token / sequence / geometric
            IS (batch-normalised or not), seq-MIS / geo-RS / K3-RS rejection, the KL penalties, the entropy bonus,
            every aggregation, no split; with metrics="all" the metrics are the torch stage's, computed when first
            read (stage.metrics.DeferredMetrics). None (the default) and True: wherever those kernels run (Triton on
            CUDA; the CPU kernels for backend "auto" / "cpu", Triton's interpreter for "triton" on CPU tensors), else
            the torch stage (compile_stage's); True refuses a call outside the family before any pass; False: never.
        metrics: "all" (every metric of SPEC §8 in the output's `.metrics`, verl's names) or "loss_only" (none:
            the loss and its gradient alone, for steps that log no metrics; the stage's ~60 metric reductions
            and their launches are skipped; with the torch stage the loss and gradient are the same bits, with the
            fused one the same to float32 rounding). With the fused stage "all" defers them to their first read.
        memory_budget_bytes: the fused-linear path (`linear_decoupled_ppo_loss`) forms logits in chunks
            of rows whose logits take at most this many bytes (None: on CUDA a quarter of the memory free for it,
            a power of two from 512 MiB to 4 GiB; 32 MiB on CPU).
        select_loss_rows: the fused-linear path runs only the rows in the loss through its head GEMMs, which reads
            their count on the host (one synchronisation; the rows outside cost nothing); False: every row, no host
            read (the rows outside come out as zeros, at the cost of their GEMMs). None (the default): as `validate`.
        linear_one_pass: the fused-linear path forms the gradient in its forward pass where every token's
            coefficients allow (SPEC §2.1: three GEMMs of the loss's rows instead of four, the gradients held
            from the forward to the backward). False: always the two-pass form.
        logits_one_pass: the logits path forms dlogits in its forward pass where the fused stage's kernels cover the
            call (SPEC §2.4: each row read twice in a row, the second time from cache, and its gradient written: two
            passes over the logits' bytes for fwd + bwd instead of three; the gradient held from the forward to the
            backward). None (the default): on the Triton backend, for a GPU's memory bandwidth; True: on the CPU
            kernels too (the same bits, measured no faster there: a CPU's pass is bound by its exponentials, not
            its memory); False: always the two-pass form.
        head_dtype: the fused-linear path's head GEMM: None (the inputs' dtype, float32 accumulation), "float32"
            or torch.float32 (float32 GEMMs on bf16/fp16 operands: vLLM's `head_dtype=float32`, SGLang's
            `--enable-fp32-lm-head`) or "tf32" (NeMo-RL's `fp32_lm_head: tf32`: float32 with TF32 matrix units on
            CUDA; float32 on a CPU). The logits path has no head: `decoupled_ppo_loss` refuses it.
        numerics: the log-probs' arithmetic: "default" (each backend's fastest exact form), "vllm" (vLLM's own
            operations, bit for bit on the same device: its V2 sampler's on the Triton backend, its V1 sampler's on
            the others; "vllm_raw": its raw log-probs, before the temperature) or "batch_invariant" (every
            per-row output the same bits whatever the batch; from hidden states the head GEMMs run in fixed 64-row
            blocks). docs/numerics.md.
    """

    loss_type: str = "ppo_clip"
    tau_pos: float = 1.0
    tau_neg: float = 1.05
    dro_beta: Optional[float] = None
    clip_ratio_low: float = 0.2
    clip_ratio_high: float = 0.2
    clip_ratio_c: Optional[float] = 3.0
    loss_agg_mode: str = "token-mean"
    loss_scale_factor: Optional[float] = None
    global_num_tokens: Optional[float] = None
    global_num_seqs: Optional[float] = None
    temperature: float = 1.0
    entropy_coeff: float = 0.0
    compute_entropy: bool = False
    kl_coef: float = 0.0
    kl_type: str = "k3"
    rollout_correction: Optional[RolloutCorrection] = None
    backend: str = "auto"
    validate: bool = True
    chunk_rows: Optional[int] = None
    inplace_backward: bool = False
    compile_stage: Optional[bool] = None
    fused_stage: Optional[bool] = None
    metrics: str = "all"
    memory_budget_bytes: Optional[int] = None
    select_loss_rows: Optional[bool] = None
    linear_one_pass: bool = True
    logits_one_pass: Optional[bool] = None
    head_dtype: Optional[str] = None
    numerics: str = "default"
    # -- conventions where the reference libraries differ (SPEC §6.2) ---------
    ratio_level: str = "token"
    log_ratio_clamp: Optional[float] = 20.0
    cispo_cap: Optional[float] = None
    seq_mean_over: str = "nonempty"
    entropy_agg_mode: Optional[str] = None
    kl_bias_correction: bool = False
    kl_score_gradient: bool = False
    off_policy_mask_threshold: Optional[float] = None
    seq_mean_advantages: bool = False
    # -- parameters of single losses (verl's / TRL's names and defaults) ----------------------------
    vespo_k_pos: float = 2.0
    vespo_lambda_pos: float = 3.0
    vespo_k_neg: float = 3.0
    vespo_lambda_neg: float = 2.0
    clip_cov_ratio: float = 0.0002
    clip_cov_lb: float = 1.0
    clip_cov_ub: float = 5.0
    kl_cov_ratio: float = 0.0002
    ppo_kl_coef: float = 1.0
    topr_negative_ratio_lower: float = 0.0
    topr_negative_ratio_upper: float = 1.0
    m2po_threshold: Optional[float] = None
    m2po_quadrant: bool = True
    # -- the 2026 trust regions on the rollout policy (SPEC §6.1) ------------------------------------------
    vaco_threshold: Optional[float] = None
    vaco_divergence: str = "tv"
    log_ratio_sq_coef: float = 0.0
    ipo_eps: float = 0.3
    ipo_kl_tau: float = 0.0
    kpop_phi: float = 0.1
    binary_tv_low: float = 0.2
    binary_tv_high: float = 0.2
    adaptive_entropy: bool = False

    def __post_init__(self):
        if self.loss_type not in LOSS_TYPES:
            raise ValueError(f"loss_type: expected one of {LOSS_TYPES}, got {self.loss_type!r}")
        if self.rollout_correction is not None and not isinstance(self.rollout_correction, RolloutCorrection):
            raise TypeError(
                "rollout_correction: expected a RolloutCorrection or None, "
                f"got {type(self.rollout_correction).__name__}"
            )
        self._check_family()
        for name in ("clip_ratio_low", "clip_ratio_high"):
            object.__setattr__(self, name, check_finite_positive(name, getattr(self, name), allow_zero=True))
        if _checking_values() and self.clip_ratio_low >= 1.0:
            raise ValueError(f"clip_ratio_low: expected eps_lo < 1 so that 1 - eps_lo > 0, got {self.clip_ratio_low!r}")
        if self.clip_ratio_c is not None:
            c = check_finite_positive("clip_ratio_c", self.clip_ratio_c)
            if _checking_values() and c <= 1.0:
                raise ValueError(f"clip_ratio_c: expected c > 1 (or None to disable dual clip), got {c!r}")
            object.__setattr__(self, "clip_ratio_c", c)
        if self.loss_agg_mode not in LOSS_AGG_MODES:
            raise ValueError(f"loss_agg_mode: expected one of {LOSS_AGG_MODES}, got {self.loss_agg_mode!r}")
        for name in ("loss_scale_factor", "global_num_tokens", "global_num_seqs"):
            value = getattr(self, name)
            if value is not None:
                object.__setattr__(self, name, check_finite_positive(name, value))
        object.__setattr__(self, "temperature", check_finite_positive("temperature", self.temperature))
        if not is_number(self.entropy_coeff):
            raise TypeError(f"entropy_coeff: expected a number, got {self.entropy_coeff!r}")
        if _checking_values():
            if not math.isfinite(self.entropy_coeff):
                raise ValueError(f"entropy_coeff: expected a finite number, got {self.entropy_coeff!r}")
            object.__setattr__(self, "entropy_coeff", float(self.entropy_coeff))
        object.__setattr__(self, "kl_coef", check_finite_positive("kl_coef", self.kl_coef, allow_zero=True))
        if self.kl_type not in KL_TYPES:
            raise ValueError(f"kl_type: expected one of {KL_TYPES}, got {self.kl_type!r}")
        base, plus = self.kl_type.rstrip("+"), "+" if self.kl_type.endswith("+") else ""
        base = _KL_ALIASES.get(base, base)
        object.__setattr__(self, "kl_type", base + ("" if base == "k2" else plus))  # k2+ is k2
        if self.backend not in BACKENDS:
            raise ValueError(f"backend: expected one of {BACKENDS}, got {self.backend!r}")
        for name in ("compute_entropy", "validate", "inplace_backward", "linear_one_pass"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name}: expected a bool, got {getattr(self, name)!r}")
        for name in ("compile_stage", "fused_stage", "select_loss_rows", "logits_one_pass"):
            if getattr(self, name) is not None and not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name}: expected a bool or None, got {getattr(self, name)!r}")
        if self.metrics not in METRICS_MODES:
            raise ValueError(f"metrics: expected one of {METRICS_MODES}, got {self.metrics!r}")
        check_memory_budget(self.memory_budget_bytes)
        object.__setattr__(self, "head_dtype", check_head_dtype(self.head_dtype))
        check_numerics(self.numerics)
        if self.chunk_rows is not None and (not isinstance(self.chunk_rows, int) or self.chunk_rows < 1):
            raise ValueError(f"chunk_rows: expected a positive int or None, got {self.chunk_rows!r}")

    def _check_family(self) -> None:
        """The loss-family fields: types, ranges, and combinations that have no meaning. The fields of single loss
        types, and what each loss type refuses, are declared by its row of the stage's table (LOSS_TERMS)."""
        if self.ratio_level not in ("token", "sequence"):
            raise ValueError(f"ratio_level: expected 'token' or 'sequence', got {self.ratio_level!r}")
        if self.ratio_level == "sequence" and self.loss_type not in SEQUENCE_RATIO_LOSSES:
            raise ValueError(f"ratio_level: 'sequence' applies to loss types {SEQUENCE_RATIO_LOSSES}, not "
                             f"{self.loss_type!r} (gspo and geo_mean are sequence-level already)")
        if self.seq_mean_over not in SEQ_MEAN_OVER:
            raise ValueError(f"seq_mean_over: expected one of {SEQ_MEAN_OVER}, got {self.seq_mean_over!r}")
        if self.entropy_agg_mode is not None and self.entropy_agg_mode not in LOSS_AGG_MODES:
            raise ValueError(f"entropy_agg_mode: expected None or one of {LOSS_AGG_MODES}, "
                             f"got {self.entropy_agg_mode!r}")
        for name in ("log_ratio_clamp", "m2po_threshold"):
            if getattr(self, name) is not None:
                object.__setattr__(self, name, check_finite_positive(name, getattr(self, name)))
        if self.off_policy_mask_threshold is not None:
            if not is_number(self.off_policy_mask_threshold):
                raise TypeError(f"off_policy_mask_threshold: expected a number or None, got "
                                f"{self.off_policy_mask_threshold!r}")
            object.__setattr__(self, "off_policy_mask_threshold", float(self.off_policy_mask_threshold))
        for name in ("kl_bias_correction", "kl_score_gradient", "m2po_quadrant", "adaptive_entropy",
                     "seq_mean_advantages"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name}: expected a bool, got {getattr(self, name)!r}")
        object.__setattr__(self, "log_ratio_sq_coef",
                           check_finite_positive("log_ratio_sq_coef", self.log_ratio_sq_coef, allow_zero=True))
        if self.vaco_threshold is not None:
            object.__setattr__(self, "vaco_threshold", check_finite_positive("vaco_threshold", self.vaco_threshold))
        if self.vaco_divergence not in VACO_DIVERGENCES:
            raise ValueError(f"vaco_divergence: expected one of {VACO_DIVERGENCES}, got {self.vaco_divergence!r}")
        for option in LOSS_OPTIONS.values():  # every loss's fields are valid, whichever loss is chosen
            object.__setattr__(self, option.name, _checked_option(option, getattr(self, option.name)))
        self._check_loss_type(LOSS_TERMS[self.loss_type])

    def _check_loss_type(self, entry) -> None:
        """What the chosen loss type's row declares: its required fields, its ordered pairs, the token masks and
        the IS levels it refuses."""
        name = self.loss_type
        for option in entry.options:
            if option.required and getattr(self, option.name) is None:
                raise ValueError(f"{option.name}: expected a number > 0 with loss_type={name!r}, got None")
        if _checking_values():
            for lo, hi in entry.ordered:
                if getattr(self, lo) > getattr(self, hi):
                    raise ValueError(f"{lo}: expected <= {hi}, got {getattr(self, lo)!r} > {getattr(self, hi)!r}")
        if entry.no_token_masks:
            given = [f"{mask}={getattr(self, mask)!r}" for mask in TOKEN_MASKS if getattr(self, mask) is not None]
            if given:
                raise ValueError(f"loss_type: {name!r} {entry.no_token_masks}; the token masks {TOKEN_MASKS} do not "
                                 f"apply to it, got {', '.join(given)}")
        if self.kl_score_gradient and self.kl_bias_correction:
            raise ValueError("kl_score_gradient: expected kl_bias_correction=False (the KL term is multiplied by "
                             "exp(lp - sg lp) or by the ratio r, not both)")
        if self.seq_mean_advantages and entry.sums is not None:
            raise ValueError(f"seq_mean_advantages: expected a per-token loss type; loss_type={name!r} sums the "
                             "advantages per sequence before rejection decides the mask their mean is over")
        rc = self.rollout_correction
        if rc is not None and rc.rs and rc.rs_mode == "zero_weight" and entry.sums is not None:
            raise ValueError(f"rollout_correction: expected rs_mode='mask' with loss_type={name!r}, which sums its "
                             "weights per sequence before rejection is decided")
        if rc is not None and rc.is_level not in entry.is_levels:
            raise ValueError(f"rollout_correction: loss_type={name!r} "
                             f"{entry.is_level_refusal.format(is_level=repr(rc.is_level))}")

    @property
    def selects_loss_rows(self) -> bool:
        """Whether the fused-linear path reads its loss rows' count on the host (select_loss_rows, else validate)."""
        return self.validate if self.select_loss_rows is None else self.select_loss_rows

    @property
    def needs_entropy(self) -> bool:
        return self.compute_entropy or self.adaptive_entropy or self.entropy_coeff != 0.0

    @classmethod
    def from_verl_actor(cls, actor, rollout_correction: Optional[RolloutCorrection] = None,
                        **overrides) -> "PolicyLossConfig":
        """Build from a verl 0.9.1 ``ActorConfig`` (or its dict / OmegaConf node) so that the loss is the one
        verl's registered function of that ``policy_loss.loss_mode`` computes: the policy loss and its
        parameters (``dro_beta``, ``tau_pos``, ``tau_neg``, the Clip-Cov / KL-Cov ones), the clip ratios
        (``clip_ratio_low`` / ``clip_ratio_high``, falling back to ``clip_ratio``, and ``clip_ratio_c``),
        ``loss_agg_mode`` (where verl's function overrides it, its choice: sapo is seq-mean-token-mean),
        ``loss_scale_factor``, ``entropy_coeff`` and the KL loss (``use_kl_loss``, ``kl_loss_coef``,
        ``kl_loss_type``).

        ``bypass_mode`` (verl's ``apply_bypass_mode``): the loss type of ``policy_loss.rollout_correction``
        and its IS level, threshold, rejection options and batch normalisation, as verl's bypass loss reads
        them; call the loss with verl's ``old_log_prob`` (the rollout's, in bypass mode) as
        ``rollout_logprobs`` and no ``old_logprobs``. Otherwise the rollout correction comes separately
        (verl keeps it under ``algorithm.rollout_correction``: see ``RolloutCorrection.from_verl``). An
        explicit ``rollout_correction=`` wins, and so do keyword overrides. Anything this library does not
        compute raises an error naming verl's option."""
        from .integrations.configs import policy_loss_config_from_verl_actor

        return policy_loss_config_from_verl_actor(actor, rollout_correction, **overrides)

    @classmethod
    def from_trl(cls, args, **overrides) -> "PolicyLossConfig":
        """Build from a TRL 1.16 ``GRPOConfig`` (or its dict): ``loss_type`` (its loss and aggregation:
        grpo / sapo = seq-mean-token-mean and dr_grpo = token sums / (B x max_completion_length), both
        over every sequence; bnpo / dapo / cispo / vespo = token-mean, over this batch's tokens unless
        ``global_num_tokens`` carries TRL's ``num_items_in_batch``; luspo its own), ``epsilon`` /
        ``epsilon_high`` (CISPO's absolute cap), ``delta`` (= dual clip c), ``importance_sampling_level``,
        ``beta`` (the unclamped k3, ``use_bias_correction_kl``), ``off_policy_mask_threshold``, the SAPO
        and VESPO parameters, ``entropy_coef`` (a token mean, as TRL's bonus) and, with ``use_vllm`` and
        ``vllm_importance_sampling_correction``, the sampler correction (`RolloutCorrection.from_trl`).
        TRL exponentiates log-ratios unclamped (log_ratio_clamp=None). Errors name TRL's option."""
        from .integrations.configs import policy_loss_config_from_trl

        return policy_loss_config_from_trl(args, **overrides)

    def with_overrides(self, **overrides) -> "PolicyLossConfig":
        unknown = set(overrides) - set(self.__dataclass_fields__)
        if unknown:
            hints = []
            for name in sorted(unknown):
                close = difflib.get_close_matches(name, self.__dataclass_fields__, n=2)
                if close:
                    hints.append(f"{name!r}: did you mean {' or '.join(map(repr, close))}?")
            hint = f" ({'; '.join(hints)})" if hints else ""
            raise TypeError(f"config: unknown PolicyLossConfig field(s) {sorted(unknown)}{hint}")
        return replace(self, **overrides) if overrides else self


HEAD_DTYPES = (None, "float32", "tf32")
NUMERICS = ("default", "vllm", "vllm_raw", "batch_invariant")


def check_numerics(numerics) -> None:
    if numerics not in NUMERICS:
        raise ValueError(f"numerics: expected 'default', 'vllm', 'vllm_raw' or 'batch_invariant', got {numerics!r}")


def check_head_dtype(head_dtype) -> Optional[str]:
    """The head GEMM's precision by name: None, "float32" or "tf32"; torch.float32 is read as "float32" (the dtype a
    user passes), any other dtype is refused by name."""
    if head_dtype is torch.float32:
        return "float32"
    if not (head_dtype is None or isinstance(head_dtype, str)) or head_dtype not in HEAD_DTYPES:
        raise ValueError(f"head_dtype: expected None, 'float32' (or torch.float32) or 'tf32', got {head_dtype!r}")
    return head_dtype


def check_memory_budget(budget) -> None:
    if budget is not None and (isinstance(budget, bool) or not isinstance(budget, int) or budget < 1):
        raise ValueError(f"memory_budget_bytes: expected a positive int or None, got {budget!r}")
