"""Transcription of NeMo-RL's local log-prob code: what rlkernels' NeMo-RL log-prob routes replace.

Source: NVIDIA-NeMo/RL, commit 7ea279abfbeb698b092856d0dab61e7cf39bc909
(2026-08-22, "fix: guard tokenizer save with rank 0 to avoid NFS deadlock (#3504)"):

- ``nemo_rl/algorithms/logits_sampling_utils.py`` lines 29-66 (``TrainingSamplingParams``,
  ``need_top_k_or_top_p_filtering``) and 283-284 (``apply_top_k_top_p`` without filtering)
- ``nemo_rl/distributed/model_utils.py`` lines 1611-1695 (``get_next_token_logprobs_from_logits``)
- ``nemo_rl/models/automodel/train.py`` lines 197-215 (``apply_top_k_top_p_filtering_for_local_logits``) and
  656-697, 800-864 (``LogprobsPostProcessor.__init__`` and ``_compute_local_logprobs``)

Deliberate differences, each marked ``# TRANSCRIPTION NOTE:``: the vocabulary-parallel, DTensor and top-k / top-p
branches raise ``NotImplementedError`` (the routes hand them to NeMo-RL's own code, which the tests check by that
error); ``.cuda()`` on the labels is ``.to(device)`` (the tests run on the CPU); ``LogprobsPostProcessor`` keeps the
attributes ``_compute_local_logprobs`` reads.

The tests write this file into a stand-in ``nemo_rl`` package on disk, as ``nemo_rl.distributed.model_utils`` and
``nemo_rl.models.automodel.train``, so each test imports it afresh. Only ``torch``, ``dataclasses`` and ``typing``
are imported.
"""

from dataclasses import dataclass
from typing import Optional

import torch


@dataclass
class TrainingSamplingParams:
    """logits_sampling_utils.py lines 29-44."""

    top_k: Optional[int] = None
    top_p: float = 1.0
    temperature: float = 1.0


def _need_top_k_filtering(top_k: Optional[int]) -> bool:
    return top_k is not None and top_k > 0


def _need_top_p_filtering(top_p: Optional[float]) -> bool:
    return top_p is not None and top_p != 1.0


def need_top_k_or_top_p_filtering(sampling_params: Optional[TrainingSamplingParams]) -> bool:
    """logits_sampling_utils.py lines 57-66."""
    if sampling_params is None:
        return False

    top_k = sampling_params.top_k
    top_p = sampling_params.top_p
    return _need_top_k_filtering(top_k) or _need_top_p_filtering(top_p)


def apply_top_k_top_p(logits, top_k, top_p):
    """logits_sampling_utils.py lines 254-284."""
    if not _need_top_k_filtering(top_k) and not _need_top_p_filtering(top_p):
        return logits, None
    # TRANSCRIPTION NOTE: the filtering itself (lines 285-330) is not transcribed.
    raise NotImplementedError("NeMo-RL's top-k / top-p filtering is not transcribed")


def apply_top_k_top_p_filtering_for_local_logits(logits, sampling_params):
    """train.py lines 197-215."""
    if need_top_k_or_top_p_filtering(sampling_params):
        logits, _ = apply_top_k_top_p(
            logits,
            top_k=sampling_params.top_k,
            top_p=sampling_params.top_p,
        )
    return logits


def get_next_token_logprobs_from_logits(
    input_ids,
    next_token_logits,
    seq_index=None,
    vocab_parallel_rank=None,
    vocab_parallel_group=None,
    context_parallel_group=None,
    sampling_params=None,
    chunk_size=None,
):
    """model_utils.py lines 1611-1695."""
    use_chunking = (
        vocab_parallel_group is not None
        and chunk_size is not None
        and not need_top_k_or_top_p_filtering(sampling_params)
    )
    if not use_chunking:
        next_token_logits = next_token_logits.to(torch.float32)

    if vocab_parallel_group is not None:
        # TRANSCRIPTION NOTE: from_parallel_logits_to_logprobs is not transcribed.
        raise NotImplementedError("NeMo-RL's vocabulary-parallel log-probs are not transcribed")

    elif isinstance(next_token_logits, torch.distributed.tensor.DTensor):
        # TRANSCRIPTION NOTE: get_logprobs_from_vocab_parallel_logits is not transcribed.
        raise NotImplementedError("NeMo-RL's DTensor log-probs are not transcribed")

    else:
        # Remove last position's logits
        next_token_logits_wo_last = next_token_logits[:, :-1]
        # Apply top-k and top-p filtering
        next_token_logits_wo_last, _ = apply_top_k_top_p(
            next_token_logits_wo_last,
            top_k=sampling_params.top_k if sampling_params is not None else None,
            top_p=sampling_params.top_p if sampling_params is not None else 1.0,
        )
        # Compute logprobs
        next_token_logprobs = torch.nn.functional.log_softmax(next_token_logits_wo_last, dim=-1)
        # TRANSCRIPTION NOTE: `.cuda()` -> `.to(next_token_logits.device)`.
        next_tokens = input_ids[:, 1:].to(next_token_logits.device)  # Skip first token
        logprobs = next_token_logprobs.gather(dim=-1, index=next_tokens.unsqueeze(-1)).squeeze(-1)

    return logprobs


class LogprobsPostProcessor:
    """train.py lines 656-697 (the attributes `_compute_local_logprobs` reads) and 800-864."""

    def __init__(self, cfg, sampling_params: Optional[TrainingSamplingParams] = None):
        # TRANSCRIPTION NOTE: the meshes, cp_size and enable_seq_packing are not kept.
        self.cfg = cfg
        self.sampling_params = sampling_params
        self.logprob_chunk_size = cfg.get("logprob_chunk_size", None)

    def _compute_local_logprobs(self, logits, input_ids):
        next_tokens = input_ids[:, 1:].to(logits.device)
        target_seq_len = int(next_tokens.shape[1])

        if target_seq_len == 0:
            return logits.new_empty(
                (input_ids.shape[0], 0),
                dtype=torch.float32,
            )

        logits = logits[:, :target_seq_len, :]

        if self.logprob_chunk_size is None:
            logits = logits.to(torch.float32).contiguous()
            logits = apply_top_k_top_p_filtering_for_local_logits(logits, self.sampling_params)
            log_probs = torch.nn.functional.log_softmax(logits, dim=-1)
            token_logprobs = log_probs.gather(dim=-1, index=next_tokens.unsqueeze(-1)).squeeze(-1)
            del log_probs
            return token_logprobs

        chunked_token_logprobs = []
        for chunk_start in range(0, target_seq_len, self.logprob_chunk_size):
            chunk_end = min(chunk_start + self.logprob_chunk_size, target_seq_len)
            chunk_logits = logits[:, chunk_start:chunk_end, :].to(torch.float32)
            chunk_logits = chunk_logits.contiguous()
            chunk_logits = apply_top_k_top_p_filtering_for_local_logits(chunk_logits, self.sampling_params)
            chunk_log_probs = torch.nn.functional.log_softmax(chunk_logits, dim=-1)
            chunk_token_logprobs = chunk_log_probs.gather(
                dim=-1,
                index=next_tokens[:, chunk_start:chunk_end].unsqueeze(-1),
            ).squeeze(-1)
            chunked_token_logprobs.append(chunk_token_logprobs)
            del chunk_log_probs, chunk_logits

        token_logprobs = torch.cat(chunked_token_logprobs, dim=1)
        del chunked_token_logprobs

        return token_logprobs
