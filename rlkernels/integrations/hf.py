"""Response logits and hidden states of a Hugging Face causal LM, already shifted (the no-shift convention).

rlkernels pairs row t of the logits (or hidden states) with `labels[t]` (docs/spec.md, "Input
conventions"): the logits that predict completion token j sit at position P + j - 1 of a
prompt + completion sequence of prompt length P. These helpers return exactly those rows, and the
completion ids as labels:

    logits, labels = response_logits(model, input_ids, attention_mask, prompt_length=P)
    out = rlkernels.decoupled_ppo_loss(logits, labels, advantages, completion_mask, ...)

    hidden, labels = response_hidden_states(model, input_ids, attention_mask, prompt_length=P)
    out = rlkernels.linear_decoupled_ppo_loss(hidden, model.get_output_embeddings().weight, labels, ...)

`response_logits` asks the model for those positions only (`logits_to_keep` as an index tensor), so the
[B, P + C, V] logits are never formed and the result is contiguous; `response_hidden_states` slices the
decoder's output (a view, no copy). Slicing full logits as `model(...).logits[:, P - 1:-1]` is correct
but forms (and, for a contiguous result, copies) the whole sequence's logits; passing
`model(...).logits[:, P:]` or unshifted logits gives a wrong loss with no error.

`add_loss_forward(model)` lets a trainer compute a loss from the last hidden states and the LM head
*inside* the model's forward (`model(..., rlkernels_loss=fn)`), through whatever wraps the model (DDP,
FSDP): the trainer integrations use it, as TRL's and verl's own fused heads do.
"""

import functools
import types
from typing import Tuple

import torch


def _completion(input_ids: torch.Tensor, prompt_length: int) -> Tuple[int, int, torch.Tensor]:
    if input_ids.dim() != 2:
        raise ValueError(f"input_ids: expected [B, P + C], got shape {tuple(input_ids.shape)}")
    total = input_ids.shape[1]
    if not (isinstance(prompt_length, int) and 1 <= prompt_length <= total):
        raise ValueError(f"prompt_length: expected an int in [1, {total}] (the padded prompt width), got "
                         f"{prompt_length!r}")
    return prompt_length, total - prompt_length, input_ids[:, prompt_length:]


def response_logits(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, prompt_length: int,
                    **model_kwargs) -> Tuple[torch.Tensor, torch.Tensor]:
    """([B, C, V] logits predicting the completion tokens, [B, C] completion ids). The model computes
    only those C positions (`logits_to_keep` = positions P - 1 .. P + C - 2)."""
    P, C, labels = _completion(input_ids, prompt_length)
    keep = torch.arange(P - 1, P + C - 1, device=input_ids.device)
    logits = model(input_ids=input_ids, attention_mask=attention_mask, logits_to_keep=keep, **model_kwargs).logits
    return logits, labels


def response_hidden_states(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, prompt_length: int,
                           **model_kwargs) -> Tuple[torch.Tensor, torch.Tensor]:
    """([B, C, H] last hidden states predicting the completion tokens, a view; [B, C] completion ids),
    for `linear_decoupled_ppo_loss` with the model's output embeddings."""
    P, C, labels = _completion(input_ids, prompt_length)
    hidden = model.get_decoder()(input_ids=input_ids, attention_mask=attention_mask, **model_kwargs).last_hidden_state
    return hidden[:, P - 1:P + C - 1], labels


def add_loss_forward(model) -> None:
    """Patch `model.forward` (once, over whatever forward it has) so that `model(..., rlkernels_loss=fn)` runs
    the decoder on the other arguments and returns `fn(last_hidden_state, lm_head.weight, lm_head.bias)`
    from inside the forward, where a DDP / FSDP wrapper's hooks have run (an FSDP2 DTensor head is gathered
    with `full_tensor()`); without `rlkernels_loss` the forward is the one it replaces. `fn` runs with
    autocast off: it casts to the head's dtype itself."""
    if getattr(model.forward, "_rlkernels_loss_forward", False):
        return
    forward = model.forward

    @functools.wraps(type(model).forward)  # the signature `generate` validates its kwargs against
    def loss_forward(self, *args, rlkernels_loss=None, **kwargs):
        if rlkernels_loss is None:
            return forward(*args, **kwargs)
        kwargs["use_cache"] = False
        hidden = self.get_decoder()(*args, **kwargs).last_hidden_state
        head = self.get_output_embeddings()
        weight, bias = head.weight, head.bias
        if hasattr(weight, "full_tensor"):  # FSDP2 shards parameters as DTensors: gather the head (as TRL does)
            weight = weight.full_tensor()
            bias = None if bias is None else bias.full_tensor()
        with torch.autocast(hidden.device.type, enabled=False):
            return rlkernels_loss(hidden.to(weight.device), weight, bias)

    loss_forward._rlkernels_loss_forward = True
    model.forward = types.MethodType(loss_forward, model)
