"""The argument checks every public function shares (SPEC §11), in one message format:
`<argument>: expected <what>, got <what>`.

Structural checks (type, dtype, rank, shape, device) are free and always run, before any kernel. Value checks
(label range, cu_seqlens contents, NaN / inf, per-token temperatures, the sampler's ids) look at device memory:
`ValueChecks` gathers them into one flag tensor read with a single host synchronisation per call, and
`validate=False` skips them for sync-free steps.
"""

from typing import List, Mapping, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
INDEX_DTYPES = (torch.int32, torch.int64)
# Label dtypes: compared with ignore_index and [0, V) after a cast to int64, so that -100 never wraps
# in a narrow or unsigned dtype. uint16/32/64 lack the CPU kernels that cast needs in every torch.
LABEL_DTYPES = (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8)



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
    if allow_any_rank:  # [..., V] with at least one token dimension: a result per token, never a 0-d one
        if logits.dim() < 2:
            raise ValueError(f"logits: expected [..., V] with at least one token dimension ([N, V]; one row: "
                             f"logits[None]), got shape {tuple(logits.shape)}")
    elif logits.dim() not in (2, 3):
        raise ValueError(f"logits: expected [B, T, V] (padded) or [N, V] (packed), got shape {tuple(logits.shape)}")
    if logits.shape[-1] < 1:
        raise ValueError(f"logits: expected a vocabulary of at least 1 entry, got V = {logits.shape[-1]}")


def check_head(hidden, weight, bias, *, allow_any_rank: bool = False) -> None:
    """The fused-linear inputs: hidden [..., H] (or [B, T, H] / [N, H]), weight [V, H], bias [V] or None,
    one float dtype and one device."""
    check_tensor("hidden", hidden, kind="float")
    if allow_any_rank:  # as check_logits: at least one token dimension
        if hidden.dim() < 2:
            raise ValueError(f"hidden: expected [..., H] with at least one token dimension ([N, H]; one row: "
                             f"hidden[None]), got shape {tuple(hidden.shape)}")
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


def check_metrics(metrics) -> List[Tuple[str, object]]:
    """`metrics_to_floats`' argument: a mapping of names to one-element tensors (any real dtype, any device) or
    Python numbers; (name, value) pairs in its order."""
    if not isinstance(metrics, Mapping):
        raise TypeError(f"metrics: expected a dict of name -> 0-d tensor (a PolicyLossOutput's .metrics), got "
                        f"{_describe(metrics)}")
    for name, value in metrics.items():
        if isinstance(value, torch.Tensor):
            if value.numel() != 1 or value.dtype.is_complex:
                raise ValueError(f"metrics[{name!r}]: expected a 0-d (one-element) real tensor, got "
                                 f"{_describe(value)}")
        elif isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TypeError(f"metrics[{name!r}]: expected a 0-d tensor or a number, got {_describe(value)}")
    return list(metrics.items())


def check_group(name: str, group) -> None:
    if group is not None and not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"{name}: expected a torch.distributed ProcessGroup or None, got {type(group).__name__}")


def flat(t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """A per-token tensor on the flat token axis (None stays None; a flat one is returned as it is)."""
    return t if t is None or t.dim() == 1 else t.reshape(-1)


def check_per_token(shape, device, **tensors) -> None:
    for name, x in tensors.items():
        if x is not None:
            check_tensor(name, x, kind="mask" if name == "response_mask" else "float", shape=shape, device=device)



def _read_flags_eagerly(flags: torch.Tensor) -> List[bool]:
    return flags.tolist()  # the one host synchronisation


# Kept out of torch.compile: a graph break where the caller allows one, and under fullgraph=True an
# error whose text says what to do instead of a bare "unsupported .tolist()".
_read_flags = torch.compiler.disable(
    _read_flags_eagerly,
    reason="rlkernels: validate=True reads the value checks back to the host (one synchronisation); "
    "pass validate=False inside torch.compile(fullgraph=True) or a sync-free step",
)


# what a row of each source is, in refuse_non_finite_rows' message
_ROW_SOURCES = {
    "logits": "logits: expected finite logits on every row the pass reads, got a NaN or +inf logit in row {row}",
    "hidden": "hidden: expected finite logits hidden @ weight.T + bias on every row the pass reads, got a NaN or +inf "
              "logit in row {row} (a NaN or inf in that row of hidden, or in weight or bias)",
}


def refuse_non_finite_rows(source: str, logprobs: torch.Tensor, rows: torch.Tensor, token_shape) -> None:
    """validate=True, after the vocabulary pass: a row the pass read whose logits hold a NaN or +inf has a NaN
    log-prob (backends.base: every backend keeps the NaN; a row of -inf logits has a -inf one, which is legal), so
    the [N] log-probs say which rows are bad without another read of [N, V]. One host synchronisation, for the
    first offending row's index in the caller's token shape. `source`: "logits" or "hidden"."""
    if logprobs.numel() == 0:
        return
    bad = rows & torch.isnan(logprobs.detach())
    first = torch.where(bad.any(), bad.int().argmax(), -1)
    (index,) = _read_flags(first.reshape(1))
    if index >= 0:
        row = tuple(int(i) for i in torch.unravel_index(torch.tensor(index), tuple(token_shape)))
        raise ValueError(_ROW_SOURCES[source].format(row=row[0] if len(row) == 1 else row))


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

    def mask_values(self, name: str, mask: torch.Tensor) -> None:
        """A numeric mask must hold 0 and 1 only: it is read as bool, so a weight of 0.5 (or a NaN) would silently
        count as a whole token."""
        if mask.dtype != torch.bool:
            self.add(((mask != 0) & (mask != 1)).any(), f"{name}: expected a bool mask or values 0 and 1, got "
                     "another value (a weight such as 0.5 would count as a whole token: weigh tokens through the "
                     "advantages instead)")

    def values(self, valid: torch.Tensor, where: str, finite: Sequence[Tuple[str, Optional[torch.Tensor]]] = (),
               not_nan: Sequence[Tuple[str, Optional[torch.Tensor]]] = ()) -> None:
        """`finite`: no NaN or ±inf (advantages, weights); `not_nan`: log-probs and the like, which may be -inf (a
        probability of 0) but never NaN or +inf (a probability above 1)."""
        for name, x in not_nan:
            if x is not None:
                self.add((valid & (torch.isnan(x) | (x == float("inf")))).any(),
                         f"{name}: expected no NaN or +inf on {where} (-inf is a probability of 0; +inf is none), "
                         "got NaN or +inf")
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


