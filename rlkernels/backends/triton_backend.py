"""The Triton backend: launchers only (layout checks, allocation, grid and BLOCK_* live in kernels/triton)."""

import os

import torch

from ..kernels.triton.token_grad import token_grad_bwd
from ..kernels.triton.token_stats import token_stats_fwd
from .base import RowStats

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


class TritonBackend:
    name = "triton"

    def supports(self, logits: torch.Tensor) -> bool:
        """CUDA logits of fp16/bf16/fp32; CPU logits too when the Triton interpreter is on (tests)."""
        if logits.dtype not in _DTYPES:
            return False
        if logits.is_cuda:
            return True
        return logits.device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1"

    def token_stats_fwd(self, logits, labels, temperature, compute_entropy, compute_sum_pi_squared) -> RowStats:
        return RowStats(*token_stats_fwd(logits, labels, temperature, compute_entropy, compute_sum_pi_squared))

    def token_grad_bwd(
        self, logits, labels, row_max, log_norm, entropy, coef_logprob, coef_entropy, temperature, inplace,
    ) -> torch.Tensor:
        return token_grad_bwd(
            logits, labels, row_max, log_norm, entropy, coef_logprob, coef_entropy, temperature, inplace
        )
