"""rlkernels inside slime (and miles): a custom loss for `--loss-type custom_loss`.

    --loss-type custom_loss --custom-loss-function-path rlkernels.integrations.slime.policy_loss_function
    --custom-megatron-init-path rlkernels.integrations.slime.install     # slime's log-prob passes too

slime calls `policy_loss_function(args, batch, logits, sum_of_sample_mean) -> (loss, log)` with Megatron's packed
logits `[1, T, V]` (float32; `V / tp` per rank under tensor parallelism) and per-sample lists. This function
computes slime's `policy_loss_function` with `rlkernels.decoupled_ppo_loss` from the logits:
- the response rows as slime's `get_responses` takes them: row t predicts token t + 1, sample i's response rows are
  `[end - R - 1, end - 1)`, the logits divided by `--rollout-temperature` (the kernel's `temperature`);
- under tensor parallelism the vocabulary-parallel pass (`tp_group=` Megatron's tensor-parallel group);
- `--eps-clip`, `--eps-clip-high`, `--eps-clip-c` (PPO clip, dual clip; the ratio unclamped, as slime's);
  `--advantage-estimator cispo` (CISPO) and `gspo` (the ratio of each sample's mean log-ratio, `ratio_level=
  "sequence"`); `--use-rollout-logprobs` (the ratio against the sampler: bypass mode); `--use-tis` with
  `--tis-clip(-low)` (token TIS) or slime's `icepop_function` (IcePop); `--use-opsm` / `--opsm-delta`;
  `--entropy-coef`; `--use-kl-loss`, `--kl-loss-coef`, `--kl-loss-type` k1 | k2 | k3 | low_var_kl and
  `--use-unbiased-kl`;
- slime's reducer: each sample's masked token mean, **summed** over the samples (`seq-mean-token-mean` with
  `global_num_seqs=1`), or `--calculate-per-token-loss` (token sums); slime then rescales for Megatron itself.
Refused, naming slime's option: context parallelism, rollout top-p replay, a custom reducer or other custom TIS
functions, OPSM with TIS (slime's OPSM reads π_old, rlkernels' the sampler's log-probs when it has them),
`--use-unbiased-kl` with `low_var_kl` (slime clamps r·k3, rlkernels k3 before the ratio), and
multi-sample rollouts whose `rollout_mask_sums` differ from a sample's own mask total (slime divides each sample
by its rollout's total; rlkernels' sequence mean by the sample's own tokens).
The log: slime's keys `loss`, `pg_loss`, `entropy_loss`, `pg_clipfrac`, `ppo_kl` (+ `kl_loss`) as device tensors, with
slime's values (`pg_clipfrac` and `ppo_kl` reduced as slime reduces them: per-sample means, summed). With
RLKERNELS_LOGPROB_PARITY=1, `logprob_parity/...` of slime's `log_probs` against its `rollout_log_probs` (parity.py).
"""

from typing import List, Optional

import torch

from ..api import decoupled_ppo_loss, token_logprobs
from ..config import PolicyLossConfig, RolloutCorrection
from .activation import Rebinding
from .parity import parity_metrics

ICEPOP = "slime.backends.megatron_utils.loss.icepop_function"
VANILLA_TIS = "slime.backends.megatron_utils.loss.vanilla_tis_function"
_KL_TYPES = {"k1": "k1", "k2": "k2", "k3": "k3_unclamped", "low_var_kl": "k3"}



def _opt(args, name, default=None):
    return getattr(args, name, default)


def _tis_kind(args) -> str:
    path = _opt(args, "custom_tis_function_path")
    name = path if isinstance(path, str) or path is None else f"{path.__module__}.{path.__name__}"
    if path is None or name == VANILLA_TIS or name.endswith(".vanilla_tis_function"):
        return "tis"
    if name == ICEPOP or name.endswith(".icepop_function"):
        return "icepop"
    raise ValueError(f"custom_tis_function_path: {name!r} is not slime's vanilla_tis_function or icepop_function")


def config_from_slime(args) -> PolicyLossConfig:
    """The `PolicyLossConfig` of slime's arguments (an argparse namespace)."""
    if _opt(args, "rollout_top_p", 1.0) != 1.0:
        raise ValueError("rollout_top_p: slime's top-p replay of the logits is not supported; use 1.0")
    if _opt(args, "custom_pg_loss_reducer_function_path") is not None:
        raise ValueError("custom_pg_loss_reducer_function_path: a custom reducer is not supported")
    if _opt(args, "use_opsm", False) and _opt(args, "use_tis", False):
        raise ValueError("use_opsm with use_tis: slime's OPSM reads pi_old against the current policy, rlkernels' "
                         "the sampler's log-probs when it has them")
    estimator = _opt(args, "advantage_estimator", "grpo")
    eps = _opt(args, "eps_clip", 0.2)
    eps_high = _opt(args, "eps_clip_high") or eps
    rc = None
    if _opt(args, "use_tis", False):
        bounds = (float(_opt(args, "tis_clip_low", 0.0)), float(_opt(args, "tis_clip", 2.0)))
        rc = RolloutCorrection(is_level="token", is_threshold=bounds,
                               is_mode="mask" if _tis_kind(args) == "icepop" else "truncate")
    kl_coef = _opt(args, "kl_loss_coef", 0.0) if _opt(args, "use_kl_loss", False) else 0.0
    kl_type = _opt(args, "kl_loss_type", "k1")
    if kl_type not in _KL_TYPES:
        raise ValueError(f"kl_loss_type: expected one of {sorted(_KL_TYPES)}, got {kl_type!r}")
    if kl_coef and kl_type == "low_var_kl" and _opt(args, "use_unbiased_kl", False):
        raise ValueError("use_unbiased_kl with kl_loss_type='low_var_kl': slime clamps r x k3 to [-10, 10], "
                         "rlkernels clamps k3 before the ratio; use kl_loss_type='k3' (unclamped) or no ratio")
    return PolicyLossConfig(
        loss_type="cispo" if estimator == "cispo" else "vanilla", clip_ratio_low=eps, clip_ratio_high=eps_high,
        clip_ratio_c=_opt(args, "eps_clip_c"), log_ratio_clamp=None,
        ratio_level="sequence" if estimator == "gspo" else "token",
        loss_agg_mode="token-sum" if _opt(args, "calculate_per_token_loss", False) else "seq-mean-token-mean",
        global_num_seqs=1.0, temperature=float(_opt(args, "rollout_temperature", 1.0)),
        entropy_coeff=float(_opt(args, "entropy_coef", 0.0)), compute_entropy=True,
        kl_coef=float(kl_coef), kl_type=_KL_TYPES[kl_type], kl_bias_correction=bool(_opt(args, "use_unbiased_kl")),
        off_policy_mask_threshold=_opt(args, "opsm_delta") if _opt(args, "use_opsm", False) else None,
        rollout_correction=rc)


def _cat(values: Optional[List[torch.Tensor]]) -> Optional[torch.Tensor]:
    return torch.cat(list(values), 0) if values else None


def _tp_group():
    """Megatron's tensor-parallel group when it has more than one rank, else None."""
    try:
        from megatron.core import parallel_state as mpu
    except ImportError:
        return None
    if not mpu.model_parallel_is_initialized():
        return None
    if mpu.get_context_parallel_world_size() > 1:
        raise ValueError("context parallelism: slime's CP-split response windows are not supported")
    return mpu.get_tensor_model_parallel_group() if mpu.get_tensor_model_parallel_world_size() > 1 else None


def _response_rows(unconcat_tokens, total_lengths, response_lengths, device):
    """slime's `get_responses` windows: the packed rows of every sample's response (row t predicts token t + 1:
    `[end - R - 1, end - 1)`) and the tokens they predict, concatenated."""
    rows, labels, offset = [], [], 0
    for tokens, total, response in zip(unconcat_tokens, total_lengths, response_lengths):
        start = offset + total - response - 1
        rows.append(torch.arange(start, start + response, device=device))
        labels.append(tokens[total - response:total].to(device))
        offset += total
    return torch.cat(rows), torch.cat(labels)


def get_log_probs_and_entropy(logits: torch.Tensor, *, args, unconcat_tokens: list, total_lengths: list,
                              response_lengths: list, with_entropy: bool = False, non_loss_data: bool = True,
                              **top_p):
    """slime's `get_log_probs_and_entropy` (`slime/backends/megatron_utils/loss.py`: the old and reference log-prob
    passes, `forward_only`, and the update pass of slime's own loss), by one `rlkernels.token_logprobs` pass over
    the packed logits: the temperature inside the kernel (slime divides into a new [T, V] float32 tensor), no
    softmax saved, the rows outside every response skipped (`ignore_index`). Returns slime's `(empty,
    {"log_probs": [R_i], "entropy": [R_i]})`; the entropy carries a gradient only with `--entropy-coef` (as
    slime's). A call with slime's top-p replay (`top_p_token_ids` / `top_p_token_offsets`, `--rollout-top-p` < 1)
    runs slime's own function: rlkernels does not renormalise over slime's kept set here."""
    if any(value is not None for value in top_p.values()):
        if _LOG_PROBS.original is None:
            raise ValueError("rollout_top_p: slime's top-p replay of the logits is not supported; use 1.0")
        return _LOG_PROBS.original(logits, args=args, unconcat_tokens=unconcat_tokens, total_lengths=total_lengths,
                                   response_lengths=response_lengths, with_entropy=with_entropy,
                                   non_loss_data=non_loss_data, **top_p)
    assert non_loss_data
    if logits.dim() != 3 or logits.size(0) != 1:
        raise ValueError(f"logits: expected slime's packed [1, T, V], got {tuple(logits.shape)}")
    flat = logits.squeeze(0)
    rows, labels = _response_rows(unconcat_tokens, total_lengths, response_lengths, flat.device)
    targets = torch.full(flat.shape[:1], -100, dtype=torch.long, device=flat.device).index_copy_(0, rows, labels)
    stats = token_logprobs(flat, targets, temperature=float(_opt(args, "rollout_temperature", 1.0)),
                           compute_entropy=with_entropy, tp_group=_tp_group(), validate=False)
    res = {"log_probs": list(stats.logprobs.index_select(0, rows).split(list(response_lengths)))}
    if with_entropy:
        entropy = stats.entropy if _opt(args, "entropy_coef", 0.0) != 0 else stats.entropy.detach()
        res["entropy"] = list(entropy.index_select(0, rows).split(list(response_lengths)))
    return torch.empty((0,), device=flat.device), res


# where slime binds get_log_probs_and_entropy: the loss module defines it, the actor's compute_log_prob imports it
_LOG_PROBS = Rebinding("get_log_probs_and_entropy", get_log_probs_and_entropy,
                       ("slime.backends.megatron_utils.loss", "slime.backends.megatron_utils.actor"))


def install(args=None) -> None:
    """slime's old and reference log-prob passes through `get_log_probs_and_entropy` above: rebinds the name in
    `slime.backends.megatron_utils.loss` and `.actor`, now or when they are imported (activation.py). In each
    Megatron actor by slime's own hook, which passes its `args` (not read): `--custom-megatron-init-path
    rlkernels.integrations.slime.install`."""
    del args
    _LOG_PROBS.install()


def uninstall() -> None:
    """slime's own `get_log_probs_and_entropy` back wherever `install()` put rlkernels'."""
    _LOG_PROBS.uninstall()


def _slime_ratio_log(args, config, logprobs, reference, advantages, masks, response_lengths):
    """slime's `pg_clipfrac` and `ppo_kl` with slime's values: per token from the detached log-probs (ppo_kl = old -
    new, a sample's mean of it under GSPO; the clipped fraction as slime's PPO or CISPO counts it), then slime's
    reducer: each sample's masked mean, summed over the samples (token sums with `--calculate-per-token-loss`)."""
    with torch.no_grad():
        lp = logprobs.detach()
        ppo_kl = torch.zeros_like(lp) if reference is None else reference.detach().to(lp.dtype) - lp
        weights = torch.cat(masks).to(lp.dtype)
        counts = torch.stack([m.sum() for m in masks]).to(lp.dtype)
        sample = torch.repeat_interleave(torch.arange(len(masks), device=lp.device),  # output_size: no host read
                                         torch.as_tensor(response_lengths, device=lp.device), output_size=lp.shape[0])

        def per_sample_sums(x):
            return torch.zeros(len(masks), dtype=lp.dtype, device=lp.device).index_add_(0, sample, x * weights)

        if config.ratio_level == "sequence":  # GSPO: every token takes its sample's mean log-ratio
            ppo_kl = (per_sample_sums(ppo_kl) / counts.clamp(min=1))[sample]
        ratio = torch.exp(-ppo_kl)
        clamped = ratio.clamp(1 - config.clip_ratio_low, 1 + config.clip_ratio_high)
        if config.loss_type == "cispo":
            clipped = clamped != ratio
        else:
            clipped = -clamped * advantages > -ratio * advantages
        denominators = 1.0 if _opt(args, "calculate_per_token_loss", False) else counts.clamp(min=1)
        return {name: (per_sample_sums(x) / denominators).sum()
                for name, x in (("pg_clipfrac", clipped.to(lp.dtype)), ("ppo_kl", ppo_kl))}


def policy_loss_function(args, batch: dict, logits: torch.Tensor, sum_of_sample_mean=None, tp_group=None):
    """slime's `policy_loss_function`, by rlkernels (module docstring). `sum_of_sample_mean` (slime's reducer) is
    not called: the aggregation is rlkernels'."""
    config = config_from_slime(args)
    total_lengths, response_lengths = list(batch["total_lengths"]), list(batch["response_lengths"])
    masks = [m.bool() for m in batch["loss_masks"]]
    denominators = batch.get("rollout_mask_sums")
    if denominators is not None and not config.loss_agg_mode == "token-sum":
        own = torch.stack([m.sum() for m in masks]).to(torch.float64)
        if not torch.equal(torch.as_tensor(denominators, dtype=torch.float64, device=own.device).reshape(-1), own):
            raise ValueError("rollout_mask_sums: a rollout of several samples (slime divides each sample by its "
                             "rollout's token total); rlkernels divides by the sample's own tokens")
    rows_t, labels = _response_rows(batch["unconcat_tokens"], total_lengths, response_lengths, logits.device)
    response_logits = logits.reshape(-1, logits.shape[-1]).index_select(0, rows_t)
    cu = torch.zeros(len(response_lengths) + 1, dtype=torch.int64, device=logits.device)
    cu[1:] = torch.cumsum(torch.as_tensor(response_lengths, device=logits.device), 0)

    use_rollout = bool(_opt(args, "use_rollout_logprobs", False))
    old = _cat(batch.get("rollout_log_probs") if use_rollout else batch.get("log_probs"))
    rollout = None
    if use_rollout:  # the ratio against the sampler: bypass mode
        old, rollout = None, old
    elif config.rollout_correction is not None:
        rollout = _cat(batch["rollout_log_probs"])
        if old is None:  # slime's TIS falls back on the current log-probs, detached: the same as the proximal
            raise ValueError("log_probs: use_tis needs the old log-probs in the batch (slime's recomputed ones)")
    out = decoupled_ppo_loss(
        response_logits, labels, _cat(batch["advantages"]), torch.cat(masks),
        old_logprobs=None if old is None else old.detach(), rollout_logprobs=None if rollout is None else rollout,
        ref_logprobs=_cat(batch.get("ref_log_probs")) if config.kl_coef else None, cu_seqlens=cu, config=config,
        # the response rows are this function's own copy, read by nothing after: their storage takes the gradient
        inplace_backward=True, tp_group=tp_group if tp_group is not None else _tp_group())
    m = out.metrics
    reference = old if old is not None else rollout  # what slime's ppo_kl is of (the sampler's in bypass mode)
    log = {"loss": out.loss.detach(), "pg_loss": m["actor/pg_loss"], "entropy_loss": m["actor/entropy"],
           **_slime_ratio_log(args, config, out.logprobs, reference, _cat(batch["advantages"]), masks,
                              response_lengths)}
    if "actor/kl_loss" in m:
        log["kl_loss"] = m["actor/kl_loss"]
    if old is not None:  # opt-in: pi_old against the sampler (parity.py)
        log.update(parity_metrics(old, _cat(batch.get("rollout_log_probs")), torch.cat(masks), cu))
    return out.loss, log
