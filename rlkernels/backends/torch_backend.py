"""The chunked PyTorch backend: the CPU default and the fallback everywhere.

Rows are processed `chunk_rows` at a time, so at most a few float32 [chunk, V] temporaries exist at
once (peak extra memory O(chunk * V + N)); the full log-softmax is never materialised. Forward keeps
only (row_max, log_norm) and the entropy per row for the backward, which recomputes
p = exp((z - row_max) / T - log_norm) chunk by chunk.
"""

from typing import Iterator, Optional, Tuple

import torch

from .base import RowStats

# Rows per chunk: ~1 Mi elements (4 MiB in float32) keeps a chunk cache-resident, so the handful of
# elementwise passes below cost about one read of the logits and one write of the gradient from
# main memory, while each op still has enough work to amortise its dispatch (measured on 2 cores,
# N = 2048, V = 32768 fwd+bwd: 256 Ki elements 1.37 s, 1 Mi 0.99 s, 4 Mi 1.41 s, 16 Mi 1.55 s;
# the naive fp32 log_softmax composition 1.57 s).
CHUNK_ELEMENTS = 1 << 20


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
    def _shifted(chunk, row_max, acc, temperature, out=None) -> torch.Tensor:
        """(z - row_max) / T in the accumulation dtype, into `out` or a new buffer (never into the
        logits unless `out` is their storage, i.e. an in-place backward)."""
        shifted = torch.sub(chunk.to(acc), row_max, out=out)
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
            # -inf is the max identity; a row with no finite entry keeps shift 0 (and gets log_norm
            # = -inf, logprob = -inf, entropy 0, sum p^2 0: no distribution, never NaN)
            m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
            shifted = self._shifted(logits[s:e], m, acc, temperature)
            target = shifted.gather(1, safe_labels[s:e]).squeeze(1)
            ex = shifted.exp() if compute_entropy else shifted.exp_()
            s1 = ex.sum(1)
            log_s1 = s1.log()
            row_max[s:e] = m.squeeze(1)
            log_norm[s:e] = log_s1
            logprobs[s:e] = target - log_s1
            has_mass = s1 > 0
            if compute_entropy:
                # H = -sum p log p = log s1 - sum(ex * shifted) / s1; ex = 0 at -inf logits, where
                # the product is 0 * -inf = NaN by IEEE but 0 by the limit p log p -> 0: nansum.
                h = log_s1 - ex.mul_(shifted).nansum(1) / s1
                entropy[s:e] = torch.where(has_mass, h, torch.zeros_like(h))
            if compute_sum_pi_squared:
                ex2 = ex.square_().sum(1) if not compute_entropy else (shifted.exp_().square_()).sum(1)
                sum_pi_squared[s:e] = torch.where(has_mass, ex2 / (s1 * s1), torch.zeros_like(s1))
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
        # Inactive rows, and rows without a distribution (log_norm = -inf), get log_norm = +inf so
        # that p = 0: inactive rows come out exactly 0, distribution-less ones as c at the target.
        usable = active & (log_norm > float("-inf"))
        log_norm = torch.where(usable, log_norm.to(acc), torch.full((), float("inf"), dtype=acc, device=device))
        row_max = row_max.to(acc)
        c = torch.where(active, coef_logprob.to(acc), torch.zeros((), dtype=acc, device=device))
        safe_labels = labels.clamp(0, max(V - 1, 0)).unsqueeze(1)
        inv_t = 1.0 / temperature
        write_direct = out.dtype == acc  # build the gradient in its destination: no extra copy
        for s, e in self._chunks(N, V):
            buf = self._shifted(logits[s:e], row_max[s:e, None], acc, temperature, out=out[s:e] if write_direct else None)
            log_p = buf.sub_(log_norm[s:e, None])  # (z - row_max)/T - log_norm, in this order: see RowStats
            c_rows = c[s:e, None]
            if coef_entropy is not None:
                # dH/dz = -p (log p + H): g = -p * (c + e * (log p + H)); where p = 0 the term is 0
                p = log_p.exp()
                t = log_p.add_(entropy[s:e, None].to(acc)).mul_(coef_entropy[s:e, None].to(acc)).add_(c_rows)
                g = t.mul_(p).neg_().masked_fill_(p == 0, 0.0)
            else:
                g = log_p.exp_().mul_(-c_rows)
            # the target column: c * (1 - p_y), formed in the accumulation dtype (never in bf16)
            g.scatter_add_(1, safe_labels[s:e], c_rows)
            if inv_t != 1.0:
                g.mul_(inv_t)
            if not write_direct:
                out[s:e].copy_(g)
        return out
