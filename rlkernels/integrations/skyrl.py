"""rlkernels inside SkyRL 0.4: SkyRL's policy losses, computed by `rlkernels.policy_loss`, in SkyRL's registry.

    import rlkernels.integrations.skyrl as rlk_skyrl
    rlk_skyrl.register()                      # in the driver, before SkyRL validates its config
    # then: trainer.algorithm.policy_loss_type=rlkernels_dual_clip   (LOSS_NAMES maps each SkyRL name)

Each registered function has SkyRL's contract (`fn(log_probs, old_log_probs, advantages, config, loss_mask,
rollout_logprobs) -> (loss, metrics)`) and its meaning in SkyRL 0.4:
- the loss is a **sum** over the tokens the correction keeps: the trainer has already divided the advantages by
  its `loss_reduction` (token_mean, sequence_mean, ...) and multiplies by dp_size itself, so nothing here reads
  `loss_reduction` (an adapter that averaged would count the reduction twice);
- `off_policy_correction` in SkyRL's order, ratios π_old/μ: the outlier-token veto (`rs seq_all_k1`, either bound
  optional), the token mask (`token_k1`, both bounds), token / sequence TIS (min(ρ, C); the sequence ratio over the
  mask the token mask leaves: `seq_tokens="kept"`), then the geometric / product sequence masks (`seq_mean_k1` /
  `seq_sum_k1` over that mask);
- metrics are Python floats, as SkyRL's are (one synchronisation per call): every metric SkyRL's own loss logs,
  under its name and with its value (`clip_ratio`, `cispo/ratio_*`, `is_ratio_*`, `outlier_seq_*`, `token_mask_ratio`,
  `tis_token_clip_high_ratio` / `tis_seq_clip_high_ratio`, `geo_sequence_mask_*` / `product_sequence_mask_*`:
  `skyrl_metrics`), and rlkernels' own (`actor/...`, `rollout_corr/...`) beside them; with
  RLKERNELS_LOGPROB_PARITY=1, `logprob_parity/...` of `old_log_probs` against `rollout_logprobs` (parity.py).

Not registered: SkyRL's rollout_is, dppo, clip_cov, kl_cov, cross_entropy and importance_sampling losses (their
forms are not rlkernels loss types). Refused with an error naming SkyRL's option: the deprecated `use_tis` /
`tis_imp_ratio_cap` (use `off_policy_correction`), cispo anchored on the rollout with TIS (SkyRL refuses it too) or
with a mask of the correction (the masks would be of π_old against μ while the ratio is of π against μ), gspo with a
token mask (SkyRL takes the sequence's mean log-ratio over the mask before it). cispo anchored on the rollout runs
without `old_log_probs` (SkyRL's skip-forward path).
"""

import weakref
from typing import Dict, Optional

import torch

from ..api import metrics_to_floats, policy_loss, token_logprobs
from ..config import PolicyLossConfig, RolloutCorrection
from .activation import Rebinding
from .parity import parity_metrics
from .requirements import import_trainer, require_trainer

# SkyRL's loss name -> the name registered here
LOSS_NAMES: Dict[str, str] = {
    "regular": "rlkernels_regular",
    "dual_clip": "rlkernels_dual_clip",
    "gspo": "rlkernels_gspo",
    "cispo": "rlkernels_cispo",
    "sapo": "rlkernels_sapo",
}

# SkyRL's correction options that mask (every one but tis_ratio_type and its caps)
_MASK_OPTIONS = ("outlier_token_is_threshold_low", "outlier_token_is_threshold_high", "token_mask_is_threshold_low",
                 "token_mask_is_threshold_high", "sequence_mask_metric")


def _get(node, name, default=None):
    return node.get(name, default) if isinstance(node, dict) else getattr(node, name, default)


def rollout_correction_from_skyrl(opc) -> Optional[RolloutCorrection]:
    """SkyRL's `OffPolicyCorrectionConfig` (a dataclass or dict) as a `RolloutCorrection`, or None when off."""
    if opc is None:
        return None
    rs = {}
    low, high = _get(opc, "outlier_token_is_threshold_low"), _get(opc, "outlier_token_is_threshold_high")
    if low is not None or high is not None:  # SkyRL drops a token strictly outside: the bounds themselves are kept
        rs["seq_all_k1"] = (low, high)
    low, high = _get(opc, "token_mask_is_threshold_low"), _get(opc, "token_mask_is_threshold_high")
    if low is not None and high is not None:  # SkyRL applies the token mask only with both bounds
        rs["token_k1"] = (low, high)
    metric = _get(opc, "sequence_mask_metric")
    if metric == "geometric":
        rs["seq_mean_k1"] = (_get(opc, "geo_mask_low", 0.99), _get(opc, "geo_mask_high", 1.01))
    elif metric == "product":
        rs["seq_sum_k1"] = (_get(opc, "product_mask_low", 0.5), _get(opc, "product_mask_high", 2.0))
    elif metric is not None:
        raise ValueError(f"off_policy_correction.sequence_mask_metric: expected None, 'geometric' or 'product', "
                         f"got {metric!r}")
    level = _get(opc, "tis_ratio_type")
    if level == "token":
        threshold = _get(opc, "token_tis_ratio_clip_high", 2.0)
    elif level == "sequence":
        threshold = _get(opc, "sequence_tis_ratio_clip_high", 5.0)
    elif level is not None:
        raise ValueError(f"off_policy_correction.tis_ratio_type: expected None, 'token' or 'sequence', got {level!r}")
    else:
        threshold = 2.0
    if level is None and not rs:
        return None
    return RolloutCorrection(is_level=level, is_threshold=threshold, is_mode="truncate", rs=rs, seq_tokens="kept")


def config_from_skyrl(algorithm, loss_type: str) -> PolicyLossConfig:
    """The `PolicyLossConfig` of SkyRL's loss `loss_type` under its `AlgorithmConfig` (a dataclass or dict)."""
    if loss_type not in LOSS_NAMES:
        raise ValueError(f"loss_type: SkyRL's {loss_type!r} has no rlkernels form; "
                         f"expected one of {sorted(LOSS_NAMES)}")
    if _get(algorithm, "use_tis", False) or (_get(algorithm, "tis_imp_ratio_cap", -1.0) or -1.0) > 0:
        raise ValueError("use_tis / tis_imp_ratio_cap: deprecated in SkyRL 0.4 and not read here; set "
                         "off_policy_correction.tis_ratio_type='token' and token_tis_ratio_clip_high")
    rc = rollout_correction_from_skyrl(_get(algorithm, "off_policy_correction"))
    common = dict(loss_agg_mode="token-sum", rollout_correction=rc, log_ratio_clamp=20.0, clip_ratio_c=None,
                  clip_ratio_low=_get(algorithm, "eps_clip_low", 0.2),
                  clip_ratio_high=_get(algorithm, "eps_clip_high", 0.2))
    if loss_type == "dual_clip":
        return PolicyLossConfig(loss_type="vanilla", **{**common, "clip_ratio_c": _get(algorithm, "clip_ratio_c", 3.0)})
    if loss_type == "regular":
        return PolicyLossConfig(loss_type="vanilla", **common)
    if loss_type == "gspo":  # GSPO-token: sg(mean log-ratio over the sequence) + lp - sg(lp), log s <= 10
        if rc is not None and any(option == "token_k1" for option, _ in rc.rs):
            raise ValueError("off_policy_correction.token_mask_is_threshold_low/high with gspo: SkyRL averages the "
                             "sequence's log-ratio over the mask before its token mask, rlkernels (as verl) over the "
                             "tokens the mask keeps. Drop the token mask or use another loss")
        return PolicyLossConfig(loss_type="gspo", **common)
    if loss_type == "sapo":
        sapo = _get(algorithm, "sapo")
        return PolicyLossConfig(loss_type="sapo", tau_pos=_get(sapo, "tau_pos", 1.0),
                                tau_neg=_get(sapo, "tau_neg", 1.05),
                                **common)
    cispo = _get(algorithm, "cispo")  # cispo: sg(clamp(r, 1 - lo, 1 + hi)) A lp, r against cispo_anchor
    low, high = _get(cispo, "cispo_eps_clip_low", 1.0), _get(cispo, "cispo_eps_clip_high", 4.0)
    if low >= 1.0:  # SkyRL's default: no lower bound (r > 0), the weight min(r, 1 + hi)
        common.update(cispo_cap=1.0 + high)
    else:
        common.update(clip_ratio_low=low, clip_ratio_high=high)
    if _get(cispo, "cispo_anchor", "old") == "rollout" and rc is not None:
        opc = _get(algorithm, "off_policy_correction")
        if rc.is_level is not None:
            raise ValueError(f"off_policy_correction.tis_ratio_type={rc.is_level!r} with cispo.cispo_anchor="
                             "'rollout': the rollout-anchored ratio is already the off-policy correction, so TIS "
                             "would count it twice (SkyRL refuses it too). Set off_policy_correction."
                             "tis_ratio_type=None")
        masks = [f"off_policy_correction.{name}" for name in _MASK_OPTIONS if _get(opc, name) is not None]
        raise ValueError(f"{', '.join(masks)} with cispo.cispo_anchor='rollout': SkyRL takes the ratio against "
                         "the rollout but these masks of pi_old against it; rlkernels' masks are of the ratio's "
                         "own reference. Unset them, or set cispo.cispo_anchor='old'")
    return PolicyLossConfig(loss_type="cispo", **common)


def policy_loss_fn(loss_type: str, routes: bool = False) -> "RegisteredLoss":
    """SkyRL's loss `loss_type` as a callable of SkyRL's registered-loss contract, computed by rlkernels; with
    `routes`, unpickling it (in each SkyRL worker) also installs the log-prob route there (`install_routes`)."""
    if loss_type not in LOSS_NAMES:
        raise ValueError(f"loss_type: SkyRL's {loss_type!r} has no rlkernels form; "
                         f"expected one of {sorted(LOSS_NAMES)}")
    return RegisteredLoss(loss_type, routes)


class RegisteredLoss:
    """SkyRL's loss `loss_type`, computed by rlkernels: what `register()` puts in SkyRL's registry. SkyRL's registry
    cloudpickles it into its Ray actor and each worker unpickles it in `PolicyWorkerBase.__init__`, before the model
    is built; pickled by reference to `_unpickled_loss`, which installs the log-prob route in that process when the
    loss was registered with `routes=True`."""

    def __init__(self, loss_type: str, routes: bool):
        self.loss_type, self.routes = loss_type, routes
        self.__name__ = LOSS_NAMES[loss_type]

    def __reduce__(self):
        return _unpickled_loss, (self.loss_type, self.routes)

    def __call__(self, log_probs: torch.Tensor, old_log_probs: Optional[torch.Tensor], advantages: torch.Tensor,
                 config, loss_mask: Optional[torch.Tensor] = None, rollout_logprobs: Optional[torch.Tensor] = None):
        loss_type = self.loss_type
        cfg = config_from_skyrl(config, loss_type)
        mask = torch.ones_like(log_probs, dtype=torch.bool) if loss_mask is None else loss_mask > 0
        rollout_anchor = loss_type == "cispo" and _get(_get(config, "cispo"), "cispo_anchor", "old") == "rollout"
        if rollout_anchor:
            if rollout_logprobs is None:
                raise ValueError("rollout_logprobs: required by cispo with cispo_anchor='rollout'")
            old = None  # bypass mode: the ratio against the sampler (SkyRL's skip-forward path passes no pi_old)
        elif old_log_probs is None:
            raise ValueError(f"old_log_probs: required by {loss_type} (only cispo with cispo_anchor='rollout' "
                             "runs without them)")
        else:
            old = old_log_probs.detach()
        if rollout_logprobs is None:
            cfg = cfg.with_overrides(rollout_correction=None)  # SkyRL skips the correction without them
        out = policy_loss(log_probs, advantages, mask, old_logprobs=old, rollout_logprobs=rollout_logprobs,
                          config=cfg)
        metrics = dict(out.metrics)
        metrics.update(skyrl_metrics(loss_type, config, log_probs, old_log_probs, advantages, mask,
                                     rollout_logprobs))
        if old_log_probs is not None:  # parity.py: pi_old against the sampler, opt-in
            metrics.update(parity_metrics(old_log_probs, rollout_logprobs, mask))
        return out.loss, metrics_to_floats(metrics)  # one synchronisation for all of them


def _unpickled_loss(loss_type: str, routes: bool) -> RegisteredLoss:
    if routes:
        install_routes()
    return RegisteredLoss(loss_type, routes)


def _exp(delta: torch.Tensor) -> torch.Tensor:
    """SkyRL's `safe_exp_delta`: exp of the delta clamped to +-20, taken in float32."""
    return delta.float().clamp(-20.0, 20.0).exp().to(delta.dtype)


def _masked_mean(x: torch.Tensor, mask: torch.Tensor, dim=None) -> torch.Tensor:
    return (x * mask).sum(dim) / mask.sum(dim).clamp(min=1.0)


def _bound_fractions(prefix: str, stat: torch.Tensor, low, high) -> Dict[str, torch.Tensor]:
    """`<prefix>_{masked,over_high,under_low}_ratio` of SkyRL's sequence masks: fractions of every sequence."""
    over = stat > high if high is not None else torch.zeros_like(stat, dtype=torch.bool)
    under = stat < low if low is not None else torch.zeros_like(stat, dtype=torch.bool)
    n = float(stat.shape[0])
    return {f"{prefix}_masked_ratio": (over | under).sum() / n, f"{prefix}_over_high_ratio": over.sum() / n,
            f"{prefix}_under_low_ratio": under.sum() / n}


def skyrl_metrics(loss_type: str, algorithm, log_probs, old_log_probs, advantages, mask, rollout_logprobs
                  ) -> Dict[str, torch.Tensor]:
    """SkyRL 0.4's metrics of its loss `loss_type` under SkyRL's names, with SkyRL's values
    (`ppo_utils.py`'s losses, `off_policy_correction_utils.py`): computed from the detached inputs as SkyRL does
    (ratios in float32 clamped to +-20, the fractions over the mask each step of SkyRL's correction leaves).
    Device tensors (SAPO's constant 0 a number), read back with the loss's other metrics in one synchronisation."""
    with torch.no_grad():
        lp = log_probs.detach()
        m = mask.to(lp.dtype)
        out = {}
        old = None if old_log_probs is None else old_log_probs.detach()
        if loss_type == "sapo":
            out["clip_ratio"] = 0.0
        elif loss_type == "cispo":
            out.update(_cispo_metrics(_get(algorithm, "cispo"), lp, old, rollout_logprobs, mask, m))
        else:
            low, high = 1 - _get(algorithm, "eps_clip_low", 0.2), 1 + _get(algorithm, "eps_clip_high", 0.2)
            log_ratio = lp - old
            if loss_type == "gspo":  # the sequence's mean log-ratio, log <= 10
                ratio = _masked_mean(log_ratio, m, -1).unsqueeze(-1).expand_as(lp).clamp(max=10.0).exp()
            else:
                ratio = _exp(log_ratio)
            surr1, surr2 = ratio * advantages, ratio.clamp(low, high) * advantages
            out["clip_ratio"] = _masked_mean((-surr2 > -surr1).to(lp.dtype), m)
        opc = _get(algorithm, "off_policy_correction")
        if rollout_logprobs is not None and rollout_correction_from_skyrl(opc) is not None:
            out.update(_correction_metrics(opc, old, rollout_logprobs.detach(), m))
    return out


def _cispo_metrics(cispo, lp, old, rollout, mask, m):
    anchor = rollout.detach() if _get(cispo, "cispo_anchor", "old") == "rollout" else old
    low, high = 1 - _get(cispo, "cispo_eps_clip_low", 1.0), 1 + _get(cispo, "cispo_eps_clip_high", 4.0)
    ratio = _exp(lp - anchor)
    any_active = mask.any()  # SkyRL: the extremes over the masked tokens, over every token when there is none
    ratio_max = torch.where(any_active, torch.where(mask, ratio, -torch.inf).max(), ratio.max())
    ratio_min = torch.where(any_active, torch.where(mask, ratio, torch.inf).min(), ratio.min())
    return {"clip_ratio": _masked_mean(((ratio < low) | (ratio > high)).to(lp.dtype), m),
            "cispo/ratio_mean": _masked_mean(ratio, m), "cispo/ratio_clamped_mean": _masked_mean(
                ratio.clamp(low, high), m), "cispo/ratio_max": ratio_max, "cispo/ratio_min": ratio_min}


def _correction_metrics(opc, old, rollout, m):
    """SkyRL's `compute_off_policy_correction` metrics, each over the mask its earlier steps leave."""
    log_ratio = old - rollout
    ratio = _exp(log_ratio)
    out = {"is_ratio_mean": _masked_mean(ratio, m), "is_ratio_std": (ratio * m).std(),
           "is_ratio_max": (ratio * m).max(), "is_ratio_min": (ratio * m).min()}
    low, high = _get(opc, "outlier_token_is_threshold_low"), _get(opc, "outlier_token_is_threshold_high")
    if low is not None or high is not None:
        outside = torch.zeros_like(ratio, dtype=torch.bool)
        over = (ratio > high) & (m > 0) if high is not None else outside
        under = (ratio < low) & (m > 0) if low is not None else outside
        n = float(ratio.shape[0])
        keep = ~(over | under).any(-1, keepdim=True)
        out.update(outlier_seq_masked_ratio=(~keep).sum() / n, outlier_seq_over_high_ratio=over.any(-1).sum() / n,
                   outlier_seq_under_low_ratio=under.any(-1).sum() / n)
        m = m * keep
    low, high = _get(opc, "token_mask_is_threshold_low"), _get(opc, "token_mask_is_threshold_high")
    if low is not None and high is not None:
        inside = (ratio >= low) & (ratio <= high)
        out["token_mask_ratio"] = (~inside & (m > 0)).sum() / (m > 0).sum().clamp(min=1)
        m = m * (inside | (m == 0))
    level = _get(opc, "tis_ratio_type")
    if level == "token":
        capped = (ratio > _get(opc, "token_tis_ratio_clip_high", 2.0)) & (m > 0)
        out["tis_token_clip_high_ratio"] = capped.sum() / (m > 0).sum().clamp(min=1)
    elif level == "sequence":
        capped = _exp((log_ratio * m).sum(-1)) > _get(opc, "sequence_tis_ratio_clip_high", 5.0)
        out["tis_seq_clip_high_ratio"] = capped.sum() / float(ratio.shape[0])
    metric = _get(opc, "sequence_mask_metric")
    if metric == "geometric":
        geo = _exp((log_ratio * m).sum(-1) / m.sum(-1).clamp(min=1.0))
        out.update(_bound_fractions("geo_sequence_mask", geo, _get(opc, "geo_mask_low", 0.99),
                                    _get(opc, "geo_mask_high", 1.01)))
    elif metric == "product":
        out.update(_bound_fractions("product_sequence_mask", _exp((log_ratio * m).sum(-1)),
                                    _get(opc, "product_mask_low", 0.5), _get(opc, "product_mask_high", 2.0)))
    return out


def register(registry=None, routes: bool = True) -> Dict[str, str]:
    """Register every loss of LOSS_NAMES in SkyRL's `PolicyLossRegistry` (or `registry`), once; returns LOSS_NAMES.
    Call it in the driver before SkyRL validates `trainer.algorithm.policy_loss_type`; with Ray already running,
    SkyRL's registry also ships the losses to its workers. `routes`: the policy workers that unpickle a loss also
    compute their log-probs and entropy by rlkernels (`install_routes`)."""
    if registry is None:
        registry = import_trainer("skyrl", "skyrl.backends.skyrl_train.utils.ppo_utils").PolicyLossRegistry
    available = set(registry.list_available())
    for skyrl_name, name in LOSS_NAMES.items():
        if name not in available:
            registry.register(name, policy_loss_fn(skyrl_name, routes))
    return dict(LOSS_NAMES)


# ---------------------------------------------------------------- the log-prob route
# HFModelWrapper.forward (FSDP workers: the policy's old and update forwards, the reference's) calls these two names
# of its module on the temperature-scaled logits, log-probs first; the entropy function is bound in __init__
_WRAPPER_MODULE = "skyrl.backends.skyrl_train.workers.model_wrapper"
# (the logits of the last log-prob pass with autograd, their version, its entropy): the entropy call that follows on the
# same logits reuses it. Held until that call or the next pass; the entropy's graph keeps the pass's saved tensors only
# until the backward (as the log-probs' does), so what outlives a step is a [B, T] tensor.
_last_pass = None


def logprobs_from_logits(logits: torch.Tensor, labels: torch.Tensor, inplace_backward: bool = True) -> torch.Tensor:
    """SkyRL's `logprobs_from_logits` by one fused `rlkernels.token_logprobs` pass, which also takes each row's
    entropy for the `chunked_entropy_from_logits` call that follows on the same logits. Float32 log-probs (as
    SkyRL's flash-attn path on a GPU); `inplace_backward` as SkyRL's (the gradient into the logits' storage)."""
    global _last_pass
    # the entropy rides along where SkyRL asks for it, the update forward (with autograd); its old and reference
    # passes (no autograd) ask for none, and an entropy call there runs its own pass
    training = torch.is_grad_enabled()
    stats = token_logprobs(logits, labels, compute_entropy=training, inplace_backward=inplace_backward,
                           validate=False)
    _last_pass = (weakref.ref(logits), _version(logits), stats.entropy) if training else None
    return stats.logprobs


def _version(tensor: torch.Tensor) -> int:
    return -1 if tensor.is_inference() else tensor._version  # an inference tensor has no version counter


@torch.compiler.disable  # SkyRL may torch.compile its entropy function; this one is a lookup or one fused pass
def chunked_entropy_from_logits(logits: torch.Tensor, requires_grad: bool = False,
                                attention_mask: Optional[torch.Tensor] = None, chunk_size: int = 1024) -> torch.Tensor:
    """SkyRL's `chunked_entropy_from_logits`: the entropy of the log-prob pass just run on these logits (unchanged
    since), else its own pass; in the logits' dtype, 0 where `attention_mask` is 0, detached unless
    `requires_grad`. `chunk_size` is not read."""
    global _last_pass
    previous, _last_pass = _last_pass, None
    if previous is not None and previous[0]() is logits and previous[1] == _version(logits):
        entropy = previous[2]
    else:
        labels = torch.zeros(logits.shape[:-1], dtype=torch.long, device=logits.device)
        entropy = token_logprobs(logits, labels, compute_entropy=True, validate=False).entropy
    if attention_mask is not None:
        entropy = entropy * attention_mask
    entropy = entropy.to(logits.dtype)
    return entropy if requires_grad else entropy.detach()


def install_routes() -> None:
    """SkyRL's FSDP model wrapper computes its log-probs and entropy with the two functions above, in this process:
    now if the wrapper's module is imported and otherwise when it is (activation.py; a wrapper built before keeps
    the entropy function it bound). Also a Ray `worker_process_setup_hook` for the processes that read no
    registered loss (the reference model's). Imports none of SkyRL."""
    require_trainer("skyrl")
    for rebinding in _ROUTES:
        rebinding.install()


def uninstall_routes() -> None:
    """SkyRL's own functions back in the wrapper's module (wrappers built since keep the entropy function)."""
    for rebinding in _ROUTES:
        rebinding.uninstall()


_ROUTES = (Rebinding("logprobs_from_logits", logprobs_from_logits, (_WRAPPER_MODULE,)),
           Rebinding("chunked_entropy_from_logits", chunked_entropy_from_logits, (_WRAPPER_MODULE,)))
