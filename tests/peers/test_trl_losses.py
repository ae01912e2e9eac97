"""Each TRL-convention loss against TRL 1.16's own `GRPOTrainer._compute_loss`, run without a trainer.

`_compute_loss` is called unbound on a stand-in object that carries the attributes it reads (the
`GRPOConfig` itself as `args`, an accelerator on one process) and whose
`_get_per_token_logps_and_entropies` hands back leaf tensors of log-probs and entropies: TRL's own
code computes the loss, and autograd through it gives the gradient w.r.t. the log-probs and the
entropies, which must equal rlkernels' closed-form coefficients. The config comes from
`PolicyLossConfig.from_trl(GRPOConfig(...))`, so the mapping is tested too.

float64 on both sides, 1e-9 relative to the sum of the terms' magnitudes (TOL "trl"): the same formulas
in another order; TRL has no epsilons in its denominators. Needs `pip install trl==1.16.0`.
"""

import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import rlkernels
from rlkernels import PolicyLossConfig

from ..cases import assert_close, scaled, tol

try:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from trl import GRPOConfig
        from trl.trainer.grpo_trainer import GRPOTrainer
except ImportError as exc:  # pragma: no cover - reported by the skip
    pytest.skip(f"TRL 1.16 is not importable here ({exc}); pip install trl==1.16.0", allow_module_level=True)

TRL_LOSSES = ("grpo", "bnpo", "dapo", "dr_grpo", "luspo", "sapo", "cispo", "vespo")
VLLM_MODES = (None, "token_truncate", "token_mask", "sequence_truncate", "sequence_mask")


class _Accelerator:
    num_processes = 1
    sync_gradients = True

    def gather(self, x):
        return x

    gather_for_metrics = gather

    def reduce(self, x, reduction="sum"):
        return x


class _Model:
    training = True


class _Stand:
    """What `_compute_loss` reads of its trainer, and nothing else."""

    _compute_loss = GRPOTrainer._compute_loss
    get_off_policy_mask = staticmethod(GRPOTrainer.get_off_policy_mask)
    get_gamma_weights = staticmethod(GRPOTrainer.get_gamma_weights)

    def __init__(self, args, logps, entropies):
        self.args, self._logps, self._entropies = args, logps, entropies
        self.loss_type, self.beta = args.loss_type, args.beta
        self.epsilon_low = args.epsilon
        self.epsilon_high = args.epsilon_high if args.epsilon_high is not None else args.epsilon
        self.importance_sampling_level = args.importance_sampling_level
        self.off_policy_mask_threshold = args.off_policy_mask_threshold
        self.top_entropy_quantile = args.top_entropy_quantile
        self.use_vllm = args.use_vllm
        self.vllm_importance_sampling_correction = args.vllm_importance_sampling_correction
        self.max_completion_length = args.max_completion_length
        self.aux_loss_enabled = False
        self.entropy_coef = args.entropy_coef
        self._entropy_bonus_enabled = args.entropy_coef != 0.0
        self.use_adaptive_entropy = False
        self.current_gradient_accumulation_steps = 1
        self.accelerator, self.model = _Accelerator(), _Model()
        self._metrics = {"train": _Sink(), "eval": _Sink()}

    def _get_per_token_logps_and_entropies(self, *args, **kwargs):
        return self._logps, self._entropies, None


class _Sink(dict):
    def __missing__(self, key):
        self[key] = []
        return self[key]


def _args(**kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return GRPOConfig(output_dir="/tmp/rlkernels-trl-test", use_cpu=True, report_to=[], **kw)


def _importance_ratio(old, sampling, mask, mode, lo, hi):
    """TRL's `_generate_and_score_completions` correction (grpo_trainer.py): old vs sampler log-probs."""
    diff = (old - sampling) * mask
    if mode.startswith("sequence"):
        diff = diff.sum(-1, keepdim=True)
    ratio = torch.exp(diff)
    if mode.endswith("truncate"):
        return torch.clamp(ratio, min=lo, max=hi)
    lo_v, hi_v = (-float("inf") if lo is None else lo), (float("inf") if hi is None else hi)
    return ratio.masked_fill((ratio < lo_v) | (ratio > hi_v), 0.0)


@st.composite
def cases(draw):
    B, T = draw(st.integers(1, 4)), draw(st.integers(1, 6))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    spread = draw(st.sampled_from([0.02, 0.3, 1.5]))
    old = -torch.rand(B, T, generator=gen, dtype=torch.float64) * 3 - 0.05
    lp = old + torch.randn(B, T, generator=gen, dtype=torch.float64) * spread
    sampling = old + torch.randn(B, T, generator=gen, dtype=torch.float64) * spread
    ref = old + torch.randn(B, T, generator=gen, dtype=torch.float64) * spread
    entropy = torch.rand(B, T, generator=gen, dtype=torch.float64) * 2
    per_token_adv = draw(st.booleans())
    adv = torch.randn((B, T) if per_token_adv else (B,), generator=gen, dtype=torch.float64)
    mask = (torch.rand(B, T, generator=gen) < draw(st.sampled_from([1.0, 0.7]))).long()
    if draw(st.booleans()):
        mask[0] = 0  # an empty completion
    return lp, old, sampling, ref, entropy, adv, mask


@pytest.mark.parametrize("loss_type", TRL_LOSSES)
@settings(max_examples=scaled(40))
@given(case=cases(), level=st.sampled_from(["token", "sequence"]), beta=st.sampled_from([0.0, 0.04]),
       bias_kl=st.booleans(), delta=st.sampled_from([None, 1.6]), opsm=st.sampled_from([None, 0.0, 0.3]),
       vllm=st.sampled_from(VLLM_MODES), clip=st.sampled_from([(None, 3.0), (0.5, 2.0), (0.8, None)]),
       entropy_coef=st.sampled_from([0.0, 0.01]), eps_high=st.sampled_from([None, 0.28, 5.0]))
def test_loss_matches_trl(loss_type, case, level, beta, bias_kl, delta, opsm, vllm, clip, entropy_coef, eps_high):
    lp, old, sampling, ref, entropy, adv, mask = case
    if loss_type == "vespo" and vllm is not None and vllm.startswith("sequence"):
        vllm = "token_" + vllm.split("_")[1]  # TRL refuses sequence-level IS with VESPO (as rlkernels)
    if eps_high == 5.0 and loss_type != "cispo":
        eps_high = None  # 5.0 is CISPO's absolute cap (ScaleRL); a PPO clip range of 5 is not a case
    B, T = lp.shape
    args = _args(loss_type=loss_type, importance_sampling_level=level, beta=beta, use_bias_correction_kl=bias_kl,
                 delta=delta, off_policy_mask_threshold=opsm, epsilon_high=eps_high, entropy_coef=entropy_coef,
                 max_completion_length=T + 2, use_vllm=vllm is not None,
                 vllm_importance_sampling_correction=vllm is not None,
                 vllm_importance_sampling_mode=vllm or "sequence_mask",
                 vllm_importance_sampling_clip_min=clip[0], vllm_importance_sampling_clip_max=clip[1])
    leaf, ent = lp.clone().requires_grad_(True), entropy.clone().requires_grad_(True)
    inputs = {
        "prompt_ids": torch.zeros(B, 1, dtype=torch.long), "prompt_mask": torch.ones(B, 1, dtype=torch.long),
        "completion_ids": torch.zeros(B, T, dtype=torch.long), "completion_mask": mask, "advantages": adv,
        "old_per_token_logps": old, "ref_per_token_logps": ref, "sampling_per_token_logps": sampling,
        "num_items_in_batch": mask.sum().double(),
    }
    if vllm is not None:
        inputs["importance_sampling_ratio"] = _importance_ratio(old, sampling, mask, vllm, *clip)
    want = _Stand(args, leaf, ent)._compute_loss(None, inputs)
    want_lp, want_ent = torch.autograd.grad(want, (leaf, ent), allow_unused=True)

    config = PolicyLossConfig.from_trl(args)
    mine, mine_ent = lp.clone().requires_grad_(True), entropy.clone().requires_grad_(True)
    out = rlkernels.policy_loss(mine, adv, mask, old_logprobs=old, rollout_logprobs=sampling if vllm or opsm is not None
                                else None, ref_logprobs=ref if beta else None,
                                entropy=mine_ent if entropy_coef else None, config=config)
    got_lp, got_ent = torch.autograd.grad(out.loss, (mine, mine_ent), allow_unused=True)
    # differences are reordering of float64 sums; scale by the magnitude of the terms (the KL's
    # e^(ref - lp) and VESPO's phi included), not by the total, in which terms of both signs cancel
    terms = adv.abs().reshape(B, -1) * (lp.abs() + 5) + beta * (torch.exp(ref - lp) + (ref - lp).abs() + 1) * 8
    scale = max(1.0, float(want.detach().abs()), float((terms * mask).sum()))
    row = "trl.sapo" if loss_type == "sapo" else "trl"
    assert_close(out.loss.detach(), want.detach(), **tol(row, torch.float64, scale=scale), name="loss")
    assert_close(got_lp, torch.zeros_like(lp) if want_lp is None else want_lp,
                 **tol(row, torch.float64, scale=scale), name="d loss / d logprobs")
    if entropy_coef:
        assert_close(got_ent, want_ent, **tol("trl", torch.float64, scale=1.0), name="d loss / d entropy")


def test_from_trl_maps_and_names_trls_options():
    config = PolicyLossConfig.from_trl(_args(loss_type="cispo", epsilon_high=5.0, beta=0.0))
    assert (config.loss_type, config.cispo_cap, config.loss_agg_mode) == ("cispo", 5.0, "token-mean")
    config = PolicyLossConfig.from_trl(_args(loss_type="dr_grpo", max_completion_length=64, delta=2.0))
    assert (config.loss_agg_mode, config.loss_scale_factor, config.seq_mean_over, config.clip_ratio_c) == (
        "seq-mean-token-sum-norm", 64, "all", 2.0)
    config = PolicyLossConfig.from_trl(_args(use_vllm=True, vllm_importance_sampling_mode="token_truncate",
                                             vllm_importance_sampling_clip_min=0.5))
    rc = config.rollout_correction
    assert (rc.is_level, rc.is_mode, rc.is_range) == ("token", "truncate", (0.5, 3.0))
    with pytest.raises(ValueError, match=r"^delta: expected > 1 \+ epsilon_high"):
        PolicyLossConfig.from_trl(_args(loss_type="grpo", delta=1.1))
    with pytest.raises(ValueError, match=r"^top_entropy_quantile: 0.5 is not supported"):
        PolicyLossConfig.from_trl(_args(top_entropy_quantile=0.5))
    with pytest.raises(ValueError, match=r"^loss_type: TRL's 'sft' is not computed"):
        PolicyLossConfig.from_trl({"loss_type": "sft"})
    with pytest.raises(ValueError, match=r"^vllm_importance_sampling_mode: expected"):
        PolicyLossConfig.from_trl({"use_vllm": True, "vllm_importance_sampling_mode": "token"})
