"""The routes: rlkernels' hooks in verl's FSDP engine (`FSDPEngineWithLMHead.forward_step`, `prepare_model_inputs`,
`prepare_model_outputs`), installed by `install_routes()` (the opt-in) or at the first lookup of a route's loss.

For `loss_mode=rlkernels_logits[_<loss_type>]` the engine hands the packed logits of each micro-batch to
`decoupled_ppo_loss`; for `rlkernels_linear[_<loss_type>]` the model's forward hands its last hidden states and LM
head to `linear_decoupled_ppo_loss` (no logits formed). Each computes the log-probs, entropy, policy loss, entropy
bonus and KL penalty in its fused pass; where the engine's settings rule that out it warns once, naming the setting,
and verl's own actor loss runs on verl's log-probs. On a run that takes a route, the log-prob passes (no loss
function) that ask for sum pi^2 take it too. Any other micro-batch runs verl's methods unchanged.
"""

import os
import warnings
from functools import partial
from typing import Optional

import torch

from ...api import (
    decoupled_ppo_loss,
    linear_decoupled_ppo_loss,
    linear_token_logprobs,
    metrics_to_floats,
    token_logprobs,
)
from ...config import PolicyLossConfig
from ..configs import parse_loss_mode, verl_global_counts
from ..hf import add_loss_forward, hidden_state_loss_blocker

ROUTES_ENV = "RLKERNELS_VERL_ROUTES"  # the opt-in: "1", or the route of the log-prob passes ("linear" / "logits")


def _verl_losses():
    """verl's actor-loss module (it imports verl's dataset stack: PIL, ...), or None where it does not import:
    the registered losses and the driver-side correction work without it."""
    try:
        from verl.workers.utils import losses
    except ImportError:
        return None
    return losses


def verl_ppo_loss(config, model_output, data, dp_group=None):
    """verl's own actor loss (`verl.workers.utils.losses.ppo_loss`, looked up at each call)."""
    return _verl_losses().ppo_loss(config, model_output, data, dp_group)


# ---------------------------------------------------------------- the logits route
# verl's FSDP engine turns the logits into log-probs (and entropy) in `prepare_model_outputs` and hands only
# those to the actor loss. For a logits loss mode the engine's method (hooked by install_routes()) hands the packed
# logits, their labels and temperatures instead, under _ROUTE, and the actor loss below computes everything
# with decoupled_ppo_loss. _BLOCKER carries why a micro-batch could not take the route.
_ROUTE, _BLOCKER = "rlkernels_logits_route", "rlkernels_logits_blocker"
_warned = set()


def _warn_once(message: str) -> None:
    if message not in _warned:
        _warned.add(message)
        warnings.warn(message, stacklevel=3)


def _loss_mode(actor_config) -> str:
    policy = getattr(actor_config, "policy_loss", None)
    return "vanilla" if policy is None else policy.get("loss_mode", "vanilla")


def _route_kind(mode) -> Optional[str]:
    """"logits" or "linear" for the routes' loss modes, None for the others (integrations/configs.py's names)."""
    return parse_loss_mode(mode)[0]


def _route_actor_config(loss_function):
    """(actor config, route kind, blocker): the config and kind when `loss_function` binds a route's loss
    mode and gradients are on, else None / None. The blocker is None when the function is this module's
    actor loss as verl's engine worker binds it (partial(ppo_loss, config=actor_config)), else why not."""
    config = getattr(loss_function, "keywords", {}).get("config") if torch.is_grad_enabled() else None
    kind = None if config is None else _route_kind(_loss_mode(config))
    if kind is None:
        return None, None, None
    func = loss_function.func
    if getattr(func, "_rlkernels_ppo_loss", False):  # an attribute, not identity: a re-imported module's too
        return config, kind, None
    return config, kind, f"the actor loss is {getattr(func, '__name__', func)!r} (distillation?), not verl's ppo_loss"


def _is_verl_ppo_loss(func) -> bool:
    """verl's own actor loss, recognised by name (a test or a re-import may have rebound the module attribute)."""
    return (getattr(func, "__module__", None) == "verl.workers.utils.losses"
            and getattr(func, "__name__", "") == "ppo_loss")


def _route_loss_function(loss_function):
    """The loss function the engine runs: verl's ppo_loss bound for a route's loss mode (as verl's engine
    worker binds it, partial(ppo_loss, config=actor_config)) becomes this module's `ppo_loss` with the same
    arguments; anything else is returned as it is."""
    if not (isinstance(loss_function, partial) and _is_verl_ppo_loss(loss_function.func) and torch.is_grad_enabled()):
        return loss_function
    config = loss_function.keywords.get("config")
    if config is None or _route_kind(_loss_mode(config)) is None:
        return loss_function
    return partial(ppo_loss, *loss_function.args, **loss_function.keywords)


def _route_blocker(engine, output, micro_batch, stats: Optional[str] = None):
    """The verl setting that keeps this micro-batch off the route, or None (`output` None: before the
    forward). `stats`: the route of a no-loss pass for sum pi^2 ("linear" takes verl's fused-kernel setting, as it
    runs the decoder itself)."""
    from verl.utils import tensordict_utils as tu

    def get(key, default=False):
        return tu.get_non_tensor_data(data=micro_batch, key=key, default=default)

    if not get("use_remove_padding", True):
        return "use_remove_padding=False (the route takes verl's packed layout)"
    if get("use_fused_kernels") and stats != "linear":
        return "use_fused_kernels=True (verl's fused LM head forms no logits)"
    if getattr(engine, "use_ulysses_sp", False):
        return "ulysses_sequence_parallel_size > 1 (each rank holds a padded slice of the packed sequence)"
    if get("distillation_use_topk") or get("distillation_only"):
        return "distillation (its loss consumes the logits)"
    if get("calculate_sum_pi_squared") and stats is None:
        return "calculate_sum_pi_squared=True"
    if get("return_model_output"):
        return "return_model_output=True (the caller reads the log-probs of every position)"
    engine_type = type(engine)
    if engine_type.__module__.startswith("verl.") and engine_type.__name__ != "FSDPEngineWithLMHead":
        return f"verl's {engine_type.__name__} (its own input handling; the routes are wired for FSDPEngineWithLMHead)"
    if output is not None and getattr(output, "logits", None) is None:
        return "a model output without logits"
    return None


def _temperature(micro_batch, output_args, n):
    """verl's temperature: one float, or its per-sequence tensor as verl expands it to the packed tokens."""
    temperature = micro_batch["temperature"]
    return output_args["temperature_rmpad"][:n] if torch.is_tensor(temperature) else float(temperature)


def _wants_entropy(micro_batch) -> bool:
    from verl.utils import tensordict_utils as tu

    return bool(tu.get_non_tensor_data(data=micro_batch, key="calculate_entropy", default=False))


def _forward_step(self, micro_batch, loss_function, forward_only):
    """FSDPEngineWithLMHead.forward_step: verl's, with a route's actor loss in place of verl's ppo_loss
    (_route_loss_function) and in reach of prepare_model_inputs (which verl does not hand it)."""
    loss_function = _route_loss_function(loss_function)
    self._rlkernels_loss_function = loss_function
    _, kind, _ = _route_actor_config(loss_function)
    if kind is not None:  # the log-prob passes (no loss function) read it: their sum_pi_squared takes the route
        self._rlkernels_route_kind = kind
    try:
        return type(self)._verl_forward_step(self, micro_batch, loss_function, forward_only)
    finally:
        self._rlkernels_loss_function = None


# what verl's prepare_model_inputs passes a text-only model (remove-padding layout); anything else goes to the
# model's own forward (the linear route runs the decoder alone)
_TEXT_INPUTS = {"input_ids", "attention_mask", "position_ids", "cu_seqlens", "cu_seqlens_cpu"}


def _prepare_model_inputs(self, micro_batch):
    """FSDPEngineWithLMHead.prepare_model_inputs: verl's, plus, on the linear route, `rlkernels_loss=`: the
    model's forward (patched by `add_loss_forward`) then computes the whole actor loss from the last hidden
    states and the LM head with linear_decoupled_ppo_loss, so the logits are never formed."""
    model_inputs, output_args = type(self)._verl_prepare_model_inputs(self, micro_batch)
    loss_function = getattr(self, "_rlkernels_loss_function", None)
    config, kind, blocker = _route_actor_config(loss_function)
    self._rlkernels_linear_blocker = None
    if kind is None and loss_function is None and _stats_route(self, micro_batch) == "linear":
        return _linear_stats_inputs(self, model_inputs, output_args, micro_batch), output_args
    if kind != "linear" or blocker is not None or _route_blocker(self, None, micro_batch) is not None:
        return model_inputs, output_args
    model = _hf_model(self)
    extra = sorted(set(model_inputs) - _TEXT_INPUTS)
    self._rlkernels_linear_blocker = hidden_state_loss_blocker(model) or (
        f"model inputs the decoder alone does not take ({', '.join(extra)})" if extra else None)
    if self._rlkernels_linear_blocker is not None:  # the same on every rank but for the inputs (text models)
        return model_inputs, output_args
    add_loss_forward(model)
    labels = output_args["input_ids_rmpad_rolled"]
    n = labels.shape[0] - int(output_args.get("pad_size") or 0)
    entropy = _wants_entropy(micro_batch)

    def loss_of(hidden, weight, bias):  # inside the model's forward
        hidden = hidden.reshape(-1, hidden.shape[-1])[:n].to(weight.dtype)
        args, rl_config, scale = _route_inputs(config, micro_batch, n, entropy)
        out = linear_decoupled_ppo_loss(hidden, weight, labels[:n], args.pop("advantages"), args.pop("response_mask"),
                                        bias=bias, config=rl_config,
                                        temperature=_temperature(micro_batch, output_args, n), **args)
        return {_ROUTE: dict(out=out, scale=scale, entropy=entropy)}

    model_inputs["rlkernels_loss"] = loss_of
    return model_inputs, output_args


# ---------------------------------------------------------------- sum pi^2 for the optimal token baseline
# verl's log-prob pass (compute_log_prob, no loss function) with actor.calculate_sum_pi_squared=True: on a run
# that takes a route, rlkernels' fused pass computes the log-probs, entropy and sum pi^2 of the temperature-scaled
# distribution (verl's definition), from the logits (logits route) or the last hidden states (linear route: no
# logits, also where verl's own fused kernels raise for sum pi^2). verl's options the fused LM head adds to the
# inputs are its own forward's, dropped when the linear route runs the decoder itself.
_FUSED_KERNEL_INPUTS = ("temperature", "return_dict", "shift_labels")


def _hf_model(engine):
    model = getattr(engine.module, "_fsdp_wrapped_module", engine.module)  # FSDP1 wraps the HF model; FSDP2 not
    return model.get_base_model() if hasattr(model, "get_base_model") else model  # PEFT


def _stats_route(engine, micro_batch) -> Optional[str]:
    """The route of a no-loss pass that asks for sum pi^2: "linear" / "logits" where the run takes one (declared by
    RLKERNELS_VERL_ROUTES=linear|logits, or seen in a training micro-batch of this engine) and nothing rules it
    out, else None (verl's own path)."""
    from verl.utils import tensordict_utils as tu

    if not tu.get_non_tensor_data(data=micro_batch, key="calculate_sum_pi_squared", default=False):
        return None
    declared = os.environ.get(ROUTES_ENV, "").strip().lower()
    kind = declared if declared in ("linear", "logits") else getattr(engine, "_rlkernels_route_kind", None)
    if kind is None or _route_blocker(engine, None, micro_batch, stats=kind) is not None:
        return None
    if kind == "linear" and hidden_state_loss_blocker(_hf_model(engine)) is not None:
        return None
    return kind


def _linear_stats_inputs(engine, model_inputs, output_args, micro_batch):
    """The model's inputs with `rlkernels_loss=`: its forward returns the statistics of its last hidden states."""
    stripped = {k: v for k, v in model_inputs.items() if k not in _FUSED_KERNEL_INPUTS}
    if set(stripped) - _TEXT_INPUTS:  # inputs only the model's own forward takes: verl's path, as it was
        return model_inputs
    model_inputs = stripped
    add_loss_forward(_hf_model(engine))
    labels = output_args["input_ids_rmpad_rolled"]
    n = labels.shape[0] - int(output_args.get("pad_size") or 0)
    entropy = _wants_entropy(micro_batch)

    def stats_of(hidden, weight, bias):  # inside the model's forward, as the LM head's call
        hidden = hidden.reshape(-1, hidden.shape[-1])[:n].to(weight.dtype)
        stats = linear_token_logprobs(hidden, weight, labels[:n], bias=bias,
                                      temperature=_temperature(micro_batch, output_args, n), compute_entropy=entropy,
                                      compute_sum_pi_squared=True, validate=False, select_loss_rows=True)
        return {_ROUTE: dict(stats=stats, entropy=entropy)}

    model_inputs["rlkernels_loss"] = stats_of
    return model_inputs


def _stats_outputs(engine, output, output_args, micro_batch):
    """verl's model output of a no-loss pass from rlkernels' statistics, or None (verl's own)."""
    if isinstance(output, dict) and _ROUTE in output:
        stats, entropy = output[_ROUTE]["stats"], output[_ROUTE]["entropy"]
    elif _stats_route(engine, micro_batch) == "logits" and getattr(output, "logits", None) is not None:
        logits = output.logits.squeeze(0)
        if hasattr(logits, "full_tensor"):  # a DTensor split over the vocabulary by tensor parallelism, as verl
            logits = logits.full_tensor()
        n = logits.shape[0] - int(output_args.get("pad_size") or 0)
        entropy = _wants_entropy(micro_batch)
        stats = token_logprobs(logits[:n], output_args["input_ids_rmpad_rolled"][:n],
                               temperature=_temperature(micro_batch, output_args, n), compute_entropy=entropy,
                               compute_sum_pi_squared=True, validate=False)
    else:
        return None
    offsets = micro_batch["input_ids"].offsets()  # verl's nested outputs, one row per sequence
    nested = lambda t: torch.nested.nested_tensor_from_jagged(t.detach(), offsets)  # noqa: E731
    model_output = {"log_probs": nested(stats.logprobs), "sum_pi_squared": nested(stats.sum_pi_squared)}
    if entropy:
        model_output["entropy"] = nested(stats.entropy)
    return model_output


def _prepare_model_outputs(self, output, output_args, micro_batch, logits_processor_func):
    """FSDPEngineWithLMHead.prepare_model_outputs: verl's, unless the actor loss takes a route: the loss the
    forward computed (linear), or the packed logits, labels and temperatures (logits)."""
    config, kind, blocker = _route_actor_config(logits_processor_func)
    if kind == "linear" and isinstance(output, dict) and _ROUTE in output:
        return {_ROUTE: output[_ROUTE]}
    if kind is None and logits_processor_func is None:
        stats = _stats_outputs(self, output, output_args, micro_batch)
        if stats is not None:
            return stats
    if kind is not None and blocker is None:
        blocker = _route_blocker(self, output, micro_batch)
    if kind == "linear" and blocker is None:
        blocker = getattr(self, "_rlkernels_linear_blocker", None) or "the model's forward did not compute the loss"
    if kind is None or blocker is not None:
        model_output = type(self)._verl_prepare_model_outputs(self, output, output_args, micro_batch,
                                                             logits_processor_func)
        if blocker is not None:
            model_output[_BLOCKER] = blocker
        return model_output
    logits = output.logits.squeeze(0)  # [packed tokens (+ pad_to_length's pad), V]
    if hasattr(logits, "full_tensor"):  # a DTensor split over the vocabulary by tensor parallelism, as verl
        logits = logits.full_tensor()
    n = logits.shape[0] - int(output_args.get("pad_size") or 0)  # pad_to_length pads the end of the sequence
    return {_ROUTE: dict(logits=logits[:n], labels=output_args["input_ids_rmpad_rolled"][:n],
                         temperature=_temperature(micro_batch, output_args, n), entropy=_wants_entropy(micro_batch))}


def _response_rows(data, width):
    """The packed row whose logits predict each [b, width] response slot (one before the token: verl's
    shift) and whether the slot holds a token: the inverse of verl's `no_padding_2_padding`."""
    prompts, responses = data["prompts"], data["responses"]
    if prompts.is_nested:
        prompt_lens, response_lens = prompts.offsets().diff(), responses.offsets().diff()
    else:
        attention_mask = data["attention_mask"]
        prompt_lens = attention_mask[:, :prompts.shape[1]].sum(1)
        response_lens = attention_mask[:, prompts.shape[1]:].sum(1)
    ends = (prompt_lens + response_lens).cumsum(0)
    j = torch.arange(width, device=ends.device)
    return (ends - response_lens - 1)[:, None] + j, j < response_lens[:, None]


def ppo_loss(config, model_output, data, dp_group=None):
    """A route's actor loss, run by the engine hook in place of verl's `ppo_loss` for the routes' loss modes:
    from what the engine handed over (the logits, or the loss the linear route computed in the model's
    forward), verl's own where the route was not taken."""
    route, blocker = model_output.pop(_ROUTE, None), model_output.pop(_BLOCKER, None)
    if route is None:
        kind = _route_kind(_loss_mode(config))
        if torch.is_grad_enabled() and kind is not None:
            reason = blocker or ("the engine handed nothing to the loss (the routes are wired into verl's "
                                 "FSDPEngineWithLMHead, with the actor loss bound as verl's engine worker binds it: "
                                 "partial(ppo_loss, config=actor_config))")
            _warn_once(f"actor.policy_loss.loss_mode={_loss_mode(config)}: {reason}; the loss is computed from "
                       f"verl's log-probs instead (the same loss, without the fused {kind} pass)")
        return verl_ppo_loss(config, model_output, data, dp_group)
    if "out" in route:  # the linear route: computed inside the model's forward
        return _route_outputs(config, model_output, data, route["out"], route["entropy"], route["scale"])
    logits = route["logits"]
    args, rl_config, scale = _route_inputs(config, data, logits.shape[0], route["entropy"])
    out = decoupled_ppo_loss(
        logits, route["labels"], args.pop("advantages"), args.pop("response_mask"), config=rl_config,
        inplace_backward=True,  # nothing else reads the logits: the gradient overwrites them, as verl's path does
        temperature=route["temperature"], **args)
    return _route_outputs(config, model_output, data, out, route["entropy"], scale)


ppo_loss._rlkernels_ppo_loss = True


def _route_inputs(config, data, n, entropy):
    """verl's ppo_loss for one micro-batch of n packed tokens, in this library's terms: the per-token
    arguments of the loss call (padded [b, R] response tensors placed on the packed rows that predict
    them, 0 elsewhere), the PolicyLossConfig (from_verl_actor with verl's global batch counts), and the
    factor of verl's token-sum (dp_size)."""
    info = config.global_batch_info  # as verl's ppo_loss fills it
    info.update(dp_size=data["dp_size"], batch_num_tokens=data["batch_num_tokens"],
                global_batch_size=data["global_batch_size"], loss_scale_factor=config.loss_scale_factor)
    fields = [f for f in ("response_mask", "old_log_probs", "advantages", "rollout_is_weights", "ref_log_prob")
              if f in data.keys()]
    padded = data.select(*fields).to_padded_tensor()
    mask = padded["response_mask"].bool()
    rows, valid = _response_rows(data, mask.shape[-1])
    keep = mask & valid
    index = (rows[keep],)

    def packed(name):
        if name not in padded.keys():
            return None
        x = padded[name]
        return x.new_zeros(n).index_put_(index, x[keep])

    counts = verl_global_counts(info)
    if "loss_scale_factor" not in counts:  # read by seq-mean-token-sum-norm only
        counts["loss_scale_factor"] = float(mask.shape[-1])  # verl's horizon: the padded response width
    # validate=False: no value checks in the step; the fused-linear row selection's one host read is kept (the
    # prompt's rows stay out of the head GEMMs)
    rl_config = PolicyLossConfig.from_verl_actor(config, validate=False, select_loss_rows=True, compute_entropy=entropy,
                                                 **counts)
    if not entropy:  # verl adds the bonus only where the trainer asked for entropy
        rl_config = rl_config.with_overrides(entropy_coeff=0.0)
    use_kl = bool(config.get("use_kl_loss", False))
    args = dict(advantages=packed("advantages"), response_mask=packed("response_mask").bool(),
                old_logprobs=packed("old_log_probs"), ref_logprobs=packed("ref_log_prob") if use_kl else None,
                is_weights=packed("rollout_is_weights"), cu_seqlens=data["input_ids"].offsets())
    return args, rl_config, info["dp_size"] if rl_config.loss_agg_mode == "token-sum" else 1  # verl's token-sum x dp


def _route_outputs(config, model_output, data, out, entropy, scale):
    """verl's ppo_loss results from the library's output: the loss, verl's metrics under verl's names and
    aggregations, and verl's nested log-probs (and entropy) in `model_output`."""
    from verl.utils.metric import AggregationType, Metric

    info = config.global_batch_info
    summed = info["dp_size"] > 1 or any(info[k] is not None for k in (
        "batch_num_tokens", "global_batch_size", "loss_scale_factor"))
    aggregation = AggregationType.SUM if summed else AggregationType.MEAN  # verl's choice for its loss metrics
    use_kl = bool(config.get("use_kl_loss", False))
    values = metrics_to_floats(out.metrics)  # one host sync; verl's Metric reads each value anyway
    totals = {"actor/pg_loss": "actor/pg_loss", "actor/entropy": "actor/entropy_loss", "actor/kl_loss": "kl_loss"}
    metrics = {k: Metric(AggregationType.MEAN, v) for k, v in values.items()
               if k.startswith("actor/") and k not in totals}
    metrics["actor/pg_loss"] = Metric(aggregation, values["actor/pg_loss"] * scale)
    if entropy:
        metrics["actor/entropy_loss"] = Metric(aggregation, values["actor/entropy"] * scale)
    if use_kl:
        metrics["kl_loss"] = Metric(aggregation, values["actor/kl_loss"] * scale)
        metrics["kl_coef"] = config.kl_loss_coef
    offsets = data["input_ids"].offsets()  # verl's nested outputs (log-probs of the loss's tokens, 0 elsewhere)
    model_output["log_probs"] = torch.nested.nested_tensor_from_jagged(out.logprobs.detach(), offsets)
    if entropy:
        model_output["entropy"] = torch.nested.nested_tensor_from_jagged(out.entropy.detach(), offsets)
    return out.loss * scale, metrics


_ENGINE_HOOKS = (("forward_step", _forward_step), ("prepare_model_inputs", _prepare_model_inputs),
                 ("prepare_model_outputs", _prepare_model_outputs))


def _engine_class():
    try:
        from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead
    except ImportError:
        return None
    return FSDPEngineWithLMHead if _verl_losses() is not None else None


def routes_installed() -> bool:
    engine = _engine_class()
    return engine is not None and all(f"_verl_{name}" in engine.__dict__ for name, _ in _ENGINE_HOOKS)


def install_routes() -> bool:
    """Wrap verl's FSDPEngineWithLMHead.forward_step, prepare_model_inputs and prepare_model_outputs with the
    routes' hooks (idempotent). The hooks act only on a micro-batch whose actor loss is bound for a route's
    loss mode; verl's methods run unchanged for every other one. False when verl's engine does not import."""
    engine = _engine_class()
    if engine is None:
        return False
    for name, hook in _ENGINE_HOOKS:
        if f"_verl_{name}" not in engine.__dict__:
            setattr(engine, f"_verl_{name}", getattr(engine, name))
            setattr(engine, name, hook)
    return True


def uninstall_routes() -> None:
    """verl's own engine methods back (tests, or a process that runs other verl jobs after an rlkernels one)."""
    engine = _engine_class()
    for name, _ in _ENGINE_HOOKS if engine is not None else ():
        if f"_verl_{name}" in engine.__dict__:
            setattr(engine, name, engine.__dict__[f"_verl_{name}"])
            delattr(engine, f"_verl_{name}")


def install_routes_at_first_lookup(config) -> None:
    """A run selected a route: verl looked its loss up for the first time, inside its own ppo_loss, after
    this micro-batch's forward on verl's path. Install the hooks for the next micro-batches, and say so."""
    installed = install_routes()
    mode = _loss_mode(config)
    if installed and torch.is_grad_enabled():
        warnings.warn(f"actor.policy_loss.loss_mode={mode}: rlkernels' engine hooks are installed now, at the first "
                      "lookup of the loss; this micro-batch ran verl's path (the same loss), the next ones take the "
                      f"route. Set {ROUTES_ENV}=1 in the workers' environment to take it from the first micro-batch",
                      stacklevel=3)
    elif not installed:
        _warn_once(f"actor.policy_loss.loss_mode={mode}: verl's FSDP engine (verl.workers.engine.fsdp) does not "
                   "import here, so the route cannot be taken; the loss is computed from verl's log-probs")
