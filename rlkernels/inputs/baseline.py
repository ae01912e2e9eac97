"""The inputs of the optimal token baseline and verl's variance proxies (SPEC §10), checked and flattened."""

from typing import NamedTuple

import torch

from ..config import check_finite_positive
from ..stage.baseline import TokenRows, VarianceInputs
from .checks import ValueChecks, check_cu_seqlens, check_per_token, check_tensor, flat


class BaselineOptions(NamedTuple):
    multi_turn: bool
    handle_zero_tail: bool
    eps: float


def check_baseline_options(multi_turn, handle_zero_tail, eps) -> BaselineOptions:
    if not isinstance(multi_turn, bool) or not isinstance(handle_zero_tail, bool):
        raise TypeError(f"multi_turn / handle_zero_tail: expected bools, got {multi_turn!r} / {handle_zero_tail!r}")
    return BaselineOptions(multi_turn, handle_zero_tail, check_finite_positive("eps", eps, allow_zero=True))


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
    check_tensor("token_rewards", token_rewards, kind="float")
    if token_rewards.dim() not in (1, 2):
        raise ValueError(f"token_rewards: expected [B, T] (padded) or [N] (packed), got shape "
                         f"{tuple(token_rewards.shape)}")
    device, token_shape = token_rewards.device, tuple(token_rewards.shape)
    check_per_token(token_shape, device, response_mask=response_mask, old_logprobs=old_logprobs,
                     sum_pi_squared=sum_pi_squared, is_weights=is_weights)
    check_cu_seqlens(cu_seqlens, token_shape, device)
    row, position, num_rows, width = _rows_of(token_shape, cu_seqlens, device)
    check_tensor("group_index", group_index, kind="int", shape=(num_rows,), device=device)
    mask = response_mask.reshape(-1).bool()
    if validate:
        checks = ValueChecks()
        checks.layout(cu_seqlens, token_shape[0], None, None)
        checks.mask_values("response_mask", response_mask)
        checks.values(mask, "tokens of the response mask",
                      finite=[("token_rewards", token_rewards.reshape(-1)), ("is_weights", flat(is_weights))],
                      not_nan=[("old_logprobs", old_logprobs.reshape(-1)),
                               ("sum_pi_squared", sum_pi_squared.reshape(-1))])
        checks.run()
    return TokenRows(token_rewards.reshape(-1).detach(), mask, old_logprobs.reshape(-1).detach(),
                     sum_pi_squared.reshape(-1).detach(), None if is_weights is None else flat(is_weights).detach(),
                     row, position, group_index.reshape(-1).long(), width)


def prepare_variance_rows(advantages, response_mask, old_logprobs, sum_pi_squared, is_weights, cu_seqlens,
                          grad_norm):
    """The checks of `variance_proxy_metrics`, then (its flat inputs, the gradient norm: a float, a detached 0-d
    tensor or None)."""
    check_tensor("advantages", advantages, kind="float")
    if advantages.dim() not in (1, 2):
        raise ValueError(f"advantages: expected [B, T] (padded) or [N] (packed), got shape {tuple(advantages.shape)}")
    device, token_shape = advantages.device, tuple(advantages.shape)
    check_per_token(token_shape, device, response_mask=response_mask, old_logprobs=old_logprobs,
                     sum_pi_squared=sum_pi_squared, is_weights=is_weights)
    check_cu_seqlens(cu_seqlens, token_shape, device)
    if isinstance(grad_norm, torch.Tensor):
        # what clip_grad_norm_ returns: kept on the device (reading it would be a host sync)
        if grad_norm.dim() != 0 or not grad_norm.dtype.is_floating_point:
            raise TypeError(f"grad_norm: expected a number, a 0-d float tensor or None, got a tensor of shape "
                            f"{tuple(grad_norm.shape)} and dtype {grad_norm.dtype}")
        grad_norm = grad_norm.detach()
    elif grad_norm is not None and (isinstance(grad_norm, bool) or not isinstance(grad_norm, (int, float))):
        raise TypeError(f"grad_norm: expected a number, a 0-d float tensor or None, got {grad_norm!r}")
    row, _, num_rows, width = _rows_of(token_shape, cu_seqlens, device)
    rows = VarianceInputs(advantages.reshape(-1).detach(), response_mask.reshape(-1).bool(),
                          old_logprobs.reshape(-1).detach(), sum_pi_squared.reshape(-1).detach(),
                          None if is_weights is None else flat(is_weights).detach(), row, num_rows, width)
    return rows, grad_norm
