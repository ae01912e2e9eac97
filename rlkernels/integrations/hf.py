"""Response logits and hidden states of a Hugging Face causal LM, already shifted (the no-shift convention).

rlkernels pairs row t of the logits (or hidden states) with `labels[t]` (SPEC §15): the logits that
predict completion token j sit at position P + j - 1 of a prompt + completion sequence of prompt length P.
These helpers return exactly those rows, and the completion ids as labels:

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
*inside* the model's forward (`model(..., rlkernels_loss=fn)`) and the head's own call, through whatever
wraps the model (DDP, FSDP): the trainer integrations use it. `hidden_state_loss_blocker(model)` says
when that loss would not be the loss on the model's logits.
"""

import functools
import types
from typing import Optional, Tuple

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


# config attributes with which a model transforms its logits after the LM head (Gemma-2's softcapping,
# Cohere's logit_scale, Granite's logits_scaling, Falcon-H1's lm_head_multiplier, MiniCPM3's output
# multiplier): a loss on hidden states and the head's weight would miss the transform
_LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling", "lm_head_multiplier",
                     "output_multiplier")


def hidden_state_loss_blocker(model) -> Optional[str]:
    """Why a loss on `model`'s last hidden states and LM head weight would not be the loss on its logits
    (or could not run alike on every rank), or None: a vision-language model (its own forward runs the
    vision tower, on every rank, before the decoder), a logit transform after the head, or an adapter on
    the head (PEFT's LoRA wraps it; its weight is then the base weight)."""
    config = getattr(model, "config", None)
    if config is not None and getattr(config, "vision_config", None) is not None:
        return "a vision-language model (its forward runs the vision tower before the decoder)"
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    for name in _LOGIT_TRANSFORMS:
        value = getattr(text_config, name, None)
        if value is not None and value != 1.0:
            return f"config.{name}={value} (the model transforms its logits after the LM head)"
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if head is None or not hasattr(model, "get_decoder"):
        return f"a model without get_decoder() / get_output_embeddings() ({type(model).__name__})"
    if hasattr(head, "base_layer"):
        return "an adapter on the LM head (PEFT)"
    return None


def add_loss_forward(model) -> None:
    """Patch `model.forward` (once, over whatever forward it has) so that `model(..., rlkernels_loss=fn)` runs
    the decoder on the other arguments and returns `fn(last_hidden_state, lm_head.weight, lm_head.bias)`;
    without `rlkernels_loss` the forward is the one it replaces. `fn` runs inside the LM head's own call
    (its forward swapped for the call's duration), so a DDP / FSDP wrapper's hooks run as for the head's
    matmul: FSDP gathers the head's weight (in its compute dtype) before `fn`, again before its backward,
    and reduces its gradient after, whether the head is its own FSDP unit or part of the root's. `fn` runs
    with autocast off: it casts to the head's dtype itself. Check `hidden_state_loss_blocker` first."""
    if getattr(model.forward, "_rlkernels_loss_forward", False):
        return
    forward = model.forward

    @functools.wraps(type(model).forward)  # the signature `generate` validates its kwargs against
    def loss_forward(self, *args, rlkernels_loss=None, **kwargs):
        if rlkernels_loss is None:
            return forward(*args, **kwargs)
        kwargs["use_cache"] = False
        hidden = self.get_decoder()(*args, **kwargs).last_hidden_state
        return _call_through_head(self.get_output_embeddings(), hidden, rlkernels_loss)

    loss_forward._rlkernels_loss_forward = True
    model.forward = types.MethodType(loss_forward, model)


def _call_through_head(head, hidden, fn):
    """fn(hidden, weight, bias) computed as the head module's forward (FSDP1 wraps the module: its inner
    module's forward is swapped, so the wrapper's own forward still runs)."""
    inner = getattr(head, "_fsdp_wrapped_module", head)

    def head_forward(h):
        weight, bias = inner.weight, inner.bias
        if hasattr(weight, "full_tensor"):  # a DTensor the wrapper did not gather: gather it (as TRL does)
            weight = weight.full_tensor()
            bias = None if bias is None else bias.full_tensor()
        with torch.autocast(h.device.type, enabled=False):
            return fn(h.to(weight.device), weight, bias)

    had_own = "forward" in inner.__dict__
    own = inner.__dict__.get("forward")
    inner.forward = head_forward
    try:
        return head(hidden)
    finally:
        if had_own:
            inner.forward = own
        else:
            del inner.forward
