"""The trainers' option names -> rlkernels' configs, written once: verl 0.9.1 and TRL 1.16.

`RolloutCorrection.from_verl` / `.from_trl` and `PolicyLossConfig.from_verl_actor` / `.from_trl` call
these; the verl plugin's loss-mode names (`rlkernels[_<type>]`, `rlkernels_logits[_<type>]`,
`rlkernels_linear[_<type>]`) and verl's global batch counts are read here too. Nothing here imports a trainer: the
mappings read dicts, OmegaConf nodes and the trainers' config objects by key or attribute. Every error
names the trainer's option, not this library's field.

One module for both trainers, not a part in `integrations/verl/` and one in `integrations/trl/`: `from_verl` /
`from_trl` must work where neither trainer is installed, and importing any module inside those folders first runs
their `__init__`, which imports the trainer (and for verl registers the plugin's names in verl's registries).
"""

import math
from typing import Callable, Dict, Optional, Tuple

from ..config import (
    IS_MODES,
    KL_TYPES,
    LOSS_TYPES,
    RS_OPTIONS,
    SEQUENCE_RATIO_LOSSES,
    PolicyLossConfig,
    RolloutCorrection,
    Threshold,
    is_number,
)

# ---------------------------------------------------------------- the verl plugin's loss-mode names
PLUGIN_PREFIX = "rlkernels"
ROUTES = ("logits", "linear")  # rlkernels_logits[_<type>]: the engine hands the logits; _linear: hidden states


def plugin_loss_modes(loss_types=LOSS_TYPES):
    """(verl loss-mode name, route or None, loss type) of every name the verl plugin registers: `rlkernels`
    is PPO clip ("vanilla"), `rlkernels_<type>` any other loss type, each also on the two routes."""
    for loss_type in loss_types:
        if loss_type in ("ppo_clip", "reinforce"):  # ppo_clip is vanilla; reinforce is verl's own bypass_mode
            continue
        for route in (None,) + ROUTES:
            prefix = PLUGIN_PREFIX if route is None else f"{PLUGIN_PREFIX}_{route}"
            yield (prefix if loss_type == "vanilla" else f"{prefix}_{loss_type}"), route, loss_type


def parse_loss_mode(mode) -> Tuple[Optional[str], str]:
    """(route or None, loss type or verl's own mode) of a verl `policy_loss.loss_mode`: the plugin's names
    (`rlkernels_linear_cispo` -> ("linear", "cispo")), or verl's own ((None, mode))."""
    if not (isinstance(mode, str) and (mode == PLUGIN_PREFIX or mode.startswith(PLUGIN_PREFIX + "_"))):
        return None, mode
    rest = mode[len(PLUGIN_PREFIX) + 1:]
    for route in ROUTES:
        if rest == route or rest.startswith(route + "_"):
            return route, rest[len(route) + 1:] or "vanilla"
    return None, rest or "vanilla"


def _get(node, key, default=None):
    """A trainer config's value: dicts and OmegaConf nodes by key, dataclasses by attribute."""
    if node is None:
        return default
    if isinstance(node, dict) or hasattr(node, "keys"):
        return node.get(key, default)
    return getattr(node, key, default)


def _built(cls, kw: dict, overrides: dict, option_name: Callable[[str], str]):
    """cls(**kw) with `overrides`; an error about a field that came from a trainer's config names that
    trainer's option (`option_name(field)`), not this library's field."""
    try:
        return cls(**kw).with_overrides(**overrides)
    except (TypeError, ValueError) as exc:
        message = str(exc)
        field_name = message.split(":", 1)[0]
        if field_name in kw and field_name not in overrides:
            message = option_name(field_name) + message[len(field_name):]
        raise type(exc)(message) from None


def _renamed(build, field_name: str, argument: str) -> None:
    """Run a constructor check and re-raise its error under the name the caller of from_verl used."""
    try:
        build()
    except (TypeError, ValueError) as exc:
        message = str(exc)
        if message.startswith(field_name):
            message = argument + message[len(field_name):]
        raise type(exc)(message) from None


# ---------------------------------------------------------------- verl: algorithm.rollout_correction
def _parse_verl_bound(name: str, spec) -> Threshold:
    if isinstance(spec, bool):
        raise TypeError(f"{name}: expected a number or a 'lo_hi' string, got {spec!r}")
    if is_number(spec):
        return float(spec)
    if isinstance(spec, str):
        text = spec.strip()
        try:
            if "_" in text:
                lo, hi = text.split("_", 1)
                return (float(lo), float(hi))
            return float(text)
        except ValueError:
            pass
    raise ValueError(f"{name}: expected a number or a 'lo_hi' string, got {spec!r}")


def _verl_rejection(rollout_rs, rollout_rs_threshold) -> Tuple[Tuple[str, Threshold], ...]:
    """verl's comma list of options and its one-or-per-option thresholds -> RolloutCorrection.rs."""
    if rollout_rs in (None, "", "none", "None"):
        return ()
    if not isinstance(rollout_rs, str):
        raise TypeError(f"rollout_rs: expected a comma-separated string of options, got {rollout_rs!r}")
    options = [o.strip() for o in rollout_rs.split(",") if o.strip()]
    unknown = [o for o in options if o not in RS_OPTIONS]
    if unknown:
        raise ValueError(f"rollout_rs: unknown option(s) {unknown}; expected some of {RS_OPTIONS}")
    if rollout_rs_threshold is None:
        raise ValueError("rollout_rs_threshold: required when rollout_rs is set")
    specs = ([rollout_rs_threshold] if is_number(rollout_rs_threshold)
             else [s.strip() for s in str(rollout_rs_threshold).split(",") if s.strip()])
    if len(specs) == 1:
        specs = specs * len(options)
    if len(specs) != len(options):
        raise ValueError(f"rollout_rs_threshold: expected 1 or {len(options)} comma-separated thresholds for "
                         f"rollout_rs={rollout_rs!r}, got {rollout_rs_threshold!r}")
    rs = tuple((opt, _parse_verl_bound(f"rollout_rs_threshold ({opt})", spec)) for opt, spec in zip(options, specs))
    for pair in rs:
        _renamed(lambda pair=pair: RolloutCorrection(rs=(pair,)), f"rs[{pair[0]!r}]",
                 f"rollout_rs_threshold ({pair[0]})")
    _renamed(lambda: RolloutCorrection(rs=rs), "rs", "rollout_rs")
    return rs


VERL_IS_LEVELS = (None, "token", "sequence")


def rollout_correction_from_verl(rollout_is=None, rollout_is_threshold=2.0, rollout_rs=None,
                                 rollout_rs_threshold=None, rollout_is_batch_normalize=False) -> RolloutCorrection:
    """`RolloutCorrection.from_verl` (its docstring is the contract)."""
    if rollout_is is not None and not isinstance(rollout_is, str):  # verl's config node
        node = rollout_is
        if not (isinstance(node, dict) or hasattr(node, "get")):
            raise TypeError(f"rollout_is: expected None, 'token', 'sequence' or verl's rollout_correction config "
                            f"(a mapping), got {node!r}")
        return rollout_correction_from_verl(
            node.get("rollout_is", None), node.get("rollout_is_threshold", 2.0), node.get("rollout_rs", None),
            node.get("rollout_rs_threshold", None), node.get("rollout_is_batch_normalize", False))
    for name, value in (("rollout_is_threshold", rollout_is_threshold), ("rollout_rs_threshold",
                                                                           rollout_rs_threshold)):
        if isinstance(value, bool) or not (value is None or is_number(value) or isinstance(value, str)):
            raise TypeError(f"{name}: expected a number, a 'lo_hi' string or None, got {value!r}")
    if isinstance(rollout_is, str) and rollout_is.strip() in ("", "none", "None"):
        rollout_is = None
    if rollout_is not in VERL_IS_LEVELS:  # verl 0.9.1's RolloutCorrectionConfig: "Must be one of {'token', 'sequence'}"
        raise ValueError(f"rollout_is: verl takes None, 'token' or 'sequence', got {rollout_is!r}"
                         + (" (rlkernels' geometric level is RolloutCorrection(is_level='geometric'), outside "
                            "verl's config)" if rollout_is == "geometric" else ""))
    if not isinstance(rollout_is_batch_normalize, bool):
        raise TypeError(f"rollout_is_batch_normalize: expected a bool, got {rollout_is_batch_normalize!r}")
    # verl computes no weights when the threshold is None, whatever rollout_is says
    is_level = rollout_is if rollout_is_threshold is not None else None
    is_threshold: Threshold = 2.0
    if is_level is not None:
        is_threshold = _parse_verl_bound("rollout_is_threshold", rollout_is_threshold)
        _renamed(lambda: RolloutCorrection(is_threshold=is_threshold), "is_threshold", "rollout_is_threshold")
    return RolloutCorrection(is_level=is_level, is_threshold=is_threshold,
                             is_batch_normalize=rollout_is_batch_normalize,
                             rs=_verl_rejection(rollout_rs, rollout_rs_threshold))


# ---------------------------------------------------------------- verl: the actor config
# verl 0.9.1 losses whose registered function ignores the actor's loss_agg_mode for one of its own
VERL_FIXED_AGGREGATION = {"sapo": "seq-mean-token-mean"}
_VERL_POLICY_OPTIONS = ("clip_cov_ratio", "clip_cov_lb", "clip_cov_ub", "kl_cov_ratio", "ppo_kl_coef",
                        "topr_negative_ratio_lower", "topr_negative_ratio_upper")


def _verl_loss_type(policy, rollout_correction):
    """(loss type, rollout correction) of verl's policy_loss node: a plugin name, verl's own loss, or
    bypass_mode with the correction verl's apply_bypass_mode put under it (an explicit one wins)."""
    _, mode = parse_loss_mode(_get(policy, "loss_mode", "vanilla"))
    if mode == "bypass_mode":
        node = _get(policy, "rollout_correction", None)
        if node is None:
            raise ValueError("actor.policy_loss.rollout_correction: required with loss_mode='bypass_mode' (verl's "
                             "apply_bypass_mode sets it), got None")
        mode = _get(node, "loss_type", "ppo_clip")
        if mode not in ("ppo_clip", "reinforce"):
            raise ValueError(f"actor.policy_loss.rollout_correction.loss_type: expected 'ppo_clip' or "
                             f"'reinforce', got {mode!r}")
        if rollout_correction is None:
            try:
                rollout_correction = rollout_correction_from_verl(node)
            except (TypeError, ValueError) as exc:
                raise type(exc)(f"actor.policy_loss.rollout_correction.{exc}") from None
    elif mode not in LOSS_TYPES:
        raise ValueError(f"actor.policy_loss.loss_mode: {mode!r} is not computed by rlkernels; supported: "
                         f"{tuple(t for t in LOSS_TYPES if t != 'ppo_clip') + ('bypass_mode',)}")
    return mode, rollout_correction


def policy_loss_config_from_verl_actor(actor, rollout_correction: Optional[RolloutCorrection] = None,
                                       **overrides) -> PolicyLossConfig:
    """`PolicyLossConfig.from_verl_actor` (its docstring is the contract)."""
    policy = _get(actor, "policy_loss", {})
    mode, rollout_correction = _verl_loss_type(policy, rollout_correction)
    clip = _get(actor, "clip_ratio", 0.2)
    low, high = _get(actor, "clip_ratio_low", None), _get(actor, "clip_ratio_high", None)
    kw = dict(
        loss_type=mode,
        clip_ratio_low=clip if low is None else low,
        clip_ratio_high=clip if high is None else high,
        clip_ratio_c=_get(actor, "clip_ratio_c", 3.0),
        # verl 0.9.1's sapo aggregates seq-mean-token-mean whatever loss_agg_mode says (an explicit override
        # still wins); geo_mean's own mean ignores it here as in verl
        loss_agg_mode=VERL_FIXED_AGGREGATION.get(mode, _get(actor, "loss_agg_mode", "token-mean")),
        loss_scale_factor=_get(actor, "loss_scale_factor", None),
        entropy_coeff=float(_get(actor, "entropy_coeff", 0.0)),
        tau_pos=_get(actor, "tau_pos", 1.0),
        tau_neg=_get(actor, "tau_neg", 1.05),
        dro_beta=_get(policy, "dro_beta", None),
        rollout_correction=rollout_correction,
    )
    for key in _VERL_POLICY_OPTIONS:
        if _get(policy, key, None) is not None:  # verl's None means its default, which is ours
            kw[key] = _get(policy, key)
    if _get(actor, "use_kl_loss", False):
        kl_type = _get(actor, "kl_loss_type", "low_var_kl")
        if kl_type not in KL_TYPES:
            raise ValueError(f"actor.kl_loss_type: {kl_type!r} is not computed by rlkernels; supported: {KL_TYPES}")
        kw.update(kl_coef=float(_get(actor, "kl_loss_coef", 0.001)), kl_type=kl_type)
    verl_names = {"loss_type": "actor.policy_loss.loss_mode", "kl_coef": "actor.kl_loss_coef"}
    verl_names.update({k: f"actor.policy_loss.{k}" for k in kw if k in ("dro_beta",) + _VERL_POLICY_OPTIONS})
    return _built(PolicyLossConfig, kw, overrides, lambda name: verl_names.get(name, f"actor.{name}"))


def verl_global_counts(info: dict) -> dict:
    """verl's global batch info (the actor config's `global_batch_info`) -> the global counts of
    `PolicyLossConfig.from_verl_actor`. verl divides by the whole batch's count and multiplies by dp_size (so that
    DDP's mean of the ranks' gradients is the whole batch's); dividing by count / dp_size is the same."""
    dp = info.get("dp_size", 1) or 1
    out = {}
    # a count of 0 means the rejection removed every token of the mini-batch: every sum is then 0, and any
    # positive divisor gives the loss 0 with zero gradients (verl divides 0 by 0: NaN)
    if info.get("batch_num_tokens") is not None:
        out["global_num_tokens"] = float(info["batch_num_tokens"]) / dp or 1.0
    if info.get("global_batch_size") is not None:
        out["global_num_seqs"] = float(info["global_batch_size"]) / dp or 1.0
    if info.get("loss_scale_factor") is not None:
        out["loss_scale_factor"] = float(info["loss_scale_factor"])
    return out


# ---------------------------------------------------------------- TRL: GRPOConfig
def rollout_correction_from_trl(vllm_importance_sampling_mode: str = "sequence_mask",
                                vllm_importance_sampling_clip_min: Optional[float] = None,
                                vllm_importance_sampling_clip_max: Optional[float] = 3.0) -> RolloutCorrection:
    """`RolloutCorrection.from_trl` (its docstring is the contract)."""
    level, _, mode = str(vllm_importance_sampling_mode).partition("_")
    if level not in ("token", "sequence") or mode not in IS_MODES:
        raise ValueError("vllm_importance_sampling_mode: expected 'token_truncate', 'token_mask', "
                         f"'sequence_truncate' or 'sequence_mask', got {vllm_importance_sampling_mode!r}")
    lo = 0.0 if vllm_importance_sampling_clip_min is None else vllm_importance_sampling_clip_min
    hi = math.inf if vllm_importance_sampling_clip_max is None else vllm_importance_sampling_clip_max
    try:
        return RolloutCorrection(is_level=level, is_threshold=(lo, hi), is_mode=mode)
    except (TypeError, ValueError) as exc:
        raise type(exc)(str(exc).replace("is_threshold[0] (lo)", "vllm_importance_sampling_clip_min")
                        .replace("is_threshold[1] (hi)", "vllm_importance_sampling_clip_max")
                        .replace("is_threshold", "vllm_importance_sampling_clip_min/max")) from None


# TRL 1.16 loss_type -> (policy loss, aggregation, sequence means over every sequence)
TRL_LOSSES: Dict[str, Tuple[str, str, bool]] = {
    "grpo": ("vanilla", "seq-mean-token-mean", True), "sapo": ("sapo", "seq-mean-token-mean", True),
    "bnpo": ("vanilla", "token-mean", False), "dapo": ("vanilla", "token-mean", False),
    "dr_grpo": ("vanilla", "seq-mean-token-sum-norm", True), "cispo": ("cispo", "token-mean", False),
    "vespo": ("vespo", "token-mean", False), "luspo": ("luspo", "seq-mean-token-sum", True),
}
_TRL_NAMES = {"clip_ratio_low": "epsilon", "clip_ratio_high": "epsilon_high", "clip_ratio_c": "delta",
              "cispo_cap": "epsilon_high", "kl_coef": "beta", "tau_pos": "sapo_temperature_pos",
              "tau_neg": "sapo_temperature_neg", "loss_scale_factor": "max_completion_length",
              "ratio_level": "importance_sampling_level", "entropy_coeff": "entropy_coef"}


def _trl_loss(get) -> Tuple[str, str, bool]:
    trl_loss = get("loss_type", "dapo")
    if trl_loss not in TRL_LOSSES:
        raise ValueError(f"loss_type: TRL's {trl_loss!r} is not computed by rlkernels; supported: {tuple(TRL_LOSSES)}")
    value = get("top_entropy_quantile")
    if value is not None and value < 1.0:
        raise ValueError(f"top_entropy_quantile: {value!r} is not supported by PolicyLossConfig.from_trl (TRL's "
                         "trainer state decides it per step); compute it in the trainer")
    return TRL_LOSSES[trl_loss]


def policy_loss_config_from_trl(args, **overrides) -> PolicyLossConfig:
    """`PolicyLossConfig.from_trl` (its docstring is the contract)."""
    def get(key, default=None):
        return _get(args, key, default)

    loss_type, agg, over_all = _trl_loss(get)
    eps_lo = get("epsilon", 0.2)
    eps_hi = get("epsilon_high", None)
    eps_hi = eps_lo if eps_hi is None else eps_hi
    delta = get("delta", None)
    ppo_clip = loss_type in ("vanilla", "luspo")
    if delta is not None and ppo_clip and delta <= 1 + eps_hi:
        raise ValueError(f"delta: expected > 1 + epsilon_high = {1 + eps_hi} (TRL's two-sided clip then equals "
                         f"the dual clip c = delta), got {delta!r}")
    level = get("importance_sampling_level", "token")
    kw = dict(
        loss_type=loss_type, loss_agg_mode=agg, seq_mean_over="all" if over_all else "nonempty",
        clip_ratio_low=eps_lo, clip_ratio_high=eps_hi if loss_type != "cispo" else 0.2,
        clip_ratio_c=delta if ppo_clip else None, cispo_cap=eps_hi if loss_type == "cispo" else None,
        ratio_level=level if loss_type in SEQUENCE_RATIO_LOSSES else "token", log_ratio_clamp=None,
        kl_coef=float(get("beta", 0.0)), kl_type="k3_unclamped",
        kl_bias_correction=bool(get("use_bias_correction_kl", False)),
        off_policy_mask_threshold=get("off_policy_mask_threshold", None),
        tau_pos=get("sapo_temperature_pos", 1.0), tau_neg=get("sapo_temperature_neg", 1.05),
        vespo_k_pos=get("vespo_k_pos", 2.0), vespo_lambda_pos=get("vespo_lambda_pos", 3.0),
        vespo_k_neg=get("vespo_k_neg", 3.0), vespo_lambda_neg=get("vespo_lambda_neg", 2.0),
        entropy_coeff=float(get("entropy_coef", 0.0) or 0.0), entropy_agg_mode="token-mean",
        adaptive_entropy=bool(get("use_adaptive_entropy", False)),
        temperature=get("temperature", 1.0),
    )
    if get("loss_type", "dapo") == "dr_grpo":
        kw["loss_scale_factor"] = get("max_completion_length", None)
    if get("use_vllm", False) and get("vllm_importance_sampling_correction", True):
        kw["rollout_correction"] = rollout_correction_from_trl(
            get("vllm_importance_sampling_mode", "sequence_mask"), get("vllm_importance_sampling_clip_min"),
            get("vllm_importance_sampling_clip_max", 3.0))
    return _built(PolicyLossConfig, kw, overrides, lambda name: _TRL_NAMES.get(name, name))
