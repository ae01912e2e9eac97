"""rlkernels inside TorchTitan's RL experiment (torchtitan 0.3): its GRPO / DAPO losses, computed by rlkernels.

    from rlkernels.integrations import torchtitan as rlk_titan
    PolicyTrainer.Config(loss=rlk_titan.GRPOLoss.Config(clip_eps=0.2))           # from the logits
    PolicyTrainer.Config(loss=rlk_titan.LinearGRPOLoss.Config(clip_eps=0.2))     # from hidden states: no logits

`GRPOLoss` / `DAPOLoss` take TorchTitan's configs (`clip_eps`; `ratio_clip_low`, `ratio_clip_high`) and its call
`loss_fn(logits, labels, global_valid_tokens, *, generator_logprobs, advantages, loss_mask) -> (loss, metrics)`,
and compute TorchTitan's loss with `rlkernels.decoupled_ppo_loss`: the ratio against the generator's log-probs
(rlkernels' bypass mode), its log-ratio clamped to ±10, PPO clip without dual clip, a token whose generator
log-prob is not finite dropped from the loss and its count, the sum over `global_valid_tokens` (1 when None).

`LinearGRPOLoss` / `LinearDAPOLoss` are `ChunkedLossWrapper`s to TorchTitan's trainer, which therefore hands them
the decoder's last hidden states and the LM head (`set_lm_head`); they run `rlkernels.linear_decoupled_ppo_loss`,
so the [B, L, V] logits never exist, not even a chunk's. Their loss is an ordinary autograd value (gradients
to the hidden states and the head at `backward()`, scaled by what multiplies the loss; TorchTitan's wrapper
applies the head's gradient during the call and ignores the scale). The head must be a plain `nn.Linear` (a
sharded DTensor weight is refused).

The metrics are TorchTitan's keys, pre-divided by the denominator for its SUM reduction across ranks:
`loss/mean`, `loss/ratio_clipped_frac`, `bit_wise/logprob_diff/mean`, `trainer/entropy/mean` (device tensors).
With RLKERNELS_LOGPROB_PARITY=1, also `logprob_parity/match_rate` and `.../mean_abs_diff` of the loss's log-probs
against the generator's, in the same summable form (parity.py).
A label of -100 is TorchTitan's ignore index: rlkernels drops its token (TorchTitan gives it log-prob 0 and keeps
it where `loss_mask` is True).

Refused: TorchTitan's `debug.batch_invariant` mode, whose bitwise trainer = generator log-probs come from TorchTitan's
own `compute_logprobs` (an rlkernels pass would break that equality).
"""

from dataclasses import dataclass

import torch

from ..api import decoupled_ppo_loss, linear_decoupled_ppo_loss
from ..config import PolicyLossConfig
from .parity import parity_metrics
from .requirements import import_trainer

_loss = import_trainer("torchtitan", "torchtitan.components.loss")
BaseLoss, ChunkedLossWrapper = _loss.BaseLoss, _loss.ChunkedLossWrapper

LOG_RATIO_CLAMP = 10.0  # TorchTitan's _MAX_LOG_RATIO
_in_batch_invariant_mode = import_trainer("torchtitan", "torchtitan.distributed.utils").is_in_batch_invariant_mode


def _refuse_batch_invariant_mode() -> None:
    """TorchTitan's `debug.batch_invariant` promises the trainer's log-probs bit for bit equal to the generator's:
    both sides run its `compute_logprobs` under batch_invariant_ops' fixed-order `_log_softmax`. rlkernels' pass
    is another summation order, so the promise would silently break (the ratio's 1.0 drifts by an ulp or more):
    refused, naming the option, at every call (the trainer may enable the mode after building the loss)."""
    if _in_batch_invariant_mode():
        raise ValueError("debug.batch_invariant=True: TorchTitan's batch-invariant mode computes the trainer's "
                         "log-probs bitwise equal to the generator's with its own compute_logprobs; rlkernels' "
                         "fused pass is not that order, so the equality would not hold. Use TorchTitan's own "
                         "GRPOLoss / DAPOLoss in this mode, or turn debug.batch_invariant off")


def _config(low: float, high: float) -> PolicyLossConfig:
    return PolicyLossConfig(loss_type="vanilla", clip_ratio_low=low, clip_ratio_high=high, clip_ratio_c=None,
                            log_ratio_clamp=LOG_RATIO_CLAMP, loss_agg_mode="token-sum", compute_entropy=True)


def _inputs(generator_logprobs, loss_mask, labels):
    """TorchTitan's effective mask (a non-finite generator log-prob drops its token), the generator's log-probs
    there (0 elsewhere) and the labels clamped into range (the mask already excludes ignore_index)."""
    effective = loss_mask.bool() & torch.isfinite(generator_logprobs) & (labels >= 0)
    rollout = torch.where(effective, generator_logprobs, torch.zeros_like(generator_logprobs))
    return effective, rollout


def _titan_metrics(out, effective, rollout, config, denominator):
    """TorchTitan's metric keys, as sums over `denominator`. Its clipped fraction counts every ratio outside the
    clip band (whichever branch the loss takes), so it is taken from the log-probs here, as TorchTitan does."""
    m, n = out.metrics, effective.sum()
    ratio = torch.exp((out.logprobs - rollout).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    band = ratio.clamp(1 - config.clip_ratio_low, 1 + config.clip_ratio_high)
    clipped = (((ratio - band).abs() > 1e-6) & effective).sum()
    return {"loss/mean": out.loss.detach() / denominator,
            "loss/ratio_clipped_frac": clipped / denominator,
            "bit_wise/logprob_diff/mean": -m["rollout_corr/kl"] * n / denominator,
            "trainer/entropy/mean": m["actor/entropy"] / denominator}


def _titan_result(out, effective, rollout, config, global_valid_tokens):
    """(loss, metrics) as TorchTitan's losses return them: the sum over `global_valid_tokens` (1 when None)."""
    denominator = 1 if global_valid_tokens is None else max(global_valid_tokens, 1)
    metrics = _titan_metrics(out, effective, rollout, config, denominator)
    metrics.update(_titan_parity(out.logprobs, rollout, effective, denominator))
    return out.loss / denominator, metrics


def _titan_parity(logprobs, rollout, effective, denominator):
    """The opt-in parity report (parity.py: the loss's log-probs against the generator's) in TorchTitan's form: each
    value a sum over `denominator`, so that its SUM across ranks is the global value. A maximum or a bucket's mean
    does not sum, so the two token means only: match_rate and mean_abs_diff."""
    report = parity_metrics(logprobs, rollout, effective)
    if not report:
        return {}
    tokens = report["logprob_parity/tokens"].to(torch.float64)
    return {f"logprob_parity/{name}": torch.nan_to_num(report[f"logprob_parity/{name}"] * tokens) / denominator
            for name in ("match_rate", "mean_abs_diff")}


class DAPOLoss(BaseLoss):
    """TorchTitan's `DAPOLoss` (clip-higher PPO against the generator), from the logits, by rlkernels."""

    @dataclass(kw_only=True, slots=True)
    class Config(BaseLoss.Config):
        ratio_clip_low: float = 0.2
        ratio_clip_high: float = 0.2

    def __init__(self, config: Config, *, compile_config=None) -> None:
        del compile_config  # rlkernels' kernels are compiled already; its stage compiles itself where it helps
        self.config = _config(config.ratio_clip_low, config.ratio_clip_high)

    def __call__(self, logits, labels, global_valid_tokens=None, *, generator_logprobs, advantages, loss_mask):
        _refuse_batch_invariant_mode()
        effective, rollout = _inputs(generator_logprobs, loss_mask, labels)
        out = decoupled_ppo_loss(logits, labels.clamp(min=0), advantages, effective, rollout_logprobs=rollout,
                                 config=self.config)
        return _titan_result(out, effective, rollout, self.config, global_valid_tokens)


class GRPOLoss(DAPOLoss):
    """TorchTitan's `GRPOLoss`: `DAPOLoss` with one clip `clip_eps`."""

    @dataclass(kw_only=True, slots=True)
    class Config(BaseLoss.Config):
        clip_eps: float = 0.2

    def __init__(self, config: Config, *, compile_config=None) -> None:
        super().__init__(DAPOLoss.Config(ratio_clip_low=config.clip_eps, ratio_clip_high=config.clip_eps),
                         compile_config=compile_config)


class LinearDAPOLoss(ChunkedLossWrapper):
    """`DAPOLoss` from the hidden states and the LM head (no logits); a `ChunkedLossWrapper` to the trainer so that
    it hands over the hidden states and the head."""

    @dataclass(kw_only=True, slots=True)
    class Config(ChunkedLossWrapper.Config):
        ratio_clip_low: float = 0.2
        ratio_clip_high: float = 0.2

    def __init__(self, config: Config, *, compile_config=None) -> None:
        del compile_config
        self.num_chunks = config.num_chunks  # unused: rlkernels picks its own row blocks
        self.lm_head = None
        self.config = _config(config.ratio_clip_low, config.ratio_clip_high)

    def __call__(self, pred, labels, global_valid_tokens=None, *, generator_logprobs, advantages, loss_mask):
        _refuse_batch_invariant_mode()
        head = self.lm_head
        if head is None:
            raise ValueError("lm_head: call set_lm_head(model.lm_head) first (TorchTitan's trainer does)")
        weight, bias = head.weight, getattr(head, "bias", None)
        if type(weight).__name__ == "DTensor":
            raise ValueError("lm_head: a sharded (DTensor) LM head is not supported; use LinearGRPOLoss with a "
                             "replicated head, or GRPOLoss from the logits")
        effective, rollout = _inputs(generator_logprobs, loss_mask, labels)
        out = linear_decoupled_ppo_loss(pred, weight, labels.clamp(min=0), advantages, effective, bias=bias,
                                        rollout_logprobs=rollout, config=self.config)
        return _titan_result(out, effective, rollout, self.config, global_valid_tokens)


class LinearGRPOLoss(LinearDAPOLoss):
    """`GRPOLoss` from the hidden states and the LM head (no logits)."""

    @dataclass(kw_only=True, slots=True)
    class Config(ChunkedLossWrapper.Config):
        clip_eps: float = 0.2

    def __init__(self, config: Config, *, compile_config=None) -> None:
        super().__init__(LinearDAPOLoss.Config(num_chunks=config.num_chunks, ratio_clip_low=config.clip_eps,
                                               ratio_clip_high=config.clip_eps), compile_config=compile_config)
