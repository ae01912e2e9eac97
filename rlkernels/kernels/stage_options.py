"""The fused stage's option set as the kernels take it (kernels/triton/stage.py and the CPU kernels' sequence_stage in
csrc/cpu/token_passes.cpp, whose enums list them in this order): codes for the constexpr options, the float
hyperparameters by name. Apart from the Triton module so that the CPU kernels need no Triton."""

from typing import NamedTuple, Optional

import torch

IS_LEVELS = {None: 0, "token": 1, "sequence": 2, "geometric": 3}
KL_TYPES = {None: 0, "k1": 1, "k2": 2, "abs": 3, "k3": 4, "k3_unclamped": 5}
AGGREGATIONS = {"token-sum": 0, "token-mean": 1, "seq-mean-token-mean": 2, "seq-mean-token-sum": 3,
                "seq-mean-token-sum-norm": 4}
PROXIMAL = {"current": 0, "old": 1, "rollout": 2}  # l_old of SPEC §1: on-policy, decoupled, bypass
# the policy term: PPO's clip of each token's ratio; of its sequence's mean log-ratio, the gradient chained through
# that mean (ratio_level="sequence", TRL's GSPO); GSPO's token form (loss_type="gspo", verl's), exp(sg[mean] + lp -
# sg[lp]); CISPO's -sg(c) A lp of the token's ratio or of its sequence's (MiniMax-M1's; c clipped, or capped);
# prime-rl's trust regions on the sampler, -A p/q (+ tau (log p/q)^2) on the tokens whose p - q stays inside a band
# (dppo_binary_tv), inside it on the advantage's side (dppo_binary_tv_signed, its default until 2026-08), or whose
# |p - q| is at most ipo_eps (IPO, its default since); the plain policy gradient -A lp (GPG); DRO's -(A lp - beta/2
# (lp - l_old)^2); SAPO's soft gate of the token's ratio or of its sequence's (Qwen's, verl's and TRL's sapo); DPPO's
# -A sg(min(r, c)) lp on the tokens whose p stays inside a region around p_old toward the advantage, by its total
# variation or its binary KL (verl's dppo_tv, dppo_kl)
POLICY_TERMS = {"ppo": 0, "ppo_sequence": 1, "gspo": 2, "cispo": 3, "cispo_sequence": 4, "binary_tv": 5,
                "binary_tv_signed": 6, "ipo": 7, "gpg": 8, "dro": 9, "sapo": 10, "sapo_sequence": 11, "dppo_tv": 12,
                "dppo_kl": 13}
# the terms of ratio_level="sequence" (the bias-corrected KL multiplies the sequence's ratio too), and those whose
# derivative in the sequence's mean log-ratio goes through the record (the finish chains it to each token)
SEQUENCE_LEVEL_TERMS = (POLICY_TERMS["ppo_sequence"], POLICY_TERMS["cispo_sequence"], POLICY_TERMS["sapo_sequence"])
CHAINED_TERMS = (POLICY_TERMS["ppo_sequence"], POLICY_TERMS["sapo_sequence"])

SEQUENCE_HYPERPARAMETERS = ("is_lo", "is_hi", "k1_sum_lo", "k1_sum_hi", "k1_mean_lo", "k1_mean_hi", "k3_sum_max",
                            "k3_mean_max", "ratio_clamp", "clip_lo", "clip_hi", "clip_c",
                            # the token-level options' bounds: token_* (each token) and seq_all_k1 (every token of
                            # the sequence); k1's as a k1 range, k2's and k3's upper bounds
                            "token_k1_lo", "token_k1_hi", "token_k2_max", "token_k3_max", "all_k1_lo", "all_k1_hi",
                            "cispo_cap", "binary_tv_low", "binary_tv_high", "ipo_kl_tau",
                            "ipo_eps", "dro_beta", "tau_pos", "tau_neg",
                            # the clip ratios themselves (clip_lo / clip_hi are 1 -+ them): DPPO's region's bounds
                            "eps_lo", "eps_hi",
                            # the bounds of k2's sum, mean and maximum over the sequence, and of k3's maximum
                            "k2_sum_max", "k2_mean_max", "k2_max_bound", "k3_max_bound",
                            # the binary divergences' bounds: of each token, of the sequence's mean
                            "token_bkl_max", "token_btv_max", "bkl_mean_max", "btv_mean_max",
                            # DeepSeek-V3.2's off-policy sequence mask's delta
                            "opsm_threshold")
# the statistics the token_* options bound, as bits of RS_TOKEN: the k-statistics, the binary KL and TV
TOKEN_KINDS = {"k1": 1, "k2": 2, "k3": 4, "bkl": 8, "btv": 16}
# the binary divergences' means over the sequence (seq_mean_bkl, seq_mean_btv), as bits of RS_BINARY
BINARY_MEANS = {"bkl": 1, "btv": 2}
BINARY_EPS = 1e-6  # stage.correction.BINARY_EPS (the kernels import nothing above them; a test holds the two equal)
# how the seq_*_k2 options reduce k2 over the sequence, as bits of RS_K2
K2_SCOPES = {"sum": 1, "mean": 2, "max": 4}
FINISH_HYPERPARAMETERS = ("kl_coef", "entropy_coeff", "global_tokens", "global_seqs", "scale_factor",
                          "log_ratio_sq_coef")
HYPERPARAMETERS = SEQUENCE_HYPERPARAMETERS + FINISH_HYPERPARAMETERS


def option_codes(options: dict) -> dict:
    """The kernels' option codes (ordered as the C++ enum) from the stage's option set (stage/fused.py names it)."""
    rejection = set(options["rejection"])
    return dict(
        PROXIMAL=PROXIMAL[options["proximal"]], WEIGHTED=options["weighted"], IS_LEVEL=IS_LEVELS[options["is_level"]],
        IS_MASK=options["is_mask"], RS_K1_SUM="seq_sum_k1" in rejection, RS_K1_MEAN="seq_mean_k1" in rejection,
        RS_K3_SUM="seq_sum_k3" in rejection, RS_K3_MEAN="seq_mean_k3" in rejection,
        RATIO_CLAMP=options["ratio_clamp"], DUAL_CLIP=options["dual_clip"], KL_TYPE=KL_TYPES[options["kl_type"]],
        KL_STRAIGHT=options["kl_straight"], AGGREGATION=AGGREGATIONS[options["aggregation"]],
        SEQ_MEAN_OVER_ALL=options["seq_mean_over_all"], GLOBAL_TOKENS=options["global_tokens"],
        GLOBAL_SEQS=options["global_seqs"], SCALE_FACTOR=options["scale_factor"],
        NORMALIZE=0 if not options["normalize"] else 1 if options["is_level"] == "token" else 2,
        ENTROPY_AGGREGATION=AGGREGATIONS[options["entropy_aggregation"]], POLICY=POLICY_TERMS[options["policy"]],
        SEQ_MEAN_ADVANTAGES=options["seq_mean_advantages"], ZERO_WEIGHT=options["zero_weight"],
        KL_SCORE=options["kl_score"],
        RS_TOKEN=sum(bit for kind, bit in TOKEN_KINDS.items() if f"token_{kind}" in rejection),
        RS_ALL="seq_all_k1" in rejection,
        SEQ_TOKENS_KEPT=options["seq_tokens_kept"], GIVEN_WEIGHTS=options["given_weights"],
        CISPO_CAP=options["cispo_cap"], KL_BIAS_CORRECTION=options["kl_bias_correction"],
        SAMPLER=options["sampler"], LOG_RATIO_SQ=options["log_ratio_sq"],
        RS_K2=sum(bit for scope, bit in K2_SCOPES.items() if f"seq_{scope}_k2" in rejection),
        RS_K3_MAX="seq_max_k3" in rejection,
        RS_BINARY=sum(bit for kind, bit in BINARY_MEANS.items() if f"seq_mean_{kind}" in rejection),
        OPSM=options["opsm"])


class TokenFactors(NamedTuple):
    """What the stage decided before the pass ([N] float32 but `mask`; None where the option set has none)."""
    mask: torch.Tensor  # bool m
    advantages: torch.Tensor
    proximal: Optional[torch.Tensor]  # π_old (or μ in bypass mode); None on-policy (the ratio is 1)
    ref: Optional[torch.Tensor]  # the KL penalty's reference, or None
    a: torch.Tensor  # a_t m'_t, the aggregation weight on the final mask
    weights: Optional[torch.Tensor]  # IS weights before batch normalisation, or None
    factor: Optional[torch.Tensor]  # () the batch normalisation's factor, or None
    coef_entropy: Optional[torch.Tensor]  # e_t, or None without an entropy term
