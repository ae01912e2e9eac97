"""The shifted response logits / hidden states of a Hugging Face causal LM (rlkernels.integrations.hf)."""

import pytest
import torch

import rlkernels

from ..cases import F32, assert_close, tol

transformers = pytest.importorskip("transformers", reason="transformers is not installed")

from rlkernels.integrations.hf import response_hidden_states, response_logits  # noqa: E402


def _model():
    torch.manual_seed(0)
    cfg = transformers.Qwen2Config(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                   tie_word_embeddings=False)
    return transformers.Qwen2ForCausalLM(cfg).eval()


def test_response_rows_are_the_shifted_full_rows():
    model = _model()
    ids = torch.randint(0, 97, (3, 9))
    mask = torch.ones(3, 9, dtype=torch.long)
    mask[0, :2] = 0  # left padding
    P = 4
    full = model(input_ids=ids, attention_mask=mask).logits
    logits, labels = response_logits(model, ids, mask, prompt_length=P)
    assert logits.is_contiguous() and logits.shape == (3, 5, 97)
    assert_close(logits, full[:, P - 1:-1], **tol("hf.logits", F32), name="response logits")
    assert torch.equal(labels, ids[:, P:])
    hidden, labels_h = response_hidden_states(model, ids, mask, prompt_length=P)
    assert_close(hidden @ model.lm_head.weight.T, full[:, P - 1:-1], **tol("hf.logits", F32), name="hidden @ W.T")
    assert torch.equal(labels_h, labels)
    # the two entry points agree on the loss built from them
    adv, cmask = torch.randn(3), torch.ones(3, 5, dtype=torch.bool)
    a = rlkernels.decoupled_ppo_loss(logits, labels, adv, cmask).loss
    b = rlkernels.linear_decoupled_ppo_loss(hidden, model.lm_head.weight, labels, adv, cmask).loss
    assert_close(a, b, **tol("reordered", F32), name="loss")


def test_bad_prompt_length_names_the_argument():
    with pytest.raises(ValueError, match=r"^prompt_length: expected an int in \[1, 9\]"):
        response_logits(_model(), torch.zeros(2, 9, dtype=torch.long), torch.ones(2, 9), prompt_length=0)


def test_loss_forward_computes_through_the_head_and_leaves_the_forward_alone():
    """add_loss_forward: with rlkernels_loss the forward returns fn(hidden, weight, bias) with the LM head's
    own call around it (its hooks fire) and the head's forward restored after; without, the forward is
    unchanged; the loss equals the loss on the model's logits."""
    from rlkernels.integrations.hf import add_loss_forward

    model = _model().train()
    ids = torch.randint(0, 97, (2, 6))
    want = model(input_ids=ids).logits
    add_loss_forward(model)
    add_loss_forward(model)  # once
    calls = []
    model.lm_head.register_forward_pre_hook(lambda module, args: calls.append(args[0].shape))
    assert torch.equal(model(input_ids=ids).logits, want)
    got = model(input_ids=ids, rlkernels_loss=lambda h, w, b: torch.nn.functional.linear(h, w, b))
    assert_close(got, want, **tol("reordered", F32), name="logits through the head")
    assert calls == [(2, 6, 32), (2, 6, 32)] and "forward" not in model.lm_head.__dict__


def test_hidden_state_loss_blocker_names_what_the_hidden_state_loss_would_miss():
    from rlkernels.integrations.hf import hidden_state_loss_blocker

    model = _model()
    assert hidden_state_loss_blocker(model) is None
    model.config.final_logit_softcapping = 30.0  # Gemma-2
    assert "final_logit_softcapping=30.0" in hidden_state_loss_blocker(model)
    model.config.final_logit_softcapping = None
    model.config.logit_scale = 1.0  # a scale of 1 transforms nothing
    assert hidden_state_loss_blocker(model) is None
    model.config.vision_config = {"hidden_size": 8}
    assert "vision-language" in hidden_state_loss_blocker(model)
    del model.config.vision_config
    peft = pytest.importorskip("peft")
    lora = peft.get_peft_model(_model(), peft.LoraConfig(target_modules=["q_proj", "lm_head"], r=2))
    assert "adapter on the LM head" in hidden_state_loss_blocker(lora.get_base_model())
    lora = peft.get_peft_model(_model(), peft.LoraConfig(target_modules=["q_proj"], r=2))
    assert hidden_state_loss_blocker(lora.get_base_model()) is None
