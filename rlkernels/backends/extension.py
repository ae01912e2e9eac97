"""Backends whose two passes are compiled ops with one schema (csrc/): `torch.ops.<namespace>.*`.

The CUDA kernels (`rlkernels_cuda`, csrc/*.cu) and the CPU kernels (`rlkernels_cpu`,
csrc/cpu/token_passes.cpp) take the same arguments: logits [N, V] with unit stride along V and one row
stride, int64 labels, float32 [N] statistics and coefficients, and a temperature that is one float or
(a per-token temperature) the rows' float32 1/T. This class adapts the backend protocol
(base.Backend) to them: casts, and one call per batch row for [B, T, V] views whose rows are not one
strided sequence (the causal shift), read where they lie instead of copied. The passes without a compiled
op here (the head ids, and the full-form divergences on CUDA) are the torch backend's, inherited.
"""

from typing import Optional

import torch

from .base import RowStats, paired_row_groups, row_groups
from .temperature import Temperature
from .torch_backend import TorchBackend


def register_fakes(namespace: str) -> None:
    """Shape-only implementations, so that the ops trace under torch.compile / FakeTensor."""

    @torch.library.register_fake(f"{namespace}::token_stats_fwd")
    def _(logits, labels, temperature, compute_entropy, compute_sum_pi_squared, inv_temperature=None):
        N = logits.shape[0]
        new = lambda n: logits.new_empty((n,), dtype=torch.float32)  # noqa: E731
        return new(N), new(N), new(N), new(N if compute_entropy else 0), new(N if compute_sum_pi_squared else 0)

    @torch.library.register_fake(f"{namespace}::token_grad_bwd")
    def _(logits, labels, row_max, log_norm, entropy, coef_logprob, coef_entropy, temperature, inv_temperature=None):
        return torch.empty_like(logits, memory_format=torch.contiguous_format)

    @torch.library.register_fake(f"{namespace}::token_grad_bwd_inplace")
    def _(logits, labels, row_max, log_norm, entropy, coef_logprob, coef_entropy, temperature, inv_temperature=None):
        return None

    @torch.library.register_fake(f"{namespace}::token_grad_bwd_out")
    def _(logits, labels, row_max, log_norm, entropy, coef_logprob, coef_entropy, temperature, dlogits,
          inv_temperature=None):
        return None


class ExtensionBackend(TorchBackend):
    name = ""
    namespace = ""

    def _ops(self):
        return getattr(torch.ops, self.namespace)

    def _normalising_pass(self) -> "ExtensionBackend":
        return self  # the kernels compute every active row's normaliser

    def token_stats_fwd(self, logits, labels, temperature, compute_entropy, compute_sum_pi_squared) -> RowStats:
        # logits: (N, V) or (B, T, V) with unit stride along V; labels: (N,) int64, -1 on skipped rows
        labels = _labels(labels)
        scalar, inverse = Temperature.of(temperature).kernel_args()
        pieces = [
            self._ops().token_stats_fwd(
                rows, labels[start:start + rows.shape[0]], scalar, bool(compute_entropy),
                bool(compute_sum_pi_squared), None if inverse is None else inverse[start:start + rows.shape[0]],
            )
            for start, rows in row_groups(logits)
        ]
        row_max, log_norm, logprobs, entropy, sum_pi_squared = (
            p[0] if len(pieces) == 1 else torch.cat(p) for p in zip(*pieces)
        )
        return RowStats(
            row_max, log_norm, logprobs, entropy if compute_entropy else None,
            sum_pi_squared if compute_sum_pi_squared else None,
        )

    def token_grad_bwd(
        self, logits, labels, row_max, log_norm, entropy: Optional[torch.Tensor], coef_logprob,
        coef_entropy: Optional[torch.Tensor], temperature, inplace,
    ) -> torch.Tensor:
        # coefficients arrive in the statistics' dtype from autograd; the kernels read float32 [N]
        has_entropy = coef_entropy is not None
        vectors = (
            _labels(labels), _f32(row_max), _f32(log_norm), _f32(entropy) if has_entropy else None,
            _f32(coef_logprob), _f32(coef_entropy) if has_entropy else None,
        )
        out = logits if inplace else torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)
        scalar, inverse = Temperature.of(temperature).kernel_args()
        for start, rows, out_rows in paired_row_groups(logits, out):
            stop = start + rows.shape[0]
            args = (rows, *(None if v is None else v[start:stop] for v in vectors), scalar)
            inv = None if inverse is None else inverse[start:stop]
            if inplace:
                self._ops().token_grad_bwd_inplace(*args, inv)  # the caller bumps logits' version counter
            else:
                self._ops().token_grad_bwd_out(*args, out_rows, inv)
        return out

    def head_stats_fwd(self, logits, labels, head_ids, temperature, compute_entropy, compute_sum_pi_squared):
        """The pass, then the head's log-probs by the extension's own k reads per row where it has them
        (head_logprobs_fwd: the CPU kernels), else by torch (TorchBackend.head_stats_fwd)."""
        if not hasattr(self._ops(), "head_logprobs_fwd"):
            return super().head_stats_fwd(logits, labels, head_ids, temperature, compute_entropy,
                                          compute_sum_pi_squared)
        stats = self.token_stats_fwd(logits, labels, temperature, compute_entropy, compute_sum_pi_squared)
        labels, head_ids = _labels(labels), _labels(head_ids)
        scalar, inverse = Temperature.of(temperature).kernel_args()
        pieces = [self._ops().head_logprobs_fwd(rows, labels[s:s + rows.shape[0]], head_ids[s:s + rows.shape[0]],
                                                stats.row_max[s:s + rows.shape[0]], stats.log_norm[s:s + rows.shape[0]],
                                                scalar, None if inverse is None else inverse[s:s + rows.shape[0]])
                  for s, rows in row_groups(logits)]
        return stats, pieces[0] if len(pieces) == 1 else torch.cat(pieces)

    def head_grad_bwd(self, logits, labels, head_ids, row_max, log_norm, entropy, logprobs, head, coef_logprob,
                      coef_head, coef_entropy, temperature):
        """The head's columns inside the kernel's backward loop where the extension has it (head_grad_bwd_out: the
        CPU kernels), else the plain kernel and torch's column writes (TorchBackend.head_grad_bwd)."""
        if not hasattr(self._ops(), "head_grad_bwd_out"):
            return super().head_grad_bwd(logits, labels, head_ids, row_max, log_norm, entropy, logprobs, head,
                                         coef_logprob, coef_head, coef_entropy, temperature)
        has_entropy = coef_entropy is not None
        vectors = (
            _labels(labels), _f32(row_max), _f32(log_norm), _f32(entropy) if has_entropy else None,
            _f32(coef_logprob), _f32(coef_entropy) if has_entropy else None, _labels(head_ids), _f32(coef_head),
        )
        out = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)
        scalar, inverse = Temperature.of(temperature).kernel_args()
        for start, rows, out_rows in paired_row_groups(logits, out):
            stop = start + rows.shape[0]
            args = (rows, *(None if v is None else v[start:stop] for v in vectors), scalar)
            self._ops().head_grad_bwd_out(*args, out_rows, None if inverse is None else inverse[start:stop])
        return out


def _labels(labels: torch.Tensor) -> torch.Tensor:
    return labels if labels.dtype == torch.int64 and labels.is_contiguous() else labels.to(torch.int64).contiguous()


def _f32(t: torch.Tensor) -> torch.Tensor:
    return t if t.dtype == torch.float32 and t.is_contiguous() else t.to(torch.float32).contiguous()
