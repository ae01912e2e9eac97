"""The stage as kernels for the common PPO family, where a config and batch are inside it: two Triton launches
(kernels/triton/stage.py) on CUDA, one op of the CPU kernels (csrc/cpu/token_passes.cpp sequence_stage) on the CPU.
`blocker` says why a call is outside, `implementation` which kernels run it, `run` is `loss.run`'s twin.

The family: PPO's clip with or without dual clip (loss types vanilla / ppo_clip) of each token's ratio, or of its
sequence's (ratio_level="sequence", TRL's GSPO: the gradient chained through the sequence's mean log-ratio), any
log_ratio_clamp; GSPO's token form (loss_type="gspo", verl's); CISPO of the token's or the sequence's ratio
(MiniMax-M1's, clipped as verl's or capped as TRL's); SAPO's soft gate of either ratio (verl's, TRL's); GPG's plain
policy gradient, DRO's squared log-ratio penalty and DPPO's divergence regions on π_old (verl's); prime-rl's trust
regions on the sampler (dppo_binary_tv, dppo_binary_tv_signed and IPO, its defaults before and since 2026-08, with their
ipo_kl_tau square on the kept tokens); the log-ratio square against the sampler (log_ratio_sq_coef: the Kimi-K2.5 term,
prime-rl's kl_tau) beside any of these; on-policy, bypass without a correction, or decoupled mode with token / sequence
/ geometric IS weights (truncated or IcePop-masked, batch-normalised or not) and rejection on the sum or mean of k1, k2
or k3 over the sequence or the largest k2 or k3 in it (seq-MIS, geo-RS, K3-RS and their combinations with IS; AReaL's k2
options), on k1, k2 or k3 of each token (token_*) or k1 of every token of the sequence (seq_all_k1; SkyRL's, AReaL's),
on the binary KL or TV of each token or their means over the sequence (token_bkl / btv, seq_mean_bkl / btv: OpenRLHF's
gates), the sequence statistics over m or over the tokens the token options keep (seq_tokens), leaving m' or zeroing the
weights (rs_mode="zero_weight": OpenRLHF's, NeMo-RL's); each sequence's mean advantage (seq_mean_advantages: AReaL's);
DeepSeek-V3.2's off-policy sequence mask (off_policy_mask_threshold: TRL's); the KL penalties k1, k2, abs, k3,
k3_unclamped and their straight-through forms, with or without the score term (kl_score_gradient: NeMo-RL's) or times
the policy ratio (kl_bias_correction: TRL's, DeepSeek-V3.2's; through the sequence's ratio at ratio_level="sequence");
the entropy bonus at the loss's aggregation or its own (entropy_agg_mode: TRL's "token-mean"); every aggregation mode,
with the global counts; a trainer's own IS weights (is_weights: verl's, TRL's, prime-rl's).
Everything else keeps the torch stage (`loss.run`): the other rejection statistics (the binary divergences' maxima,
the sampler's KL), the other loss types (GMPO's geometric mean, Clip-Cov / KL-Cov, KPop's
trust region among them), split batches, the sampler's evidence.

The metrics: the kernels write none. With metrics="all" the output's metrics are a `metrics.DeferredMetrics`: the
torch stage's run on the same inputs when they are first read (the values bit for bit), which a trainer does after
`loss.backward()` has queued the backward. The ~55 metrics are ~60 reductions of a dozen of the torch stage's
intermediates, a few hundred small ops: kept off the path between the loss and its backward, where host time shows,
and never run for a step whose metrics nobody reads.
"""

from typing import NamedTuple, Optional

import torch

from .. import backends
from . import loss
from .correction import ALL_REJECTED
from .loss import StageOutput
from .metrics import DeferredMetrics
from .policy_terms import LOSS_TERMS
from .segments import _log

_PPO = tuple(name for name, entry in LOSS_TERMS.items() if entry.term is LOSS_TERMS["vanilla"].term)
# rejection options the sequence kernel decides: k1 / k2 / k3 summed or averaged over the sequence, k2 / k3 at their
# largest in it, k1 / k2 / k3 and the binary KL / TV bounding each token (token_*: the token leaves m'), the binary
# KL / TV averaged over the sequence (OpenRLHF's gates), and k1 bounding every token of the sequence (seq_all_k1)
_RS = ("seq_sum_k1", "seq_mean_k1", "seq_sum_k3", "seq_mean_k3", "token_k1", "token_k2", "token_k3", "seq_all_k1",
       "seq_sum_k2", "seq_mean_k2", "seq_max_k2", "seq_max_k3", "token_bkl", "token_btv", "seq_mean_bkl",
       "seq_mean_btv")
_KL_TYPES = ("k1", "k2", "abs", "k3", "k3_unclamped")
# the kernels' policy terms on the sampler (prime-rl's), and the loss types they stand for
_TRUST_REGIONS = {"dppo_binary_tv": "binary_tv", "dppo_binary_tv_signed": "binary_tv_signed", "ipo": "ipo"}


class KernelInputs(NamedTuple):
    """What the kernels read: [N] tensors (None where absent) and the sequences' layout."""
    lp: torch.Tensor  # float32 statistics
    entropy: Optional[torch.Tensor]  # None unless the loss has an entropy term
    advantages: torch.Tensor
    mask: torch.Tensor  # bool
    old: Optional[torch.Tensor]
    rollout: Optional[torch.Tensor]
    ref: Optional[torch.Tensor]  # None unless the loss has a KL term
    cu_seqlens: Optional[torch.Tensor]  # [S + 1] int64 (packed), or None (padded: seq_len tokens each)
    seq_len: int
    seq_id: torch.Tensor  # [N] int64
    num_seqs: int
    is_weights: Optional[torch.Tensor] = None  # a trainer's own IS weights (the stage applies them as given)


def blocker(batch, config, dtype: torch.dtype) -> Optional[str]:
    """Why a call's stage is outside the fused kernels' family (`dtype`: its statistics'), or None when they
    compute it. Decided from the inputs alone, before any pass runs."""
    if dtype != torch.float32:
        return f"{dtype} statistics (the kernels compute in float32)"
    if _policy(config) is None:
        return (f"loss_type={config.loss_type!r}, ratio_level={config.ratio_level!r} (PPO's clip, CISPO and SAPO of "
                "the token's or the sequence's ratio, GSPO's token form, GPG, DRO, DPPO, or the binary-TV and IPO "
                "trust regions)")
    for name in ("m2po_threshold", "vaco_threshold"):
        if getattr(config, name) is not None:  # a threshold of 0 is on
            return f"{name}={getattr(config, name)!r}"
    own = LOSS_TERMS[config.loss_type].aggregation
    entropy_term = config.entropy_coeff or config.adaptive_entropy
    if own is not None and entropy_term and config.entropy_agg_mode not in (None, config.loss_agg_mode) and \
            config.entropy_agg_mode.startswith("seq-mean") and (own[1] == "all") != (config.seq_mean_over == "all"):
        return (f"entropy_agg_mode={config.entropy_agg_mode!r} with loss_type={config.loss_type!r}'s own "
                "aggregation (the kernels take one seq_mean_over for both)")
    if batch.ref_logprobs is not None and config.kl_coef and config.kl_type.rstrip("+") not in _KL_TYPES:
        return f"kl_type={config.kl_type!r}"
    if batch.sampler_head is not None:
        return "the sampler's top-k or logits (SPEC §9)"
    split, seg = batch.split, batch.segments
    if split is not None and (split.dp_group is not None or split.cp_group is not None):
        return "a dp_group / cp_group split"
    if seg.order is not None:
        return "sequences whose tokens are not contiguous"
    return _correction_blocker(batch, config.rollout_correction)


def _correction_blocker(batch, rc) -> Optional[str]:
    if rc is None or batch.rollout_logprobs is None or not rc.enabled:
        return None
    if batch.old_logprobs is None:
        return "bypass mode with a rollout correction (its weights are of the current policy)"
    unknown = [option for option, _ in rc.rs if option not in _RS]
    if unknown:
        return f"rejection options {unknown} (the kernels decide {', '.join(_RS)})"
    return None


def _policy(config) -> Optional[str]:
    """The kernels' policy term of a config (stage_options.POLICY_TERMS), or None outside the family."""
    if config.loss_type in _PPO:
        return "ppo" if config.ratio_level == "token" else "ppo_sequence"
    if config.loss_type == "cispo":
        return "cispo" if config.ratio_level == "token" else "cispo_sequence"
    if config.loss_type == "sapo":
        return "sapo" if config.ratio_level == "token" else "sapo_sequence"
    if config.ratio_level != "token":
        return None
    if config.loss_type in ("gspo", "gpg", "dro", "dppo_tv", "dppo_kl"):
        return config.loss_type
    return _TRUST_REGIONS.get(config.loss_type)


def implementation(config, device: torch.device) -> Optional[str]:
    """The kernels that run the fused stage for a call with `config` on `device`, or None (the torch stage):
    Triton on CUDA; on the CPU, the CPU kernels, or Triton's interpreter where the call's backend is "triton"
    (TRITON_INTERPRET=1). Never for fused_stage=False or inside a compiled region (the torch stage traces there)."""
    if config.fused_stage is False or torch.compiler.is_compiling():
        return None
    if device.type == "cuda":
        return "triton" if backends.is_available("triton") else None
    if device.type != "cpu":
        return None
    if config.backend == "triton":
        return "triton" if backends.is_available("triton") and backends.triton_interpreter() else None
    return "cpu" if config.backend in ("auto", "cpu") and backends.is_available("cpu") else None


def run(stats, batch, config, corrected=None, metrics: bool = False, evidence=None) -> StageOutput:
    """`loss.run` for a call `blocker` passes: the same StageOutput, with `metrics` the torch stage's, deferred to
    their first read. `corrected` (the torch stage's correction, computed once for the fused-linear chunks) is not
    read by the kernels, which decide it again; the deferred metrics' run takes it."""
    if evidence is not None:
        raise ValueError("the fused stage takes no sampler evidence (see blocker)")
    inputs, options, hyper = _launch_arguments(stats, batch, config)
    kernels = backends.instance(implementation(config, stats.logprobs.device))
    total, lp, coef, coef_entropy, weights, kept = kernels.sequence_stage(inputs, options, hyper)
    if not metrics:
        return StageOutput(total, coef, coef_entropy, weights, kept, {}, None, lp)
    known = {}
    if options["rejection"]:  # the flag the notices read on every step: rejection kept none of m's tokens
        known[ALL_REJECTED] = (kept.any() < batch.mask.any()).to(lp.dtype)  # m' within m: none of m kept
    stream = torch.cuda.current_stream(lp.device) if lp.is_cuda else None  # the reader's may differ
    deferred = DeferredMetrics(lambda: _torch_metrics(stats, batch, config, corrected), known, stream)
    return StageOutput(total, coef, coef_entropy, weights, kept, deferred, None, lp)


def factors_blocker(config) -> Optional[str]:
    """Why forward_factors cannot carry a call inside the family, or None: the one-pass kernel forms PPO's
    coefficient of the token's own ratio (forward_gradient_blocker holds the sequence ratios back) from the token's
    own advantage and the KL's plain derivative."""
    if _policy(config) != "ppo":
        return f"loss_type={config.loss_type!r} (the one-pass kernel forms PPO's clip)"
    if config.seq_mean_advantages:
        return "seq_mean_advantages (the factors carry each token's own advantage, not its sequence's mean)"
    if config.kl_coef and (config.kl_score_gradient or config.kl_bias_correction):
        name = "kl_score_gradient" if config.kl_score_gradient else "kl_bias_correction"
        return f"{name} (the one-pass kernel forms the KL's plain derivative)"
    if config.log_ratio_sq_coef:
        return "log_ratio_sq_coef (the one-pass kernel forms no term of the sampler's log-ratio)"
    if config.off_policy_mask_threshold is not None:
        return "off_policy_mask_threshold (its sequence mask reads the current log-probs, which the factors precede)"
    return None


def forward_factors(batch, config, entropy: bool):
    """What each token's coefficients are formed from, decided before the vocabulary pass (the gradient formed in
    the forward on the logits path, SPEC §2.4): the fused stage's kernels in their factors mode, on the
    proximal log-probs in place of the current ones, which no decision of a call in the family reads (decoupled mode
    decides from π_old and μ, bypass and on-policy modes without a correction decide nothing). Returns
    (TokenFactors, the option codes, the hyperparameters); `entropy`: the pass computes the entropy (the loss's
    entropy bonus, where it has one, then takes its coefficient)."""
    proximal = batch.old_logprobs if batch.old_logprobs is not None else batch.rollout_logprobs
    mask = batch.mask
    zero = torch.zeros((), dtype=torch.float32, device=mask.device)
    placeholder = torch.zeros(mask.shape, dtype=torch.float32, device=mask.device) if proximal is None else \
        torch.where(mask, proximal.to(torch.float32), zero)
    inputs, options, hyper = _launch_arguments(_Proximal(placeholder, placeholder if entropy else None), batch, config)
    factors, codes = backends.stage_factors(implementation(config, batch.mask.device), inputs, options, hyper)
    return factors, codes, hyper


class _Proximal(NamedTuple):
    """The statistics forward_factors runs the kernels on (its placeholders: the decisions do not read them)."""
    logprobs: torch.Tensor
    entropy: Optional[torch.Tensor]


def _torch_metrics(stats, batch, config, corrected) -> dict:
    """The torch stage's metrics of a call, as `stage.choose`'s fallback records them: eager or compiled as
    `stage.select` says (eager with a precomputed correction, which the compiled stage does not take)."""
    from . import select  # the package imports this module

    with torch.no_grad():
        if corrected is not None:
            return loss.run(stats, batch, config, corrected=corrected).metrics
        return select(stats.logprobs, config.compile_stage)(stats, batch, config).metrics


def _launch_arguments(stats, batch, config):
    """(KernelInputs, the constexpr option set, the float hyperparameters) of a covered call."""
    seg = batch.segments
    rc = config.rollout_correction if batch.rollout_logprobs is not None and batch.old_logprobs is not None \
        else None
    rc = rc if rc is not None and rc.enabled else None
    kl = batch.ref_logprobs is not None and bool(config.kl_coef)
    entropy_term = stats.entropy is not None and (config.adaptive_entropy or bool(config.entropy_coeff))
    proximal = 1 if batch.old_logprobs is not None else 2 if batch.rollout_logprobs is not None else 0
    opsm = config.off_policy_mask_threshold is not None  # DeepSeek-V3.2's off-policy sequence mask
    inputs = KernelInputs(stats.logprobs, stats.entropy if entropy_term else None, batch.advantages, batch.mask,
                          batch.old_logprobs, batch.rollout_logprobs,
                          batch.ref_logprobs if kl else None, seg.cu_seqlens, seg.padded_T or 0, seg.seq_id,
                          seg.num_seqs, batch.is_weights)
    options = dict(
        proximal=("current", "old", "rollout")[proximal],
        weighted=rc is not None and rc.is_level is not None or batch.is_weights is not None,
        given_weights=batch.is_weights is not None,
        is_level=None if rc is None else rc.is_level, is_mask=rc is not None and rc.is_icepop,
        rejection=() if rc is None else tuple(option for option, _ in rc.rs),
        ratio_clamp=config.log_ratio_clamp is not None, dual_clip=config.clip_ratio_c is not None,
        kl_type=config.kl_type.rstrip("+") if kl else None, kl_straight=config.kl_type.endswith("+"),
        **_aggregations(config),
        global_tokens=config.global_num_tokens is not None, global_seqs=config.global_num_seqs is not None,
        scale_factor=config.loss_scale_factor is not None,
        normalize=rc is not None and rc.is_level is not None and rc.is_batch_normalize,
        policy=_policy(config),
        seq_mean_advantages=bool(config.seq_mean_advantages),
        zero_weight=rc is not None and rc.rs_mode == "zero_weight", kl_score=kl and bool(config.kl_score_gradient),
        kl_bias_correction=kl and bool(config.kl_bias_correction),
        # the sampler's log-probs, given and read: what the trust regions and the log-ratio square are taken against
        # (a flag set only where read, so that no other call compiles a variant of its own)
        sampler=batch.rollout_logprobs is not None and (config.loss_type in _TRUST_REGIONS or
                                                        bool(config.log_ratio_sq_coef) or opsm),
        log_ratio_sq=bool(config.log_ratio_sq_coef), opsm=opsm,
        seq_tokens_kept=rc is not None and bool(rc.rs) and rc.seq_tokens == "kept",
        cispo_cap=config.loss_type == "cispo" and config.cispo_cap is not None)
    return inputs, options, _hyperparameters(config, rc)


def _aggregations(config) -> dict:
    """The loss's and the entropy's aggregation modes, as loss.aggregation_weights decides them: a loss type's own
    (LUSPO's seq-mean-token-sum over all sequences) stands for loss_agg_mode, the entropy's too where it has no mode
    of its own or the same (blocker refuses the one case where the two would need different seq_mean_over)."""
    mode, over_all = config.loss_agg_mode, config.seq_mean_over == "all"
    entropy = config.entropy_agg_mode or mode
    own = LOSS_TERMS[config.loss_type].aggregation
    if own is not None:
        entropy = own[0] if entropy == mode else entropy
        mode, over_all = own[0], own[1] == "all"
    return dict(aggregation=mode, seq_mean_over_all=over_all, entropy_aggregation=entropy)


def _hyperparameters(config, rc) -> dict:
    """The float arguments (never constexpr: a new value launches the same binary). k1's bounds as the torch stage
    compares them: k1 in [-log hi, -log lo], the logs taken in float64 (correction._keeps)."""
    bounds = dict(rc.rs) if rc is not None else {}

    def k1_range(option):
        lo, hi = bounds.get(option, (1.0, 1.0))
        return (-_log(hi), -_log(lo))

    is_lo, is_hi = rc.is_range if rc is not None else (0.0, 1.0)
    (k1_sum_lo, k1_sum_hi), (k1_mean_lo, k1_mean_hi) = k1_range("seq_sum_k1"), k1_range("seq_mean_k1")
    (token_k1_lo, token_k1_hi), (all_k1_lo, all_k1_hi) = k1_range("token_k1"), k1_range("seq_all_k1")
    upper = {option: float(bounds.get(option, 0.0)) for option in ("token_k2", "token_k3", "token_bkl", "token_btv",
                                                                    "seq_mean_bkl", "seq_mean_btv")}
    return dict(
        is_lo=float(is_lo), is_hi=float(is_hi), k1_sum_lo=k1_sum_lo, k1_sum_hi=k1_sum_hi, k1_mean_lo=k1_mean_lo,
        k1_mean_hi=k1_mean_hi, k3_sum_max=float(bounds.get("seq_sum_k3", 0.0)),
        k3_mean_max=float(bounds.get("seq_mean_k3", 0.0)), ratio_clamp=float(config.log_ratio_clamp or 0.0),
        clip_lo=1 - config.clip_ratio_low, clip_hi=1 + config.clip_ratio_high, clip_c=float(config.clip_ratio_c or 0.0),
        kl_coef=float(config.kl_coef), entropy_coeff=float(config.entropy_coeff),
        global_tokens=float(config.global_num_tokens or 1.0), global_seqs=float(config.global_num_seqs or 1.0),
        scale_factor=float(config.loss_scale_factor or 1.0), token_k1_lo=token_k1_lo, token_k1_hi=token_k1_hi,
        token_k2_max=upper["token_k2"], token_k3_max=upper["token_k3"], all_k1_lo=all_k1_lo, all_k1_hi=all_k1_hi,
        cispo_cap=float(config.cispo_cap or 0.0), binary_tv_low=float(config.binary_tv_low),
        binary_tv_high=float(config.binary_tv_high), ipo_kl_tau=float(config.ipo_kl_tau), ipo_eps=float(config.ipo_eps),
        log_ratio_sq_coef=float(config.log_ratio_sq_coef), dro_beta=float(config.dro_beta or 0.0),
        tau_pos=float(config.tau_pos), tau_neg=float(config.tau_neg), eps_lo=float(config.clip_ratio_low),
        eps_hi=float(config.clip_ratio_high), k2_sum_max=float(bounds.get("seq_sum_k2", 0.0)),
        k2_mean_max=float(bounds.get("seq_mean_k2", 0.0)), k2_max_bound=float(bounds.get("seq_max_k2", 0.0)),
        k3_max_bound=float(bounds.get("seq_max_k3", 0.0)), token_bkl_max=upper["token_bkl"],
        token_btv_max=upper["token_btv"], bkl_mean_max=upper["seq_mean_bkl"], btv_mean_max=upper["seq_mean_btv"],
        opsm_threshold=float(config.off_policy_mask_threshold or 0.0))

