"""verl 0.9.1's actor update with the loss computed by rlkernels, no logits formed: the change is one config key.

With rlkernels installed, `import verl` loads its plugin (the `verl.plugins` entry point), which registers
rlkernels' losses and changes nothing else. A verl run then takes these overrides (OVERRIDES below: verl's
own command-line syntax):

    actor_rollout_ref.actor.policy_loss.loss_mode=rlkernels_linear    # or rlkernels_linear_<loss type>
    algorithm.rollout_correction.rollout_is=token ...                  # verl's keys

and, so that the route is taken from the very first micro-batch, RLKERNELS_VERL_ROUTES=1 in the workers'
environment (without it the route's engine hooks are installed when verl first looks the loss up, after
the first micro-batch's forward). RLKERNELS_VERL_CORRECTION=1 in the driver's would also have rlkernels
compute verl's rollout-correction keys; this script leaves them to verl.

verl's trainer needs Ray, a rollout engine and accelerators, so this script runs, on a CPU in a few seconds,
what the trainer does with one batch, through verl's own code: the driver-side rollout correction
(`rollout_corr_helper.compute_rollout_correction_and_add_to_batch`), the conversion to verl's packed layout,
and the FSDP engine's `forward_backward_batch` (global token count,
two micro-batches, packing, rolled labels, per-token temperatures) in which, with this loss mode, the
model's forward hands its last hidden states and LM head to `rlkernels.linear_decoupled_ppo_loss`: the
logits are never formed (`rlkernels_logits` hands verl's logits to `decoupled_ppo_loss` instead). The
model is a tiny randomly initialised Qwen2 built in code (nothing is downloaded); the batch is synthetic
(random prompts and responses, the rollout engine's log-probs a perturbation of the trainer's). Only the
FSDP wrapping is skipped: it needs accelerators.

    pip install 'rlkernels[verl]'
    python examples/verl_actor.py [--steps 3]
"""

import argparse
import os
from functools import partial
from types import SimpleNamespace

os.environ.setdefault("RLKERNELS_VERL_ROUTES", "1")  # the workers' environment: the route from the first micro-batch

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import verl.utils.torch_functional as verl_F  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402
from tensordict import TensorDict  # noqa: E402
from transformers import Qwen2Config, Qwen2ForCausalLM  # noqa: E402
from verl.protocol import DataProto  # noqa: E402
from verl.trainer.ppo import rollout_corr_helper  # noqa: E402
from verl.utils import tensordict_utils as tu  # noqa: E402
from verl.utils.dataset.dataset_utils import DatasetPadMode  # noqa: E402
from verl.workers.config import FSDPActorConfig, PolicyLossConfig  # noqa: E402
from verl.workers.engine.fsdp import transformer_impl  # noqa: E402
from verl.workers.utils import losses  # noqa: E402
from verl.workers.utils.padding import left_right_2_no_padding  # noqa: E402

OVERRIDES = [
    "actor_rollout_ref.actor.policy_loss.loss_mode=rlkernels_linear",  # the one change; was: vanilla
    "actor_rollout_ref.actor.ppo_mini_batch_size=8",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
    "actor_rollout_ref.actor.loss_agg_mode=token-mean",
    "actor_rollout_ref.actor.clip_ratio_low=0.2",
    "actor_rollout_ref.actor.clip_ratio_high=0.28",
    "actor_rollout_ref.actor.entropy_coeff=0.01",
    "actor_rollout_ref.actor.use_kl_loss=true",
    "actor_rollout_ref.actor.kl_loss_coef=0.01",
    "actor_rollout_ref.actor.kl_loss_type=low_var_kl",
    "actor_rollout_ref.rollout.temperature=0.8",
    "algorithm.rollout_correction.rollout_is=token",
    "algorithm.rollout_correction.rollout_is_threshold=2.0",
    "algorithm.rollout_correction.rollout_rs=seq_mean_k1",
    "algorithm.rollout_correction.rollout_rs_threshold=0.95_1.05",
]
VOCAB, PROMPT, RESPONSE = 96, 5, 9  # vocabulary; prompt width (left-padded) and response width (right-padded)


def tiny_model(vocab=VOCAB):
    torch.manual_seed(0)
    return Qwen2ForCausalLM(Qwen2Config(
        vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=512, attn_implementation="eager")).train()


def cpu_engine(model, pad_to_length=0):
    """verl's FSDPEngineWithLMHead around the bare model, without the FSDP setup its __init__ and
    initialize() do (they need accelerators): the attributes its forward_backward_batch reads."""
    transformer_impl.get_device_id = lambda: "cpu"  # verl's platform layer answers "cuda" on a CPU-only torch
    transformer_impl.get_device_name = lambda: "cpu"
    engine = object.__new__(transformer_impl.FSDPEngineWithLMHead)
    engine.module, engine.use_ulysses_sp, engine.ulysses_sequence_parallel_size = model, False, 1
    engine.pad_to_length, engine.pad_to_length_bucket = bool(pad_to_length), pad_to_length
    engine.ulysses_device_mesh, engine.scaler, engine._autocast_dtype = None, None, torch.float32
    engine.engine_config = SimpleNamespace(entropy_from_logits_with_chunking=False, entropy_checkpointing=False,
                                           use_no_sync_for_gradient_accumulation=False)
    engine.compute_entropy_from_logits = verl_F.entropy_from_logits
    return engine


def rollout_batch(model, temperature, seed, batch_size=8, prompt=PROMPT, response=RESPONSE):
    """A verl driver batch as the rollout leaves it: left-padded prompts, right-padded responses, the
    trainer's old log-probs, the rollout engine's (perturbed: the mismatch the correction is for), the
    reference policy's, and GRPO-style advantages (one per sequence). `temperature` is the sampler's: one
    float, or one per sequence."""
    g = torch.Generator().manual_seed(seed)
    B, P, R, V = batch_size, prompt, response, model.config.vocab_size
    plen, rlen = torch.randint(1, P + 1, (B,), generator=g), torch.randint(1, R + 1, (B,), generator=g)
    rlen[0] = R
    positions = torch.arange(P + R)
    attention_mask = ((positions >= P - plen[:, None]) & (positions < P + rlen[:, None])).long()
    ids = torch.randint(3, V, (B, P + R), generator=g) * attention_mask
    position_ids = (attention_mask.cumsum(1) - 1).clamp(min=0)
    t = temperature[:, None, None] if torch.is_tensor(temperature) else temperature
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=attention_mask, position_ids=position_ids).logits
        logits = logits[:, P - 1:-1] / t
        lp = torch.log_softmax(logits.float(), -1).gather(-1, ids[:, P:, None])[..., 0]
    response_mask = attention_mask[:, P:].float()
    old = (lp + torch.randn(B, R, generator=g) * 0.3) * response_mask  # the policy moved: PPO clipping binds
    old[:, 0] -= 1.5  # ratio ~4.5 on the first token: the dual clip binds where A < 0
    rollout = (old + torch.randn(B, R, generator=g) * 0.1) * response_mask
    ref = (old + torch.randn(B, R, generator=g) * 0.1) * response_mask
    advantages = torch.randn(B, 1, generator=g).expand(B, R) * response_mask
    fields = dict(input_ids=ids, attention_mask=attention_mask, position_ids=position_ids, prompts=ids[:, :P],
                  responses=ids[:, P:], response_mask=response_mask, old_log_probs=old, rollout_log_probs=rollout,
                  ref_log_prob=ref, advantages=advantages.contiguous())
    if torch.is_tensor(temperature):
        fields["temperature"] = temperature
    return fields


def actor_batch(fields, temperature, calculate_entropy, global_batch_size, micro_batch_size):
    """The TensorDict verl's trainer hands the actor: verl's packed (no-padding) layout and its flags."""
    td = left_right_2_no_padding(TensorDict({k: v.clone() for k, v in fields.items()},
                                            batch_size=[fields["input_ids"].shape[0]]))
    tu.assign_non_tensor(td, use_remove_padding=True, pad_mode=DatasetPadMode.NO_PADDING, use_fused_kernels=False,
                         calculate_entropy=calculate_entropy, use_dynamic_bsz=False,
                         global_batch_size=global_batch_size, micro_batch_size_per_gpu=micro_batch_size)
    if not torch.is_tensor(temperature):
        tu.assign_non_tensor(td, temperature=temperature)
    return td


def actor_config(actor) -> FSDPActorConfig:
    actor = dict(actor)
    return FSDPActorConfig(strategy="fsdp", rollout_n=1, policy_loss=PolicyLossConfig(**actor.pop("policy_loss")),
                           **actor)


def main(steps: int = 3):
    if not dist.is_initialized():  # verl's engine all-reduces the token count over its data-parallel group
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29531")
        dist.init_process_group("gloo", rank=0, world_size=1)
    config = OmegaConf.from_dotlist(OVERRIDES)
    actor = actor_config(OmegaConf.to_container(config.actor_rollout_ref.actor))
    temperature = float(config.actor_rollout_ref.rollout.temperature)
    model = tiny_model()
    engine = cpu_engine(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loss_function = partial(losses.ppo_loss, config=actor)  # verl's engine worker binds its actor loss so
    history = []
    for step in range(steps):
        batch = DataProto.from_dict(tensors=rollout_batch(model, temperature, seed=step))
        batch, correction_metrics = rollout_corr_helper.compute_rollout_correction_and_add_to_batch(
            batch, config.algorithm.rollout_correction)
        td = actor_batch(dict(batch.batch.items()), temperature, calculate_entropy=actor.entropy_coeff != 0,
                         global_batch_size=actor.ppo_mini_batch_size,
                         micro_batch_size=actor.ppo_micro_batch_size_per_gpu)
        optimizer.zero_grad(set_to_none=True)
        out = engine.forward_backward_batch(td, loss_function=loss_function, forward_only=False)
        optimizer.step()
        metrics = {k: m.aggregate() for k, m in out["metrics"].items() if hasattr(m, "aggregate")}
        loss = sum(out["loss"]) if isinstance(out["loss"], list) else out["loss"]
        history.append((float(loss), metrics, correction_metrics))
        print(f"step {step}: loss {float(loss):+.5f}  pg_clipfrac {metrics['actor/pg_clipfrac']:.3f}  "
              f"entropy {metrics['actor/entropy_loss']:.3f}  kl {metrics['kl_loss']:.5f}  "
              f"rejected {correction_metrics['rollout_corr/rollout_rs_masked_fraction']:.3f}")
    return history


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3)
    main(parser.parse_args().steps)
