"""The chunked PyTorch backend: the fallback everywhere, and the base class of the other backends (each
overrides the passes it has kernels for and inherits the rest in this form).

Rows are processed `chunk_rows` at a time, so at most a few float32 [chunk, V] temporaries exist at
once (peak extra memory O(chunk * V + N)); the full log-softmax is never materialised.

Each chunk goes through as few ATen ops as possible, because on a CPU every op is its own parallel
region and separate elementwise passes cost more than the arithmetic: the forward is amax +
log_softmax (one fused kernel), the backward recomputes p with ATen's fused softmax and writes
-c * p / T straight into the gradient, then overwrites the target column with c * (1 - p_y) / T
formed in float32. The backward therefore does not replay the saved (row_max, log_norm): a fused
softmax over a cache-resident chunk is cheaper here than the separate passes replaying would take.

The full-form divergences (SPEC §9.2) read both logits tensors a chunk of rows at a time, and the backward
reads them again and forms, for coefficients (a, b, c, d) of the four,

    dz_v = ( a (π_v - μ_v) + b π_v (log π_v - log μ_v - KL(π||μ)) + 2 c (π_v² / μ_v - π_v (χ² + 1))
             + d π_v (s_v - sum_u π_u s_u) / 2 ) / T,              s = sign(π - μ);

autograd reaches the trainer's logits only (μ is a fixed target).
"""

from typing import Iterator, Optional, Tuple

import torch

from .base import (
    DIVERGENCE_STATS,
    FOREIGN_TARGET,
    RowStats,
    head_logprobs,
    num_rows,
    paired_row_groups,
    row_groups,
    statistics_dtype,
)
from .temperature import Temperature

# Rows per chunk: ~1 Mi elements (4 MiB in float32) keeps a chunk cache-resident, so the handful of
# elementwise passes below cost about one read of the logits and one write of the gradient from
# main memory, while each op still has enough work to amortise its dispatch (measured on 2 cores,
# N = 2048, V = 32768 fwd+bwd: 256 Ki elements 1.37 s, 1 Mi 0.99 s, 4 Mi 1.41 s, 16 Mi 1.55 s;
# the naive fp32 log_softmax composition 1.57 s).
CHUNK_ELEMENTS = 1 << 20
# On a GPU a chunk costs ~10 kernel launches whatever its size, and no cache holds one: at 1 Mi elements an
# 8192 x 151,936 batch is 1,366 chunks, 226 ms forward against the naive composition's 8.4 ms (H200,
# 2026-12-04, benchmarks/gpu_check.sh). 32 Mi elements (128 MiB per float32 temporary) make it 38 chunks.
DEVICE_CHUNK_ELEMENTS = 1 << 25
# Row sums in blocks of this many columns, then across the blocks: ATen sums a row shorter than its parallel grain
# (32,768) in one thread in one order, but a longer row across threads when the rows are too few to share out
# (a lone row at V = 40,000 gave other bits than the same row in a batch). No block reaches the grain, so each
# row's sum is the same whatever the batch, the chunk or the thread count.
ROW_SUM_BLOCK = 4096


def row_sum(t: torch.Tensor) -> torch.Tensor:
    """Σ over the last dimension of [rows, V], batch- and thread-invariant (ROW_SUM_BLOCK); padding zeros are
    exact in a sum."""
    rows, V = t.shape
    if V <= ROW_SUM_BLOCK or rows == 0:
        return t.sum(1)
    pad = (-V) % ROW_SUM_BLOCK
    blocks = torch.nn.functional.pad(t, (0, pad)) if pad else t
    return blocks.reshape(rows, -1, ROW_SUM_BLOCK).sum(2).sum(1)


class TorchBackend:
    name = "torch"

    def __init__(self, chunk_rows: Optional[int] = None, vocab_shard: bool = False):
        self.chunk_rows = chunk_rows
        # A shard of a vocabulary-parallel head (ops/vocab_parallel.py). Its rows may have their
        # target elsewhere (FOREIGN_TARGET): their log_norm comes from the largest log p (an extra
        # reduction, only then). Its backward cannot recompute p with a fused softmax of the rows (the
        # normal, cheaper way here): p is normalised over the whole vocabulary, so it is replayed as
        # exp((z - row_max)/T - log_norm).
        self.vocab_shard = vocab_shard

    def supports(self, logits: torch.Tensor) -> bool:
        return True

    def _chunks(
        self, logits: torch.Tensor, out: Optional[torch.Tensor] = None
    ) -> Iterator[Tuple[int, int, torch.Tensor, Optional[torch.Tensor]]]:
        """(first row, end row, logits chunk, out chunk): 2-D views of at most `chunk_rows` rows,
        taken from the strided logits (and the gradient buffer) where they lie."""
        budget = CHUNK_ELEMENTS if logits.device.type == "cpu" else DEVICE_CHUNK_ELEMENTS
        rows = self.chunk_rows or max(1, budget // max(logits.shape[-1], 1))
        pieces = paired_row_groups(logits, out) if out is not None else [(s, b, None) for s, b in row_groups(logits)]
        for start, block, out_block in pieces:
            for s in range(0, block.shape[0], rows):
                e = min(block.shape[0], s + rows)
                yield start + s, start + e, block[s:e], None if out_block is None else out_block[s:e]

    @staticmethod
    def _scaled(chunk, row_max, acc, inv_t) -> torch.Tensor:
        """z / T, or rather (z - row_max) / T: subtracting before scaling keeps the differences exact
        at large logits (at 1e4 a scaled float32 logit is off by ~1e-3). At T = 1 the fused softmax
        kernels shift internally and the chunk goes in as it is. `inv_t`: 1/T, a float or the chunk's
        [rows, 1] per-row values (a per-token temperature)."""
        if not isinstance(inv_t, torch.Tensor) and inv_t == 1.0:
            return chunk
        return (chunk.to(acc) - row_max[:, None]).mul_(inv_t)

    @staticmethod
    def _rows(inv_t, s, e):
        return inv_t[s:e] if isinstance(inv_t, torch.Tensor) else inv_t

    def _normalising_pass(self) -> "TorchBackend":
        """This backend's token_stats_fwd with the row's normaliser on every active row. The torch pass derives
        log_norm from log p_y, which is -inf at a label with a -inf logit and absent on a FOREIGN_TARGET row;
        its vocabulary-shard form computes it from the largest log p instead (one more reduction, only there).
        The kernel backends compute the normaliser directly and return themselves."""
        return self if self.vocab_shard else TorchBackend(self.chunk_rows, vocab_shard=True)

    def token_stats_fwd(self, logits, labels, temperature, compute_entropy, compute_sum_pi_squared) -> RowStats:
        N, V = num_rows(logits), logits.shape[-1]
        acc = statistics_dtype(logits.dtype)
        valid = (labels >= 0) & (labels < V)
        foreign = labels == FOREIGN_TARGET  # a vocabulary shard without the target: statistics, no logprob
        active = valid | foreign
        safe_labels = labels.clamp(0, max(V - 1, 0)).unsqueeze(1)
        row_max = torch.zeros(N, dtype=acc, device=logits.device)
        logprobs = torch.zeros_like(row_max)
        entropy = torch.zeros_like(row_max) if compute_entropy else None
        sum_pi_squared = torch.zeros_like(row_max) if compute_sum_pi_squared else None
        target = torch.zeros_like(row_max)
        raw_max = torch.zeros_like(row_max)  # amax, which propagates a NaN: tells empty rows from poisoned ones
        # a row with a foreign target recovers log_norm from its largest log p (= -log_norm exactly)
        log_p_max = torch.zeros_like(row_max) if self.vocab_shard else None
        temperature = Temperature.of(temperature)
        inv_t = temperature.inverse(acc)
        for s, e, chunk, _ in self._chunks(logits):
            target[s:e] = chunk.gather(1, safe_labels[s:e]).squeeze(1).to(acc)
            m = chunk.amax(1).to(acc)
            # -inf is the max identity: a row with no finite entry keeps shift 0 (see base.RowStats)
            raw_max[s:e] = m
            row_max[s:e] = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
            log_p = torch.log_softmax(self._scaled(chunk, row_max[s:e], acc, self._rows(inv_t, s, e)), dim=1,
                                      dtype=acc)
            logprobs[s:e] = log_p.gather(1, safe_labels[s:e]).squeeze(1)
            if self.vocab_shard:
                log_p_max[s:e] = log_p.amax(1)
            if compute_entropy or compute_sum_pi_squared:
                p = log_p.exp()
                if compute_entropy:
                    # -sum p log p; p = 0 at -inf logits makes 0 * -inf = NaN by IEEE, 0 by the limit
                    entropy[s:e] = -row_sum(torch.where(p > 0, p * log_p, 0.0))
                if compute_sum_pi_squared:
                    sum_pi_squared[s:e] = row_sum(p * p)
        # softmax of a row without a finite entry is NaN: no distribution, logprob -inf, entropy and
        # sum p^2 0 (see base.RowStats); log_norm = (z_y - row_max)/T - logprob, so that
        # lse = row_max/T + log_norm holds in the two parts the other backends keep. A row holding a NaN or
        # +inf logit stays NaN throughout, as in the kernels: validate=True refuses it from that NaN
        empty = raw_max == float("-inf")  # no finite logit (a NaN or +inf row's amax is NaN / +inf)
        poisoned = ~torch.isfinite(raw_max) & ~empty
        no_mass = empty & torch.isnan(logprobs)
        logprobs = logprobs.masked_fill(no_mass, float("-inf"))
        log_norm = (target - row_max) * inv_t.squeeze(1) if temperature.per_row else \
            (target - row_max) / temperature.value()
        log_norm = log_norm - logprobs
        if self.vocab_shard:
            # also where the label's logit is -inf (log p_y = -inf leaves the label's form NaN): the head ids of
            # ops.head read this normaliser, not just log p_y
            log_norm = torch.where(foreign | torch.isnan(log_norm), -log_p_max, log_norm)
        log_norm = torch.where(no_mass, torch.full_like(logprobs, float("-inf")), log_norm)
        zero = torch.zeros((), dtype=acc, device=logits.device)
        nan = torch.full((), float("nan"), dtype=acc, device=logits.device)
        keep = lambda t: None if t is None else \
            torch.where(active & ~no_mass, torch.where(poisoned, nan, t), zero)  # noqa: E731
        return RowStats(
            torch.where(active, row_max, zero), torch.where(active, log_norm, zero), torch.where(valid, logprobs, zero),
            keep(entropy), keep(sum_pi_squared),
        )

    def token_grad_bwd(
        self, logits, labels, row_max, log_norm, entropy, coef_logprob, coef_entropy, temperature, inplace
    ):
        V = logits.shape[-1]
        acc = statistics_dtype(logits.dtype)
        device = logits.device
        out = logits if inplace else torch.empty(logits.shape, dtype=logits.dtype, device=device)
        valid = (labels >= 0) & (labels < V)
        foreign = labels == FOREIGN_TARGET
        has_coef = (coef_logprob != 0) | (coef_entropy != 0 if coef_entropy is not None else False)
        active = (valid | foreign) & has_coef
        zero = torch.zeros((), dtype=acc, device=device)
        inv_t = Temperature.of(temperature).inverse(acc)
        inv_t_flat = inv_t.squeeze(1) if isinstance(inv_t, torch.Tensor) else inv_t
        # inactive rows have c = e = 0 and so come out exactly 0 from the products below
        c = torch.where(active, coef_logprob.to(acc), zero) * inv_t_flat
        # 1 where this shard holds the target column (it gets + c), 0 for a foreign target
        onehot_y = valid.to(acc)
        c_target = c * onehot_y
        safe_labels = labels.clamp(0, max(V - 1, 0)).unsqueeze(1)
        usable = active & (log_norm > float("-inf"))
        row_max = row_max.to(acc)
        # rows without a distribution replay as p = 0 (log_norm := +inf), as in the Triton kernel
        replay_ln = torch.where(usable, log_norm.to(acc), torch.full_like(row_max, float("inf")))
        for s, e, chunk, out_chunk in self._chunks(logits, out):
            c_rows, y, ct_rows, own = c[s:e, None], safe_labels[s:e], c_target[s:e, None], onehot_y[s:e, None]
            rows_inv_t = self._rows(inv_t, s, e)
            if self.vocab_shard:
                p = (chunk.to(acc) - row_max[s:e, None]).mul_(rows_inv_t).sub_(replay_ln[s:e, None]).exp_()
            else:
                p = torch.softmax(self._scaled(chunk, row_max[s:e], acc, rows_inv_t), 1, dtype=acc)
            # a row without a finite logit has no distribution and a NaN softmax: its gradient is c
            # at the target if it is active (p := 0), else 0 -- fixed per row, not with a full pass
            no_distribution = torch.isnan(p[:, 0]) & ~usable[s:e]
            p_y = torch.where(usable[s:e, None], p.gather(1, y), zero)
            if coef_entropy is None:
                g = torch.mul(p, -c_rows, out=out_chunk)  # -c p / T, rounded once to the logits dtype
                _zero_rows(g, no_distribution)
                # the target column: c (1 - p_y) / T formed in float32 and written once, never as the
                # rounded -c p_y plus c, which cancels to garbage in bf16 as p_y -> 1
                g.scatter_(1, y, (c_rows * (own - p_y)).to(out.dtype))
            else:
                # g = -p (c + e (log p + H)) = -p (c + e H) - e p log p, with p log p = 0 at p = 0
                e_rows = torch.where(active, coef_entropy.to(acc), zero)[s:e, None] * rows_inv_t
                g = p * (-c_rows - e_rows * entropy[s:e, None].to(acc))
                g.sub_(torch.xlogy(p, p).mul_(e_rows))
                _zero_rows(g, no_distribution)
                g.scatter_add_(1, y, ct_rows)  # + c at the target, in float32 before the rounding
                out_chunk.copy_(g)
        return out

    def vllm_logprobs(self, logits, labels, temperature):
        """numerics="vllm": vLLM 0.33.0's V1 sampler's processed log-probs (vllm/v1/sample/sampler.py; what vLLM
        runs with VLLM_USE_V2_MODEL_RUNNER=0, and on a CPU without Triton): a float32 copy of the logits (:158),
        divided in place by the request's temperature held as a float32 [N, 1] tensor (`apply_temperature`,
        :291-300), then ATen's `log_softmax(dim=-1, dtype=torch.float32)` (:368-370), on the logits' device. ATen
        computes each row on its own (the same bits for a row alone, in a chunk or in the batch), so this backend's
        chunks change no bit. 0 where a label is outside [0, V); -inf on a row without a finite logit (where the
        engine's NaN would enter a ratio: base.RowStats' convention); float64 logits are read as float32, as the
        engine holds them. The Triton backend follows vLLM's V2 sampler instead."""
        T = Temperature.of(temperature)
        V = logits.shape[-1]
        out = torch.zeros(labels.shape[0], dtype=torch.float32, device=logits.device)
        safe = labels.clamp(0, max(V - 1, 0))
        t32 = T.tensor.to(device=logits.device, dtype=torch.float32)
        empty = torch.zeros(labels.shape[0], dtype=torch.bool, device=logits.device)
        for s, e, chunk, _ in self._chunks(logits):
            z = chunk.to(torch.float32, copy=True)
            z.div_(t32[s:e].unsqueeze(1) if T.per_row else t32.reshape(1, 1))
            out[s:e] = torch.log_softmax(z, dim=-1, dtype=torch.float32).gather(1, safe[s:e, None]).squeeze(1)
            empty[s:e] = z.amax(1) == float("-inf")  # not a NaN row: its log-prob stays NaN
        out = torch.where(torch.isnan(out) & empty, float("-inf"), out)
        return torch.where((labels >= 0) & (labels < V), out, torch.zeros((), dtype=torch.float32, device=out.device))

    def head_grad_bwd(self, logits, labels, head_ids, row_max, log_norm, entropy, logprobs, head, coef_logprob,
                      coef_head, coef_entropy, temperature):
        """The backward of head_stats_fwd (ops/head.py): this backend's token_grad_bwd for c + sum_j C_j, then the
        k + 1 columns {y} u H overwritten by their exact values, formed in float32 and rounded once. coef_head:
        [N, k], 0 at pads, rows outside and ids without mass."""
        temperature = Temperature.of(temperature)
        V = logits.shape[-1]
        c_total = coef_logprob + coef_head.sum(1)
        dlogits = self.token_grad_bwd(logits, labels, row_max, log_norm, entropy, c_total, coef_entropy, temperature,
                                      False)
        # 1/T from the tensor itself: a host read here would be a graph break in the backward torch.compile traces
        inv_t = temperature.inverse_tensor(row_max.dtype)
        saved = (labels, head_ids, logprobs, entropy, head)
        idx, value, slot, donor = _fixed_columns(saved, (coef_logprob, coef_entropy, coef_head, c_total), inv_t, V)
        flat = dlogits.view(-1, V)
        active = ((labels >= 0) & (labels < V)) | (labels == FOREIGN_TARGET)
        zero = torch.zeros((), dtype=value.dtype, device=value.device)
        # a row without a coefficient (outside the loss, or rejected) stays exactly 0, as the plain backward left it,
        # whatever its p (NaN on a row holding a NaN logit): masked before the donors copy anything
        carries = (coef_logprob != 0) | (coef_head != 0).any(1)
        if coef_entropy is not None:
            carries = carries | (coef_entropy != 0)
        value = torch.where((active & carries)[:, None], value, zero)
        has_slot = slot.any(1)
        donor_idx = torch.where(has_slot, idx.gather(1, donor[:, None]).squeeze(1), torch.zeros_like(donor))
        current = flat[:, :1].squeeze(1).to(value.dtype) if V else torch.zeros_like(coef_logprob)
        donor_value = torch.where(has_slot, value.gather(1, donor[:, None]).squeeze(1), current)
        idx = torch.where(slot, idx, donor_idx[:, None])
        value = torch.where(slot, value, donor_value[:, None])
        if V:
            flat.scatter_(1, idx, value.to(flat.dtype))
        return dlogits

    def head_stats_fwd(self, logits, labels, head_ids, temperature, compute_entropy, compute_sum_pi_squared):
        temperature = Temperature.of(temperature)
        stats = self._normalising_pass().token_stats_fwd(logits, labels, temperature, compute_entropy,
                                                         compute_sum_pi_squared)
        return stats, head_logprobs(logits, head_ids, stats, labels, temperature)

    def _pair_chunks(self, logits, reference):
        """(first row, end row, logits chunk, reference chunk): the trainer's rows where they lie, and the
        reference's matching [rows, V] rows."""
        ref_rows = reference.reshape(-1, logits.shape[-1])  # a view unless its strides forbid one
        for s, e, chunk, _ in self._chunks(logits):
            yield s, e, chunk, ref_rows[s:e]

    def full_divergences_fwd(self, logits, reference, active, temperature, reference_temperature, with_tv=True):
        acc = statistics_dtype(logits.dtype)
        out = torch.zeros(active.shape[0], DIVERGENCE_STATS, dtype=acc, device=logits.device)
        inv_t = Temperature.of(temperature).inverse(acc)
        inv_r = Temperature.of(reference_temperature).inverse(acc)
        with torch.no_grad():
            for s, e, z, r in self._pair_chunks(logits, reference):
                lp = _log_softmax(z, self._rows(inv_t, s, e), acc)
                out[s:e, :4] = _divergences(lp, _log_softmax(r, self._rows(inv_r, s, e), acc))
        return torch.where(active[:, None], out, torch.zeros((), dtype=acc, device=out.device))

    def full_divergences_bwd(self, logits, reference, stats, coef, temperature, reference_temperature):
        acc = stats.dtype
        grad = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)
        flat = grad.view(-1, logits.shape[-1])
        inv_t = Temperature.of(temperature).inverse(acc)
        inv_r = Temperature.of(reference_temperature).inverse(acc)
        zero = torch.zeros((), dtype=acc, device=logits.device)
        for s, e, z, r in self._pair_chunks(logits, reference):
            t_rows = self._rows(inv_t, s, e)
            lp, lq = _log_softmax(z, t_rows, acc), _log_softmax(r, self._rows(inv_r, s, e), acc)
            pi, mu, live, ratio_sq = _terms(lp, lq)
            a, b, c, d = (coef[s:e, i:i + 1] for i in range(4))
            reverse_kl, chi2 = stats[s:e, 1:2], stats[s:e, 2:3]
            log_ratio = torch.where(live, torch.where(live, lp, zero) - torch.where(live, lq, zero), zero)
            sign = torch.sign(pi - mu)
            # a divergence without a coefficient contributes nothing, even where it is +inf (0 * inf = NaN)
            g = torch.where(a != 0, a * (pi - mu), zero) \
                + torch.where(b != 0, b * (pi * (log_ratio - reverse_kl)), zero) \
                + torch.where(c != 0, 2 * c * (ratio_sq - pi * (chi2 + 1)), zero) \
                + torch.where(d != 0, 0.5 * d * pi * (sign - row_sum(pi * sign)[:, None]), zero)
            flat[s:e] = (g * t_rows).to(grad.dtype)
        return grad


def _log_softmax(rows: torch.Tensor, inv_t, acc) -> torch.Tensor:
    z = rows.to(acc)
    top = z.amax(1, keepdim=True)
    z = z - torch.where(torch.isfinite(top), top, torch.zeros_like(top))  # shift first: exact differences at 1e4
    return torch.log_softmax(z * inv_t, dim=1)


def _terms(lp: torch.Tensor, lq: torch.Tensor):
    """(π, μ, live π > 0, π²/μ where π > 0) with the empty branches' logs replaced before any product."""
    zero = torch.zeros((), dtype=lp.dtype, device=lp.device)
    pi, mu = lp.exp(), lq.exp()
    live = pi > 0
    ratio_sq = torch.where(live, torch.exp(2 * torch.where(live, lp, zero) - torch.where(live, lq, zero)), zero)
    return pi, mu, live, ratio_sq


def _divergences(lp: torch.Tensor, lq: torch.Tensor) -> torch.Tensor:
    """[rows, 4] (kl, reverse_kl, chi2, tv) of the rows' log π and log μ."""
    zero = torch.zeros((), dtype=lp.dtype, device=lp.device)
    pi, mu, live, ratio_sq = _terms(lp, lq)
    mu_live = mu > 0
    kl = row_sum(torch.where(mu_live, mu * (torch.where(mu_live, lq, zero) - torch.where(mu_live, lp, zero)), zero))
    reverse_kl = row_sum(torch.where(live, pi * (torch.where(live, lp, zero) - torch.where(live, lq, zero)), zero))
    chi2 = row_sum(ratio_sq) - 1
    tv = 0.5 * row_sum((pi - mu).abs())
    return torch.stack([kl, reverse_kl, chi2, tv], 1)


def _zero_rows(t: torch.Tensor, rows: torch.Tensor) -> None:
    """t[rows] = 0. On the CPU an index touches only those rows; on a GPU sizing the index would sync
    the host, so a masked fill -- a full pass, but sync-free -- stands in for it."""
    if t.device.type == "cpu":
        t.index_fill_(0, torch.nonzero(rows).squeeze(1), 0.0)  # (t[rows] = 0 takes a slow full path)
    else:
        t.masked_fill_(rows[:, None], 0.0)


def _fixed_columns(saved, coefficients, inv_t, V: int):
    """(columns [N, k + 1], their exact gradient values [N, k + 1] in float32, the slots holding an id, each row's
    donor slot) for the slots {h_1..h_k, y}. saved: (labels, head_ids, log p_y, entropy or None, head log-probs);
    coefficients: (c, e or None, C, c + sum_j C_j as the plain backward took it).
    Slots without an id take the value of a slot of the same row that has one (a 'donor'), so that every
    write to a column carries one value; a row with no slot at all rewrites column 0 with itself (the
    caller's gather)."""
    labels, head_ids, logprobs, entropy, head = saved
    c, e, C, c_total = coefficients
    k = head_ids.shape[1]
    has_label = (labels >= 0) & (labels < V)
    head_slot = head_ids >= 0
    match = (head_ids == labels[:, None]) & has_label[:, None]
    a_head = C + torch.where(match, c[:, None], torch.zeros_like(C))
    a_label = c + torch.where(match, C, torch.zeros_like(C)).sum(1)
    idx = torch.cat([head_ids, labels[:, None]], 1).clamp(0, max(V - 1, 0))
    a = torch.cat([a_head, a_label[:, None]], 1)
    log_p = torch.cat([head, logprobs[:, None]], 1)
    p = torch.exp(log_p)
    value = a - c_total[:, None] * p
    if e is not None:
        # -e p (log p + H), with p log p = 0 at p = 0
        value = value - e[:, None] * (torch.xlogy(p, p) + p * entropy[:, None])
    value = value * inv_t  # a float, or the [N, 1] per-row 1 / T
    # a head slot holding the label defers to the label's slot: one value per column (a scatter with two values for
    # one index keeps either, on a GPU nondeterministically)
    slot = torch.cat([head_slot & ~match, has_label[:, None]], 1)
    donor = torch.where(has_label, torch.full_like(labels, k), slot[:, :k].to(torch.int8).argmax(1))
    return idx, value, slot, donor
