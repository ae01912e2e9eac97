"""The rollout engines' own log-prob arithmetic, for `numerics="vllm"`: the sampled token's log-prob computed in
the operations and the order the engine uses, so that the trainer's value has the engine's bits.

vLLM 0.33.0's V1 sampler (`vllm/v1/sample/sampler.py`; what vLLM runs with VLLM_USE_V2_MODEL_RUNNER=0, and on a
CPU without Triton), processed log-probs: the logits as a float32 copy (`logits.to(torch.float32)`, :158), divided
in place by the request's temperature held as a float32 [N, 1] tensor (`apply_temperature`, `logits.div_(temp
.unsqueeze(dim=1))`, :291-300), then ATen's `log_softmax(dim=-1, dtype=torch.float32)` (:368-370). ATen's
log-softmax computes each row on its own (checked on the CPU: the same bits for a row alone, in a chunk or in
the whole batch), so rows are taken here a chunk at a time, as the engine's batch would hold them.

The torch, CPU and CUDA backends run this with ATen on the logits' device: the bits of vLLM's V1 path on that
device. vLLM's default V2 runner on a GPU computes with Triton kernels of its own (a max pass and a sum pass over
1024-wide blocks); the Triton backend follows that one instead (kernels/triton/vllm_logprobs.py).
"""

import torch

from .base import row_groups
from .temperature import Temperature

# rows per chunk: about this many float32 logits (the copy the engine also makes): a CPU cache's worth; on a GPU
# enough that the launches do not dominate (as the torch backend's DEVICE_CHUNK_ELEMENTS)
_CHUNK_ELEMENTS = {"cpu": 1 << 20}
_DEVICE_CHUNK_ELEMENTS = 1 << 25


def vllm_logprobs(logits: torch.Tensor, labels: torch.Tensor, temperature: Temperature) -> torch.Tensor:
    """[N] float32 log-probs of `labels` under vLLM's V1 processed log-softmax; 0 where the label is outside
    [0, V) (rows outside the loss), and -inf on a row without a finite logit (where the engine's NaN would enter a
    ratio: the backends' convention, base.RowStats). logits: [N, V] or [B, T, V] row-strided (the backends'
    convention); float64 ones are read as float32, as the engine holds them."""
    V = logits.shape[-1]
    out = torch.zeros(labels.shape[0], dtype=torch.float32, device=logits.device)
    valid = (labels >= 0) & (labels < V)
    safe = labels.clamp(0, max(V - 1, 0))
    t32 = temperature.tensor.to(device=logits.device, dtype=torch.float32)
    step = max(1, _CHUNK_ELEMENTS.get(logits.device.type, _DEVICE_CHUNK_ELEMENTS) // max(V, 1))
    for first, rows in row_groups(logits):
        for s in range(0, rows.shape[0], step):
            e = min(rows.shape[0], s + step)
            z = rows[s:e].to(torch.float32, copy=True)
            z.div_(t32[first + s:first + e].unsqueeze(1) if temperature.per_row else t32.reshape(1, 1))
            lp = torch.log_softmax(z, dim=-1, dtype=torch.float32)
            out[first + s:first + e] = lp.gather(1, safe[first + s:first + e, None]).squeeze(1)
    out = torch.where(torch.isnan(out), float("-inf"), out)
    return torch.where(valid, out, torch.zeros((), dtype=torch.float32, device=out.device))
