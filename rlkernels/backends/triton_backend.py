"""The Triton backend: launchers only (layout checks, allocation, grid and BLOCK_* live in kernels/triton).

The full-form divergences have kernels for one temperature each and one dtype for both tensors; a per-token
temperature or two dtypes take the chunked PyTorch form (inherited from TorchBackend).
"""

import os

import torch

from ..kernels.triton import divergences as divergence_kernels
from ..kernels.triton import vllm_logprobs as vllm_kernels
from ..kernels.triton.forward_grad import covers as forward_gradient_covers
from ..kernels.triton.forward_grad import forward_gradient
from ..kernels.triton.head_columns import head_logprobs_fwd, write_head_columns
from ..kernels.triton.stage import stage_fwd
from ..kernels.triton.token_grad import token_grad_bwd
from ..kernels.triton.token_stats import token_stats_fwd
from .base import RowStats
from .temperature import Temperature
from .torch_backend import TorchBackend

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


class TritonBackend(TorchBackend):
    name = "triton"

    def supports(self, logits: torch.Tensor) -> bool:
        """CUDA logits of fp16/bf16/fp32; CPU logits too when the Triton interpreter is on (tests)."""
        if logits.dtype not in _DTYPES:
            return False
        if logits.is_cuda:
            return True
        return logits.device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1"

    def _normalising_pass(self) -> "TritonBackend":
        return self  # the kernel computes every active row's normaliser

    @staticmethod
    def sequence_stage(inputs, options: dict, hyper: dict, factors: bool = False) -> tuple:
        """The per-sequence stage of the common PPO family in two launches (stage/fused.py decides when); with
        `factors`, what each token's coefficients are formed from instead (forward_gradient forms them)."""
        return stage_fwd(inputs, options, hyper, factors)

    @staticmethod
    def forward_gradient_covers(V: int) -> bool:
        """Whether forward_gradient runs a vocabulary of V entries (the tiers of LLM vocabularies: V > 1024)."""
        return forward_gradient_covers(V)

    @staticmethod
    def forward_gradient(logits, labels, temperature, out, factors, codes: dict, hyper: dict,
                         compute_entropy: bool) -> tuple:
        """The statistics and dlogits of every row in one launch (the gradient formed in the forward, SPEC §2.4):
        (logprobs, entropy or None), dlogits written into `out`."""
        return forward_gradient(logits, labels, Temperature.of(temperature).value(), out, factors, codes, hyper,
                                compute_entropy)

    def token_stats_fwd(self, logits, labels, temperature, compute_entropy, compute_sum_pi_squared) -> RowStats:
        return RowStats(*token_stats_fwd(logits, labels, Temperature.of(temperature).value(), compute_entropy,
                                         compute_sum_pi_squared))

    def token_grad_bwd(
        self, logits, labels, row_max, log_norm, entropy, coef_logprob, coef_entropy, temperature, inplace,
    ) -> torch.Tensor:
        return token_grad_bwd(logits, labels, row_max, log_norm, entropy, coef_logprob, coef_entropy,
                              Temperature.of(temperature).value(), inplace)

    def head_stats_fwd(self, logits, labels, head_ids, temperature, compute_entropy, compute_sum_pi_squared):
        """The forward kernel, then the head's log-probs by one more kernel (k reads per row)."""
        T = Temperature.of(temperature)
        stats = self.token_stats_fwd(logits, labels, T, compute_entropy, compute_sum_pi_squared)
        rows = logits if logits.stride(-1) == 1 else logits.contiguous()
        return stats, head_logprobs_fwd(rows, labels, head_ids, stats.row_max, stats.log_norm, T.value())

    def head_grad_bwd(self, logits, labels, head_ids, row_max, log_norm, entropy, logprobs, head, coef_logprob,
                      coef_head, coef_entropy, temperature):
        """The plain kernel for c + sum_j C_j, then the head's k + 1 columns by one more kernel (k + 1 reads and
        writes per row: kernels/triton/head_columns.py)."""
        T = Temperature.of(temperature).value()
        c_total = coef_logprob + coef_head.sum(1)
        out = token_grad_bwd(logits, labels, row_max, log_norm, entropy, c_total, coef_entropy, T, False)
        write_head_columns(logits if logits.stride(-1) == 1 else logits.contiguous(), out, labels, head_ids, row_max,
                           log_norm, entropy, coef_logprob, c_total, coef_head, coef_entropy, T)
        return out

    def vllm_logprobs(self, logits, labels, temperature):
        """numerics="vllm": vLLM's V2 sampler's log-probs (its default runner on a GPU), with its Triton
        operations in its order (kernels/triton/vllm_logprobs.py)."""
        return vllm_kernels.vllm_logprobs(logits, labels, Temperature.of(temperature).value())

    @staticmethod
    def _kernels_take(logits, reference, temperature: Temperature, reference_temperature: Temperature) -> bool:
        return not temperature.per_row and not reference_temperature.per_row and reference.dtype == logits.dtype

    def full_divergences_fwd(self, logits, reference, active, temperature, reference_temperature, with_tv=True):
        t, t_r = Temperature.of(temperature), Temperature.of(reference_temperature)
        if not self._kernels_take(logits, reference, t, t_r):
            return super().full_divergences_fwd(logits, reference, active, t, t_r, with_tv)
        return divergence_kernels.full_divergences_fwd(logits, reference, active, t.value(), t_r.value(),
                                                       with_tv).stats

    def full_divergences_bwd(self, logits, reference, stats, coef, temperature, reference_temperature):
        t, t_r = Temperature.of(temperature), Temperature.of(reference_temperature)
        if not self._kernels_take(logits, reference, t, t_r):
            return super().full_divergences_bwd(logits, reference, stats, coef, t, t_r)
        return divergence_kernels.full_divergences_bwd(logits, reference, stats, coef, t.value(), t_r.value())
