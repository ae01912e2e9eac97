"""The per-token inputs of the losses and the statistics, checked and laid out: `PreparedBatch`.

The steps, in the order a call takes them: `resolve_config` (the config and a per-token temperature
override) -> the tensor checks -> `_layout` (the data- / context-parallel split and the sequences) ->
the value checks (one sync) -> `PreparedBatch` (flat [N] tensors, the mask m, row labels, the Temperature,
the sampler's kept ids and distribution).
"""

from dataclasses import dataclass
from typing import Any, NamedTuple, Optional, Tuple, Union

import torch
import torch.distributed as dist

from ..backends import statistics_dtype
from ..backends.temperature import Temperature
from ..config import (
    BACKENDS,
    SAMPLER_HEAD_LOSSES,
    PolicyLossConfig,
    RolloutCorrection,
    check_finite_positive,
    check_head_dtype,
    check_memory_budget,
    check_numerics,
)
from ..ops.vocab_parallel import shard_offset
from ..stage import check_fused
from ..stage.divergences import Divergences
from ..stage.loss import check_split_options
from ..stage.policy_terms import LOSS_TERMS
from ..stage.segments import Segments
from ..stage.split import BatchSplit, context_layout
from .checks import (
    ValueChecks,
    check_cu_seqlens,
    check_group,
    check_head,
    check_logits,
    check_per_token,
    check_tensor,
    flat,
)
from .sampler import SamplerHead, check_head_values, given_divergences, prepare_head, temperature_and_support

SAMPLER_NAMES = ("sampler_topk_ids", "sampler_topk_logprobs", "sampler_logits")


@dataclass(frozen=True)
class PreparedBatch:
    """One call's checked inputs, flattened to the token axis: what the ops and the stage read. Inputs only:
    what a pass computes reaches the stage as its own record (stage.SamplerEvidence).

    Per-token tensors are [N] (N = this rank's tokens) in the caller's dtype; off `mask` they may hold
    anything (padding), and nothing reads them there."""
    token_shape: Tuple[int, ...]  # the labels' shape: (B, T) padded, (N,) packed
    mask: torch.Tensor  # [N] bool m: the response mask minus ignored and out-of-range labels
    segments: Optional[Segments] = None  # the sequences (None for per-token statistics, which need none)
    split: Optional[BatchSplit] = None  # the data- / context-parallel split (None: as segments)
    row_labels: Optional[torch.Tensor] = None  # [N] int64 label of each row, -1 on rows that take no part
    vocab_size: int = 0  # V of the labels (the whole vocabulary under tp_group)
    tp_group: Optional[dist.ProcessGroup] = None  # the vocabulary-parallel group, or None
    temperature: Optional[Temperature] = None  # one temperature, or the [N] per-token ones
    support: Optional[torch.Tensor] = None  # [N, K] int64 kept ids of the sampler (-1 pads), or None
    advantages: Optional[torch.Tensor] = None  # [N], per token
    old_logprobs: Optional[torch.Tensor] = None
    rollout_logprobs: Optional[torch.Tensor] = None
    ref_logprobs: Optional[torch.Tensor] = None
    is_weights: Optional[torch.Tensor] = None  # a trainer's own IS weights, detached
    sampler_head: Optional[SamplerHead] = None  # the sampler's top-k or logits (SPEC §9), or None


class Arguments(NamedTuple):
    """A public call's tensor and layout arguments, as the caller passed them (unchecked): built by keyword, or
    from the call's own arguments (`Arguments.of(locals())`: the public functions name them as these fields)."""
    labels: Optional[torch.Tensor] = None  # [B, T] / [N] integer sampled tokens
    advantages: Optional[torch.Tensor] = None  # per token, or one per sequence
    response_mask: Optional[torch.Tensor] = None  # bool or 0/1
    old_logprobs: Optional[torch.Tensor] = None  # the proximal policy's (decoupled mode)
    rollout_logprobs: Optional[torch.Tensor] = None  # the sampler's
    ref_logprobs: Optional[torch.Tensor] = None  # the KL penalty's reference
    is_weights: Optional[torch.Tensor] = None  # a trainer's own IS weights
    entropy: Optional[torch.Tensor] = None  # given with the log-probs (policy_loss)
    cu_seqlens: Optional[torch.Tensor] = None  # [S + 1] offsets of the packed layout
    token_index: Optional[torch.Tensor] = None  # this rank's global positions under cp_group
    tp_group: Optional[dist.ProcessGroup] = None  # the vocabulary split
    dp_group: Optional[dist.ProcessGroup] = None  # the batch split
    cp_group: Optional[dist.ProcessGroup] = None  # the sequence split
    temperature: Union[float, torch.Tensor] = 1.0  # a float, or per token / per sequence
    sampling_support: Optional[torch.Tensor] = None  # [..., K] the sampler's kept ids (-1 pads)
    ignore_index: int = -100
    # the sampler's distribution (SPEC §9): its top-k ids and their log-probs, or its logits; and the top-k's mode
    sampler_topk_ids: Optional[torch.Tensor] = None
    sampler_topk_logprobs: Optional[torch.Tensor] = None
    sampler_logits: Optional[torch.Tensor] = None
    sampler_topk_mode: str = "selected"

    @classmethod
    def of(cls, call: dict) -> "Arguments":
        """The fields among a call's named arguments (a public function's `locals()`)."""
        return cls(**{name: value for name, value in call.items() if name in cls._fields})

    @property
    def sampler(self) -> Tuple:
        """(sampler_topk_ids, sampler_topk_logprobs, sampler_logits), in the order of SAMPLER_NAMES."""
        return self.sampler_topk_ids, self.sampler_topk_logprobs, self.sampler_logits



def resolve_config(config: Optional[PolicyLossConfig], overrides: dict) -> Tuple[PolicyLossConfig, Any]:
    """(config with the keyword overrides, temperature): a tensor `temperature=` (per token) is taken out of
    the overrides and stands for the config's float, which must then be left at 1."""
    if config is None:
        config = PolicyLossConfig()
    elif not isinstance(config, PolicyLossConfig):
        raise TypeError(f"config: expected a PolicyLossConfig or None, got {type(config).__name__}")
    temperature = overrides.get("temperature")
    if not isinstance(temperature, torch.Tensor):
        config = config.with_overrides(**overrides)
        return config, config.temperature
    config = config.with_overrides(**{k: v for k, v in overrides.items() if k != "temperature"})
    if config.temperature != 1.0:
        raise ValueError(f"temperature: given as a tensor while config.temperature={config.temperature}; pass "
                         "one or the other")
    return config, temperature


class _Layout(NamedTuple):
    split: BatchSplit
    segments: Segments
    num_tokens: Union[int, torch.Tensor, None]  # what cu_seqlens[-1] must be (None: unchecked)
    positions: Union[int, torch.Tensor, None]  # token_index values lie in [0, positions)
    advantages: Optional[torch.Tensor]  # [N] per token (broadcast from one per sequence), or None


def _layout(token_shape, device, args: Arguments) -> _Layout:
    """The data/context-parallel split of the batch, this rank's sequence segments, what the value checks
    compare cu_seqlens[-1] and token_index with, and the advantages per token (broadcast to the sequences'
    tokens when given one per sequence: the sequences are known only once the layout is)."""
    per_sequence = args.advantages is not None and _sequence_advantages(args, token_shape, device)
    check_group("dp_group", args.dp_group)
    check_group("cp_group", args.cp_group)
    split = BatchSplit(args.dp_group, args.cp_group)
    cu_seqlens, token_index = args.cu_seqlens, args.token_index
    if args.cp_group is None:
        if token_index is not None:
            raise ValueError("token_index: only used with cp_group (the global positions of this rank's tokens); "
                             "pass cp_group or token_index=None")
        segments = (Segments.padded(token_shape[0], token_shape[1], device) if len(token_shape) == 2
                    else Segments.packed(cu_seqlens, token_shape[0], device))
        num_tokens, positions = token_shape[0], None
    else:
        if token_index is not None:
            check_tensor("token_index", token_index, kind="int", shape=(token_shape[-1],), device=device)
        layout = context_layout(token_shape, cu_seqlens, token_index, args.cp_group, device)
        segments, num_tokens = layout.segments, layout.total
        positions = layout.total if (len(token_shape) == 2 or cu_seqlens is None) else cu_seqlens[-1]
    advantages = args.advantages
    if per_sequence:
        advantages = segments.expand(advantages.reshape(-1)).reshape(token_shape)
    return _Layout(split, segments, num_tokens, positions, flat(advantages))


def _sequence_advantages(args: Arguments, token_shape, device) -> bool:
    """True when `advantages` holds one value per sequence ([S] or [S, 1]: GRPO-style outcome
    advantages), to be broadcast to the tokens once the sequences are known; False when per token.
    Raises naming the argument when the shape is neither."""
    advantages = args.advantages
    check_tensor("advantages", advantages, kind="float", device=device)
    if tuple(advantages.shape) == tuple(token_shape):
        return False
    S = token_shape[0] if len(token_shape) == 2 else (1 if args.cu_seqlens is None else args.cu_seqlens.numel() - 1)
    if tuple(advantages.shape) == (S,) and args.cp_group is not None:
        # a rank whose slice holds S tokens would read the same tensor per token
        raise ValueError(f"advantages: with cp_group pass one value per sequence as [{S}, 1], not [{S}]")
    if tuple(advantages.shape) in ((S,), (S, 1)):
        return True
    raise ValueError(f"advantages: expected shape {tuple(token_shape)} (per token) or ({S},) / ({S}, 1) (one per "
                     f"sequence), got {tuple(advantages.shape)}")


def vocab_size(local_vocab: int, device, tp_group, inplace: bool = False) -> int:
    """The vocabulary the labels index: this rank's V, or the whole of a vocabulary-parallel group's."""
    check_group("tp_group", tp_group)
    if tp_group is None:
        return local_vocab
    if inplace:
        raise ValueError("inplace_backward: not supported with tp_group (pass inplace_backward=False)")
    return shard_offset(tp_group, local_vocab, device)[1]



def _check_options(config: PolicyLossConfig, args: Arguments) -> None:
    """Combinations of the config and the per-token inputs that have no meaning."""
    check_split_options(config, args.dp_group, args.cp_group)
    if "decoupled" not in LOSS_TERMS[config.loss_type].modes and args.old_logprobs is not None:
        raise ValueError(f"old_logprobs: expected None with loss_type={config.loss_type!r} (a loss of bypass mode, "
                         "SPEC §1, §6); pass rollout_logprobs only, or use loss_type='ppo_clip'")
    if config.kl_coef > 0 and args.ref_logprobs is None:
        raise ValueError(f"ref_logprobs: expected a tensor since kl_coef={config.kl_coef} > 0, got None")
    rc = config.rollout_correction
    if args.is_weights is not None and rc is not None and rc.is_level is not None:
        raise ValueError(f"is_weights: given while rollout_correction computes IS weights too (is_level="
                         f"{rc.is_level!r}); pass one or the other")
    if rc is not None and rc.rs and rc.rs_mode == "zero_weight" and args.old_logprobs is None:
        raise ValueError("old_logprobs: rollout_correction.rs_mode='zero_weight' rejects through the IS weights, which "
                         "weigh the loss in decoupled mode only (SPEC §1); pass old_logprobs, or use rs_mode='mask'")
    if rc is not None and rc.enabled and args.rollout_logprobs is None:
        raise ValueError("rollout_logprobs: expected a tensor since rollout_correction is set, got None")
    if rc is not None and rc.needs_divergence and all(t is None for t in args.sampler):
        raise ValueError("sampler_topk_ids / sampler_logits: expected the sampler's distribution since "
                         "rollout_correction.rs has a seq_max_kl / seq_mean_kl option (Trust Region Masking's "
                         "KL(μ_t || π_t)), got neither")
    if config.loss_type in SAMPLER_HEAD_LOSSES:
        if args.sampler[0] is None or args.sampler[2] is not None or args.sampler_topk_mode != "selected":
            raise ValueError(f"sampler_topk_ids: loss_type={config.loss_type!r} needs the sampler's top-k ids and "
                             "log-probs (sampler_topk_ids, sampler_topk_logprobs) in sampler_topk_mode='selected' "
                             "(the sampler's distribution unfiltered: top_p = 1, top_k = -1)")
        if args.rollout_logprobs is None:
            raise ValueError(f"rollout_logprobs: expected a tensor since loss_type={config.loss_type!r} weighs the "
                             "sampled token by f(p_y / q_y), got None")
        if args.is_weights is not None:
            raise ValueError(f"is_weights: loss_type={config.loss_type!r} takes its weights f(p / q) from the "
                             "rollout correction's token IS rule; a trainer's own weights would not enter it. Pass "
                             "is_weights=None")
    if any(t is not None for t in args.sampler) and (args.tp_group is not None or args.sampling_support is not None):
        raise ValueError("sampler_topk_ids / sampler_logits: not supported with tp_group or sampling_support yet")
    if config.vaco_threshold is not None and args.rollout_logprobs is None:
        raise ValueError("rollout_logprobs: expected a tensor since vaco_threshold is set (VACO's divergence is "
                         "between the training policy and the sampler), got None")


def _batch(token_shape, mask, layout: _Layout, args: Arguments, **fields) -> PreparedBatch:
    return PreparedBatch(
        token_shape=token_shape, mask=mask, segments=layout.segments, split=layout.split, tp_group=args.tp_group,
        advantages=layout.advantages, old_logprobs=flat(args.old_logprobs),
        rollout_logprobs=flat(args.rollout_logprobs), ref_logprobs=flat(args.ref_logprobs),
        is_weights=None if args.is_weights is None else flat(args.is_weights).detach(), **fields)


def prepare_loss(source: str, token_shape, local_vocab: int, device, args: Arguments,
                 config: PolicyLossConfig) -> PreparedBatch:
    """The checks every loss entry point makes on its per-token inputs (`source`: "logits" or "hidden", for
    the messages), then the batch: flat int64 row labels, and the mask m -- the response mask minus ignored
    tokens and (with validate=False) out-of-range labels, treated as masked so that nothing is ever read
    out of bounds."""
    V = vocab_size(local_vocab, device, args.tp_group, config.inplace_backward)
    check_tensor("labels", args.labels, kind="int", shape=token_shape, device=device)
    check_per_token(token_shape, device, response_mask=args.response_mask, old_logprobs=args.old_logprobs,
                     rollout_logprobs=args.rollout_logprobs, ref_logprobs=args.ref_logprobs, is_weights=args.is_weights)
    if args.cu_seqlens is not None and len(token_shape) == 2:
        raise ValueError(f"cu_seqlens: must be None with padded [B, T, ...] {source}; pass [N, ...] {source} to pack "
                         "sequences")
    check_cu_seqlens(args.cu_seqlens, token_shape, device)
    _check_options(config, args)
    layout = _layout(token_shape, device, args)
    labels = flat(args.labels).long()  # compared in int64: -100 must not wrap in uint8/int8
    in_mask = flat(args.response_mask).bool()
    checks = ValueChecks() if config.validate else None
    if checks is not None:
        checks.layout(args.cu_seqlens, layout.num_tokens, args.token_index, layout.positions)
        checks.mask_values("response_mask", args.response_mask)
        checks.labels(in_mask, labels, V, args.ignore_index, "tokens of the response mask")
        checks.values(in_mask, "tokens of the response mask",
                      finite=[("advantages", layout.advantages), ("is_weights", flat(args.is_weights))],
                      not_nan=[("old_logprobs", flat(args.old_logprobs)),
                               ("rollout_logprobs", flat(args.rollout_logprobs)),
                               ("ref_logprobs", flat(args.ref_logprobs))])
    mask = in_mask & (labels >= 0) & (labels < V)
    if args.ignore_index >= 0:  # a negative one (-100) is outside [0, V) already
        mask = mask & (labels != args.ignore_index)
    temperature, support = temperature_and_support(args, token_shape, V, device, labels, mask, checks)
    head = prepare_head(SAMPLER_NAMES, args.sampler, token_shape, V, device, args.sampler_topk_mode)
    if checks is not None:
        check_head_values(checks, head, SAMPLER_NAMES[:2], V, mask, labels)
        checks.run()
    return _batch(token_shape, mask, layout, args, row_labels=_row_labels(labels, mask), vocab_size=V,
                  temperature=temperature, support=support, sampler_head=head)


def prepare_logits_loss(logits, args: Arguments, config: Optional[PolicyLossConfig],
                        overrides: dict) -> Tuple[PolicyLossConfig, PreparedBatch]:
    """decoupled_ppo_loss: (the config with its overrides, the batch) for [B, T, V] / [N, V] logits."""
    config, temperature = resolve_config(config, overrides)
    check_logits(logits)
    if config.head_dtype is not None:
        raise ValueError(f"head_dtype: {config.head_dtype!r} sets the precision of the fused-linear path's head GEMM; "
                         "decoupled_ppo_loss takes logits (compute them in float32 yourself, or use "
                         "linear_decoupled_ppo_loss)")
    batch = prepare_loss("logits", tuple(logits.shape[:-1]), logits.shape[-1], logits.device,
                         args._replace(temperature=temperature), config)
    check_fused(batch, config, statistics_dtype(logits.dtype), logits.device)
    return config, batch


def prepare_hidden_loss(hidden, weight, bias, args: Arguments, config: Optional[PolicyLossConfig],
                        overrides: dict) -> Tuple[PolicyLossConfig, PreparedBatch]:
    """linear_decoupled_ppo_loss: (the config with its overrides, the batch) for hidden states and the LM head."""
    config, temperature = resolve_config(config, overrides)
    check_head(hidden, weight, bias)
    batch = prepare_loss("hidden", tuple(hidden.shape[:-1]), weight.shape[0], hidden.device,
                         args._replace(temperature=temperature), config)
    check_fused(batch, config, statistics_dtype(hidden.dtype), hidden.device)
    return config, batch


def _row_labels(labels: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """Labels for the vocabulary passes: -1 on every row that takes no part (such rows are never read)."""
    return torch.where(keep, labels, torch.full_like(labels, -1))


def prepare_stats(logits, args: Arguments, backend: str, validate: bool, inplace: bool,
                  numerics: str = "default") -> PreparedBatch:
    """token_logprobs: the batch of [..., V] logits' rows."""
    check_logits(logits, allow_any_rank=True)
    check_numerics(numerics)
    return _stats_batch(tuple(logits.shape[:-1]), logits.shape[-1], logits.device, args, backend, validate, inplace)


def prepare_linear_stats(hidden, weight, bias, args: Arguments, validate: bool, options):
    """linear_token_logprobs: (the batch of [..., H] hidden states' rows under the head [V, H], the call's
    ops.PassOptions with its head dtype by name); the options' backend, memory budget, head dtype and numerics are
    checked here."""
    check_head(hidden, weight, bias, allow_any_rank=True)
    check_memory_budget(options.memory_budget_bytes)
    options = options._replace(head_dtype=check_head_dtype(options.head_dtype))
    check_numerics(options.numerics)
    batch = _stats_batch(tuple(hidden.shape[:-1]), weight.shape[0], hidden.device, args, options.backend, validate,
                         False)
    return batch, options


def _stats_batch(token_shape, local_vocab: int, device, args: Arguments, backend: str, validate: bool,
                 inplace: bool) -> PreparedBatch:
    """The checks of the two token-statistics entry points; the batch of row labels (-1 on ignored rows
    and, with validate=False, out-of-range labels), the temperature and the kept ids."""
    check_tensor("labels", args.labels, kind="int", shape=token_shape, device=device)
    check_group("dp_group", args.dp_group)  # accepted and unused: per-token statistics combine nothing
    check_group("cp_group", args.cp_group)
    if not isinstance(args.temperature, torch.Tensor):
        check_finite_positive("temperature", args.temperature)  # the checks PolicyLossConfig makes
    if backend not in BACKENDS:
        raise ValueError(f"backend: expected one of {BACKENDS}, got {backend!r}")
    V = vocab_size(local_vocab, device, args.tp_group, inplace)
    labels = args.labels.reshape(-1).long()  # compared in int64: -100 must not wrap in uint8/int8
    keep = (labels >= 0) & (labels < V) & (labels != args.ignore_index)
    checks = ValueChecks() if validate else None
    if checks is not None:
        checks.labels(labels != args.ignore_index, labels, V, args.ignore_index,
                      "tokens whose label is not ignore_index")
    temperature, support = temperature_and_support(args, token_shape, V, device, labels, keep, checks)
    if checks is not None:
        checks.run()
    return PreparedBatch(token_shape=token_shape, mask=keep, row_labels=_row_labels(labels, keep), vocab_size=V,
                         tp_group=args.tp_group, temperature=temperature, support=support)


def prepare_policy(logprobs, args: Arguments, config: Optional[PolicyLossConfig],
                   overrides: dict) -> Tuple[PolicyLossConfig, PreparedBatch]:
    """`policy_loss`'s checks: log-probs (and entropy) from elsewhere, the same per-token inputs as the
    losses on logits. (The config with its overrides, the batch.)"""
    config, _ = resolve_config(config, overrides)
    check_tensor("logprobs", logprobs, kind="float")
    if logprobs.dim() not in (1, 2):
        raise ValueError(f"logprobs: expected [B, T] (padded) or [N] (packed), got shape {tuple(logprobs.shape)}")
    device, token_shape = logprobs.device, tuple(logprobs.shape)
    check_per_token(token_shape, device, response_mask=args.response_mask, old_logprobs=args.old_logprobs,
                     rollout_logprobs=args.rollout_logprobs, ref_logprobs=args.ref_logprobs, entropy=args.entropy,
                     is_weights=args.is_weights)
    check_cu_seqlens(args.cu_seqlens, token_shape, device)
    _check_options(config, args)
    if (config.adaptive_entropy or config.entropy_coeff != 0) and args.entropy is None:
        raise ValueError(f"entropy: expected a tensor since entropy_coeff={config.entropy_coeff} != 0, got None")
    layout = _layout(token_shape, device, args)
    mask = args.response_mask.reshape(-1).bool()
    if config.validate:
        checks = ValueChecks()
        checks.layout(args.cu_seqlens, layout.num_tokens, args.token_index, layout.positions)
        checks.mask_values("response_mask", args.response_mask)
        checks.values(mask, "tokens of the response mask",
                      finite=[("advantages", layout.advantages), ("is_weights", flat(args.is_weights))],
                      not_nan=[("logprobs", flat(logprobs)), ("old_logprobs", flat(args.old_logprobs)),
                               ("rollout_logprobs", flat(args.rollout_logprobs)),
                               ("ref_logprobs", flat(args.ref_logprobs))])
        checks.run()
    batch = _batch(token_shape, mask, layout, args)
    check_fused(batch, config, statistics_dtype(logprobs.dtype), device)
    return config, batch


class CorrectionInputs(NamedTuple):
    batch: PreparedBatch
    divergences: Optional[Divergences]  # [N] each, given by the caller (SPEC §9), or None
    form: str  # the divergences' metric prefix: "full" or "topk"


def prepare_correction(train_logprobs, args: Arguments, config: RolloutCorrection, validate: bool,
                       divergences) -> CorrectionInputs:
    """`rollout_correction`'s checks: the training policy's and the sampler's log-probs, the mask, and the
    trainer-vs-sampler divergences a TRM option reads."""
    if not isinstance(config, RolloutCorrection):
        raise TypeError(f"config: expected a RolloutCorrection, got {type(config).__name__}")
    check_tensor("train_logprobs", train_logprobs, kind="float")
    if train_logprobs.dim() not in (1, 2):
        raise ValueError(f"train_logprobs: expected [B, T] or [N], got shape {tuple(train_logprobs.shape)}")
    device, token_shape = train_logprobs.device, tuple(train_logprobs.shape)
    check_per_token(token_shape, device, rollout_logprobs=args.rollout_logprobs, response_mask=args.response_mask)
    check_cu_seqlens(args.cu_seqlens, token_shape, device)
    layout = _layout(token_shape, device, args)
    mask = args.response_mask.reshape(-1).bool()
    if validate:
        checks = ValueChecks()
        checks.layout(args.cu_seqlens, layout.num_tokens, args.token_index, layout.positions)
        checks.mask_values("response_mask", args.response_mask)
        checks.values(mask, "tokens of the response mask",
                      not_nan=[("train_logprobs", flat(train_logprobs)),
                               ("rollout_logprobs", flat(args.rollout_logprobs))])
        checks.run()
    div, form = given_divergences(divergences, token_shape, config)
    return CorrectionInputs(_batch(token_shape, mask, layout, args), div, form)


