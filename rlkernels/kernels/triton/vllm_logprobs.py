"""The sampled token's log-prob in vLLM 0.33.0's V2 sampler's operations (its default model runner), for
`numerics="vllm"` on the Triton backend: the same Triton operations in the same order and layout, so that on the
same device and Triton version the bits are the engine's.

vLLM, for processed log-probs (`vllm/v1/worker/gpu/sample/`): a float32 copy of the logits; `gumbel.py`
`_temperature_kernel` divides each row by its float32 temperature (`logits / temperature`, Triton's division;
rows at T = 0 or 1 left alone); then `logprob.py` `_topk_log_softmax_kernel`, one program per row, 4 warps:
a max pass over 1024-wide blocks (`max_val = tl.max(tl.maximum(x, max_val))`), a sum pass (`se += tl.sum(e)` with
`e = tl.exp(x - max_val)`, masked lanes 0), `lse = tl.log(se)`, and `x_id - max_val - lse`. Here the division is
made as each block is loaded rather than stored first: the same float32 quotient either way.
"""

import torch
import triton
import triton.language as tl

from .aot_spec import AotSpec
from .tl_math import TRITON_DTYPES
from .token_stats import device_guard, grouped_strides

BLOCK_SIZE = 1024  # vLLM's (logprob.py, compute_token_logprobs)
NUM_WARPS = 4  # Triton's default, which vLLM's launch keeps: the layout fixes tl.sum's order
NUM_STAGES = 3  # Triton's default too (vLLM passes none); named so that the AOT check compiles what is launched


@triton.jit
def _vllm_logprobs_kernel(
    out_ptr, logits_ptr, labels_ptr, temperature_ptr,
    N, V, rows_per_group, stride_g, stride_n,
    temperature,
    ROW_TEMPERATURE: tl.constexpr, BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    label = tl.load(labels_ptr + row)
    if (label < 0) | (label >= V):  # outside the loss: 0, and the row is never read
        tl.store(out_ptr + row, 0.0)
        return
    row_ptr = logits_ptr + (row // rows_per_group) * stride_g + (row % rows_per_group) * stride_n
    if ROW_TEMPERATURE:
        t = tl.load(temperature_ptr + row).to(tl.float32)
    else:
        t = tl.cast(temperature, tl.float32)
    scaled = (t != 0.0) & (t != 1.0)  # vLLM's early return: such rows keep their logits

    max_val = float("-inf")
    for i in range(0, V, BLOCK):
        block = i + tl.arange(0, BLOCK)
        x = tl.load(row_ptr + block, mask=block < V, other=float("-inf")).to(tl.float32)
        x = tl.where(scaled, x / t, x)
        max_val = tl.max(tl.maximum(x, max_val))
    max_val = max_val.to(tl.float32)

    se = 0.0
    for i in range(0, V, BLOCK):
        block = i + tl.arange(0, BLOCK)
        x = tl.load(row_ptr + block, mask=block < V, other=0.0).to(tl.float32)
        x = tl.where(scaled, x / t, x)
        e = tl.exp(x - max_val)
        e = tl.where(block < V, e, 0.0)
        se += tl.sum(e)
    lse = tl.log(se)

    x = tl.load(row_ptr + label).to(tl.float32)
    x = tl.where(scaled, x / t, x)
    out = x - max_val - lse
    # a row without a finite logit: -inf, not the engine's NaN (the backends' convention, base.RowStats)
    tl.store(out_ptr + row, tl.where(max_val == float("-inf"), float("-inf"), out))


def vllm_logprobs(logits, labels, temperature):
    """[N] float32: vLLM V2's processed log-prob of each row's label (0 where the label is outside [0, V)).
    logits: (N, V) or (B, T, V) with unit stride along V; labels: (N,) int64; temperature: a float, or an (N,)
    tensor of per-row temperatures (divided by, in float32, as vLLM holds them)."""
    V = logits.shape[-1]
    N = logits.numel() // V if V else 0
    out = torch.empty(N, dtype=torch.float32, device=logits.device)
    if N == 0:
        return out
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    rows_per_group, stride_g, stride_n = grouped_strides(logits)
    per_row = isinstance(temperature, torch.Tensor)
    t_rows = temperature.to(device=logits.device, dtype=torch.float32).contiguous() if per_row else out
    with device_guard(logits):
        _vllm_logprobs_kernel[(N,)](
            out, logits, labels.to(torch.int64).contiguous(), t_rows, N, V, rows_per_group, stride_g, stride_n,
            1.0 if per_row else float(temperature), ROW_TEMPERATURE=per_row, BLOCK=BLOCK_SIZE, num_warps=NUM_WARPS,
            num_stages=NUM_STAGES,
        )
    return out


def aot_specs():
    """One AotSpec per (logits dtype, per-row temperature or not)."""
    specs = []
    for dtype in TRITON_DTYPES.values():
        for row_t in (False, True):
            signature = {"out_ptr": "*fp32", "logits_ptr": f"*{dtype}", "labels_ptr": "*i64",
                         "temperature_ptr": "*fp32", "N": "i32", "V": "i32", "rows_per_group": "i32",
                         "stride_g": "i64", "stride_n": "i32", "temperature": "fp32", "ROW_TEMPERATURE": "constexpr",
                         "BLOCK": "constexpr"}
            specs.append(AotSpec(
                name=f"vllm_logprobs[{dtype},ROW_TEMPERATURE={int(row_t)}]", fn=_vllm_logprobs_kernel,
                signature=signature, constexprs={"ROW_TEMPERATURE": row_t, "BLOCK": BLOCK_SIZE},
                num_warps=NUM_WARPS, num_stages=NUM_STAGES,
                aligned=("out_ptr", "logits_ptr", "labels_ptr", "temperature_ptr", "V", "stride_g", "stride_n"),
            ))
    return specs
