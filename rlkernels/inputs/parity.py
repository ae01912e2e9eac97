"""The inputs of `logprob_parity`: two log-prob tensors of one dtype, the response mask, the layout, the buckets."""

import math
from typing import Sequence

from ..stage.parity import ParityRows
from .baseline import _rows_of
from .checks import ValueChecks, check_cu_seqlens, check_per_token, check_tensor

# bucket edges of the rollout probability: the tail where mismatch hurts most (SPEC §9's "where the sampler
# puts little mass") split by decades, then the body
DEFAULT_BUCKET_EDGES = (0.0, 1e-4, 1e-3, 1e-2, 0.1, 0.5, 0.9, 1.0)


def prepare_parity(trainer_logprobs, rollout_logprobs, response_mask, cu_seqlens,
                   bucket_edges: Sequence[float], validate: bool) -> ParityRows:
    check_tensor("trainer_logprobs", trainer_logprobs, kind="float")
    if trainer_logprobs.dim() not in (1, 2):
        raise ValueError(f"trainer_logprobs: expected [B, T] (padded) or [N] (packed), got shape "
                         f"{tuple(trainer_logprobs.shape)}")
    shape, device = tuple(trainer_logprobs.shape), trainer_logprobs.device
    check_per_token(shape, device, rollout_logprobs=rollout_logprobs, response_mask=response_mask)
    if rollout_logprobs.dtype != trainer_logprobs.dtype:
        raise TypeError(f"rollout_logprobs: a bitwise comparison needs the trainer_logprobs' dtype "
                        f"({trainer_logprobs.dtype}), got {rollout_logprobs.dtype}")
    check_cu_seqlens(cu_seqlens, shape, device)
    edges = tuple(float(e) for e in bucket_edges)
    if len(edges) < 2 or edges[0] != 0.0 or edges[-1] != 1.0 or any(b <= a for a, b in zip(edges, edges[1:])) \
            or not all(math.isfinite(e) for e in edges):
        raise ValueError(f"bucket_edges: expected increasing probabilities from 0.0 to 1.0, got {tuple(bucket_edges)}")
    mask = response_mask.detach().reshape(-1).bool()
    if validate:  # the loss's checks (offsets that do not cover the tokens would index out of range)
        checks = ValueChecks()
        checks.layout(cu_seqlens, shape[0], None, None)
        checks.mask_values("response_mask", response_mask)
        checks.values(mask, "tokens of the response mask",
                      not_nan=[("trainer_logprobs", trainer_logprobs.reshape(-1)),
                               ("rollout_logprobs", rollout_logprobs.reshape(-1))])
        checks.run()
    row, position, num_rows, width = _rows_of(shape, cu_seqlens, device)
    return ParityRows(trainer_logprobs.detach().reshape(-1), rollout_logprobs.detach().reshape(-1),
                      mask, row, position, num_rows, width, edges)
