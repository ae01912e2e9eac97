"""Token statistics from hidden states and the LM-head weight, without ever holding [N, V] logits.

`rlkernels::linear_token_stats` is the fused-linear form of `rlkernels::token_stats` (SPEC §2): the same
outputs (log-prob, entropy, sum p^2 per row) and the same backward contract (per-row coefficients
c_t = dLoss/dlogprob_t, e_t = dLoss/dH_t), with logits = hidden @ weight.T + bias formed a chunk of
rows at a time and discarded:

  forward   for each chunk of rows in the loss: logits = F.linear(h, W, b) -> backend.token_stats_fwd
  backward  for each chunk of rows with (c, e) != 0: logits again -> backend.token_grad_bwd (in place)
            -> d_hidden[rows] = G @ W,  d_weight += G.T @ h,  d_bias += G.sum(0)

Rows outside the loss (mask 0, ignore_index) never enter a matrix multiply, and in the backward
neither do rows whose coefficients are both zero (rejected sequences, the inactive side of the clip,
zero advantages): they cost nothing and get exact zeros. Peak extra memory is one chunk of logits
(sized from `memory_budget_bytes`) plus [N] statistics, plus, for fp16/bf16 weights, an fp32 [V, H]
accumulator, so that the weight gradient is rounded once. Autocast does not apply inside: the head
runs in the dtype of hidden and weight.

Selecting the rows costs one host synchronisation per pass (the number of rows to compute sets the
number of chunks); the logits path has none. Any user loss on the returned log-probs works on top
(`rlkernels.policy_loss`, or plain torch), and `linear_decoupled_ppo_loss` is exactly that
composition with the per-sequence stage of the logits path.
"""

import contextlib
import functools
from typing import Callable, NamedTuple, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor

from .. import backends
from ..backends.temperature import Temperature
from .kept_set import kept_mask
from .vocab import engine_logprobs, refuse_double_backward

# Default size of one chunk of logits (memory_budget_bytes=None). On a CPU 128+ rows already saturate the cores,
# and a small chunk stays in cache: 32 MiB is 256 rows at V = 32,768 in fp32 (measured on 2 cores, N = 4096,
# H = 512, half the rows in the loss: 256 MiB chunks gave 126 MiB peak working memory, 32 MiB ones 21 MiB, at the
# same speed: 2.11 s and 2.00 s; benchmarks/linear.py). On a GPU fewer, larger chunks: each chunk is three GEMMs
# and a pass over the weight gradient, so the budget is sized from the memory free for it (`default_memory_budget`):
# a quarter of it, as a power of two between 512 MiB (~1,700 rows at V = 151,936 in bf16) and 4 GiB (the 4,096
# loss rows of an 8k-token micro-batch at half its rows in the loss, in one chunk). 512 MiB under torch.compile,
# where a budget read from the device would change the chunk size, a custom op's argument, between steps.
DEFAULT_MEMORY_BUDGET_BYTES = {"cuda": 512 << 20, "cpu": 32 << 20}
MAX_DEVICE_BUDGET_BYTES = 4 << 30


def default_memory_budget(device: torch.device) -> int:
    """The chunk budget for memory_budget_bytes=None (see DEFAULT_MEMORY_BUDGET_BYTES)."""
    if device.type != "cuda" or torch.compiler.is_compiling():
        return DEFAULT_MEMORY_BUDGET_BYTES["cuda" if device.type == "cuda" else "cpu"]
    free, _ = torch.cuda.mem_get_info(device)  # the driver's count: no stream synchronisation
    # what the caching allocator holds but no tensor uses is free for this chunk too
    available = free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    floor = DEFAULT_MEMORY_BUDGET_BYTES["cuda"]
    if available // 4 <= floor:
        return floor
    # a power of two: the chunk size (and with it the GEMMs' shapes and last bits) moves only when the free
    # memory doubles or halves, not with every allocation between two steps
    return min(MAX_DEVICE_BUDGET_BYTES, 1 << ((available // 4).bit_length() - 1))


def chunk_rows_for(V: int, dtype: torch.dtype, device: torch.device, memory_budget_bytes: Optional[int]) -> int:
    """Rows per chunk so that the chunk's logits fit the budget. (The backward overwrites them with
    their gradient; the torch backend's float32 temporaries are bounded by its own ~1 Mi-element
    sub-chunks, the kernels have none.)"""
    if memory_budget_bytes is None:
        memory_budget_bytes = default_memory_budget(device)
    per_row = V * (torch.finfo(dtype).bits // 8)
    return max(1, int(memory_budget_bytes // max(per_row, 1)))


def loss_rows(selected: Tensor, select: bool) -> Tensor:
    """The rows to run through the head: the `selected` ones (select=True: one host synchronisation, the count
    that sets the number of GEMM chunks), or every row (select=False, validate=False's sync-free form: the rows
    outside take the GEMMs too, and come out as zeros: the backends skip a row labelled -1, its statistics and its
    gradient row 0, as if it had not been run)."""
    if select:
        return torch.nonzero(selected).squeeze(1)
    return torch.arange(selected.shape[0], device=selected.device)


def carrying_rows(hidden_rows: Tensor, carries: Tensor) -> Tensor:
    """The hidden rows of a GEMM whose product must be exactly 0 where `carries` is False: with every row run
    (select_rows=False) a row outside the loss may hold NaN or inf (padding), and a zero coefficient times NaN is
    NaN in the weight's gradient, so those rows are zeroed first (selected rows never reach here)."""
    return torch.where(carries[:, None], hidden_rows, torch.zeros((), dtype=hidden_rows.dtype,
                                                                  device=hidden_rows.device))


class HeadOptions(NamedTuple):
    """How the fused-linear custom ops run the head: the call's options beside its data, handed to
    `linear_token_stats` / `linear_token_grad` as keywords (`op_kwargs`: a custom op's schema takes primitives)."""
    backend: str  # a resolved backend name
    chunk_rows: int  # rows per chunk of logits
    vocab_shard: bool = False  # the weight is one shard of a vocabulary-parallel head (backends.select)
    support: Optional[Tensor] = None  # [N, K] kept ids (a large kept set), or None
    head_dtype: str = ""  # "" (the inputs' dtype), "float32" or "tf32" (_head)
    numerics: str = "default"  # the log-probs' order (vocab.engine_logprobs)
    select_rows: bool = True  # run only the rows in the loss (one host sync: loss_rows)

    def op_kwargs(self) -> dict:
        return self._asdict()


def logits_dtype(dtype: torch.dtype, head_dtype: Optional[str]) -> torch.dtype:
    """The dtype of the head's logits: the inputs', or float32 for a float32 / TF32 head on half inputs."""
    return torch.float32 if head_dtype and dtype in (torch.float16, torch.bfloat16) else dtype


@contextlib.contextmanager
def _tf32(head_dtype: Optional[str]):
    """TF32 matrix units for float32 GEMMs inside (CUDA; a CPU has none, its head stays float32), restored after."""
    if head_dtype != "tf32":
        yield
        return
    matmul = torch.backends.cuda.matmul
    new_api = hasattr(matmul, "fp32_precision")  # torch >= 2.9; allow_tf32 before
    saved = matmul.fp32_precision if new_api else matmul.allow_tf32
    if new_api:
        matmul.fp32_precision = "tf32"
    else:
        matmul.allow_tf32 = True
    try:
        yield
    finally:
        if new_api:
            matmul.fp32_precision = saved
        else:
            matmul.allow_tf32 = saved


# A float32 head upcasts the weight in blocks sized from a chunk's rows, but never from fewer than these: a chunk's
# tail of one row would otherwise upcast a 4096-wide head one vocabulary row at a time (thousands of tiny GEMMs)
_MIN_BLOCK_ROWS = 256


def _weight_blocks(weight: Tensor, rows: int):
    """(start, end) of blocks of vocabulary rows whose float32 copy takes at most the bytes of max(rows, 256) rows
    of float32 logits: a float32 head never holds a float32 copy of the whole weight unless a chunk of logits is
    that large anyway."""
    V, H = weight.shape
    block = max(1, min(V, (max(rows, _MIN_BLOCK_ROWS) * V) // max(H, 1)))
    return [(v0, min(V, v0 + block)) for v0 in range(0, V, block)]


# numerics="batch_invariant": every head GEMM multiplies blocks of exactly this many rows (the last one padded
# with zeros), so that the GEMM library sees one shape whatever the chunk, and a row's logits (and d_hidden row)
# come out the same whatever rows share its block and wherever it stands in it. Checked on the CPU (oneDNN, fp32
# and bf16, 1 and 2 threads); a lone unpadded row takes another kernel there (tests/ops/test_batch_invariance.py).
GEMM_BLOCK_ROWS = 64


def _in_row_blocks(gemm, rows: Tensor, fixed: bool) -> Tensor:
    """gemm(rows) ([n, ...] -> [n, ...]), or the same in zero-padded blocks of GEMM_BLOCK_ROWS rows when `fixed`."""
    if not fixed:
        return gemm(rows)
    n = rows.shape[0]
    outs = []
    for r0 in range(0, n, GEMM_BLOCK_ROWS):
        block = rows[r0:r0 + GEMM_BLOCK_ROWS]
        if block.shape[0] < GEMM_BLOCK_ROWS:
            block = torch.cat([block, block.new_zeros((GEMM_BLOCK_ROWS - block.shape[0],) + block.shape[1:])])
        outs.append(gemm(block)[:min(GEMM_BLOCK_ROWS, n - r0)])
    return torch.cat(outs) if outs else gemm(rows)


def _head(hidden_rows: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
          head_dtype: Optional[str] = None, fixed_rows: bool = False) -> torch.Tensor:
    # the GEMM in the input dtype with float32 accumulation, as torch.matmul does. Autocast is off: the
    # backward recomputes these logits outside the caller's autocast region, and forward and backward
    # must see the same function (cast hidden / weight yourself for a half-precision head)
    with torch.autocast(hidden_rows.device.type, enabled=False), _tf32(head_dtype):
        if logits_dtype(weight.dtype, head_dtype) == weight.dtype:
            return _in_row_blocks(lambda h: F.linear(h, weight, bias), hidden_rows, fixed_rows)
        # a float32 head on half operands: float32 GEMMs, the weight upcast one block of vocabulary rows at a time
        h = hidden_rows.float()
        logits = torch.empty(h.shape[0], weight.shape[0], dtype=torch.float32, device=h.device)
        for v0, v1 in _weight_blocks(weight, GEMM_BLOCK_ROWS if fixed_rows else h.shape[0]):
            w, b = weight[v0:v1].float(), None if bias is None else bias[v0:v1].float()
            logits[:, v0:v1] = _in_row_blocks(lambda rows: F.linear(rows, w, b), h, fixed_rows)  # noqa: B023
        return logits


@functools.lru_cache(maxsize=None)
def _mm_into_float32(device_type: str, dtype: torch.dtype) -> bool:
    """Whether torch.mm(a, b, out_dtype=float32) runs for `dtype` operands on this device type (a
    newer torch on CUDA); probed once on two 1 x 1 matrices."""
    try:
        one = torch.ones(1, 1, dtype=dtype, device=device_type)
        return torch.mm(one, one, out_dtype=torch.float32).dtype == torch.float32
    except (TypeError, NotImplementedError, RuntimeError):
        return False


@functools.lru_cache(maxsize=None)
def _addmm_into_float32(device_type: str, dtype: torch.dtype) -> bool:
    """Whether torch.addmm(acc, a, b, out_dtype=float32, out=acc) accumulates `dtype` operands into a float32 acc in
    place (the GEMM's own beta: no temporary, no second pass; CUDA with torch >= 2.9); probed once on 1 x 1
    matrices, by the result's dtype and storage (no host read)."""
    try:
        one = torch.ones(1, 1, dtype=dtype, device=device_type)
        acc = torch.zeros(1, 1, dtype=torch.float32, device=device_type)
        out = torch.addmm(acc, one, one, out_dtype=torch.float32, out=acc)
        return out.dtype == torch.float32 and out.data_ptr() == acc.data_ptr()
    except (TypeError, NotImplementedError, RuntimeError):
        return False


def _accumulate_weight_grad(acc: torch.Tensor, grad_logits: torch.Tensor, hidden_rows: torch.Tensor,
                            first: bool) -> None:
    """acc[V, H] += G.T @ h with acc in float32 (float64 for float64 inputs); `first`: acc holds nothing yet
    (uninitialised memory), and this product is its value (beta = 0: never read).

    Same dtype: in place (addmm_), no temporary. fp16/bf16 operands: into the float32 accumulator inside the GEMM
    where torch can (addmm(..., out_dtype=float32, out=acc), CUDA: one pass over acc per chunk, and for a single
    chunk holding every loss row one write), else the product goes into float32 through a temporary (mm(...,
    out_dtype=float32)) or is rounded once to the input dtype first; either way in blocks of vocabulary rows, so
    that the temporary is never larger than the chunk of logits (never a second [V, H])."""
    beta = 0 if first else 1
    if grad_logits.dtype == acc.dtype:
        acc.addmm_(grad_logits.t(), hidden_rows, beta=beta)
        return
    if _addmm_into_float32(grad_logits.device.type, grad_logits.dtype):
        torch.addmm(acc, grad_logits.t(), hidden_rows, beta=beta, out_dtype=acc.dtype, out=acc)
        return
    into_float32 = _mm_into_float32(grad_logits.device.type, grad_logits.dtype)
    block = max(1, grad_logits.numel() // max(hidden_rows.shape[1], 1))
    for v0 in range(0, acc.shape[0], block):
        g = grad_logits[:, v0:v0 + block].t()
        product = torch.mm(g, hidden_rows, out_dtype=acc.dtype) if into_float32 else g @ hidden_rows
        if first:
            acc[v0:v0 + block].copy_(product)
        else:
            acc[v0:v0 + block].add_(product)


class _HeadGradients:
    """d_hidden [N, H], and d_weight [V, H] / d_bias [V] accumulated over chunks of rows in float32 (float64 for
    float64 inputs) and rounded once to the parameter dtype: the backward of the two-pass form and the forward of
    the one-pass form fill them alike. `need`: which of the three to form."""

    def __init__(self, hidden: Tensor, weight: Tensor, bias: Optional[Tensor], need: Tuple[bool, bool, bool],
                 head_dtype: Optional[str] = None, fixed_rows: bool = False):
        need_hidden, need_weight, need_bias = need
        self.weight, self.bias, self.head_dtype, self.fixed_rows = weight, bias, head_dtype, fixed_rows
        # a float32 head on half operands: dlogits are float32, and GEMMs 2 and 3 run in float32 as GEMM 1 did
        self.upcast = logits_dtype(weight.dtype, head_dtype) != weight.dtype
        self.wide = torch.float64 if weight.dtype == torch.float64 else torch.float32
        self.d_hidden = torch.zeros_like(hidden, memory_format=torch.contiguous_format) if need_hidden else None
        # written by the first chunk (beta = 0), not filled with zeros to be read back; zeroed if no chunk comes
        self.d_weight = torch.empty(weight.shape, dtype=self.wide, device=weight.device) if need_weight else None
        self.weight_written = False
        need_bias = need_bias and bias is not None
        self.d_bias = torch.zeros(weight.shape[0], dtype=self.wide, device=weight.device) if need_bias else None

    def add(self, idx: Tensor, grad_logits: Tensor, h: Tensor) -> None:
        """The chunk of rows `idx` (hidden rows `h`) with dlogits `grad_logits`."""
        with _tf32(self.head_dtype):  # GEMMs 2 and 3 in the precision GEMM 1 ran in
            if self.upcast:
                self._add_float32(idx, grad_logits, h)
            else:
                if self.d_hidden is not None:
                    self.d_hidden.index_copy_(0, idx, _in_row_blocks(lambda g: g @ self.weight, grad_logits,
                                                                     self.fixed_rows))
                if self.d_weight is not None:
                    _accumulate_weight_grad(self.d_weight, grad_logits, h, first=not self.weight_written)
        self.weight_written = True
        if self.d_bias is not None:
            self.d_bias.add_(grad_logits.sum(0, dtype=self.wide))

    def _add_float32(self, idx: Tensor, grad_logits: Tensor, h: Tensor) -> None:
        """GEMMs 2 and 3 of a float32 head: float32 dlogits against the weight upcast a block at a time."""
        h32 = h.float() if self.d_weight is not None else None
        d_h = torch.zeros(h.shape, dtype=torch.float32, device=h.device) if self.d_hidden is not None else None
        for v0, v1 in _weight_blocks(self.weight, GEMM_BLOCK_ROWS if self.fixed_rows else h.shape[0]):
            g = grad_logits[:, v0:v1]
            if d_h is not None:
                w = self.weight[v0:v1].float()
                d_h += _in_row_blocks(lambda rows: rows @ w, g, self.fixed_rows)  # noqa: B023
            if self.d_weight is not None:
                self.d_weight[v0:v1].addmm_(g.t(), h32, beta=0 if not self.weight_written else 1)
        if d_h is not None:
            self.d_hidden.index_copy_(0, idx, d_h.to(self.d_hidden.dtype))

    def rounded(self) -> Tuple[Optional[Tensor], Optional[Tensor], Optional[Tensor]]:
        """(d_hidden, d_weight, d_bias) in the inputs' dtypes, None where not formed."""
        if self.d_weight is not None and not self.weight_written:  # no row carried a gradient
            self.d_weight.zero_()
        return (self.d_hidden, None if self.d_weight is None else self.d_weight.to(self.weight.dtype),
                None if self.d_bias is None else self.d_bias.to(self.bias.dtype))


def _kept(logits: Tensor, support: Optional[Tensor], idx: Tensor, row_labels: Tensor) -> Tensor:
    """The chunk's logits, set to -inf outside the rows' kept ids when a support is given (in place:
    the chunk is ours). A row outside the loss (label -1: there with select_rows=False) reads no kept id: its ids
    are unchecked with validate=False, and nothing of the row is used."""
    if support is None:
        return logits
    ids = support.index_select(0, idx)
    ids = torch.where((row_labels.index_select(0, idx) != -1)[:, None], ids, torch.full((), -1, dtype=ids.dtype,
                                                                                         device=ids.device))
    return logits.masked_fill_(~kept_mask(ids, logits.shape[-1]), float("-inf"))


@torch.library.custom_op("rlkernels::linear_token_stats", mutates_args=())
def linear_token_stats(
    hidden: Tensor, weight: Tensor, bias: Optional[Tensor], row_labels: Tensor, temperature: Tensor,
    compute_entropy: bool, compute_sum_pi_squared: bool, backend: str, chunk_rows: int, vocab_shard: bool = False,
    support: Optional[Tensor] = None, head_dtype: str = "", numerics: str = "default", select_rows: bool = True,
) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(row_max, log_norm, logprobs, entropy, sum_pi_squared), [N] each (absent ones empty [0]).

    hidden: (N, H); weight: (V, H); bias: (V,) or None; row_labels: (N,) int64, -1 off the loss.
    A custom op, so that torch.compile sees one opaque op with [N] outputs (the row selection inside
    has a data-dependent size). vocab_shard: the weight is one shard of a vocabulary-parallel head
    (see backends.select). support: (N, K) kept ids (sampler replay, a large kept set): the logits
    outside them are set to -inf before the pass (p = 0 there, and a zero gradient). head_dtype: "" (the inputs'
    dtype), "float32" or "tf32" (a float32 head, linear._head). The arguments past the statistics' flags are
    HeadOptions' fields (select_rows: loss_rows)."""
    impl = backends.select(backend, hidden, vocab_shard=vocab_shard)
    T = Temperature(temperature)
    N = hidden.shape[0]
    acc = backends.statistics_dtype(hidden.dtype)
    new = lambda n=N: torch.zeros(n, dtype=acc, device=hidden.device)  # noqa: E731
    row_max, log_norm, logprobs = new(), new(), new()
    entropy = new(N if compute_entropy else 0)
    sum_pi_squared = new(N if compute_sum_pi_squared else 0)
    rows = loss_rows(row_labels != -1, select_rows)  # -1: outside the loss (-2: target in another vocabulary shard)
    for start in range(0, rows.numel(), chunk_rows):
        idx = rows[start:start + chunk_rows]
        logits = _kept(_head(hidden.index_select(0, idx), weight, bias, head_dtype or None,
                             numerics == "batch_invariant"), support, idx, row_labels)
        labels, t_rows = row_labels.index_select(0, idx), T.rows(idx)
        stats = impl.token_stats_fwd(logits, labels, t_rows, compute_entropy, compute_sum_pi_squared)
        lp = engine_logprobs(numerics, impl, logits, labels, t_rows, stats.logprobs)
        for out, value in ((row_max, stats.row_max), (log_norm, stats.log_norm), (logprobs, lp),
                           (entropy, stats.entropy), (sum_pi_squared, stats.sum_pi_squared)):
            if value is not None:
                out.index_copy_(0, idx, value.to(acc))
    return row_max, log_norm, logprobs, entropy, sum_pi_squared


@linear_token_stats.register_fake
def _(hidden, weight, bias, row_labels, temperature, compute_entropy, compute_sum_pi_squared, backend, chunk_rows,
      vocab_shard=False, support=None, head_dtype="", numerics="default", select_rows=True):
    N = hidden.shape[0]
    new = lambda n: hidden.new_empty(n, dtype=backends.statistics_dtype(hidden.dtype))  # noqa: E731
    return new(N), new(N), new(N), new(N if compute_entropy else 0), new(N if compute_sum_pi_squared else 0)


@torch.library.custom_op("rlkernels::linear_token_grad", mutates_args=())
def linear_token_grad(
    hidden: Tensor, weight: Tensor, bias: Optional[Tensor], row_labels: Tensor, row_max: Tensor, log_norm: Tensor,
    entropy: Tensor, coef_logprob: Tensor, coef_entropy: Tensor, temperature: Tensor, backend: str, chunk_rows: int,
    need_hidden: bool, need_weight: bool, need_bias: bool, vocab_shard: bool = False, support: Optional[Tensor] = None,
    head_dtype: str = "", numerics: str = "default", select_rows: bool = True,
) -> Tuple[Tensor, Tensor, Tensor]:
    """(d_hidden, d_weight, d_bias) from the coefficients (c_t, e_t); an empty coef_entropy means e = 0.
    Gradients that are not needed come back empty [0]."""
    impl = backends.select(backend, hidden, vocab_shard=vocab_shard)
    T = Temperature(temperature)
    c = coef_logprob
    e = coef_entropy if coef_entropy.numel() > 0 else None
    live = (row_labels != -1) & ((c != 0) | (e != 0 if e is not None else False))
    rows = loss_rows(live, select_rows)  # every row: those with no coefficient give exact zeros
    fixed = numerics == "batch_invariant"
    grads = _HeadGradients(hidden, weight, bias, (need_hidden, need_weight, need_bias), head_dtype or None, fixed)
    for start in range(0, rows.numel(), chunk_rows):
        idx = rows[start:start + chunk_rows]
        h = hidden.index_select(0, idx)
        if not select_rows:  # every row: those without a coefficient must give exact zeros, NaN hidden states too
            h = carrying_rows(h, live.index_select(0, idx))
        logits = _kept(_head(h, weight, bias, head_dtype or None, fixed), support, idx, row_labels)
        grad_logits = impl.token_grad_bwd(
            logits, row_labels.index_select(0, idx), row_max.index_select(0, idx),
            log_norm.index_select(0, idx), None if e is None else entropy.index_select(0, idx),
            c.index_select(0, idx), None if e is None else e.index_select(0, idx), T.rows(idx),
            True,  # the chunk's logits are ours: the gradient overwrites them
        )
        grads.add(idx, grad_logits, h)
    empty = lambda t, like: like.new_empty(0) if t is None else t  # noqa: E731 (a custom op returns tensors)
    d_hidden, d_weight, d_bias = grads.rounded()
    return empty(d_hidden, hidden), empty(d_weight, weight), empty(d_bias, weight)


@linear_token_grad.register_fake
def _(hidden, weight, bias, row_labels, row_max, log_norm, entropy, coef_logprob, coef_entropy, temperature, backend,
      chunk_rows, need_hidden, need_weight, need_bias, vocab_shard=False, support=None, head_dtype="",
      numerics="default", select_rows=True):
    dense = dict(memory_format=torch.contiguous_format)  # what the real op returns, whatever the input layout
    return (
        torch.empty_like(hidden, **dense) if need_hidden else hidden.new_empty(0),
        torch.empty_like(weight, **dense) if need_weight else weight.new_empty(0),
        weight.new_empty(weight.shape[0]) if (need_bias and bias is not None) else weight.new_empty(0),
    )


def _setup_context(ctx, inputs, output):
    hidden, weight, bias, row_labels, temperature = inputs[:5]
    backend, chunk_rows, vocab_shard, support, head_dtype, numerics, select_rows = inputs[7:14]
    row_max, log_norm, _, entropy, sum_pi_squared = output
    ctx.save_for_backward(hidden, weight, bias, row_labels, row_max, log_norm, entropy, temperature, support)
    ctx.options = HeadOptions(backend, chunk_rows, vocab_shard, None, head_dtype, numerics, select_rows)
    ctx.mark_non_differentiable(row_max, log_norm, sum_pi_squared)
    # the outputs nobody differentiates (the normaliser, sum p^2, an entropy without a coefficient) arrive as None,
    # not as [N] zeros autograd would fill for them: four launches per backward saved, and the backward skips them
    ctx.set_materialize_grads(False)


def _backward(ctx, _g_row_max, _g_log_norm, grad_logprobs, grad_entropy, _g_sum_pi_squared):
    refuse_double_backward()
    hidden, weight, bias, row_labels, row_max, log_norm, entropy, temperature, support = ctx.saved_tensors
    head = ctx.options._replace(support=support)
    c = torch.zeros_like(row_max) if grad_logprobs is None else grad_logprobs.to(row_max.dtype)
    use_entropy = grad_entropy is not None and entropy.numel() > 0
    e = grad_entropy.to(row_max.dtype) if use_entropy else row_max.new_empty(0)
    need_h, need_w, need_b = ctx.needs_input_grad[:3]
    d_hidden, d_weight, d_bias = linear_token_grad(
        hidden, weight, bias, row_labels, row_max, log_norm, entropy, c, e, temperature,
        need_hidden=need_h, need_weight=need_w, need_bias=need_b, **head.op_kwargs())
    return (d_hidden if need_h else None, d_weight if need_w else None,
            d_bias if (need_b and bias is not None) else None) + (None,) * 11


linear_token_stats.register_autograd(_backward, setup_context=_setup_context)


# -- the one-pass form: the gradient formed while each chunk's logits are in hand (SPEC §2.1) -----------------

# (rows [n], their log-probs [n], their entropies [n] or None) -> (c [n], e [n] or None) for those rows
RowCoefficients = Callable[[Tensor, Tensor, Optional[Tensor]], Tuple[Tensor, Optional[Tensor]]]


class ForwardGradient(NamedTuple):
    logprobs: Tensor  # [N] statistics, no autograd
    entropy: Optional[Tensor]
    sum_pi_squared: Optional[Tensor]
    d_hidden: Optional[Tensor]  # [N, H] dLoss/dhidden for grad_output = 1, None where not needed
    d_weight: Optional[Tensor]  # [V, H], in the weight's dtype (accumulated in float32, rounded once)
    d_bias: Optional[Tensor]  # [V]


class OnePassPlan(NamedTuple):
    """The rows and options of one one-pass call."""
    row_labels: Tensor  # [N] int64, -1 on rows outside the loss
    temperature: Temperature
    support: Optional[Tensor]  # [N, K] kept ids (a large kept set), or None
    compute_entropy: bool
    compute_sum_pi_squared: bool
    backend: str
    chunk_rows: int
    need: Tuple[bool, bool, bool]  # which of d_hidden, d_weight, d_bias to form
    kept: Optional[Tensor] = None  # [N] bool: rows whose coefficients may be nonzero (None: every row)
    head_dtype: Optional[str] = None  # None, "float32" or "tf32" (linear._head)
    numerics: str = "default"  # the log-probs' order (vocab.engine_logprobs); the gradient is the pass's
    select_rows: bool = True  # run only the rows in the loss (one host sync: loss_rows)


def linear_forward_gradient(hidden: Tensor, weight: Tensor, bias: Optional[Tensor], plan: OnePassPlan,
                            coefficients: RowCoefficients) -> ForwardGradient:
    """The statistics and the loss's gradient in one pass: for each chunk of rows in the loss, its logits
    (GEMM 1), the token statistics, the chunk's coefficients (c_t, e_t) from `coefficients`, dlogits written
    over the logits, then d_hidden[rows] = G @ W (GEMM 2) and d_weight += G.T @ h (GEMM 3). Three GEMMs of the
    loss's rows where the two-pass form (forward, then a backward that recomputes the logits) runs four.

    Valid only when each row's coefficients depend on that row's own statistics and on constants (the
    caller's `coefficients` sees one chunk at a time). A plain function, not a custom op: `coefficients` is
    a Python callable, so a compiled region takes the two-pass custom ops instead (rlkernels.ops chooses)."""
    with torch.no_grad():  # the gradient is formed here, by hand: autograd must not record the pass
        return _forward_gradient(hidden, weight, bias, plan, coefficients)


def _forward_gradient(hidden: Tensor, weight: Tensor, bias: Optional[Tensor], plan: OnePassPlan,
                      coefficients: RowCoefficients) -> ForwardGradient:
    row_labels, compute_entropy, compute_sum_pi_squared = plan.row_labels, plan.compute_entropy, \
        plan.compute_sum_pi_squared
    impl = backends.select(plan.backend, hidden)
    T = plan.temperature
    N = hidden.shape[0]
    acc = backends.statistics_dtype(hidden.dtype)
    new = lambda n=N: torch.zeros(n, dtype=acc, device=hidden.device)  # noqa: E731
    logprobs = new()
    entropy = new() if compute_entropy else None
    sum_pi_squared = new() if compute_sum_pi_squared else None
    fixed = plan.numerics == "batch_invariant"
    grads = _HeadGradients(hidden, weight, bias, plan.need, plan.head_dtype, fixed)
    in_loss = row_labels != -1
    # the rows that can carry a gradient first, then those that only need their statistics (rows the rollout
    # correction rejected: in chunks of their own, they never enter GEMMs 2 and 3)
    if not plan.select_rows:  # every row, in one group: the others' coefficients are 0, so are their gradients
        groups = [(loss_rows(in_loss, False), True)]
    else:
        groups = [(loss_rows(in_loss if plan.kept is None else in_loss & plan.kept, True), True)]
        if plan.kept is not None:
            groups.append((loss_rows(in_loss & ~plan.kept, True), False))
    for rows, with_gradient in groups:
        for start in range(0, rows.numel(), plan.chunk_rows):
            idx = rows[start:start + plan.chunk_rows]
            h = hidden.index_select(0, idx)
            logits = _kept(_head(h, weight, bias, plan.head_dtype, fixed), plan.support, idx, row_labels)
            labels, t_rows = row_labels.index_select(0, idx), T.rows(idx)
            stats = impl.token_stats_fwd(logits, labels, t_rows, compute_entropy, compute_sum_pi_squared)
            lp = engine_logprobs(plan.numerics, impl, logits, labels, t_rows, stats.logprobs).to(acc)
            ent = None if stats.entropy is None else stats.entropy.to(acc)
            for out, value in ((logprobs, lp), (entropy, ent), (sum_pi_squared, stats.sum_pi_squared)):
                if out is not None:
                    out.index_copy_(0, idx, value.to(acc))
            if not with_gradient:
                continue
            c, e = coefficients(idx, lp, ent)
            grad_logits = impl.token_grad_bwd(
                logits, labels, stats.row_max.to(acc), stats.log_norm.to(acc), None if e is None else ent, c, e,
                t_rows, True,  # the chunk's logits are ours: the gradient overwrites them
            )
            if not plan.select_rows:  # every row: only those that can carry a gradient enter the weight's GEMM
                carries = in_loss if plan.kept is None else in_loss & plan.kept
                h = carrying_rows(h, carries.index_select(0, idx))
            grads.add(idx, grad_logits, h)
    return ForwardGradient(logprobs, entropy, sum_pi_squared, *grads.rounded())
