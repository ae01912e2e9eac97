"""The chunked PyTorch backend: the CPU default and the fallback everywhere.

Rows are processed `chunk_rows` at a time, so at most a few float32 [chunk, V] temporaries exist at
once (peak extra memory O(chunk * V + N)); the full log-softmax is never materialised. Forward keeps
only (row_max, log_norm) and the entropy per row for the backward, which recomputes
p = exp((z - row_max) / T - log_norm) chunk by chunk.
"""

from typing import Iterator, Optional, Tuple

import torch

from .base import RowStats

# Elements per float32 temporary: 4 Mi = 16 MiB, large enough to keep vectorised CPU loops busy
# and small enough that three live temporaries stay well under a tenth of a [4096, 32768] logits.
CHUNK_ELEMENTS = 1 << 22


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


class TorchBackend:
    name = "torch"

    def __init__(self, chunk_rows: Optional[int] = None):
        self.chunk_rows = chunk_rows

    def supports(self, logits: torch.Tensor) -> bool:
        return True

    def _chunks(self, N: int, V: int) -> Iterator[Tuple[int, int]]:
        rows = self.chunk_rows or max(1, CHUNK_ELEMENTS // max(V, 1))
        for start in range(0, N, rows):
            yield start, min(N, start + rows)

    @staticmethod
    def _shifted(chunk: torch.Tensor, row_max: torch.Tensor, acc: torch.dtype, temperature: float) -> torch.Tensor:
        """(z - row_max) / T in the accumulation dtype, as a new tensor (the logits are never written)."""
        shifted = chunk.to(acc) - row_max
        return shifted.mul_(1.0 / temperature) if temperature != 1.0 else shifted

    def token_stats_fwd(self, logits, labels, temperature, compute_entropy, compute_sum_pi_squared) -> RowStats:
        N, V = logits.shape
        acc = accumulation_dtype(logits.dtype)
        valid = (labels >= 0) & (labels < V)
        safe_labels = labels.clamp(0, max(V - 1, 0)).unsqueeze(1)
        row_max = torch.zeros(N, dtype=acc, device=logits.device)
        log_norm = torch.zeros_like(row_max)
        logprobs = torch.zeros_like(row_max)
        entropy = torch.zeros_like(row_max) if compute_entropy else None
        sum_pi_squared = torch.zeros_like(row_max) if compute_sum_pi_squared else None
        for s, e in self._chunks(N, V):
            m = logits[s:e].amax(1, keepdim=True).to(acc)
            # -inf is the max identity; a row with no finite entry keeps shift 0 (its lse is -inf)
            m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
            shifted = self._shifted(logits[s:e], m, acc, temperature)
            ex = shifted.exp()
            s1 = ex.sum(1)
            log_s1 = s1.log()
            row_max[s:e] = m.squeeze(1)
            log_norm[s:e] = log_s1
            logprobs[s:e] = shifted.gather(1, safe_labels[s:e]).squeeze(1) - log_s1
            if compute_entropy:
                # H = -sum p log p = log s1 - sum(ex * shifted) / s1; ex = 0 at -inf logits, where
                # the product is 0 * -inf = NaN by IEEE but 0 by the limit p log p -> 0: nansum.
                entropy[s:e] = log_s1 - (ex * shifted).nansum(1) / s1
            if compute_sum_pi_squared:
                sum_pi_squared[s:e] = (ex * ex).sum(1) / (s1 * s1)
        zero = torch.zeros((), dtype=acc, device=logits.device)
        clean = lambda t: None if t is None else torch.where(valid, t, zero)  # noqa: E731
        return RowStats(clean(row_max), clean(log_norm), clean(logprobs), clean(entropy), clean(sum_pi_squared))

    def token_grad_bwd(self, logits, labels, row_max, log_norm, entropy, coef_logprob, coef_entropy, temperature, inplace):
        N, V = logits.shape
        acc = accumulation_dtype(logits.dtype)
        device = logits.device
        out = logits if inplace else torch.empty((N, V), dtype=logits.dtype, device=device)
        valid = (labels >= 0) & (labels < V)
        active = valid & ((coef_logprob != 0) | (coef_entropy != 0 if coef_entropy is not None else False))
        # Inactive rows get log_norm = +inf so that p = 0 and the row comes out exactly 0, even where
        # the logits hold no distribution (all -inf) or the coefficients are 0.
        log_norm = torch.where(active, log_norm.to(acc), torch.full((), float("inf"), dtype=acc, device=device))
        row_max = row_max.to(acc)
        c = torch.where(active, coef_logprob.to(acc), torch.zeros((), dtype=acc, device=device))
        safe_labels = labels.clamp(0, max(V - 1, 0)).unsqueeze(1)
        inv_t = 1.0 / temperature
        for s, e in self._chunks(N, V):
            log_p = self._shifted(logits[s:e], row_max[s:e, None], acc, temperature).sub_(log_norm[s:e, None])
            p = log_p.exp()
            c_rows = c[s:e, None]
            if coef_entropy is not None:
                # dH/dz = -p (log p + H): g = -p * (c + e * (log p + H)); where p = 0 the term is 0
                t = log_p.add_(entropy[s:e, None].to(acc)).mul_(coef_entropy[s:e, None].to(acc)).add_(c_rows)
                g = torch.where(p > 0, p.mul_(t).neg_(), torch.zeros((), dtype=acc, device=device))
            else:
                g = p.mul_(-c_rows)
            # the target column: c * (1 - p_y), formed in the accumulation dtype (never in bf16)
            g.scatter_add_(1, safe_labels[s:e], c_rows)
            if inv_t != 1.0:
                g.mul_(inv_t)
            out[s:e].copy_(g)
        return out
