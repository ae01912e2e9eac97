"""The sampler's inputs (SPEC §2.3, §9): its temperature, its kept ids (`sampling_support`) and its distribution
given as top-k ids with log-probs or as logits (`SamplerHead`), checked and flattened to the token axis."""

from typing import NamedTuple, Optional, Tuple

import torch

from ..backends.base import statistics_dtype
from ..backends.temperature import Temperature
from ..outputs import TokenDivergences
from ..stage.divergences import Divergences
from .checks import ValueChecks, check_tensor


def per_token_temperature(temperature: torch.Tensor, token_shape, device) -> torch.Tensor:
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


def temperature_and_support(args, token_shape, vocab: int, device, labels: torch.Tensor, keep: torch.Tensor,
                            checks: Optional[ValueChecks]) -> Tuple[Temperature, Optional[torch.Tensor]]:
    """The Temperature and the sampler's kept ids ([N, K] int64, or None) of `args` (an Arguments), checked:
    types, shapes and devices always; with `checks`, positive finite temperatures, ids in [-1, V), no id twice
    in a row, and every label in the loss among its row's ids. A float temperature was checked already
    (PolicyLossConfig, or prepare_stats)."""
    temperature = args.temperature
    per_token = isinstance(temperature, torch.Tensor)
    temperature = Temperature(per_token_temperature(temperature, token_shape, device)) if per_token \
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




def given_divergences(divergences, token_shape, config) -> Tuple[Optional[Divergences], str]:
    """rollout_correction's `divergences` (a TokenDivergences of token_divergences(...)), checked and flattened to
    [N] in the statistics' dtype, with its metric prefix ("full" or "topk"); (None, "") when not given. `config`:
    the RolloutCorrection, whose TRM options need them."""
    if divergences is None:
        if config.needs_divergence:
            raise ValueError("divergences: expected token_divergences(...) since config.rs has a seq_max_kl / "
                             "seq_mean_kl option (Trust Region Masking's KL(μ_t || π_t)), got None")
        return None, ""
    if not isinstance(divergences, TokenDivergences):
        raise TypeError(f"divergences: expected the TokenDivergences of token_divergences(...), got "
                        f"{type(divergences).__name__}")
    if tuple(divergences.kl.shape) != tuple(token_shape):
        raise ValueError(f"divergences: expected values of the tokens' shape {tuple(token_shape)}, got "
                         f"{tuple(divergences.kl.shape)}")
    flat = (None if t is None else t.reshape(-1).to(statistics_dtype(t.dtype)) if t.is_floating_point()
            else t.reshape(-1) for t in divergences[:7])
    return Divergences(*flat), "full" if divergences.form == "full" else "topk"
