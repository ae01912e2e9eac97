"""The two vocabulary-wide passes as torch.library custom ops, so torch.compile sees them as opaque
ops (with shapes from the fake implementations) instead of tracing into backend code.

`rlkernels::token_stats` (forward) carries its own autograd formula: its backward calls
`rlkernels::token_grad` (or the mutating `rlkernels::token_grad_`, for an in-place backward that
writes into the logits' storage; the op's schema declares the mutation, so autograd bumps the
logits' version counter and any other user of the old values fails loudly).

Absent optional outputs (entropy, sum p^2) are returned as empty [0] tensors: custom ops return
tensors only. The temperature arrives as `Temperature.tensor` (a 0-d float64 CPU tensor, or the [N]
per-row one; see backends/temperature.py for why) and is wrapped again here.
"""

from typing import NamedTuple, Tuple

import torch
from torch import Tensor

from .. import backends
from ..backends.temperature import Temperature


def engine_logprobs(numerics: str, impl, logits: Tensor, labels: Tensor, temperature: Temperature,
                    logprobs: Tensor) -> Tensor:
    """The sampled token's log-prob in the order `numerics` names: the pass's own (`logprobs`), or the engine's,
    as backend `impl` reproduces it (Backend.vllm_logprobs). The statistics and the gradient stay the pass's: only
    these values change."""
    if numerics == "vllm":  # processed: the sampling distribution's (vLLM's logprobs_mode="processed_logprobs")
        return impl.vllm_logprobs(logits, labels, temperature).to(logprobs.dtype)
    if numerics == "vllm_raw":  # raw: the model's, before the temperature (vLLM's default logprobs_mode)
        return impl.vllm_logprobs(logits, labels, Temperature.of(1.0)).to(logprobs.dtype)
    return logprobs


def refuse_double_backward() -> None:
    """Autograd runs a backward with grad mode on only under create_graph=True. The backward passes
    here are kernels, not differentiable torch code, so a second derivative would silently come out
    as zero: refuse instead."""
    if torch.is_grad_enabled() and not torch.compiler.is_compiling():
        raise RuntimeError(
            "rlkernels: second derivatives are not supported (backward(create_graph=True) through the fused "
            "loss or token_logprobs); differentiate once, or use rlkernels.reference for higher orders"
        )


def _backend(name: str, logits: Tensor, chunk_rows: int):
    return backends.select(name, logits, chunk_rows or None)


@torch.library.custom_op("rlkernels::token_stats", mutates_args=())
def token_stats(
    logits: Tensor, labels: Tensor, temperature: Tensor, compute_entropy: bool, compute_sum_pi_squared: bool,
    inplace_backward: bool, backend: str, chunk_rows: int, numerics: str = "default",
) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    # logits: (N, V) or (B, T, V) row-strided; labels: (N,) int64, -1 on rows that take no part. `inplace_backward` only
    # matters to the backward (see the module docstring).
    T = Temperature(temperature)
    impl = _backend(backend, logits, chunk_rows)
    stats = impl.token_stats_fwd(logits, labels, T, compute_entropy, compute_sum_pi_squared)
    logprobs = engine_logprobs(numerics, impl, logits, labels, T, stats.logprobs)
    absent = lambda t: stats.logprobs.new_empty(0) if t is None else t  # noqa: E731 (outputs may not alias)
    return stats.row_max, stats.log_norm, logprobs, absent(stats.entropy), absent(stats.sum_pi_squared)


@token_stats.register_fake
def _(logits, labels, temperature, compute_entropy, compute_sum_pi_squared, inplace_backward, backend, chunk_rows,
      numerics="default"):
    N = labels.shape[0]  # logits are [N, V] or [B, T, V] (see backends.base)
    new = lambda n: logits.new_empty(n, dtype=backends.statistics_dtype(logits.dtype))  # noqa: E731
    return new(N), new(N), new(N), new(N if compute_entropy else 0), new(N if compute_sum_pi_squared else 0)


@torch.library.custom_op("rlkernels::token_grad", mutates_args=())
def token_grad(
    logits: Tensor, labels: Tensor, row_max: Tensor, log_norm: Tensor, entropy: Tensor, coef_logprob: Tensor,
    coef_entropy: Tensor, temperature: Tensor, backend: str, chunk_rows: int,
) -> Tensor:
    has_entropy = coef_entropy.numel() > 0
    return _backend(backend, logits, chunk_rows).token_grad_bwd(
        logits, labels, row_max, log_norm, entropy if has_entropy else None, coef_logprob,
        coef_entropy if has_entropy else None, Temperature(temperature), False,
    )


@token_grad.register_fake
def _(logits, labels, row_max, log_norm, entropy, coef_logprob, coef_entropy, temperature, backend, chunk_rows):
    return torch.empty_like(logits, memory_format=torch.contiguous_format)


@torch.library.custom_op("rlkernels::token_grad_", mutates_args=("logits",))
def token_grad_(
    logits: Tensor, labels: Tensor, row_max: Tensor, log_norm: Tensor, entropy: Tensor, coef_logprob: Tensor,
    coef_entropy: Tensor, temperature: Tensor, backend: str, chunk_rows: int,
) -> None:
    has_entropy = coef_entropy.numel() > 0
    out = _backend(backend, logits, chunk_rows).token_grad_bwd(
        logits, labels, row_max, log_norm, entropy if has_entropy else None, coef_logprob,
        coef_entropy if has_entropy else None, Temperature(temperature), True,
    )
    if out.data_ptr() != logits.data_ptr():  # a backend that could not work in place
        logits.copy_(out)


@token_grad_.register_fake
def _(logits, labels, row_max, log_norm, entropy, coef_logprob, coef_entropy, temperature, backend, chunk_rows):
    return None


class SavedPass(NamedTuple):
    """What a vocabulary pass keeps for its backward (`pass_gradient`): its rows' labels, two-part normaliser and
    entropy, the temperature as the custom ops take it, and how it ran."""
    labels: Tensor  # [N] int64 (-1 outside, FOREIGN_TARGET: no label)
    row_max: Tensor  # [N]
    log_norm: Tensor  # [N]
    entropy: Tensor  # [N], or empty [0] when the pass formed none
    temperature: Tensor  # 0-d float64 CPU, or [N]
    backend: str  # a resolved backend name
    chunk_rows: int


def pass_gradient(logits: Tensor, saved: SavedPass, coef_logprob: Tensor, coef_entropy: Tensor,
                  inplace: bool = False) -> Tensor:
    """dlogits of the pass `saved` for the per-row coefficients (c_t, e_t) (an empty coef_entropy: e = 0), through
    the custom op by name; `inplace`: written into the logits' storage (the op declares the mutation, so the
    version counter is bumped)."""
    args = dict(labels=saved.labels, row_max=saved.row_max, log_norm=saved.log_norm, entropy=saved.entropy,
                coef_logprob=coef_logprob, coef_entropy=coef_entropy, temperature=saved.temperature,
                backend=saved.backend, chunk_rows=saved.chunk_rows)
    if inplace:
        token_grad_(logits, **args)
        return logits
    return token_grad(logits, **args)


def _setup_context(ctx, inputs, output):
    logits, labels, temperature, _, _, inplace_backward, backend, chunk_rows, _ = inputs
    row_max, log_norm, _, entropy, _ = output
    ctx.save_for_backward(logits, labels, row_max, log_norm, entropy, temperature)
    ctx.options = (inplace_backward, backend, chunk_rows)
    ctx.mark_non_differentiable(row_max, log_norm, output[4])
    # the outputs nobody differentiates (the normaliser, sum p^2, an entropy without a coefficient) arrive as None,
    # not as [N] zeros autograd would fill for them: four launches per backward saved, and the backward skips them
    ctx.set_materialize_grads(False)


def _backward(ctx, _g_row_max, _g_log_norm, grad_logprobs, grad_entropy, _g_sum_pi_squared):
    refuse_double_backward()
    logits, labels, row_max, log_norm, entropy, temperature = ctx.saved_tensors
    inplace_backward, backend, chunk_rows = ctx.options
    if grad_logprobs is None:
        grad_logprobs = torch.zeros_like(row_max)
    use_entropy = grad_entropy is not None and entropy.numel() > 0
    coef_entropy = grad_entropy.to(row_max.dtype) if use_entropy else row_max.new_empty(0)
    saved = SavedPass(labels, row_max, log_norm, entropy, temperature, backend, chunk_rows)
    # inplace: the gradient is written into the logits' storage; the op's declared mutation bumps the version
    # counter, so another op that saved these logits fails instead of reading a gradient
    dlogits = pass_gradient(logits, saved, grad_logprobs.to(row_max.dtype), coef_entropy, inplace_backward)
    return dlogits, None, None, None, None, None, None, None, None


token_stats.register_autograd(_backward, setup_context=_setup_context)
