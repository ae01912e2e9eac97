"""rlkernels inside AReaL 1.0: `ppo_actor_loss_fn`, the decoupled PPO loss AReaL's actor calls, by rlkernels.

    import rlkernels.integrations.areal as rlk_areal
    rlk_areal.install()          # AReaL's loss and its FSDP engine's log-prob passes, by rlkernels

AReaL has no loss registry: `areal/trainer/ppo/actor.py` imports `ppo_actor_loss_fn` at module level and its
`grpo_loss_fn` calls that name; `areal/engine/fsdp_engine.py` imports `gather_logprobs` and
`gather_logprobs_entropy`, which its old, reference and update forwards call on the model's logits. `install()`
rebinds the three names there (`gather_logprobs(_entropy)` below: one fused pass over the logits in their own
dtype, where AReaL's chunks a float32 copy and saves its softmax); `uninstall()` restores AReaL's. In AReaL's worker
processes: docs/integrations.md (the launch command, or Ray's setup hook).

Same signature and return as AReaL's `(loss, stat)`. The mapping (π_prox = rlkernels' `old_logprobs`, π_behave =
AReaL's `old_logprobs` = rlkernels' `rollout_logprobs`):
- PPO clip `eps_clip` / `eps_clip_higher`, dual clip `c_clip`, no log-ratio clamp (AReaL has none);
- `importance_sampling_level="sequence"` (GSPO): the ratio of each sequence's mean log-ratio and its mean advantage
  over the mask rejection leaves (`ratio_level="sequence"`, `seq_mean_advantages=True`);
- `RejectionSamplingConfig` (ratio π_prox/π_behave): token ratio mask → `rs token_k1` (either bound optional) with the
  untruncated token weight; token clamp → truncated token IS; sequence ratio → every token weighted by the
  sequence's **geometric-mean** ratio (`is_level="geometric"`), masked by the mean (`seq_mean_k1`) or the product
  (`agg="sum"`: `seq_sum_k1`), or truncated (`action="clamp"`, `agg="mean"`); kl_k1 → `token_k1` / `seq_sum_k1` /
  `seq_mean_k1` in ratio space; kl_k2 → `token_k2` / `seq_sum_k2` / `seq_mean_k2` / `seq_max_k2`;
- the denominator: the loss-mask count **before** rejection (AReaL's), as `global_num_tokens` (one host read, as
  AReaL's own `count_nonzero() or 1`).
  kl_k3 (AReaL's k3 is exp(−Δ) − 1 + Δ, rlkernels' k3 of −Δ) → the band of ratios where it is ≤ upper: `token_k1`,
  or `seq_all_k1` for the sequence's maximum;
- packed (1-D) input reads `cu_seqlens` only where something is sequence-level (AReaL's token-level loss ignores
  them: a context-parallel rank's may end before its token count); there they are required and must cover it.
Refused, naming AReaL's option: kl_k3's sequence sum or mean (no rlkernels statistic), `agg="max"` with k1 or the
ratio (no max of a log-ratio), `action="clamp"` with a KL metric or a sequence `agg` other than "mean", a lower
bound on k2 or k3.

`stat` carries AReaL's logging keys: `loss`, `importance_weight`, `approx_kl`, `clip_mask`, `dual_clip_mask` and,
with rejection, `behave_imp_weight`, `behave_approx_kl`, `behave_mask`, `filtered_fraction`. The per-token ones
are recomputed from the detached log-probs (rlkernels' pass reduces them away); they do not touch the gradient.
With RLKERNELS_LOGPROB_PARITY=1 the parity report of π_prox against π_behave goes to AReaL's `stats_tracker.scalar`
(`logprob_parity/...`; parity.py).
"""

import math
from typing import Optional

import torch

from ..api import metrics_to_floats, policy_loss, token_logprobs
from ..config import PolicyLossConfig, RolloutCorrection
from .activation import Rebinding
from .parity import parity_metrics
from .requirements import require_trainer


def _get(node, name, default=None):
    return node.get(name, default) if isinstance(node, dict) else getattr(node, name, default)


def rollout_correction_from_areal(rejection_sampling) -> Optional[RolloutCorrection]:
    """AReaL's `RejectionSamplingConfig` (or dict) as a `RolloutCorrection`; None for None."""
    if rejection_sampling is None:
        return None
    level, action = _get(rejection_sampling, "level", "token"), _get(rejection_sampling, "action", "mask")
    metric, agg = _get(rejection_sampling, "metric", "ratio"), _get(rejection_sampling, "agg", "mean")
    upper, lower = _get(rejection_sampling, "upper"), _get(rejection_sampling, "lower")
    sequence = level == "sequence"
    if metric == "kl_k3":
        return _k3_as_ratio_band(sequence, action, agg, lower, upper)
    if action == "clamp" and (metric != "ratio" or (sequence and agg != "mean")):
        raise ValueError(f"rejection_sampling.action='clamp' with metric={metric!r}, agg={agg!r}: AReaL then clamps "
                         "the weights of the units its statistic flags to the statistic's bounds, which is no "
                         "truncation rlkernels has; use action='mask', or metric='ratio' (agg='mean')")
    if sequence and agg == "max" and metric in ("ratio", "kl_k1"):
        raise ValueError(f"rejection_sampling.agg='max' with metric={metric!r}: rlkernels has no sequence maximum of "
                         "the log-ratio; use agg='mean' or 'sum'")
    weight_level = "geometric" if sequence and metric == "ratio" else "token"
    if action == "clamp":  # the weight clamped to [lower, upper]: truncation (of the geometric mean per sequence)
        return RolloutCorrection(is_level=weight_level, is_threshold=(lower or 0.0, upper), is_mode="truncate")
    if metric in ("ratio", "kl_k1"):  # bounds on the ratio (kl_k1: on its log)
        bounds = (lower, upper) if metric == "ratio" else (
            None if lower is None else math.exp(lower), math.exp(upper))
        option = "token_k1" if not sequence else ("seq_sum_k1" if agg == "sum" else "seq_mean_k1")
    else:  # kl_k2: an upper bound on ½ d², summed, averaged or maximised per sequence
        if lower is not None and lower > 0:
            raise ValueError("rejection_sampling.lower with metric='kl_k2': rlkernels bounds k2 from above only")
        bounds = upper
        option = "token_k2" if not sequence else f"seq_{agg}_k2"
    # the survivors' weight: their own untruncated ratio (the sequence's geometric mean for a sequence ratio)
    return RolloutCorrection(is_level=weight_level, is_threshold=(0.0, math.inf), is_mode="mask", rs={option: bounds})


def _k3_as_ratio_band(sequence: bool, action: str, agg: str, lower, upper) -> RolloutCorrection:
    """AReaL's kl_k3, g(d) = exp(-d) - 1 + d of d = log(pi_prox / pi_behave), is rlkernels' k3 of -d, the other
    direction. g is convex with g(0) = 0, so {g(d) <= u} is an interval of d: a token's k3 bound is a band on its
    ratio (`token_k1`), and a sequence's maximum k3 bound is that band on every token (`seq_all_k1`). A sequence's
    sum or mean of g is not a function of anything rlkernels bounds, and is refused."""
    option = "kl_k3 with level='sequence'"
    if action != "mask" or (lower is not None and lower > 0) or upper is None:
        raise ValueError(f"rejection_sampling: {option if sequence else 'kl_k3'} with action={action!r}, lower="
                         f"{lower!r}, upper={upper!r}: rlkernels takes AReaL's k3 with action='mask' and an upper "
                         "bound only")
    if sequence and agg != "max":
        raise ValueError(f"rejection_sampling.agg={agg!r} with metric='kl_k3' at level='sequence': AReaL's k3 is "
                         "rlkernels' k3 of the reversed log-ratio, whose sequence sum or mean rlkernels has no "
                         "statistic for; use agg='max', metric='kl_k2', or level='token'")
    if not 0 < upper < 19.0:  # g(20) = 19: a band past the +-20 clamp of rlkernels' log-ratio would not be exact
        raise ValueError(f"rejection_sampling.upper={upper!r} with metric='kl_k3': expected 0 < upper < 19")
    band = (math.exp(_k3_root(upper, -1.0)), math.exp(_k3_root(upper, 1.0)))
    return RolloutCorrection(is_level="token", is_threshold=(0.0, math.inf), is_mode="mask",
                             rs={"seq_all_k1" if sequence else "token_k1": band})


def _k3_root(u: float, side: float) -> float:
    """The root of exp(-d) - 1 + d = u with the sign of `side`, by bisection in float64 (g is monotone on each
    side of 0)."""
    inside, outside = 0.0, side
    while math.exp(-outside) - 1 + outside < u:
        outside *= 2
    for _ in range(200):
        middle = 0.5 * (inside + outside)
        if math.exp(-middle) - 1 + middle < u:
            inside = middle
        else:
            outside = middle
    return inside


def config_from_areal(eps_clip: float, eps_clip_higher: Optional[float] = None, c_clip: Optional[float] = None,
                      rejection_sampling=None, importance_sampling_level: str = "token") -> PolicyLossConfig:
    if importance_sampling_level not in ("token", "sequence"):
        raise ValueError(f"importance_sampling_level: expected 'token' or 'sequence', "
                         f"got {importance_sampling_level!r}")
    gspo = importance_sampling_level == "sequence"
    return PolicyLossConfig(
        loss_type="vanilla", clip_ratio_low=eps_clip, clip_ratio_high=eps_clip if eps_clip_higher is None else
        eps_clip_higher, clip_ratio_c=c_clip, log_ratio_clamp=None, ratio_level="sequence" if gspo else "token",
        seq_mean_advantages=gspo, loss_agg_mode="token-mean",
        rollout_correction=rollout_correction_from_areal(rejection_sampling))


def ppo_actor_loss_fn(logprobs: torch.Tensor, proximal_logprobs: torch.Tensor, old_logprobs: torch.Tensor,
                      advantages: torch.Tensor, eps_clip: float, loss_mask: torch.Tensor,
                      eps_clip_higher: Optional[float] = None, c_clip: Optional[float] = None,
                      rejection_sampling=None, importance_sampling_level: str = "token",
                      cu_seqlens: Optional[torch.Tensor] = None):
    """AReaL's `ppo_actor_loss_fn`, computed by `rlkernels.policy_loss` (module docstring)."""
    config = config_from_areal(eps_clip, eps_clip_higher, c_clip, rejection_sampling, importance_sampling_level)
    sequences, named = _sequences_read(logprobs, cu_seqlens, config, rejection_sampling, importance_sampling_level)
    mask = loss_mask.bool()
    reads = [mask.count_nonzero()]  # AReaL's denominator: the mask before rejection (AReaL reads it too)
    if sequences is not None and sequences.numel():
        reads.append(sequences[-1].to(reads[0].dtype))  # where the sequences end: read in the same transfer
    values = torch.stack(reads).tolist()
    if sequences is not None and (len(values) < 2 or values[1] != logprobs.shape[0]):
        raise ValueError(f"cu_seqlens: with {named} the sequences must cover the {logprobs.shape[0]} packed tokens; "
                         f"they end at {values[1] if len(values) > 1 else 0}")
    count = max(values[0], 1)
    config = config.with_overrides(global_num_tokens=float(count))
    rc = config.rollout_correction
    out = policy_loss(logprobs, advantages, mask, old_logprobs=proximal_logprobs.detach(),
                      rollout_logprobs=None if rc is None else old_logprobs.detach(), config=config,
                      cu_seqlens=sequences)
    _log_parity(proximal_logprobs, old_logprobs, mask, sequences)
    return out.loss, _stat(out, logprobs, proximal_logprobs, old_logprobs, advantages, config, sequences)


def _log_parity(proximal, behave, mask, cu_seqlens) -> None:
    """The opt-in parity report (parity.py: pi_prox, the trainer's, against pi_behave, the engine's) as AReaL logs
    a scalar: `stats_tracker.scalar`, floats."""
    report = parity_metrics(proximal, behave, mask, cu_seqlens)
    if report:
        from areal.utils import stats_tracker  # AReaL's own logger, imported only when the report is on

        stats_tracker.scalar(**metrics_to_floats(report))


def _sequences_read(logprobs, cu_seqlens, config, rejection_sampling, importance_sampling_level):
    """(the cu_seqlens of packed input where something sequence-level reads them, else None; the options that do,
    for messages): AReaL's token-level loss ignores them, and a context-parallel rank's may end before its token
    count."""
    if logprobs.ndim != 1:
        return None, ""
    rc = config.rollout_correction
    by_sequence = {name: value for name, value in (
        ("importance_sampling_level", importance_sampling_level),
        ("rejection_sampling.level", _get(rejection_sampling, "level", "token") if rc is not None else None))
        if value == "sequence"}
    if not by_sequence:
        return None, ""
    named = ", ".join(f"{name}='sequence'" for name in by_sequence)
    if cu_seqlens is None:
        raise ValueError(f"cu_seqlens: required with packed (1-D) input and {named}, as AReaL's own loss requires")
    return cu_seqlens, named


def _sequence_mean(x, kept, cu_seqlens):
    """Each token's sequence mean of x over `kept` ([B, T], or packed [N] with cu_seqlens), 0 off `kept`."""
    x = torch.where(kept, x, torch.zeros_like(x))
    if x.ndim == 2:
        mean = x.sum(-1, keepdim=True) / kept.sum(-1, keepdim=True).clamp(min=1)
    else:
        ids = torch.repeat_interleave(torch.arange(len(cu_seqlens) - 1, device=x.device), cu_seqlens.diff())
        sums = torch.zeros(len(cu_seqlens) - 1, dtype=x.dtype, device=x.device).index_add_(0, ids, x)
        counts = torch.zeros_like(sums).index_add_(0, ids, kept.to(x.dtype)).clamp(min=1)
        mean = (sums / counts)[ids]
    return torch.where(kept, mean.expand_as(x), torch.zeros_like(x))


def _stat(out, logprobs, proximal, behave, advantages, config, cu_seqlens):
    """AReaL's per-token logging values, from the detached log-probs (no gradient)."""
    with torch.no_grad():
        kept = out.mask.bool()
        delta = logprobs.detach() - proximal
        if config.ratio_level == "sequence":
            delta, advantages = _sequence_mean(delta, kept, cu_seqlens), _sequence_mean(advantages, kept, cu_seqlens)
        ratio = torch.where(kept, torch.exp(delta), torch.zeros_like(delta))
        low, high = 1 - config.clip_ratio_low, 1 + config.clip_ratio_high
        surrogate, clipped_surrogate = -advantages * ratio, -advantages * ratio.clamp(low, high)
        token_loss = torch.maximum(surrogate, clipped_surrogate)
        clip_mask = (surrogate < clipped_surrogate) & kept
        dual_clip_mask = torch.zeros_like(clip_mask)
        if config.clip_ratio_c is not None:
            dual = advantages.abs() * config.clip_ratio_c
            dual_clip_mask = (dual < token_loss) & kept
            token_loss = torch.minimum(token_loss, dual)
        stat = dict(importance_weight=ratio, approx_kl=logprobs.detach() - proximal, clip_mask=clip_mask,
                    dual_clip_mask=dual_clip_mask)
        weights = out.is_weights
        if config.rollout_correction is not None:
            weights = torch.where(kept, weights, torch.zeros_like(weights))
            token_loss = token_loss * weights
            behave_mask = (weights > 0) & kept
            stat.update(behave_imp_weight=weights, behave_mask=behave_mask,
                        behave_approx_kl=torch.where(behave_mask, proximal - behave, 0),
                        filtered_fraction=float(out.metrics.get("rollout_corr/rollout_rs_masked_fraction", 0.0)))
        stat["loss"] = token_loss
    return stat


def gather_logprobs(logits: torch.Tensor, labels: torch.Tensor, temperature: float = 1.0, tp_group=None,
                    chunk_size: int = 1024) -> torch.Tensor:
    """AReaL's `gather_logprobs` (`areal/utils/functional/vocab_parallel.py`), by one fused `rlkernels.token_logprobs`
    pass over the logits in their own dtype: no float32 copy of the logits, no softmax saved for the backward.
    `chunk_size` is not read (rlkernels picks its own row blocks); float32 log-probs, as AReaL's."""
    del chunk_size
    return token_logprobs(logits, labels, temperature=temperature, tp_group=tp_group, validate=False).logprobs


def gather_logprobs_entropy(logits: torch.Tensor, labels: torch.Tensor, temperature: float = 1.0, tp_group=None,
                            chunk_size: int = 1024):
    """AReaL's `gather_logprobs_entropy`: (log-probs, entropy), both with autograd, from the same fused pass."""
    del chunk_size
    stats = token_logprobs(logits, labels, temperature=temperature, tp_group=tp_group, compute_entropy=True,
                           validate=False)
    return stats.logprobs, stats.entropy


def install(module=None) -> None:
    """Rebind `ppo_actor_loss_fn` where AReaL's actor reads it and `gather_logprobs(_entropy)` where its FSDP engine
    does: in `module`, or in AReaL's modules now if they are imported and else when they are (activation.py; AReaL's
    workers: `python -m rlkernels.integrations.launch areal areal.infra.rpc.rpc_server`, or the Ray
    `worker_process_setup_hook`). Imports none of AReaL."""
    if module is not None:
        for rebinding in _REBINDINGS:
            rebinding.patch(module)
        return
    require_trainer("areal")
    for rebinding in _REBINDINGS:
        rebinding.install()


def uninstall() -> None:
    """Put AReaL's own functions back wherever `install()` put rlkernels', and stop waiting for the rest."""
    for rebinding in _REBINDINGS:
        rebinding.uninstall()


# where AReaL reads the names at module level: the actor's grpo_loss_fn calls ppo_actor_loss_fn; the FSDP engine's
# _compute_logprobs(_entropy) (old, ref and update forwards) call gather_logprobs(_entropy)
_REBINDINGS = (Rebinding("ppo_actor_loss_fn", ppo_actor_loss_fn, ("areal.trainer.ppo.actor",)),
               Rebinding("gather_logprobs", gather_logprobs, ("areal.engine.fsdp_engine",)),
               Rebinding("gather_logprobs_entropy", gather_logprobs_entropy, ("areal.engine.fsdp_engine",)))
