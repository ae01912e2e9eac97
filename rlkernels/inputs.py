"""Every argument check and layout step of the public functions (SPEC §11), ending in one `PreparedBatch`.

One message format: `<argument>: expected <what>, got <what>`. Structural checks (type, dtype, rank,
shape, device, option combinations) are free and always run, before any kernel. Value checks (label
range, cu_seqlens contents, NaN / inf, per-token temperatures, the sampler's kept ids) look at device
memory: they are gathered into one flag tensor and read with a single host synchronisation per call, and
`validate=False` skips them for sync-free steps.

The steps, in the order a call takes them: `resolve_config` (the config and a per-token temperature
override) -> the tensor checks -> `_layout` (the data- / context-parallel split and the sequences) ->
the value checks -> `PreparedBatch` (flat [N] tensors, the mask m, row labels, one temperature form).
"""

import math
from dataclasses import dataclass
from typing import Any, List, NamedTuple, Optional, Sequence, Tuple, Union

import torch
import torch.distributed as dist

from .backends.base import FOREIGN_TARGET
from .backends.temperature import Temperature
from .config import BACKENDS, SAMPLER_HEAD_LOSSES, PolicyLossConfig, RolloutCorrection, check_finite_positive
from .ops.vocab_parallel import shard_offset
from .stage.loss import check_split_options
from .stage.segments import Segments
from .stage.split import BatchSplit, context_layout

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
INDEX_DTYPES = (torch.int32, torch.int64)
# Label dtypes: compared with ignore_index and [0, V) after a cast to int64, so that -100 never wraps
# in a narrow or unsigned dtype. uint16/32/64 lack the CPU kernels that cast needs in every torch.
LABEL_DTYPES = (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8)


@dataclass(frozen=True)
class PreparedBatch:
    """One call's checked inputs, flattened to the token axis: what the ops and the stage read.

    Per-token tensors are [N] (N = this rank's tokens) in the caller's dtype; off `mask` they may hold
    anything (padding), and nothing reads them there."""
    token_shape: Tuple[int, ...]  # the labels' shape: (B, T) padded, (N,) packed
    mask: torch.Tensor  # [N] bool m: the response mask minus ignored and out-of-range labels
    segments: Optional[Segments] = None  # the sequences (None for per-token statistics, which need none)
    split: Optional[BatchSplit] = None  # the data- / context-parallel split (None: as segments)
    row_labels: Optional[torch.Tensor] = None  # [N] int64 label of each row, -1 on rows that take no part
    vocab_size: int = 0  # V of the labels (the whole vocabulary under tp_group)
    tp_group: Any = None  # the vocabulary-parallel group, or None
    temperature: Optional[Temperature] = None  # one temperature, or the [N] per-token ones
    support: Optional[torch.Tensor] = None  # [N, K] int64 kept ids of the sampler (-1 pads), or None
    advantages: Optional[torch.Tensor] = None  # [N], per token
    old_logprobs: Optional[torch.Tensor] = None
    rollout_logprobs: Optional[torch.Tensor] = None
    ref_logprobs: Optional[torch.Tensor] = None
    is_weights: Optional[torch.Tensor] = None  # a trainer's own IS weights, detached
    sampler_head: Any = None  # SamplerHead: the sampler's top-k or logits (SPEC §9), or None
    divergences: Any = None  # stage.correction.DivergenceRecord, set after the pass that computes it
    head_terms: Any = None  # stage.policy_terms.HeadContext for a loss that reads the sampler's top-k, or None


class Arguments(NamedTuple):
    """A public call's tensor and layout arguments, as the caller passed them (unchecked)."""
    labels: Optional[torch.Tensor] = None
    advantages: Optional[torch.Tensor] = None
    response_mask: Optional[torch.Tensor] = None
    old_logprobs: Optional[torch.Tensor] = None
    rollout_logprobs: Optional[torch.Tensor] = None
    ref_logprobs: Optional[torch.Tensor] = None
    is_weights: Optional[torch.Tensor] = None
    entropy: Optional[torch.Tensor] = None
    cu_seqlens: Optional[torch.Tensor] = None
    token_index: Optional[torch.Tensor] = None
    tp_group: Any = None
    dp_group: Any = None
    cp_group: Any = None
    temperature: Union[float, torch.Tensor] = 1.0
    sampling_support: Optional[torch.Tensor] = None
    ignore_index: int = -100
    # the sampler's distribution (SPEC §9): (sampler_topk_ids, sampler_topk_logprobs, sampler_logits), and the mode
    sampler: Tuple = (None, None, None)
    sampler_topk_mode: str = "selected"


SAMPLER_NAMES = ("sampler_topk_ids", "sampler_topk_logprobs", "sampler_logits")


# ---------------------------------------------------------------- tensor checks
def _describe(x) -> str:
    if isinstance(x, torch.Tensor):
        return f"tensor of shape {tuple(x.shape)}, dtype {x.dtype}, device {x.device}"
    return f"{type(x).__name__}"


def check_tensor(name: str, x, *, kind: str, shape: Optional[Tuple[int, ...]] = None, device=None) -> None:
    """kind: 'float' (fp16/bf16/fp32/fp64), 'int' (LABEL_DTYPES), 'mask' (bool, int or float)."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {_describe(x)}")
    if kind == "float" and x.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{name}: expected a floating dtype (float16, bfloat16, float32, float64), got {x.dtype}")
    if kind == "int" and x.dtype not in LABEL_DTYPES:
        raise TypeError(f"{name}: expected an integer dtype (int64, int32, int16, int8 or uint8), got {x.dtype}")
    if kind == "mask" and x.dtype.is_complex:
        raise TypeError(f"{name}: expected a bool, integer or float 0/1 mask, got {x.dtype}")
    if shape is not None and tuple(x.shape) != tuple(shape):
        raise ValueError(f"{name}: expected shape {tuple(shape)}, got {tuple(x.shape)}")
    if device is not None and x.device != device:
        raise ValueError(f"{name}: expected a tensor on {device} (the device of the inputs), got {x.device}")


def check_logits(logits, *, allow_any_rank: bool = False) -> None:
    if not isinstance(logits, torch.Tensor):
        raise TypeError(f"logits: expected a torch.Tensor, got {_describe(logits)}")
    if logits.dtype not in FLOAT_DTYPES:
        raise TypeError(f"logits: expected float16, bfloat16, float32 or float64, got {logits.dtype}")
    if allow_any_rank:
        if logits.dim() < 1:
            raise ValueError("logits: expected shape [..., V], got a 0-d tensor")
    elif logits.dim() not in (2, 3):
        raise ValueError(f"logits: expected [B, T, V] (padded) or [N, V] (packed), got shape {tuple(logits.shape)}")
    if logits.shape[-1] < 1:
        raise ValueError(f"logits: expected a vocabulary of at least 1 entry, got V = {logits.shape[-1]}")


def check_head(hidden, weight, bias, *, allow_any_rank: bool = False) -> None:
    """The fused-linear inputs: hidden [..., H] (or [B, T, H] / [N, H]), weight [V, H], bias [V] or None,
    one float dtype and one device."""
    check_tensor("hidden", hidden, kind="float")
    if allow_any_rank:
        if hidden.dim() < 1:
            raise ValueError("hidden: expected shape [..., H], got a 0-d tensor")
    elif hidden.dim() not in (2, 3):
        raise ValueError(f"hidden: expected [B, T, H] (padded) or [N, H] (packed), got shape {tuple(hidden.shape)}")
    check_tensor("weight", weight, kind="float", device=hidden.device)
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[-1] or weight.shape[0] < 1:
        raise ValueError(f"weight: expected [V, H] with H = {hidden.shape[-1]} (the nn.Linear layout) and V >= 1, "
                         f"got shape {tuple(weight.shape)}")
    if weight.dtype != hidden.dtype:
        raise TypeError(f"weight: expected the dtype of hidden ({hidden.dtype}), got {weight.dtype}")
    if bias is not None:
        check_tensor("bias", bias, kind="float", shape=(weight.shape[0],), device=hidden.device)
        if bias.dtype != hidden.dtype:
            raise TypeError(f"bias: expected the dtype of hidden ({hidden.dtype}), got {bias.dtype}")


def check_cu_seqlens(cu_seqlens, token_shape: Tuple[int, ...], device) -> None:
    if cu_seqlens is None:
        return
    if len(token_shape) != 1:
        raise ValueError(
            f"cu_seqlens: only valid with the packed layout ([N, V] logits, [N] per-token tensors); "
            f"got per-token shape {tuple(token_shape)} — pass cu_seqlens=None for padded [B, T, V] inputs"
        )
    if not isinstance(cu_seqlens, torch.Tensor):
        raise TypeError(f"cu_seqlens: expected an int32/int64 torch.Tensor, got {_describe(cu_seqlens)}")
    if cu_seqlens.dtype not in INDEX_DTYPES:
        raise TypeError(f"cu_seqlens: expected dtype int32 or int64, got {cu_seqlens.dtype}")
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 1:
        raise ValueError(f"cu_seqlens: expected a 1-D tensor [S + 1] with S >= 0, got shape {tuple(cu_seqlens.shape)}")
    if cu_seqlens.device != device:
        raise ValueError(f"cu_seqlens: expected a tensor on {device} (the device of logits), got {cu_seqlens.device}")


def _check_group(name: str, group) -> None:
    if group is not None and not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"{name}: expected a torch.distributed ProcessGroup or None, got {type(group).__name__}")


def _check_per_token(shape, device, **tensors) -> None:
    for name, x in tensors.items():
        if x is not None:
            check_tensor(name, x, kind="mask" if name == "response_mask" else "float", shape=shape, device=device)


# ---------------------------------------------------------------- value checks (one sync)
def _read_flags_eagerly(flags: torch.Tensor) -> List[bool]:
    return flags.tolist()  # the one host synchronisation


# Kept out of torch.compile: a graph break where the caller allows one, and under fullgraph=True an
# error whose text says what to do instead of a bare "unsupported .tolist()".
_read_flags = torch.compiler.disable(
    _read_flags_eagerly,
    reason="rlkernels: validate=True reads the value checks back to the host (one synchronisation); "
    "pass validate=False inside torch.compile(fullgraph=True) or a sync-free step",
)


class ValueChecks:
    """Collects device-side boolean failure flags and raises for the first one, with one sync."""

    def __init__(self):
        self._flags: List[torch.Tensor] = []
        self._messages: List[str] = []

    def add(self, failed: torch.Tensor, message: str) -> None:
        self._flags.append(failed.reshape(()))
        self._messages.append(message)

    def labels(self, valid: torch.Tensor, labels: torch.Tensor, vocab: int, ignore_index: int, where: str) -> None:
        out_of_range = valid & (labels != ignore_index) & ((labels < 0) | (labels >= vocab))
        self.add(out_of_range.any(), f"labels: expected values in [0, {vocab}) or ignore_index={ignore_index} on "
                 f"{where}, got a label outside that range")

    def values(self, valid: torch.Tensor, where: str, finite: Sequence[Tuple[str, Optional[torch.Tensor]]] = (),
               not_nan: Sequence[Tuple[str, Optional[torch.Tensor]]] = ()) -> None:
        for name, x in not_nan:
            if x is not None:
                self.add((valid & torch.isnan(x)).any(), f"{name}: expected no NaN on {where}, got NaN")
        for name, x in finite:
            if x is not None:
                self.add((valid & ~torch.isfinite(x)).any(),
                         f"{name}: expected finite values (no NaN/inf) on {where}, got NaN or inf")

    def layout(self, cu_seqlens: Optional[torch.Tensor], num_tokens, token_index: Optional[torch.Tensor],
               positions) -> None:
        """cu_seqlens[-1] must be `num_tokens` (a device tensor for a context-parallel split, None:
        unchecked); `token_index` must lie in [0, positions)."""
        if cu_seqlens is not None:
            cu = cu_seqlens.long()
            self.add(cu[0] != 0, "cu_seqlens: expected cu_seqlens[0] == 0")
            if cu.numel() > 1:
                self.add((cu[1:] < cu[:-1]).any(), "cu_seqlens: expected non-decreasing offsets")
            if isinstance(num_tokens, torch.Tensor):
                self.add(cu[-1] != num_tokens, "cu_seqlens: expected cu_seqlens[-1] == the number of tokens on all "
                         "ranks of cp_group (cu_seqlens is the global one)")
            elif num_tokens is not None:
                self.add(cu[-1] != num_tokens, f"cu_seqlens: expected cu_seqlens[-1] == N = {num_tokens} (the number "
                         "of rows)")
        if token_index is not None:
            ti = token_index.long()
            self.add(((ti < 0) | (ti >= positions)).any(),
                     "token_index: expected global positions in [0, the length of the split axis on all ranks)")

    def run(self) -> None:
        if not self._flags:
            return
        failed = _read_flags(torch.stack(self._flags))
        for bad, message in zip(failed, self._messages):
            if bad:
                raise ValueError(message)


# ---------------------------------------------------------------- configuration and temperature
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


def _per_token_temperature(temperature: torch.Tensor, token_shape, device) -> torch.Tensor:
    """[N] temperatures from a tensor broadcastable to the labels' shape (per token, or [B, 1] per sequence)."""
    check_tensor("temperature", temperature, kind="float", device=device)
    if temperature.dim() not in (0, len(token_shape)):  # a [B] tensor would broadcast along T, not B
        per_sequence = ", or [B, 1] per sequence" if len(token_shape) == 2 else ""
        raise ValueError(f"temperature: expected a tensor with the labels' {len(token_shape)} dimensions (per token "
                         f"{token_shape}{per_sequence}), got shape {tuple(temperature.shape)}")
    try:
        return torch.broadcast_to(temperature, token_shape).reshape(-1).detach()
    except RuntimeError:
        raise ValueError(f"temperature: expected a float or a tensor broadcastable to the labels' shape {token_shape} "
                         f"(per token, or [B, 1] per sequence), got shape {tuple(temperature.shape)}") from None


# ---------------------------------------------------------------- layout
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
    _check_group("dp_group", args.dp_group)
    _check_group("cp_group", args.cp_group)
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
    return _Layout(split, segments, num_tokens, positions, _flat(advantages))


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


def _flat(t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    return None if t is None else t.reshape(-1)


def vocab_size(local_vocab: int, device, tp_group, inplace: bool = False) -> int:
    """The vocabulary the labels index: this rank's V, or the whole of a vocabulary-parallel group's."""
    _check_group("tp_group", tp_group)
    if tp_group is None:
        return local_vocab
    if inplace:
        raise ValueError("inplace_backward: not supported with tp_group (pass inplace_backward=False)")
    return shard_offset(tp_group, local_vocab, device)[1]


# ---------------------------------------------------------------- the sampler's inputs
def _sampler(args: Arguments, token_shape, vocab: int, device, labels: torch.Tensor, keep: torch.Tensor,
             checks: Optional[ValueChecks]):
    """The Temperature and the sampler's kept ids ([N, K] int64, or None), checked:
    types, shapes and devices always; with `checks`, positive finite temperatures, ids in [-1, V), no id twice
    in a row, and every label in the loss among its row's ids. A float temperature was checked already
    (PolicyLossConfig, or prepare_stats)."""
    temperature = args.temperature
    per_token = isinstance(temperature, torch.Tensor)
    temperature = Temperature(_per_token_temperature(temperature, token_shape, device)) if per_token \
        else Temperature.of(temperature)
    support = None
    if args.sampling_support is not None:
        given = args.sampling_support
        check_tensor("sampling_support", given, kind="int", device=device)
        if given.dim() != len(token_shape) + 1 or tuple(given.shape[:-1]) != token_shape or given.shape[-1] == 0:
            raise ValueError(f"sampling_support: expected shape {token_shape + ('K',)} (the labels' shape and K >= 1 "
                             f"kept ids, -1 padding), got {tuple(given.shape)}")
        support = given.reshape(-1, given.shape[-1]).long()
    if args.tp_group is not None and (per_token or support is not None):
        raise ValueError("temperature / sampling_support: a per-token temperature or a kept set is not supported with "
                         "tp_group yet")
    if checks is not None:
        if per_token:
            checks.add((~torch.isfinite(temperature.tensor) | (temperature.tensor <= 0)).any(),
                       "temperature: expected finite values > 0")
        if support is not None:
            _check_support(checks, support, vocab, labels, keep)
    return temperature, support


def _check_support(checks: ValueChecks, support: torch.Tensor, vocab: int, labels: torch.Tensor,
                   keep: torch.Tensor) -> None:
    if not support.numel():
        checks.add(keep.any(), _MISSING_LABEL)
        return
    checks.add(((support < -1) | (support >= vocab)).any(),
               f"sampling_support: expected token ids in [0, {vocab}) or -1 (padding)")
    ordered = support.sort(1).values
    checks.add(((ordered[:, 1:] == ordered[:, :-1]) & (ordered[:, 1:] >= 0)).any(),
               "sampling_support: an id appears twice in a row (the kept set is a set)")
    checks.add((keep & ~(support == labels[:, None]).any(1)).any(), _MISSING_LABEL)


_MISSING_LABEL = ("sampling_support: a label in the loss is not among its row's kept ids (the sampler cannot have "
                  "drawn it)")


class SamplerHead(NamedTuple):
    """The second distribution of SPEC §9, checked and flattened: the top-k form (ids and log-probs) or the full
    form (logits), never both."""
    ids: Optional[torch.Tensor] = None  # [N, k] int64, -1 pads
    logprobs: Optional[torch.Tensor] = None  # [N, k] as given (full-vocabulary log-probs)
    mode: str = "selected"  # "selected" (candidates before filtering) or "support" (the kept set)
    logits: Optional[torch.Tensor] = None  # [..., V] the full form's logits, shaped like the trainer's
    given_ids: Optional[torch.Tensor] = None  # [N, k] the ids as given (the value checks read these)

    @property
    def slots(self) -> torch.Tensor:
        return self.ids >= 0


HEAD_MODES = ("selected", "support")
# Σ_H exp(log μ) may exceed 1 by the sampler's rounding only: float32 log-probs summed over k <= a few hundred ids
# carry ~1e-6 relative error each; slime accepts 1 + 1e-4, and so do we
HEAD_MASS_SLACK = 1e-4


def prepare_head(names: Tuple[str, str, str], given: Tuple, token_shape, vocab: int, device, mode: str,
                 trainer_shape=None) -> Optional[SamplerHead]:
    """The structural checks of a second distribution `given` as (ids, log-probs, logits): the top-k form
    (`names[0]`, `names[1]`) or the full form (`names[2]`); None when neither is given. `trainer_shape`: the
    trainer logits' shape the full form must match (None: the fused-linear path, the labels' shape + (V,))."""
    ids_name, lp_name, logits_name = names
    ids, logprobs, logits = given
    if mode not in HEAD_MODES:
        raise ValueError(f"mode: expected one of {HEAD_MODES}, got {mode!r}")
    if logits is not None:
        if ids is not None or logprobs is not None:
            raise ValueError(f"{logits_name}: given with {ids_name} / {lp_name}; pass the full form or the top-k form")
        check_tensor(logits_name, logits, kind="float", device=device)
        shape = tuple(trainer_shape) if trainer_shape is not None else token_shape + (vocab,)
        if tuple(logits.shape) != shape:
            raise ValueError(f"{logits_name}: expected shape {shape} (the trainer's logits), got {tuple(logits.shape)}")
        return SamplerHead(logits=logits.detach(), mode=mode)
    if ids is None and logprobs is None:
        return None
    if ids is None or logprobs is None:
        missing = ids_name if ids is None else lp_name
        raise ValueError(f"{missing}: expected a tensor (the top-k form takes the ids and their log-probs), got None")
    check_tensor(ids_name, ids, kind="int", device=device)
    if ids.dim() != len(token_shape) + 1 or tuple(ids.shape[:-1]) != token_shape or ids.shape[-1] == 0:
        raise ValueError(f"{ids_name}: expected shape {token_shape + ('k',)} (the labels' shape and k >= 1 ids, -1 "
                         f"padding), got {tuple(ids.shape)}")
    if ids.shape[-1] > vocab:
        raise ValueError(f"{ids_name}: expected k <= V = {vocab} ids per row, got k = {ids.shape[-1]}")
    check_tensor(lp_name, logprobs, kind="float", shape=tuple(ids.shape), device=device)
    k = ids.shape[-1]
    given = ids.reshape(-1, k).long()
    # an id outside [0, V) is a pad for the passes: never gathered, on any row (the value checks raise for the rows
    # in the loss; rows outside it, and validate=False, must still read nothing out of bounds)
    safe = torch.where((given >= 0) & (given < vocab), given, torch.full_like(given, -1))
    return SamplerHead(safe, logprobs.reshape(-1, k).detach(), mode, given_ids=given)


def check_head_values(checks: ValueChecks, head: SamplerHead, names: Tuple[str, str], vocab: int, rows: torch.Tensor,
                      labels: Optional[torch.Tensor]) -> None:
    """The value checks of a top-k head on the rows that take part (`rows`, [N] bool): ids in [0, V) or -1, no
    id twice in a row, log-probs not NaN and <= 0, Σ_H exp(log-prob) <= 1 + HEAD_MASS_SLACK in "selected" mode,
    and, in "support" mode, the sampled token among the ids (vLLM RFC #42259: a duplicated sampled token and
    invalid ids from an all--inf tile must raise, not corrupt the loss)."""
    if head is None or head.ids is None:
        return
    ids_name, lp_name = names
    ids, lp = head.given_ids, head.logprobs
    slots = ids >= 0
    live = slots & rows[:, None]
    checks.add((rows[:, None] & ((ids < -1) | (ids >= vocab))).any(),
               f"{ids_name}: expected token ids in [0, {vocab}) or -1 (padding)")
    ordered = torch.where(rows[:, None], ids, torch.full_like(ids, -1)).sort(1).values
    checks.add(((ordered[:, 1:] == ordered[:, :-1]) & (ordered[:, 1:] >= 0)).any(),
               f"{ids_name}: an id appears twice in a row (a top-k is a set of distinct ids)")
    checks.add((live & torch.isnan(lp)).any(), f"{lp_name}: expected no NaN at the ids, got NaN")
    checks.add((live & (lp > 0)).any(), f"{lp_name}: expected log-probs <= 0, got a positive value")
    if head.mode == "selected":
        zero = torch.zeros((), dtype=torch.float64, device=lp.device)
        mu = torch.where(live, lp.double().exp(), zero)
        # plus the rounding of each log-prob to its dtype (|log μ| eps / 2 relative in μ): bf16 log-probs of a
        # peaked row sum past 1 + 1e-4 by themselves
        spread = torch.where(live, mu * lp.double().abs(), zero).sum(1)
        slack = HEAD_MASS_SLACK + 0.5 * torch.finfo(lp.dtype).eps * spread
        checks.add((mu.sum(1) > 1 + slack).any(),
                   f"{lp_name}: expected full-vocabulary log-probs (sum of exp over a row's ids <= 1 + "
                   f"{HEAD_MASS_SLACK} plus the log-probs' own rounding), got a row whose mass exceeds that")
    elif labels is not None:
        checks.add((rows & (labels >= 0) & ~(live & (ids == labels[:, None])).any(1)).any(),
                   f"{ids_name}: mode='support' but a sampled token is not among its row's ids (the sampler's kept "
                   "set must contain what it drew)")


# ---------------------------------------------------------------- the prepared batches
def _check_options(config: PolicyLossConfig, args: Arguments) -> None:
    """Combinations of the config and the per-token inputs that have no meaning."""
    check_split_options(config, args.dp_group, args.cp_group)
    if config.loss_type == "reinforce" and args.old_logprobs is not None:
        raise ValueError(
            "old_logprobs: expected None with loss_type='reinforce' (the bypass-mode loss of SPEC §6); "
            "pass rollout_logprobs only, or use loss_type='ppo_clip'"
        )
    if config.kl_coef > 0 and args.ref_logprobs is None:
        raise ValueError(f"ref_logprobs: expected a tensor since kl_coef={config.kl_coef} > 0, got None")
    rc = config.rollout_correction
    if args.is_weights is not None and rc is not None and rc.is_level is not None:
        raise ValueError(f"is_weights: given while rollout_correction computes IS weights too (is_level="
                         f"{rc.is_level!r}); pass one or the other")
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
        advantages=layout.advantages, old_logprobs=_flat(args.old_logprobs),
        rollout_logprobs=_flat(args.rollout_logprobs), ref_logprobs=_flat(args.ref_logprobs),
        is_weights=None if args.is_weights is None else _flat(args.is_weights).detach(), **fields)


def prepare_loss(source: str, token_shape, local_vocab: int, device, args: Arguments,
                 config: PolicyLossConfig) -> PreparedBatch:
    """The checks every loss entry point makes on its per-token inputs (`source`: "logits" or "hidden", for
    the messages), then the batch: flat int64 row labels, and the mask m -- the response mask minus ignored
    tokens and (with validate=False) out-of-range labels, treated as masked so that nothing is ever read
    out of bounds."""
    V = vocab_size(local_vocab, device, args.tp_group, config.inplace_backward)
    check_tensor("labels", args.labels, kind="int", shape=token_shape, device=device)
    _check_per_token(token_shape, device, response_mask=args.response_mask, old_logprobs=args.old_logprobs,
                     rollout_logprobs=args.rollout_logprobs, ref_logprobs=args.ref_logprobs, is_weights=args.is_weights)
    if args.cu_seqlens is not None and len(token_shape) == 2:
        raise ValueError(f"cu_seqlens: must be None with padded [B, T, ...] {source}; pass [N, ...] {source} to pack "
                         "sequences")
    check_cu_seqlens(args.cu_seqlens, token_shape, device)
    _check_options(config, args)
    layout = _layout(token_shape, device, args)
    labels = args.labels.reshape(-1).long()  # compared in int64: -100 must not wrap in uint8/int8
    in_mask = args.response_mask.reshape(-1).bool()
    checks = ValueChecks() if config.validate else None
    if checks is not None:
        checks.layout(args.cu_seqlens, layout.num_tokens, args.token_index, layout.positions)
        checks.labels(in_mask, labels, V, args.ignore_index, "tokens of the response mask")
        checks.values(in_mask, "tokens of the response mask",
                      finite=[("advantages", layout.advantages), ("is_weights", _flat(args.is_weights))],
                      not_nan=[("old_logprobs", _flat(args.old_logprobs)),
                               ("rollout_logprobs", _flat(args.rollout_logprobs)),
                               ("ref_logprobs", _flat(args.ref_logprobs))])
    mask = in_mask & (labels >= 0) & (labels < V) & (labels != args.ignore_index)
    temperature, support = _sampler(args, token_shape, V, device, labels, mask, checks)
    head = prepare_head(SAMPLER_NAMES, args.sampler, token_shape, V, device, args.sampler_topk_mode)
    if checks is not None:
        check_head_values(checks, head, SAMPLER_NAMES[:2], V, mask, labels)
        checks.run()
    return _batch(token_shape, mask, layout, args, row_labels=_row_labels(labels, mask), vocab_size=V,
                  temperature=temperature, support=support, sampler_head=head)


def _row_labels(labels: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """Labels for the vocabulary passes: -1 on every row that takes no part (such rows are never read)."""
    return torch.where(keep, labels, torch.full_like(labels, -1))


def prepare_stats(token_shape, local_vocab: int, device, args: Arguments, backend: str, validate: bool,
                  inplace: bool = False) -> PreparedBatch:
    """The checks of the two token-statistics entry points; the batch of row labels (-1 on ignored rows
    and, with validate=False, out-of-range labels), the temperature and the kept ids."""
    check_tensor("labels", args.labels, kind="int", shape=token_shape, device=device)
    _check_group("dp_group", args.dp_group)  # accepted and unused: per-token statistics combine nothing
    _check_group("cp_group", args.cp_group)
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
    temperature, support = _sampler(args, token_shape, V, device, labels, keep, checks)
    if checks is not None:
        checks.run()
    return PreparedBatch(token_shape=token_shape, mask=keep, row_labels=_row_labels(labels, keep), vocab_size=V,
                         tp_group=args.tp_group, temperature=temperature, support=support)


class DivergenceRows(NamedTuple):
    """token_divergences' rows: which take part, their labels for the pass, the temperatures, the value checks."""
    rows: torch.Tensor  # [N] bool
    row_labels: torch.Tensor  # [N] int64: the label, -1 outside, FOREIGN_TARGET on rows without a label
    temperature: Temperature
    reference_temperature: Temperature
    checks: ValueChecks
    prepared: PreparedBatch  # what ops.head_stats reads


def prepare_divergence_rows(token_shape, vocab: int, device, labels, temperatures: Tuple, backend: str,
                            ignore_index: int, mask=None) -> DivergenceRows:
    """The checks of token_divergences' rows, labels and temperatures (the trainer's, the reference's or None),
    the label range among the value checks. `mask`: [...] bool or 0/1, the rows that take part (without labels;
    None: every row)."""
    temperature, reference_temperature = temperatures
    if backend not in BACKENDS:
        raise ValueError(f"backend: expected one of {BACKENDS}, got {backend!r}")
    checks = ValueChecks()
    N = math.prod(token_shape)
    if labels is None:
        rows = torch.ones(N, dtype=torch.bool, device=device)
        if mask is not None:
            check_tensor("response_mask", mask, kind="mask", shape=token_shape, device=device)
            rows = mask.reshape(-1).bool()
        row_labels = torch.where(rows, FOREIGN_TARGET, -1).to(torch.int64)
    else:
        check_tensor("labels", labels, kind="int", shape=token_shape, device=device)
        flat = labels.reshape(-1).long()
        checks.labels(flat != ignore_index, flat, vocab, ignore_index, "tokens whose label is not ignore_index")
        rows = (flat >= 0) & (flat < vocab) & (flat != ignore_index)
        row_labels = _row_labels(flat, rows)

    def one(name, t) -> Temperature:
        if isinstance(t, torch.Tensor):
            per_token = _per_token_temperature(t, token_shape, device)
            checks.add((~torch.isfinite(per_token) | (per_token <= 0)).any(), f"{name}: expected finite values > 0")
            return Temperature(per_token)
        check_finite_positive(name, t)
        return Temperature.of(t)

    t = one("temperature", temperature)
    t_ref = t if reference_temperature is None else one("reference_temperature", reference_temperature)
    prepared = PreparedBatch(token_shape=token_shape, mask=rows, row_labels=row_labels, vocab_size=vocab,
                             temperature=t)
    return DivergenceRows(rows, row_labels, t, t_ref, checks, prepared)


def prepare_policy(logprobs, args: Arguments, config: PolicyLossConfig) -> PreparedBatch:
    """`policy_loss`'s checks: log-probs (and entropy) from elsewhere, the same per-token inputs as the
    losses on logits."""
    check_tensor("logprobs", logprobs, kind="float")
    if logprobs.dim() not in (1, 2):
        raise ValueError(f"logprobs: expected [B, T] (padded) or [N] (packed), got shape {tuple(logprobs.shape)}")
    device, token_shape = logprobs.device, tuple(logprobs.shape)
    _check_per_token(token_shape, device, response_mask=args.response_mask, old_logprobs=args.old_logprobs,
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
        checks.values(mask, "tokens of the response mask",
                      finite=[("advantages", layout.advantages), ("is_weights", _flat(args.is_weights))],
                      not_nan=[("logprobs", _flat(logprobs)), ("old_logprobs", _flat(args.old_logprobs)),
                               ("rollout_logprobs", _flat(args.rollout_logprobs)),
                               ("ref_logprobs", _flat(args.ref_logprobs))])
        checks.run()
    return _batch(token_shape, mask, layout, args)


def prepare_correction(train_logprobs, args: Arguments, config: RolloutCorrection, validate: bool) -> PreparedBatch:
    """`rollout_correction`'s checks: the training policy's and the sampler's log-probs and the mask."""
    if not isinstance(config, RolloutCorrection):
        raise TypeError(f"config: expected a RolloutCorrection, got {type(config).__name__}")
    check_tensor("train_logprobs", train_logprobs, kind="float")
    if train_logprobs.dim() not in (1, 2):
        raise ValueError(f"train_logprobs: expected [B, T] or [N], got shape {tuple(train_logprobs.shape)}")
    device, token_shape = train_logprobs.device, tuple(train_logprobs.shape)
    _check_per_token(token_shape, device, rollout_logprobs=args.rollout_logprobs, response_mask=args.response_mask)
    check_cu_seqlens(args.cu_seqlens, token_shape, device)
    layout = _layout(token_shape, device, args)
    mask = args.response_mask.reshape(-1).bool()
    if validate:
        checks = ValueChecks()
        checks.layout(args.cu_seqlens, layout.num_tokens, args.token_index, layout.positions)
        checks.values(mask, "tokens of the response mask",
                      not_nan=[("train_logprobs", _flat(train_logprobs)),
                               ("rollout_logprobs", _flat(args.rollout_logprobs))])
        checks.run()
    return _batch(token_shape, mask, layout, args)


# ---------------------------------------------------------------- the optimal token baseline
def _rows_of(token_shape, cu_seqlens, device):
    """(row, position, number of rows, padded width) of flat tokens: a padded [B, T] batch flattened (its rows are
    its view's: no row or position tensors), or the packed sequences of cu_seqlens (one sequence without it)."""
    if len(token_shape) == 2:
        B, T = token_shape
        return None, None, B, T
    (N,) = token_shape
    cu = (torch.tensor([0, N], device=device) if cu_seqlens is None else cu_seqlens.to(device=device, dtype=torch.long))
    row = torch.searchsorted(cu[1:], torch.arange(N, device=device), right=True)
    return row, torch.arange(N, device=device) - cu.index_select(0, row), cu.numel() - 1, None


def prepare_baseline_rows(token_rewards, response_mask, group_index, old_logprobs, sum_pi_squared, is_weights,
                          cu_seqlens, validate: bool):
    """The checks of `optimal_token_baseline`, then its flat `TokenRows`."""
    from .stage.baseline import TokenRows

    check_tensor("token_rewards", token_rewards, kind="float")
    if token_rewards.dim() not in (1, 2):
        raise ValueError(f"token_rewards: expected [B, T] (padded) or [N] (packed), got shape "
                         f"{tuple(token_rewards.shape)}")
    device, token_shape = token_rewards.device, tuple(token_rewards.shape)
    _check_per_token(token_shape, device, response_mask=response_mask, old_logprobs=old_logprobs,
                     sum_pi_squared=sum_pi_squared, is_weights=is_weights)
    check_cu_seqlens(cu_seqlens, token_shape, device)
    row, position, num_rows, width = _rows_of(token_shape, cu_seqlens, device)
    check_tensor("group_index", group_index, kind="int", shape=(num_rows,), device=device)
    mask = response_mask.reshape(-1).bool()
    if validate:
        checks = ValueChecks()
        checks.layout(cu_seqlens, token_shape[0], None, None)
        checks.values(mask, "tokens of the response mask",
                      finite=[("token_rewards", token_rewards.reshape(-1)), ("is_weights", _flat(is_weights))],
                      not_nan=[("old_logprobs", old_logprobs.reshape(-1)),
                               ("sum_pi_squared", sum_pi_squared.reshape(-1))])
        checks.run()
    return TokenRows(token_rewards.reshape(-1).detach(), mask, old_logprobs.reshape(-1).detach(),
                     sum_pi_squared.reshape(-1).detach(), None if is_weights is None else _flat(is_weights).detach(),
                     row, position, group_index.reshape(-1).long(), width)


def prepare_variance_rows(advantages, response_mask, old_logprobs, sum_pi_squared, is_weights, cu_seqlens,
                          grad_norm):
    """The checks of `variance_proxy_metrics`, then its flat inputs."""
    from .stage.baseline import VarianceInputs

    check_tensor("advantages", advantages, kind="float")
    if advantages.dim() not in (1, 2):
        raise ValueError(f"advantages: expected [B, T] (padded) or [N] (packed), got shape {tuple(advantages.shape)}")
    device, token_shape = advantages.device, tuple(advantages.shape)
    _check_per_token(token_shape, device, response_mask=response_mask, old_logprobs=old_logprobs,
                     sum_pi_squared=sum_pi_squared, is_weights=is_weights)
    check_cu_seqlens(cu_seqlens, token_shape, device)
    if grad_norm is not None and (isinstance(grad_norm, bool) or not isinstance(grad_norm, (int, float))):
        raise TypeError(f"grad_norm: expected a number or None, got {grad_norm!r}")
    row, _, num_rows, width = _rows_of(token_shape, cu_seqlens, device)
    return VarianceInputs(advantages.reshape(-1).detach(), response_mask.reshape(-1).bool(),
                          old_logprobs.reshape(-1).detach(), sum_pi_squared.reshape(-1).detach(),
                          None if is_weights is None else _flat(is_weights).detach(), row, num_rows, width)
