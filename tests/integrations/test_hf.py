"""The shifted response logits / hidden states of a Hugging Face causal LM (rlkernels.integrations.hf)."""

import pytest
import torch

import rlkernels

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
    assert torch.allclose(logits, full[:, P - 1:-1], atol=1e-5)
    assert torch.equal(labels, ids[:, P:])
    hidden, labels_h = response_hidden_states(model, ids, mask, prompt_length=P)
    assert torch.allclose(hidden @ model.lm_head.weight.T, full[:, P - 1:-1], atol=1e-5)
    assert torch.equal(labels_h, labels)
    # the two entry points agree on the loss built from them
    adv, cmask = torch.randn(3), torch.ones(3, 5, dtype=torch.bool)
    a = rlkernels.decoupled_ppo_loss(logits, labels, adv, cmask).loss
    b = rlkernels.linear_decoupled_ppo_loss(hidden, model.lm_head.weight, labels, adv, cmask).loss
    assert torch.allclose(a, b, rtol=1e-5, atol=1e-6)


def test_bad_prompt_length_names_the_argument():
    with pytest.raises(ValueError, match=r"^prompt_length: expected an int in \[1, 9\]"):
        response_logits(_model(), torch.zeros(2, 9, dtype=torch.long), torch.ones(2, 9), prompt_length=0)
