"""rlkernels inside OpenRLHF 0.11: a drop-in `PolicyLoss`, computed by `rlkernels.policy_loss`.

    import rlkernels.integrations.openrlhf as rlk_openrlhf
    rlk_openrlhf.install()          # before OpenRLHF builds its actor trainer (its workers: docs/integrations.md)

OpenRLHF has no loss registry: its actor trainer builds `PolicyLoss(...)` from the module-level name it imported
(`openrlhf/trainer/ray/ppo_actor.py`). `install()` rebinds that name (and `openrlhf.models.PolicyLoss`,
`openrlhf.models.loss.PolicyLoss`) to this module's `PolicyLoss`; `uninstall()` puts OpenRLHF's back. Runs that do
not call it are untouched.

The class takes OpenRLHF's constructor and forward and returns its 5-tuple `(loss, clip_ratio, ppo_kl, vllm_kl,
is_filter_ratio)` as device tensors (no synchronisation). What it maps:
- `clip_eps_low/high`, `dual_clip`, the ±20 log-ratio clamp of "ppo";
- `policy_loss_type="gspo"`: the ratio of each sequence's mean log-ratio, unclamped, a mean of sequence means;
  against the sampler (`rollout_log_probs`) when the correction is on, as OpenRLHF (which then skips the
  correction block, so here too);
- aggregation: `token_level_loss` (token-mean; seq-mean-token-mean over non-empty sequences) with the global counts
  the trainer passes (`batch_num_tokens` / `global_batch_size` over `dp_size`);
- the correction (`is_correction_level` token | seq, `_mode` clip | mask, `_gating` ratio | binary_kl | tv,
  `_threshold`): clip = truncated token IS; token ratio mask = IcePop; every other mask gives its dropped units
  weight 0 (the rejection options `seq_mean_k1`, `token_bkl`, `seq_mean_bkl`, `token_btv`, `seq_mean_btv` with
  `rs_mode="zero_weight"`: they stay in every denominator, as OpenRLHF's action mask is untouched) and the
  survivors their untruncated token IS weight π_old/μ.

`install()` also replaces `Actor.forward` with `actor_forward`: the policy's, the reference's and the old log-prob
passes take their log-probs and entropy from one rlkernels pass over the model's logits, without OpenRLHF's float32
copy of them.

`clip_ratio` is rlkernels' `actor/pg_clipfrac` over the action mask; `ppo_kl` OpenRLHF's mean of old − new log-prob
over it, unclamped; `vllm_kl` is `rollout_corr/kl`; `is_filter_ratio` the dropped fraction. OpenRLHF's actor logs
nothing else, so the opt-in parity report (RLKERNELS_LOGPROB_PARITY=1, parity.py: π_old against the sampler, with
the correction on) is the module's `logprob_parity` attribute after each call (device tensors), for a caller that
logs it.
"""

import math
from typing import Optional

import torch
from torch import nn

from ..api import policy_loss, token_logprobs
from ..config import PolicyLossConfig, RolloutCorrection
from .activation import Rebinding
from .parity import parity_metrics
from .requirements import require_trainer

_GATE_KINDS = {"binary_kl": "bkl", "tv": "btv"}
_TARGETS = ("openrlhf.models.loss", "openrlhf.models", "openrlhf.trainer.ray.ppo_actor")
_ACTOR_MODULE = "openrlhf.models.actor"  # Actor.forward: the log-prob passes (policy, reference, old)


def rollout_correction_from_openrlhf(level: str, mode: str, gating: str, threshold) -> Optional[RolloutCorrection]:
    """OpenRLHF's `is_correction_*` options as a `RolloutCorrection` (None when the level is "off")."""
    if level == "off":
        return None
    if level not in ("token", "seq") or mode not in ("mask", "clip") or gating not in ("ratio", *_GATE_KINDS):
        raise ValueError(f"is_correction_level/mode/gating: expected off|token|seq, mask|clip, ratio|binary_kl|tv; "
                         f"got {level!r}, {mode!r}, {gating!r}")
    low, high = threshold
    if mode == "clip":  # OpenRLHF allows it at token level with the ratio gate only
        return RolloutCorrection(is_level="token", is_threshold=(low, high), is_mode="truncate")
    if level == "token" and gating == "ratio":  # IcePop: the weight is 0 outside, the mask unchanged
        return RolloutCorrection(is_level="token", is_threshold=(low, high), is_mode="mask")
    if gating == "ratio":  # the sequence's geometric-mean ratio in [low, high]
        rs = {"seq_mean_k1": (low, high)}
    else:
        rs = {f"{'token' if level == 'token' else 'seq_mean'}_{_GATE_KINDS[gating]}": high}
    # survivors keep their own token IS weight, untruncated; the dropped units stay in every denominator
    return RolloutCorrection(is_level="token", is_threshold=(0.0, math.inf), is_mode="mask", rs=rs,
                             rs_mode="zero_weight")


class PolicyLoss(nn.Module):
    """OpenRLHF 0.11.2's `openrlhf.models.loss.PolicyLoss`, same constructor and forward, computed by rlkernels."""

    def __init__(self, clip_eps_low: float = 0.2, clip_eps_high: float = 0.2, dual_clip: float = None,
                 token_level_loss: bool = True, policy_loss_type: str = "ppo", is_correction_level: str = "off",
                 is_correction_mode: str = "mask", is_correction_gating: str = "ratio",
                 is_correction_threshold=(0.5, 5.0)) -> None:
        super().__init__()
        self.logprob_parity = {}
        if policy_loss_type not in ("ppo", "gspo"):
            raise ValueError(f"policy_loss_type: expected 'ppo' or 'gspo', got {policy_loss_type!r}")
        if is_correction_mode == "clip" and (is_correction_level == "seq" or is_correction_gating != "ratio"):
            raise ValueError("is_correction_mode=clip requires is_correction_level=token and "
                             "is_correction_gating=ratio")
        if is_correction_gating != "ratio" and is_correction_level != "off" and is_correction_threshold[0] > 0:
            raise ValueError(f"is_correction_threshold: is_correction_gating={is_correction_gating} takes an upper "
                             "bound only (a single delta)")
        gspo = policy_loss_type == "gspo"
        self.token_level_loss = token_level_loss and not gspo  # OpenRLHF forces per-sample means for GSPO
        self.policy_loss_type = policy_loss_type
        self.is_correction_level = is_correction_level
        self.rollout_correction = None if gspo else rollout_correction_from_openrlhf(
            is_correction_level, is_correction_mode, is_correction_gating, tuple(is_correction_threshold))
        rc = self.rollout_correction
        self.config = PolicyLossConfig(
            loss_type="vanilla", clip_ratio_low=clip_eps_low, clip_ratio_high=clip_eps_high, clip_ratio_c=dual_clip,
            ratio_level="sequence" if gspo else "token", log_ratio_clamp=None if gspo else 20.0,
            loss_agg_mode="token-mean" if self.token_level_loss else "seq-mean-token-mean",
            seq_mean_over="nonempty", rollout_correction=rc)

    def forward(self, log_probs: torch.Tensor, old_log_probs: torch.Tensor, advantages: torch.Tensor,
                action_mask: Optional[torch.Tensor] = None, rollout_log_probs: Optional[torch.Tensor] = None,
                dp_size: int = 1, batch_num_tokens: Optional[float] = None,
                global_batch_size: Optional[float] = None):
        mask = torch.ones_like(log_probs, dtype=torch.bool) if action_mask is None else action_mask.bool()
        correcting = self.is_correction_level != "off"
        if correcting and rollout_log_probs is None:
            raise ValueError(f"rollout_log_probs: required with is_correction_level={self.is_correction_level!r}")
        overrides = {}
        if self.token_level_loss and batch_num_tokens is not None:
            overrides["global_num_tokens"] = float(batch_num_tokens) / dp_size
        elif not self.token_level_loss and global_batch_size is not None:
            overrides["global_num_seqs"] = float(global_batch_size) / dp_size
        rc = self.rollout_correction
        if self.policy_loss_type == "gspo" and correcting:  # GSPO's ratio against the sampler: bypass mode
            old, rollout = None, rollout_log_probs.detach()
        else:
            old, rollout = old_log_probs.detach(), rollout_log_probs if correcting else None
        config = self.config.with_overrides(**overrides)
        out = policy_loss(log_probs, advantages, mask, old_logprobs=old,
                          rollout_logprobs=None if rollout is None else rollout.detach(), config=config)
        m = out.metrics
        vllm_kl = is_filter_ratio = None
        if rc is not None:
            vllm_kl = m["rollout_corr/kl"]
            if rc.rs:
                seq = any(not option.startswith("token_") for option, _ in rc.rs)
                is_filter_ratio = m["rollout_corr/rollout_rs_seq_masked_fraction" if seq
                                    else "rollout_corr/rollout_rs_masked_fraction"]
            elif rc.is_icepop:
                is_filter_ratio = m["rollout_corr/rollout_is_oob_ratio"]
            else:
                is_filter_ratio = (m["rollout_corr/rollout_is_ratio_fraction_high"]
                                   + m["rollout_corr/rollout_is_ratio_fraction_low"])
        # OpenRLHF's ppo_kl: of the unclamped log-ratio (rlkernels' actor/ppo_kl is of the loss's, clamped to +-20)
        counted = mask.to(old_log_probs.dtype)
        ppo_kl = ((old_log_probs.detach() - log_probs.detach()) * counted).sum() / counted.sum()
        # OpenRLHF's actor logs the 5-tuple only: the opt-in parity report (parity.py) waits here for the caller
        self.logprob_parity = parity_metrics(old_log_probs, rollout_log_probs if correcting else None, mask)
        return out.loss, m["actor/pg_clipfrac"], ppo_kl, vllm_kl, is_filter_ratio


def actor_forward(self, sequences: torch.Tensor, action_mask: Optional[torch.Tensor] = None,
                  attention_mask: Optional[torch.Tensor] = None, return_output=False, allgather_logits=False,
                  return_logprobs=False, ring_attn_group=None, packed_seq_lens=None, return_entropy=False,
                  **mm_inputs):
    """OpenRLHF 0.11.2's `Actor.forward` (`openrlhf/models/actor.py`; the policy's, the reference's and the old
    log-prob passes), with the log-probs and the entropy from one `rlkernels.token_logprobs` pass over the model's
    logits in their own dtype and the temperature inside the kernel: no float32 copy of the logits, no softmax.
    Float32 log-probs and entropy, as OpenRLHF's. `output["logits"]` stays the model's (not cast, not divided by the
    temperature); OpenRLHF's trainers read the log-probs, the entropy and the aux loss from it. A call that wants
    the logits themselves (no `action_mask`, no `return_logprobs`) or carries vision inputs runs OpenRLHF's own."""
    if (action_mask is None and not return_logprobs) or mm_inputs or getattr(self, "is_vlm", False):
        return _openrlhf_forward(self)(self, sequences, action_mask, attention_mask, return_output, allgather_logits,
                                       return_logprobs, ring_attn_group, packed_seq_lens, return_entropy, **mm_inputs)
    import sys

    batch, seqlen = sequences.size()
    helpers = sys.modules[_ACTOR_MODULE] if self.packing_samples else None  # OpenRLHF's unpadding, ring attention
    if self.packing_samples:
        sequences, position_ids, rolled, pad_len, indices = helpers.unpad_and_slice_tensor(
            sequences, attention_mask, ring_attn_group)
        model_mask = None
    else:
        rolled, model_mask = torch.roll(sequences, shifts=-1, dims=1), attention_mask
        position_ids = attention_mask.long().cumsum(-1) - 1
        position_ids.masked_fill_(attention_mask == 0, 1)
    output = self.model(sequences, attention_mask=model_mask, position_ids=position_ids)
    stats = token_logprobs(output["logits"], rolled, temperature=self.temperature, compute_entropy=return_entropy,
                           validate=False)

    def padded(values):  # the packed layout back to [batch, seqlen]
        if not self.packing_samples:
            return values
        return helpers.gather_and_pad_tensor(values, ring_attn_group, pad_len, indices, batch, seqlen)

    if return_entropy:
        assert return_output
        output.entropy = padded(stats.entropy)[:, :-1]
    log_probs = padded(stats.logprobs)[:, :-1]
    if action_mask is not None:
        log_probs = log_probs[:, -action_mask.shape[1]:] * action_mask.float()
    return (log_probs, output) if return_output else log_probs


def _openrlhf_forward(actor):
    """OpenRLHF's own forward: the one `install()` replaced, else the next one up the actor's classes (a subclass
    that defines `forward = actor_forward`, as the plugin running OpenRLHF's tests does)."""
    if _FORWARD.original is not None:
        return _FORWARD.original
    for cls in type(actor).__mro__:
        forward = cls.__dict__.get("forward")
        if forward is not None and forward is not actor_forward:
            return forward
    raise TypeError(f"{type(actor).__name__}: no OpenRLHF forward to hand this call to")


def install() -> None:
    """Make OpenRLHF build this `PolicyLoss` and run `actor_forward`: rebinds the name where OpenRLHF's actor trainer
    reads it (and in `openrlhf.models`, `openrlhf.models.loss`) and `Actor.forward`, in those modules already
    imported and in the others when they are (activation.py: also the Ray `worker_process_setup_hook` that reaches
    OpenRLHF's actors). Imports none of OpenRLHF. Idempotent; `uninstall()` restores OpenRLHF's."""
    require_trainer("openrlhf")
    _POLICY_LOSS.install()
    _FORWARD.install()


def uninstall() -> None:
    """Put OpenRLHF's own `PolicyLoss` and `Actor.forward` back wherever `install()` put rlkernels' (or a module
    imported it from there), and stop waiting for the rest."""
    _POLICY_LOSS.uninstall()
    _FORWARD.uninstall()


# a bare `openrlhf.models` (as the tests load it) has no PolicyLoss: left alone
_POLICY_LOSS = Rebinding("PolicyLoss", PolicyLoss, _TARGETS)
_FORWARD = Rebinding("Actor.forward", actor_forward, (_ACTOR_MODULE,))
