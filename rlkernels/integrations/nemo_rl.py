"""rlkernels inside NeMo-RL: a `LossFunction` that stands in for `ClippedPGLossFn`.

    from rlkernels.integrations.nemo_rl import ClippedPGLossFn
    (policy, ..., loss_fn, ...) = grpo.setup(...)
    loss_fn = ClippedPGLossFn(master_config["loss_fn"])                      # input_type LOGPROB
    loss_fn = ClippedPGLossFn(master_config["loss_fn"], input_type="logit")  # the fused pass from the logits
    grpo_train(policy, ..., loss_fn, ...)

NeMo-RL has no loss registry: `grpo.setup()` returns the loss function `grpo_train(...)` then uses, so the one
line replaces it in the run script. The class has NeMo-RL's `LossFunction` protocol (`loss_type`, `input_type`,
`__call__(data, global_valid_seqs, global_valid_toks, **inputs) -> (loss, metrics)`) and reads
`ClippedPGLossConfig`'s names (a dict or an object):
- `ratio_clip_min/max`, `ratio_clip_c` (dual clip), the unclamped ratio to `prev_logprobs`;
  `sequence_level_importance_ratios` (GSPO: the ratio of each sequence's mean log-ratio and sequence-level IS
  weights); `use_cispo`; `disable_ppo_ratio` (REINFORCE: −A·ℓθ); `force_on_policy_ratio`;
- `use_importance_sampling_correction` with `truncated_importance_sampling_type` None (untruncated π_prev/π_gen),
  "tis" (truncated to [min, max]), "icepop" (0 outside) or "seq-mask-tis" (sequences whose geometric-mean ratio
  leaves [min, max] dropped, survivors keep the untruncated weight);
- `token_level_loss`: the token mean over `global_valid_toks`, or the mean of sequence means over
  `global_valid_seqs` (NeMo-RL's global denominators, passed in);
- `reference_policy_kl_penalty` with `reference_policy_kl_type` k1 | k2 | k3, the KL term times
  exp(ℓθ − sg ℓθ) as NeMo-RL weighs it (`kl_score_gradient`): k3 with its default clamps (20 on the log-ratio,
  10 on the value) is rlkernels' k3; k1 and k2 are unclamped here (NeMo-RL clamps them at the same values).
Refused, naming NeMo-RL's option: `use_on_policy_kl_approximation` (its KL weight is against the generator while
the ratio is against π_prev), other KL clamp values, `positive_example_nll_weight`, `ratio_clip_c` with
`disable_ppo_ratio`.
`input_type="logit"`: the loss takes the model's logits `[B, T, V]` (row t predicts `input_ids[:, t + 1]`) and runs
`rlkernels.decoupled_ppo_loss` on them (`tp_group=` for vocabulary-parallel logits). Metrics are Python floats, as
NeMo-RL's (one synchronisation): every metric NeMo-RL's loss logs, under its name with its value (`nemo_rl_metrics`:
`probs_ratio*`, `token_mult_prob_error`, `gen_kl_error`, `policy_kl_error`, `js_divergence_error`, `kl_penalty`,
`sampling_importance_ratio`, `is_oob_ratio`, `approx_entropy`, `num_valid_samples`), rlkernels' own beside them;
with RLKERNELS_LOGPROB_PARITY=1 also `logprob_parity/...` of `prev_logprobs` against `generation_logprobs`
(parity.py). The logits are passed whole (the last position's label is `ignore_index`), and the backward writes the
gradient into their storage (`inplace_backward=True`, the default) when they are a computed tensor (not a leaf: a
caller's own) that owns it: NeMo-RL reads them after the
loss only in the forward (the Megatron path's `DraftLossWrapper` takes its teacher as a rolled copy,
`loss/utils.py:173` @7ea279ab), and the bumped version counter makes any later read by autograd fail loudly. A view
into a larger tensor (`SequencePackingLossWrapper`'s per-sequence slices) takes a new gradient: the view's backward
allocates the whole tensor's gradient anyway, and the slices share one version counter.

The log-prob routes (`install()`; the loss object installs them in each process that builds or unpickles it, so in
NeMo-RL's Ray workers, unless `routes=False`): AutoModel's prev and reference log-probs
(`LogprobsPostProcessor._compute_local_logprobs`) and the update forward of an input_type LOGPROB loss
(`get_next_token_logprobs_from_logits`, local branch) by one rlkernels pass, where NeMo-RL makes a float32 copy of
the logits and takes their float32 log-softmax (saved for the backward in the update). Top-k / top-p sampling
parameters, vocabulary- or context-parallel groups and DTensor logits run NeMo-RL's own code. The routes reach a
worker when the loss object does, at its first `train` call: that step's prev and reference log-probs, computed
before it, are NeMo-RL's own unless the workers install the routes at start (`install` as the Ray job's
`worker_process_setup_hook`, activation.py).
"""

import math
from typing import Optional

import torch
import torch.nn.functional as F

from ..api import decoupled_ppo_loss, metrics_to_floats, policy_loss, token_logprobs
from ..config import PolicyLossConfig, RolloutCorrection
from .activation import Rebinding
from .parity import parity_metrics

TOKEN_LEVEL, SEQUENCE_LEVEL = "token_level", "sequence_level"  # NeMo-RL's LossType values
_KL_TYPES = ("k1", "k2", "k3")


def _get(cfg, name, default=None):
    return cfg.get(name, default) if isinstance(cfg, dict) else getattr(cfg, name, default)


def _nemo_enums():
    """NeMo-RL's LossType / LossInputType where it is importable, else their string values."""
    try:
        from nemo_rl.algorithms.loss.interfaces import LossInputType, LossType
    except ImportError:
        return None, None
    return LossType, LossInputType


def rollout_correction_from_nemo_rl(cfg) -> Optional[RolloutCorrection]:
    if not _get(cfg, "use_importance_sampling_correction", False):
        return None
    level = "sequence" if _get(cfg, "sequence_level_importance_ratios", False) else "token"
    kind = _get(cfg, "truncated_importance_sampling_type")
    high = _get(cfg, "truncated_importance_sampling_ratio")
    low = _get(cfg, "truncated_importance_sampling_ratio_min")
    if high is None or kind is None:  # NeMo-RL applies its weights only truncated when a ratio is set
        return RolloutCorrection(is_level=level, is_threshold=(0.0, math.inf), is_mode="mask")
    if kind == "tis":
        return RolloutCorrection(is_level=level, is_threshold=(low or 0.0, high), is_mode="truncate")
    if kind == "icepop":
        return RolloutCorrection(is_level=level, is_threshold=(low, high), is_mode="mask")
    if kind == "seq-mask-tis":
        return RolloutCorrection(is_level=level, is_threshold=(0.0, math.inf), is_mode="mask",
                                 rs={"seq_mean_k1": (low, high)}, rs_mode="zero_weight")
    raise ValueError(f"truncated_importance_sampling_type: expected None, 'tis', 'icepop' or 'seq-mask-tis', "
                     f"got {kind!r}")


def config_from_nemo_rl(cfg) -> PolicyLossConfig:
    """The `PolicyLossConfig` of NeMo-RL's `ClippedPGLossConfig` (without the global denominators)."""
    if _get(cfg, "use_on_policy_kl_approximation", False):
        raise ValueError("use_on_policy_kl_approximation: NeMo-RL weighs the KL by pi / pi_gen while the ratio is "
                         "against pi_prev; rlkernels' KL ratio is the loss's own")
    if (_get(cfg, "positive_example_nll_weight", 0.0) or 0.0) > 0:
        raise ValueError("positive_example_nll_weight: VAPO's NLL term on correct samples is not supported")
    if (_get(cfg, "kl_input_clamp_value", 20.0), _get(cfg, "kl_output_clamp_value", 10.0)) != (20.0, 10.0):
        raise ValueError("kl_input_clamp_value / kl_output_clamp_value: only NeMo-RL's defaults (20, 10) are "
                         "rlkernels' k3 clamps")
    disable_ratio = _get(cfg, "disable_ppo_ratio", False)
    if disable_ratio and _get(cfg, "ratio_clip_c") is not None:
        raise ValueError("ratio_clip_c with disable_ppo_ratio: a dual clip on -A lp has no rlkernels form")
    kl_type = _get(cfg, "reference_policy_kl_type", "k3")
    if kl_type not in _KL_TYPES:
        raise ValueError(f"reference_policy_kl_type: expected one of {_KL_TYPES}, got {kl_type!r}")
    penalty = 0.0 if _get(cfg, "use_kl_in_reward", False) else _get(cfg, "reference_policy_kl_penalty", 0.01)
    loss_type = "gpg" if disable_ratio else ("cispo" if _get(cfg, "use_cispo", False) else "vanilla")
    sequence_ratio = _get(cfg, "sequence_level_importance_ratios", False)
    return PolicyLossConfig(
        loss_type=loss_type, clip_ratio_low=_get(cfg, "ratio_clip_min", 0.2),
        clip_ratio_high=_get(cfg, "ratio_clip_max", 0.2), clip_ratio_c=_get(cfg, "ratio_clip_c"),
        log_ratio_clamp=None, ratio_level="sequence" if sequence_ratio and loss_type == "vanilla" else "token",
        loss_agg_mode="token-mean" if _get(cfg, "token_level_loss", True) else "seq-mean-token-mean",
        kl_coef=float(penalty), kl_type=kl_type, kl_score_gradient=bool(penalty),
        rollout_correction=rollout_correction_from_nemo_rl(cfg))


class ClippedPGLossFn:
    """NeMo-RL's `ClippedPGLossFn` (same config), computed by rlkernels; a NeMo-RL `LossFunction`. `input_type`
    "logprob" (NeMo-RL's) or "logit"; `tp_group` for vocabulary-parallel logits; `inplace_backward` lets the logits
    route's gradient take the logits' storage where they are a computed tensor that owns it; `routes` installs the
    log-prob routes (module docstring) where the object is built and where it is unpickled."""

    def __init__(self, cfg=None, use_fused_linear_logprobs: bool = False, input_type: str = "logprob",
                 tp_group=None, inplace_backward: bool = True, routes: bool = True):
        cfg = {} if cfg is None else cfg
        self.inplace_backward, self.routes = inplace_backward, routes
        self.cfg, self.config = cfg, config_from_nemo_rl(cfg)
        self.force_on_policy_ratio = bool(_get(cfg, "force_on_policy_ratio", False))
        if input_type not in ("logprob", "logit"):
            raise ValueError(f"input_type: expected 'logprob' or 'logit', got {input_type!r}")
        self.tp_group = tp_group
        loss_type_enum, input_type_enum = _nemo_enums()
        level = TOKEN_LEVEL if self.config.loss_agg_mode == "token-mean" else SEQUENCE_LEVEL
        self.loss_type = level if loss_type_enum is None else loss_type_enum(level)
        self.input_type = input_type if input_type_enum is None else getattr(input_type_enum, input_type.upper())
        self.use_fused_linear_logprobs = use_fused_linear_logprobs
        if routes:
            install()

    def __setstate__(self, state):
        """Unpickled in a NeMo-RL worker (the loss object travels to its Ray actors): the log-prob routes there too.
        An object pickled before these options existed gets their defaults."""
        self.__dict__.update({"inplace_backward": True, "routes": True, **state})
        if self.routes:
            install()

    def __call__(self, data, global_valid_seqs, global_valid_toks, next_token_logprobs=None, logits=None, **_):
        token_mask = data["token_mask"][:, 1:].bool() & data["sample_mask"].bool()[:, None]
        counts = dict(global_num_tokens=float(global_valid_toks)) if self.config.loss_agg_mode == "token-mean" \
            else dict(global_num_seqs=float(global_valid_seqs))
        config = self.config.with_overrides(**counts)
        rc = config.rollout_correction
        kw = dict(advantages=data["advantages"][:, 1:], response_mask=token_mask,
                  rollout_logprobs=None if rc is None else data["generation_logprobs"][:, 1:],
                  ref_logprobs=data["reference_policy_logprobs"][:, 1:] if config.kl_coef else None, config=config)
        if logits is not None:
            if self.force_on_policy_ratio and rc is not None:
                raise ValueError("force_on_policy_ratio with importance sampling from the logits: pass log-probs")
            out = self._from_logits(logits, data["input_ids"], None if self.force_on_policy_ratio
                                    else data["prev_logprobs"][:, 1:], kw)
        else:
            lp = next_token_logprobs
            old = lp.detach() if self.force_on_policy_ratio else data["prev_logprobs"][:, 1:]
            out = policy_loss(lp, old_logprobs=old, **kw)
        prev, generated = data.get("prev_logprobs"), data.get("generation_logprobs")
        report = {} if prev is None or generated is None else parity_metrics(prev[:, 1:], generated[:, 1:],
                                                                             token_mask)  # opt-in: parity.py
        own = nemo_rl_metrics(self.cfg, config, data, out.logprobs, global_valid_seqs, global_valid_toks)
        metrics = metrics_to_floats({**out.metrics, **own, **report, "loss": out.loss.detach()})
        metrics["actor_loss"] = metrics.get("actor/pg_loss", 0.0)
        return out.loss, metrics

    def _from_logits(self, logits, input_ids, old, kw):
        """The loss over the whole [B, T, V] logits, row t labelled input_ids[:, t + 1] and the last row left out, so
        the gradient can take the logits' storage (a slice's backward would allocate the whole tensor's); the
        per-token inputs get a zero last column, the log-probs lose it again."""
        labels = F.pad(input_ids[:, 1:], (0, 1), value=-100)  # the last row: no token follows
        kw = {name: value if name == "config" or value is None else F.pad(value, (0, 1)) for name, value in kw.items()}
        inplace = self.inplace_backward and self.tp_group is None and _owns(logits)  # not with tp_group
        out = decoupled_ppo_loss(logits, labels, old_logprobs=None if old is None else F.pad(old, (0, 1)),
                                 tp_group=self.tp_group, inplace_backward=inplace, **kw)
        return out._replace(**{name: getattr(out, name)[:, :-1] for name in ("logprobs", "entropy", "is_weights",
                                                                             "mask") if getattr(out, name) is not None})


def _owns(logits: torch.Tensor) -> bool:
    """Whether the gradient may take the logits' storage: they are a computed tensor (a model's output; a leaf is
    the caller's own, which it may read after) and their storage's only tensor (not a slice of a larger one)."""
    return logits.grad_fn is not None and logits.storage_offset() == 0 and logits.is_contiguous() and \
        logits.untyped_storage().nbytes() == logits.numel() * logits.element_size()


# The log-prob routes. NeMo-RL's local log-prob code: a float32 copy of the logits, their float32 log-softmax
# (chunked along the sequence by `logprob_chunk_size` in the prev / reference pass), a gather.

def _filters(sampling_params) -> bool:
    """NeMo-RL's `need_top_k_or_top_p_filtering` (`algorithms/logits_sampling_utils.py` @7ea279ab): top-k > 0 or
    top-p != 1 renormalise the log-probs over NeMo-RL's kept set, which the routes leave to NeMo-RL."""
    if sampling_params is None:
        return False
    top_k, top_p = getattr(sampling_params, "top_k", None), getattr(sampling_params, "top_p", 1.0)
    return (top_k is not None and top_k > 0) or (top_p is not None and top_p != 1.0)


def _is_dtensor(x) -> bool:
    return torch.distributed.is_available() and isinstance(x, torch.distributed.tensor.DTensor)


def _next_token_logprobs(logits: torch.Tensor, next_tokens: torch.Tensor) -> torch.Tensor:
    """[B, n] float32: row t of `logits` [B, L >= n, V] at next_tokens[:, t], one rlkernels pass over the logits as
    they are, rows past n labelled out: a slice of the logits would cost its own gradient, which its backward then
    copies into a new one of the whole tensor."""
    labels = next_tokens.to(logits.device)
    if logits.shape[1] < labels.shape[1]:
        raise ValueError(f"next_token_logits: {logits.shape[1]} positions for {labels.shape[1]} next tokens")
    labels = F.pad(labels, (0, logits.shape[1] - labels.shape[1]), value=-100)
    # validate: a token id outside the vocabulary is refused (NeMo-RL's gather raises), not scored 0
    return token_logprobs(logits, labels).logprobs[:, :next_tokens.shape[1]].float().contiguous()


def get_next_token_logprobs_from_logits(input_ids, next_token_logits, seq_index=None, vocab_parallel_rank=None,
                                        vocab_parallel_group=None, context_parallel_group=None, sampling_params=None,
                                        chunk_size=None):
    """NeMo-RL's `get_next_token_logprobs_from_logits` (`distributed/model_utils.py` @7ea279ab), which
    `prepare_loss_input` calls for the update forward of an input_type LOGPROB loss: [B, T - 1] float32 log-probs of
    input_ids[:, 1:]. Its local branch (no vocabulary- or context-parallel group, no DTensor, no top-k / top-p) by
    one rlkernels pass, `chunk_size` not needed; every other branch is NeMo-RL's own."""
    if vocab_parallel_group is None and context_parallel_group is None and not _is_dtensor(next_token_logits) \
            and not _filters(sampling_params):
        if next_token_logits.shape[1] < input_ids.shape[1]:
            raise ValueError(f"next_token_logits: {next_token_logits.shape[1]} positions for input_ids of "
                             f"{input_ids.shape[1]} (NeMo-RL scores positions 0 .. T - 2)")
        return _next_token_logprobs(next_token_logits, input_ids[:, 1:])  # the whole logits: no slice's gradient
    if _NEXT_TOKEN.original is None:
        raise ValueError("sampling_params / vocab_parallel_group / context_parallel_group: NeMo-RL's own "
                         "get_next_token_logprobs_from_logits computes these; import NeMo-RL after install()")
    return _NEXT_TOKEN.original(input_ids, next_token_logits, seq_index=seq_index,
                                vocab_parallel_rank=vocab_parallel_rank, vocab_parallel_group=vocab_parallel_group,
                                context_parallel_group=context_parallel_group, sampling_params=sampling_params,
                                chunk_size=chunk_size)


def compute_local_logprobs(self, logits: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
    """AutoModel's `LogprobsPostProcessor._compute_local_logprobs` (`models/automodel/train.py` @7ea279ab): the
    prev and reference log-probs without tensor parallelism, [B, T - 1] float32, by one rlkernels pass over the
    logits as they are. With top-k / top-p sampling parameters, NeMo-RL's own method."""
    if _filters(self.sampling_params):
        return _LOCAL_LOGPROBS.original(self, logits, input_ids)
    if input_ids.shape[1] <= 1:
        return logits.new_empty((input_ids.shape[0], 0), dtype=torch.float32)
    return _next_token_logprobs(logits, input_ids[:, 1:])


_NEXT_TOKEN = Rebinding("get_next_token_logprobs_from_logits", get_next_token_logprobs_from_logits,
                        ("nemo_rl.distributed.model_utils", "nemo_rl.algorithms.loss.utils"))
_LOCAL_LOGPROBS = Rebinding("LogprobsPostProcessor._compute_local_logprobs", compute_local_logprobs,
                            ("nemo_rl.models.automodel.train",))


def install() -> None:
    """The log-prob routes above in NeMo-RL's modules, now or when they are imported (activation.py); imports none
    of NeMo-RL. `ClippedPGLossFn(routes=True)` calls it where it is built and where it is unpickled."""
    _NEXT_TOKEN.install()
    _LOCAL_LOGPROBS.install()


def uninstall() -> None:
    """NeMo-RL's own functions back wherever `install()` put rlkernels'."""
    _NEXT_TOKEN.uninstall()
    _LOCAL_LOGPROBS.uninstall()


def _mean(x, mask, norm=None, dim=None):
    """NeMo-RL's masked_mean: sum(x * mask) / (norm + 1e-8), norm the mask's sum or the global count given."""
    return (x * mask).sum(dim) / ((mask.sum(dim) if norm is None else norm) + 1e-8)


def _nemo_kl(logprobs, reference, kl_type, clamps=False):
    """NeMo-RL's calculate_kl of logr = reference - logprobs; with `clamps`, its defaults (20 in, 10 out)."""
    logr = reference - logprobs
    if clamps:
        logr = logr.clamp(-20.0, 20.0)
    if kl_type == "k1":
        kl = -logr
    elif kl_type == "k2":
        kl = logr * logr / 2
    else:
        kl = torch.exp(logr) - 1 - logr
    return kl.clamp(-10.0, 10.0) if clamps else kl


def nemo_rl_metrics(cfg, config: PolicyLossConfig, data, logprobs, global_valid_seqs, global_valid_toks):
    """NeMo-RL's `ClippedPGLossFn` metrics under its names, with its values (`loss_functions.py` @7ea279ab): the
    ratio's mean, clamped mean and extremes, the generator-versus-trainer errors (`token_mult_prob_error`,
    `gen_kl_error`, `policy_kl_error`, `js_divergence_error`), `kl_penalty`, `sampling_importance_ratio`,
    `is_oob_ratio`, `approx_entropy`, `num_valid_samples`, each divided by NeMo-RL's global counts as NeMo-RL
    divides them. Device tensors, from the detached log-probs; read back with the loss's other metrics."""
    with torch.no_grad():
        curr = logprobs.detach()
        token_mask, sample_mask = data["token_mask"][:, 1:], data["sample_mask"]
        mask = token_mask * sample_mask.unsqueeze(-1)
        gen = data["generation_logprobs"][:, 1:]
        force = bool(_get(cfg, "force_on_policy_ratio", False))
        prev = curr if force else data["prev_logprobs"][:, 1:]
        kl_type, gvt, gvs = _get(cfg, "reference_policy_kl_type", "k3"), global_valid_toks, global_valid_seqs
        log_mixture = torch.log(0.5 * torch.exp(prev) + 0.5 * torch.exp(gen))

        def to_mixture(lp):
            return torch.exp(lp - log_mixture) - (lp - log_mixture) - 1

        out = {"token_mult_prob_error": _mean(torch.exp((gen - prev).abs() * mask), mask, gvt),
               "gen_kl_error": _mean(_nemo_kl(gen, prev, kl_type), mask, gvt),
               "policy_kl_error": _mean(_nemo_kl(prev, gen, kl_type), mask, gvt),
               "js_divergence_error": _mean(0.5 * to_mixture(prev) + 0.5 * to_mixture(gen), mask, gvt),
               "approx_entropy": -_mean(torch.exp(curr - gen) * curr, mask, gvt),
               "num_valid_samples": sample_mask.sum(), "positive_nll_loss": 0.0}
        out["kl_penalty"] = 0.0
        if config.kl_coef:
            kl = _nemo_kl(curr, data["reference_policy_logprobs"][:, 1:], kl_type, clamps=True)
            out["kl_penalty"] = _mean(kl, mask, gvt) if config.loss_agg_mode == "token-mean" else _mean(
                _mean(kl, token_mask, dim=-1), sample_mask, gvs)
        out.update(_nemo_ratio_metrics(cfg, curr, prev, token_mask, mask, gvt))
        out.update(_nemo_weight_metrics(cfg, prev, gen, token_mask, sample_mask, mask, gvs, gvt))
    return out


def _nemo_ratio_metrics(cfg, curr, prev, token_mask, mask, gvt):
    if _get(cfg, "force_on_policy_ratio", False):
        ratios = clamped = torch.ones_like(curr)
    elif not _get(cfg, "disable_ppo_ratio", False):
        log_ratios = curr - prev
        if _get(cfg, "sequence_level_importance_ratios", False):
            ratios = torch.exp(_mean(log_ratios, token_mask, dim=-1)).unsqueeze(-1).expand_as(curr)
        else:
            ratios = torch.exp(log_ratios)
        clamped = ratios.clamp(1.0 - _get(cfg, "ratio_clip_min", 0.2), 1.0 + _get(cfg, "ratio_clip_max", 0.2))
    else:
        ratios = clamped = curr
    kept, none = mask.bool(), ~mask.bool().any()
    out = {"probs_ratio": _mean(ratios, mask, gvt), "probs_ratio_clamped": _mean(clamped, mask, gvt)}
    for name, values in (("probs_ratio", ratios), ("probs_ratio_clamped", clamped)):  # inf / -inf: none masked
        out[f"{name}_min"] = torch.where(none, torch.inf, torch.where(kept, values, torch.inf).min())
        out[f"{name}_max"] = torch.where(none, -torch.inf, torch.where(kept, values, -torch.inf).max())
    return out


def _nemo_weight_metrics(cfg, prev, gen, token_mask, sample_mask, mask, gvs, gvt):
    """`sampling_importance_ratio` (the actor weights after NeMo-RL's truncation) and `is_oob_ratio`."""
    out = {}
    sequence = _get(cfg, "sequence_level_importance_ratios", False)
    if sequence:
        weights = torch.nan_to_num(torch.exp(((prev - gen) * mask).sum(-1)), nan=0.0, posinf=0.0, neginf=0.0)
        weights = weights.unsqueeze(-1)
    else:
        weights = torch.nan_to_num(torch.exp(prev - gen), nan=0.0, posinf=0.0, neginf=0.0)
    high, kind = _get(cfg, "truncated_importance_sampling_ratio"), _get(cfg, "truncated_importance_sampling_type")
    low = _get(cfg, "truncated_importance_sampling_ratio_min")
    if high is not None and kind == "tis":
        low = 0.0 if low is None else low
        out["is_oob_ratio"] = _mean(((weights > high) | (weights < low)).to(prev.dtype), mask, gvt)
        weights = weights.clamp(low, high)
    elif high is not None and kind == "icepop":
        kept = (weights >= low) & (weights <= high)
        out["is_oob_ratio"] = _mean((~kept).to(prev.dtype), mask, gvt)
        weights = torch.where(kept, weights, torch.zeros_like(weights))
    elif high is not None and kind == "seq-mask-tis":
        log_ratio = torch.nan_to_num(prev - gen, nan=0.0, posinf=0.0, neginf=0.0)
        geometric = torch.exp(_mean(log_ratio, token_mask, dim=-1))
        kept = ((geometric >= low) & (geometric <= high)).to(prev.dtype)
        out["is_oob_ratio"] = _mean(1.0 - kept, sample_mask, gvs)
        weights = weights * kept.unsqueeze(-1)
    # NeMo-RL's own broadcast: sequence weights [B, 1] against the [B] sample mask
    out["sampling_importance_ratio"] = _mean(weights, sample_mask, gvs) if sequence else _mean(weights, mask, gvt)
    return out

