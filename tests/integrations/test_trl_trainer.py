"""rlkernels.integrations.trl.GRPOTrainer against TRL 1.16's own GRPOTrainer, on a tiny randomly
initialised Qwen2 and a word-level tokenizer built in code (nothing downloaded).

Same batch, same weights: TRL's `_compute_loss` (its fused LM head) and ours (hidden states and the LM
head through `linear_decoupled_ppo_loss`) give the same loss and the same gradient of every parameter,
to 1e-5 relative in float32 (TOL "trl.trainer"), for every TRL loss type with its options; then three
real training steps (generation, rewards, the optimizer) with the drop-in trainer.
"""

import copy
import os
import warnings

import pytest
import torch

from rlkernels.testing.peers import load_example

from ..cases import F32, F64, approx, tol

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    trl = pytest.importorskip("trl", reason="TRL 1.16 is not installed (pip install 'rlkernels[trl]')")
    from datasets import Dataset
    from trl.trainer.utils import add_fused_lm_head

    from rlkernels import PolicyLossConfig, RolloutCorrection
    from rlkernels.integrations.hf import add_loss_forward
    from rlkernels.integrations.trl import GRPOTrainer


example = load_example("trl_grpo.py")  # its tiny model (and batches) serve these tests too
VOCAB = example.VOCAB
_tokenizer = example.tiny_tokenizer


def _model(tok):
    model = example.tiny_model(tok)  # seeded
    with torch.no_grad():
        model.lm_head.weight[tok.eos_token_id] *= 8.0  # completions of different lengths
    return model


def _dataset(n=8):
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(2, 5, (n,), generator=g).tolist()
    prompts = [" ".join(f"w{int(i)}" for i in torch.randint(0, VOCAB - 3, (k,), generator=g)) for k in lengths]
    return Dataset.from_dict({"prompt": prompts})


def _reward(completions, **kwargs):
    return [sum(w.startswith("w") and int(w[1:]) < 75 for w in c.split()) / max(len(c.split()), 1)
            for c in completions]


def _args(tmp_path, **kw):
    base = dict(output_dir=str(tmp_path), use_cpu=True, bf16=False, report_to=[], per_device_train_batch_size=4,
                num_generations=4, max_completion_length=6, logging_steps=1, save_strategy="no", seed=0)
    base.update(kw)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return trl.GRPOConfig(**base)


def _batch(tok, model, beta, vllm, seed=0):
    """A batch as TRL's `_generate_and_score_completions` hands it to `_compute_loss`."""
    g = torch.Generator().manual_seed(seed)
    B, P, C = 4, 4, 6
    prompt_ids = torch.randint(3, VOCAB, (B, P), generator=g)
    prompt_mask = torch.ones(B, P, dtype=torch.long)
    prompt_mask[0, :2] = 0  # left padding
    prompt_ids[0, :2] = tok.pad_token_id
    completion_ids = torch.randint(3, VOCAB, (B, C), generator=g)
    completion_mask = torch.ones(B, C, dtype=torch.long)
    completion_mask[1, 4:] = 0  # an early <eos>
    completion_mask[2, 2:] = 0
    old = -torch.rand(B, C, generator=g) * 6 - 5  # about the toy model's log-probs, ratios far from 1
    inputs = {"prompt_ids": prompt_ids, "prompt_mask": prompt_mask, "completion_ids": completion_ids,
              "completion_mask": completion_mask, "advantages": torch.randn(B, generator=g),
              "old_per_token_logps": old, "num_items_in_batch": completion_mask.sum().float()}
    with torch.no_grad():
        logits = model(torch.cat([prompt_ids, completion_ids], 1),
                       attention_mask=torch.cat([prompt_mask, completion_mask], 1)).logits[:, P - 1:-1]
        lp = torch.log_softmax(logits, -1).gather(-1, completion_ids[..., None]).squeeze(-1)
    inputs["old_per_token_logps"] = lp + 0.3 * torch.randn(B, C, generator=g)  # both clip sides bind
    if beta:
        inputs["ref_per_token_logps"] = lp + 0.2 * torch.randn(B, C, generator=g)
    if vllm:
        sampling = inputs["old_per_token_logps"] + 0.1 * torch.randn(B, C, generator=g)
        inputs["sampling_per_token_logps"] = sampling
        diff = (inputs["old_per_token_logps"] - sampling) * completion_mask
        ratio = torch.exp(diff.sum(-1, keepdim=True) if vllm.startswith("sequence") else diff)
        inputs["importance_sampling_ratio"] = (ratio.clamp(max=3.0) if vllm.endswith("truncate")
                                               else ratio.masked_fill(ratio > 3.0, 0.0))
    return inputs


CONFIGS = [
    dict(loss_type="grpo"), dict(loss_type="bnpo"), dict(loss_type="dapo"), dict(loss_type="dr_grpo"),
    dict(loss_type="luspo", importance_sampling_level="sequence"), dict(loss_type="sapo"),
    dict(loss_type="cispo", epsilon_high=5.0), dict(loss_type="vespo"),
    dict(loss_type="grpo", beta=0.04), dict(loss_type="dapo", beta=0.04, use_bias_correction_kl=False),
    dict(loss_type="grpo", delta=1.6, epsilon_high=0.28), dict(loss_type="grpo", importance_sampling_level="sequence"),
    dict(loss_type="dapo", off_policy_mask_threshold=0.1, vllm="token_truncate"),
    dict(loss_type="grpo", entropy_coef=0.01, temperature=0.7),
    dict(loss_type="bnpo", vllm="sequence_mask"),
    dict(loss_type="dapo", vllm="token_mask", gradient_accumulation_steps=2),
    dict(loss_type="dapo", entropy_coef=0.01, gradient_accumulation_steps=2),
    dict(loss_type="cispo", epsilon_high=5.0, entropy_coef=0.02, beta=0.04),
    # no old log-probs (num_iterations = 1) but the sampler's, for OPSM: TRL's ratio is then 1
    dict(loss_type="grpo", off_policy_mask_threshold=0.05, without_old=True),
]


@pytest.mark.parametrize("kw", CONFIGS, ids=lambda kw: "-".join(f"{k}={v}" for k, v in kw.items()))
def test_loss_and_gradients_match_trls_trainer(tmp_path, kw):
    kw = dict(kw)
    vllm = kw.pop("vllm", None)
    without_old = kw.pop("without_old", False)
    tok = _tokenizer()
    args = _args(tmp_path, **kw)
    # built with beta = 0 (a reference model would be loaded from the Hub by name), then given the real
    # args: the reference log-probs come in the batch
    built = _args(tmp_path, **{**kw, "beta": 0.0})
    model_theirs, model_ours = _model(tok), _model(tok)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        theirs = trl.GRPOTrainer(model=model_theirs, reward_funcs=_reward, args=built, train_dataset=_dataset(),
                                 processing_class=tok)
        ours = GRPOTrainer(model=model_ours, reward_funcs=_reward, args=built, train_dataset=_dataset(),
                           processing_class=tok)
    args.use_vllm = args.vllm_importance_sampling_correction = bool(vllm)  # what vLLM would switch on
    args.vllm_importance_sampling_mode = vllm or "sequence_mask"
    for trainer in (theirs, ours):
        trainer.args, trainer.beta = args, args.beta
        trainer.current_gradient_accumulation_steps = args.gradient_accumulation_steps  # set by the train loop
        trainer.use_vllm = trainer.vllm_importance_sampling_correction = bool(vllm)
    # TRL's own ratios arrive in the batch (importance_sampling_ratio) and go in as is_weights
    ours.rlkernels_config = PolicyLossConfig.from_trl(args).with_overrides(rollout_correction=None,
                                                                          compute_entropy=True)
    inputs = _batch(tok, model_theirs, args.beta, vllm)
    if without_old:
        inputs["sampling_per_token_logps"] = inputs.pop("old_per_token_logps") + 0.05
        inputs["sampling_per_token_logps"][0, 1] = float("nan")  # a token the sampler could not score
    losses, grads = [], []
    for trainer, model in ((theirs, model_theirs), (ours, model_ours)):
        model.train()
        model.zero_grad()
        loss = trainer._compute_loss(model, copy.deepcopy(inputs))
        loss.backward()
        losses.append(loss.detach())
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    q = tol("trl.trainer", torch.float32, scale=max(1.0, float(losses[0].abs())))
    assert abs(float(losses[1] - losses[0])) <= q["atol"] + q["rtol"] * abs(float(losses[0])), (losses, kw)
    assert grads[0].keys() == grads[1].keys()
    worst = max(float((grads[1][n] - grads[0][n]).abs().max()) / max(float(grads[0][n].abs().max()), 1e-30)
                for n in grads[0])
    assert worst <= tol("trl.trainer", torch.float32)["rtol"], f"max |d grad| / max |grad| = {worst:.2e}"
    print(f"TRL agreement {kw}: loss {abs(float(losses[1] - losses[0])) / max(1.0, abs(float(losses[0]))):.1e}, "
          f"grad {worst:.1e} (relative)")  # the figures the README quotes (pytest -s)
    # every metric TRL's _compute_loss logs is logged by the drop-in under that name, with TRL's value
    # (TRL's "policy_loss" comes from its entropy branch: it is the loss itself, logged by the Trainer)
    theirs_names = set(theirs._metrics["train"]) - {"policy_loss"}
    shared = theirs_names & set(ours._metrics["train"])
    assert shared == theirs_names, theirs_names - shared
    for name in shared:
        a, b = theirs._metrics["train"][name][-1], ours._metrics["train"][name][-1]
        assert b == approx(a, "trl.trainer.value", F32), (name, a, b)


@pytest.mark.parametrize("target", [100.0, 0.5], ids=["entropy-below-target", "entropy-above-target"])
@pytest.mark.parametrize("loss_type", ["grpo", "dapo"])
def test_adaptive_entropy_follows_trls_controller(tmp_path, target, loss_type):
    """TRL PR #6140's adaptive entropy (TRL 1.16's own trainer against the drop-in): three optimizer steps on
    three batches. The first applies no bonus (no measurement yet); each step's window entropy moves the
    coefficient by delta toward the target, within [min, max], and gates the next step's bonus. Loss, every
    gradient, the controller's state and the logged coefficient agree at every step. The toy model's entropy
    is ~5.7 nats: a target of 100 keeps it below (the bonus applies and grows to the max), one of 0.5 above
    (no bonus, the coefficient decays to the min)."""
    tok = _tokenizer()
    args = _args(tmp_path, loss_type=loss_type, use_adaptive_entropy=True, entropy_coef=0.05, entropy_coef_delta=0.03,
                 entropy_coef_min=0.0, entropy_coef_max=0.1, entropy_target=target)
    models = (_model(tok), _model(tok))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        theirs = trl.GRPOTrainer(model=models[0], reward_funcs=_reward, args=args, train_dataset=_dataset(),
                                 processing_class=tok)
        ours = GRPOTrainer(model=models[1], reward_funcs=_reward, args=args, train_dataset=_dataset(),
                           processing_class=tok)
    assert ours.rlkernels_config.adaptive_entropy
    coefficients = []
    for step in range(3):
        inputs = _batch(tok, models[0], 0.0, None, seed=step)
        results = []
        for trainer, model in ((theirs, models[0]), (ours, models[1])):
            trainer.current_gradient_accumulation_steps = 1
            model.train()
            model.zero_grad()
            loss = trainer._compute_loss(model, copy.deepcopy(inputs))
            loss.backward()
            results.append((float(loss), {n: p.grad.clone() for n, p in model.named_parameters()}))
        (want, want_grads), (got, got_grads) = results
        assert got == approx(want, "trl.trainer.value", F32), (step, got, want)
        worst = max(float((got_grads[n] - want_grads[n]).abs().max()) / max(float(want_grads[n].abs().max()), 1e-30)
                    for n in want_grads)
        assert worst <= tol("trl.trainer", torch.float32)["rtol"], (step, worst)
        assert ours.entropy_coef == approx(theirs.entropy_coef, "trl.entropy_coef", F64), step
        assert ours._last_world_entropy == approx(theirs._last_world_entropy, "trl.trainer", F32), step
        assert ours._metrics["train"]["entropy_coef"][-1] == pytest.approx(theirs._metrics["train"]["entropy_coef"][-1])
        coefficients.append(ours.entropy_coef)
    assert coefficients == pytest.approx([0.08, 0.1, 0.1] if target > 10 else [0.02, 0.0, 0.0])


def test_drop_in_trainer_trains(tmp_path):
    """Three real steps: TRL generates, scores and logs; rlkernels computes the loss."""
    tok = _tokenizer()
    args = _args(tmp_path, max_steps=3, loss_type="dapo", num_iterations=2, learning_rate=1e-3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = GRPOTrainer(model=_model(tok), reward_funcs=_reward, args=args, train_dataset=_dataset(),
                              processing_class=tok)
        before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
        trainer.train()
    assert trainer.state.global_step == 3
    moved = [n for n, p in trainer.model.named_parameters() if not torch.equal(p.detach(), before[n])]
    assert moved, "no parameter moved"
    logged = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert logged and all(torch.isfinite(torch.tensor(e["loss"])) for e in logged)
    assert any("actor/pg_loss" in e for e in trainer.state.log_history)


def test_unsupported_options_name_the_option(tmp_path):
    tok = _tokenizer()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(ValueError, match=r"^top_entropy_quantile"):
            GRPOTrainer(model=_model(tok), reward_funcs=_reward, args=_args(tmp_path, top_entropy_quantile=0.5),
                        train_dataset=_dataset(), processing_class=tok)
        softcapped = _model(tok)
        softcapped.config.final_logit_softcapping = 30.0  # Gemma-2's: a loss on the head's weight would miss it
        with pytest.raises(ValueError, match=r"^model: config.final_logit_softcapping=30.0"):
            GRPOTrainer(model=softcapped, reward_funcs=_reward, args=_args(tmp_path), train_dataset=_dataset(),
                        processing_class=tok)
        with pytest.raises(TypeError, match=r"^rollout_correction: expected a RolloutCorrection"):
            GRPOTrainer(model=_model(tok), reward_funcs=_reward, args=_args(tmp_path), train_dataset=_dataset(),
                        processing_class=tok, rollout_correction="token")
        trainer = GRPOTrainer(model=_model(tok), reward_funcs=_reward, args=_args(tmp_path), train_dataset=_dataset(),
                              processing_class=tok, rollout_correction=RolloutCorrection.token_tis())
    assert trainer.rlkernels_config.rollout_correction.is_level == "token"


def test_the_example_runs_as_written(tmp_path, capsys):
    """examples/trl_grpo.py, as a user runs it (two steps here): its log reports the reward of the step that
    generated and says that the next one reused that batch (num_iterations=2), never a NaN reward."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = example.main(max_steps=2, output_dir=str(tmp_path))
    assert trainer.state.global_step == 2
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("step ")]
    assert len(lines) == 2 and "nan" not in " ".join(lines)
    assert ", reward " in lines[0] and "the previous step's batch again" in lines[1]


def _check_ddp(rank, world, tmp_dir):
    """On each of two gloo ranks (accelerate's MULTI_CPU, the model wrapped in DDP by the trainer's
    accelerator), a different batch: TRL's trainer and the drop-in, each through its DDP-wrapped model,
    give the same averaged gradient; it is the same on both ranks and differs from the local one."""

    import torch.distributed as dist

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT="29541")
    tok = _tokenizer()
    args = _args(tmp_dir, loss_type="dapo", beta=0.04, entropy_coef=0.01)
    built = _args(tmp_dir, loss_type="dapo", beta=0.0, entropy_coef=0.01)  # a reference model would be downloaded
    models = {"theirs": _model(tok), "ours": _model(tok)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainers = {"theirs": trl.GRPOTrainer(model=models["theirs"], reward_funcs=_reward, args=built,
                                              train_dataset=_dataset(), processing_class=tok),
                    "ours": GRPOTrainer(model=models["ours"], reward_funcs=_reward, args=built,
                                        train_dataset=_dataset(), processing_class=tok)}
    assert trainers["ours"].accelerator.num_processes == world
    trainers["ours"].rlkernels_config = PolicyLossConfig.from_trl(args).with_overrides(compute_entropy=True)
    inputs = _batch(tok, models["theirs"], args.beta, None, seed=rank)  # each rank its own batch
    grads = {}
    for name, trainer in trainers.items():
        trainer.args, trainer.beta = args, args.beta
        trainer.current_gradient_accumulation_steps = 1
        wrapped = trainer.accelerator.prepare_model(models[name])
        assert isinstance(wrapped, torch.nn.parallel.DistributedDataParallel)
        wrapped.train()
        loss = trainer._compute_loss(wrapped, copy.deepcopy(inputs))
        loss.backward()
        grads[name] = torch.cat([p.grad.reshape(-1) for p in models[name].parameters()])
    worst = float((grads["ours"] - grads["theirs"]).abs().max()) / float(grads["theirs"].abs().max())
    assert worst <= tol("trl.trainer", torch.float32)["rtol"], f"rank {rank}: max |d grad| / max |grad| = {worst:.2e}"
    print(f"TRL agreement under DDP, rank {rank}: grad {worst:.1e} (relative)")
    both = [torch.empty_like(grads["ours"]) for _ in range(world)]
    dist.all_gather(both, grads["ours"])
    assert torch.equal(both[0], both[1]), "the drop-in's gradients were not reduced across the ranks"
    # the same with the models sharded by FSDP2 (each decoder layer, then the root; for the drop-in also the
    # LM head and embeddings as their own units, as verl wraps an untied model): the loss runs inside the
    # head's call; the gradients (the reduced shards, gathered) equal TRL's under DDP above
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world,))
    reference = grads["theirs"]
    for name, trainer in trainers.items():
        for separate_head in ((False, True) if name == "ours" else (False,)):
            model = _model(tok)
            trainer.model = model
            if name == "ours":
                add_loss_forward(model)  # what the constructor does to the model it is given
            else:  # TRL's fused head reads the weight outside the head's call: with the head its own unit, its
                # gradients come out unreduced (measured: 0.996 relative off), so TRL runs the root-head sharding
                add_fused_lm_head(model, temperature=trainer.temperature, outputs=("log_probs", "entropy"))
            units = list(model.model.layers) + ([model.model.embed_tokens, model.lm_head] if separate_head else [])
            for unit in units:
                fully_shard(unit, mesh=mesh)
            fully_shard(model, mesh=mesh)
            loss = trainer._compute_loss(model, copy.deepcopy(inputs))
            loss.backward()
            got = torch.cat([p.grad.full_tensor().reshape(-1) for p in model.parameters()])
            worst = float((got - reference).abs().max()) / float(reference.abs().max())
            case = f"FSDP2 {name}{' (head its own unit)' if separate_head else ''}, rank {rank}"
            assert worst <= tol("trl.trainer", torch.float32)["rtol"], f"{case}: |d grad| / |grad| {worst:.2e}"
            print(f"TRL agreement under {case}: grad {worst:.1e} (relative)")
    # and two real training steps under DDP: the replicas stay equal
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = GRPOTrainer(model=_model(tok), reward_funcs=_reward, train_dataset=_dataset(), processing_class=tok,
                              args=_args(tmp_dir, max_steps=2, loss_type="dapo", learning_rate=1e-2))
        trainer.train()
    assert trainer.state.global_step == 2
    params = torch.cat([p.detach().reshape(-1) for p in trainer.model.parameters()])
    both = [torch.empty_like(params) for _ in range(world)]
    dist.all_gather(both, params)
    assert torch.equal(both[0], both[1]), "the replicas diverged"


def test_drop_in_trainer_under_ddp_and_fsdp2_matches_trls(tmp_path):
    """Two gloo ranks: the loss runs inside the DDP-wrapped (then FSDP2-sharded) forward, so the wrapper
    reduces its gradients (and gathers the head) as for TRL's own fused head."""
    from rlkernels.testing.spawn import spawn

    spawn(2, _check_ddp, str(tmp_path))
