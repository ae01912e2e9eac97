"""GRPO with TRL 1.16, the loss computed by rlkernels: the one change is the import.

Runs on a CPU in about ten seconds, with a tiny randomly initialised Qwen2 and a word-level tokenizer
built in code (nothing is downloaded); the reward is the fraction of completion words w<i> with i < 75.

    pip install 'rlkernels[trl]'
    python examples/trl_grpo.py
"""

import torch
from datasets import Dataset
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM
from trl import GRPOConfig

from rlkernels import RolloutCorrection
from rlkernels.integrations.trl import GRPOTrainer  # was: from trl import GRPOTrainer

VOCAB = 300


def tiny_tokenizer():
    specials = ["<pad>", "<eos>", "<unk>"]
    vocab = {tok: i for i, tok in enumerate(specials + [f"w{i}" for i in range(VOCAB - len(specials))])}
    tk = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tk.decoder = decoders.WordPiece(prefix="##")
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")
    tok.padding_side = "left"
    return tok


def tiny_model(tok):
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=False,
        pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, bos_token_id=tok.eos_token_id))
    model.generation_config.pad_token_id = tok.pad_token_id
    model.generation_config.eos_token_id = tok.eos_token_id
    return model


def reward(completions, **kwargs):
    return [sum(w.startswith("w") and int(w[1:]) < 75 for w in c.split()) / max(len(c.split()), 1)
            for c in completions]


def main(max_steps: int = 3, output_dir: str = "/tmp/rlkernels-trl-example"):
    tok = tiny_tokenizer()
    g = torch.Generator().manual_seed(0)
    prompts = [" ".join(f"w{int(i)}" for i in torch.randint(0, VOCAB - 3, (3,), generator=g)) for _ in range(8)]
    args = GRPOConfig(output_dir=output_dir, use_cpu=True, bf16=False, report_to=[], max_steps=max_steps,
                      per_device_train_batch_size=4, num_generations=4, max_completion_length=8,
                      loss_type="dapo", num_iterations=2, learning_rate=1e-3, logging_steps=1,
                      save_strategy="no")
    trainer = GRPOTrainer(
        model=tiny_model(tok), reward_funcs=reward, args=args, train_dataset=Dataset.from_dict({"prompt": prompts}),
        processing_class=tok,
        # rlkernels' own correction against the sampler's log-probs replaces TRL's vLLM importance sampling
        # (it acts when the sampler's log-probs exist, i.e. with use_vllm=True; None keeps TRL's)
        rollout_correction=RolloutCorrection.geo_rs_token_tis(bounds=(0.98, 1.02)) if args.use_vllm else None,
    )
    trainer.train()
    for entry in trainer.state.log_history:
        if "loss" in entry:
            line = f"step {entry['step']}: loss {entry['loss']:.5f}, clip ratio {entry['clip_ratio/region_mean']:.3f}"
            # TRL logs a reward on the steps that generate; with num_iterations=2 every other step trains on the
            # batch of the step before, and has none of its own
            line += f", reward {entry['reward']:.3f}" if "reward" in entry else ", the previous step's batch again"
            print(line)
    return trainer


if __name__ == "__main__":
    main()
