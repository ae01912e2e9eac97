"""Shared test inputs and comparisons: the tolerance table, the one batch builder, the hypothesis
strategies for batches and configurations, and the comparison helper.

Values come from a torch generator (seeded by hypothesis in the strategies: drawing thousands of
floats one by one through hypothesis is slow); shapes, masks, layouts and options are drawn by
hypothesis itself so that shrinking finds the smallest failing structure. `make_batch` is the one
place that turns those choices into tensors, for the strategies and for plain tests alike.

Option names (agg modes, loss types, KL types, IS levels, RS options) come from rlkernels.config,
never re-typed here.
"""

import math
import os
from dataclasses import dataclass
from typing import Dict, Optional, Sequence, Tuple

import pytest
import torch
from hypothesis import strategies as st

from rlkernels import PolicyLossConfig, RolloutCorrection
from rlkernels.config import KL_TYPES, LOG_RATIO_RS_OPTIONS, LOSS_AGG_MODES, VACO_DIVERGENCES
from rlkernels.stage.policy_terms import LOSS_TERMS

# Every property test states its CI example budget; the "thorough" profile (tests/conftest.py) runs ten times as
# many, HYPOTHESIS_SCALE=k k times as many under either profile.
EXAMPLE_SCALE = int(os.environ.get("HYPOTHESIS_SCALE", "10" if os.environ.get("HYPOTHESIS_PROFILE") == "thorough"
                                   else "1"))


def scaled(n: int) -> int:
    return n * EXAMPLE_SCALE


# ---- tolerances -------------------------------------------------------------------------------------
# One table for the whole suite: TOL[what is compared, dtype] -> Tol(rtol, atol, why). Tests read it
# through tol() (keyword arguments for assert_close, atol times a scale the test states), approx()
# (pytest.approx against a Python float: a hand-computed value, a peer's metric) or at_most() (a one-sided
# bound); a test that measures a relative error itself compares it with an entry's rtol / atol. A test that
# needs another number adds an entry here with its reason; exact comparisons (torch.equal, rtol = atol = 0)
# stay exact and are not listed. tests/test_cases.py fails on a numeric tolerance written anywhere else.


@dataclass(frozen=True)
class Tol:
    rtol: float
    atol: float
    why: str


F64, F32, BF16, F16 = torch.float64, torch.float32, torch.bfloat16, torch.float16

# One rounding of an fp32 result to the output dtype, round to nearest: half an ulp, relative.
HALF_ULP = {BF16: 2.0**-8, F16: 2.0**-11}  # bf16 keeps 8 significant bits, fp16 11
ULP = {BF16: 2.0**-7, F16: 2.0**-10}  # two roundings (or a value and the truth each rounded) may land one ulp apart
# Triton's CPU interpreter converts fp32 -> bf16 by truncation (triton/runtime/interpreter.py
# `cast_impl` calls `_convert_float` without a rounding mode): a whole ulp, where a GPU's cvt.rn rounds
# to nearest. fp32 -> fp16 goes through numpy's astype, which rounds to nearest: no extra error.
INTERPRETER_BF16 = 2.0**-7

_F64_ORDER = ("float64 on both sides: the same math in a different summation order; the largest terms are "
              "exp(20) ~ 5e8, so errors scale with the value (relative)")
_F32_CLAMPED = ("fp32 arithmetic against float64: a blocked fp32 exp-sum errs by about (V/BLOCK + log2 BLOCK) "
                "* 2^-24 ~ 1e-6 relative, and exp() of a log-ratio that carries that error amplifies it by "
                "|delta| <= 20 (the clamp), so 2e-5 bounds it. bf16/fp16 logits upcast exactly, so their "
                "statistics, loss and metrics use this row too")
_F32_KERNEL_GRAD = ("fp32 math: log p = (z - row_max)/T - log_norm carries a few ulps of log_norm, i.e. ~1e-7 "
                    "relative error in p; 1e-5 leaves room for the entropy term's products")
_FP16_SUBNORMAL = "fp16 subnormals (< 6.1e-5) round absolutely by <= 2^-25, inside atol"

TOL: Dict[Tuple[str, torch.dtype], Tol] = {
    # -- the public API on any backend against the float64 oracle (backends/parity.py, test_api.py) ----
    # "value": logprobs, entropy, is_weights, loss and metrics, keyed by the dtype of the statistics
    # (fp32 for half logits). Losses and metrics scale atol by max(1, |expected|).
    ("value", F64): Tol(1e-9, 1e-10, _F64_ORDER),
    ("value", F32): Tol(2e-5, 1e-5, _F32_CLAMPED),
    ("trl", F64): Tol(1e-9, 1e-9, "TRL's _compute_loss vs rlkernels in float64: the same formulas summed in another "
                                  "order (TRL has no epsilon in a denominator); atol scales by the sum of the terms' "
                                  "magnitudes, in which terms of both signs cancel"),
    ("trl.trainer", F32): Tol(1e-5, 1e-6, "TRL's trainer (its fused LM head, float32 tiles) against rlkernels' "
                                          "fused-linear loss on the same float32 model and batch: the same math, "
                                          "other summation orders over V and H"),
    ("trl.sapo", F64): Tol(1e-6, 1e-6, "TRL builds SAPO's temperatures with torch.where(A > 0, tau_pos, tau_neg) "
                                       "of two Python floats: a float32 tensor, so tau_neg = 1.05 carries a "
                                       "relative 2^-24 ~ 6e-8 error that the gate and 4 / tau amplify a few times"),
    # "dlogits": d loss / d logits in the logits dtype; atol scales by max(1e-3, max |expected|).
    ("dlogits", F64): Tol(1e-9, 1e-10, _F64_ORDER),
    ("dlogits", F32): Tol(2e-5, 1e-5, _F32_CLAMPED + "; backends/parity.py floors atol at 2^-23 |c_t| / T, "
                                                      "the float32 rounding of p_y - 1 in a confident token's label"),
    ("dlogits", BF16): Tol(max(2e-5, HALF_ULP[BF16]), 1e-5,
                           "the fp32 row, then one more rounding to bf16 (half an ulp, 2^-8), which dominates"),
    ("sampler.dlogits", BF16): Tol(ULP[BF16], 1e-5,
                                   "the kept-set gradient is an fp32 autograd composition (the entropy's p (log p + "
                                   "H) terms err by ~1e-6 relative) rounded once to bf16: near a rounding midpoint "
                                   "it and the rounded oracle land one ulp (2^-7) apart"),
    ("sampler.dlogits", F16): Tol(ULP[F16], 1e-5,
                                  "as the bf16 row: one fp16 ulp (2^-10) apart near a rounding midpoint; "
                                  + _FP16_SUBNORMAL),
    ("dlogits", F16): Tol(max(2e-5, HALF_ULP[F16]), 1e-5,
                          "the fp32 row, then one more rounding to fp16 (half an ulp, 2^-11), which dominates; "
                          + _FP16_SUBNORMAL),
    ("dlogits@interpreter", BF16): Tol(INTERPRETER_BF16, 1e-5,
                                       "as ('dlogits', bf16), but the interpreter truncates to bf16: one whole ulp"),

    # -- one Triton kernel call (or the torch backend's token statistics) against the float64 oracle ----
    ("kernel.stats", F32): Tol(1e-5, 1e-5,
                               "token statistics (row_max, log_norm, logprobs, entropy, sum p^2) on small "
                               "vocabularies (V <= 300): a blocked fp32 exp-sum errs by (V/BLOCK + log2 BLOCK) * "
                               "2^-24 < 1e-6 relative and log / division add a few ulps; no clamp amplifies it. "
                               "Half logits upcast exactly: the row for every input dtype"),
    # atol scales by max(1, max |expected|)
    ("kernel.dlogits", F32): Tol(1e-5, 1e-5, _F32_KERNEL_GRAD),
    ("kernel.dlogits", BF16): Tol(HALF_ULP[BF16] + 1e-5, 1e-5,
                                  "the fp32 row plus one rounding to bf16 (round to nearest): half an ulp, 2^-8"),
    ("kernel.dlogits", F16): Tol(HALF_ULP[F16] + 1e-5, 1e-5,
                                 "the fp32 row plus one rounding to fp16: half an ulp, 2^-11; " + _FP16_SUBNORMAL),
    ("kernel.dlogits@interpreter", BF16): Tol(INTERPRETER_BF16 + 1e-5, 1e-5,
                                              "the fp32 row plus the interpreter's truncation to bf16: one ulp"),
    # the target column c (1 - p_y), p_y in (0.9, 0.9999), is compared without an absolute floor
    ("kernel.target_column", BF16): Tol(HALF_ULP[BF16] + 2e-5, 0.0,
                                        "one rounding to bf16, plus twice the fp32 row since there is no atol: "
                                        "1 - p_y is formed in fp32 from log p_y, not from p_y rounded to bf16"),
    ("kernel.target_column", F16): Tol(HALF_ULP[F16] + 2e-5, 0.0,
                                       "one rounding to fp16, plus twice the fp32 row since there is no atol"),
    ("kernel.target_column@interpreter", BF16): Tol(INTERPRETER_BF16 + 2e-5, 0.0,
                                                    "as ('kernel.target_column', bf16) with the interpreter's "
                                                    "truncation: one ulp"),

    ("verl.distillation", F64): Tol(1e-6, 1e-7,
                                    "verl's kl_divergence casts both log-probs to float32 (.float()) before its sum: "
                                    "~2^-24 relative per term of t (log t - log s), |log| <= ~40 here"),
    # -- SPEC §9: divergences between two distributions, and their gradients -------------------------
    ("divergence", F64): Tol(1e-7, 1e-9,
                             "float64 on both sides in another order; the tail bucket 1 - sum_H p is a subtraction "
                             "whose k * 2^-53 absolute error is 1e-15 / tail relative (tails >= 1e-12 are compared), "
                             "and KL and chi2 take its log and divide by it"),
    ("divergence", F32): Tol(1e-4, 1e-5,
                             "fp32 log-probs against float64: each log p carries ~|log p| * 2^-24 absolute error "
                             "(|log p| reaches ~50 beside -inf and near one-hot rows), and chi2's exp(2 log pi - "
                             "log mu) turns it into ~1.5e-5 relative per term; KL's differences of logs and the "
                             "tail bucket's 1 - sum_H p add a few ulps of the head mass. atol scales by the value"),
    ("divergence.dlogits", F64): Tol(1e-7, 1e-9, "as ('divergence', fp64): the tail's derivative is 1 / tail"),
    ("divergence.dlogits", F32): Tol(1e-4, 1e-5, "as ('divergence', fp32): the same products, once more in the "
                                                 "backward's closed form; atol scales by max(1e-3, max |expected|), "
                                                 "or by the sum of the terms' magnitudes at the entry where the "
                                                 "terms may cancel (tests/backends/test_cpu_divergences.py)"),
    ("divergence.dlogits", BF16): Tol(1e-4 + ULP[BF16], 1e-5,
                                      "the fp32 row, then the result rounded once to bf16; assert_close rounds the "
                                      "float64 oracle to bf16 too, so the two may land one ulp (2^-7) apart"),
    ("divergence.dlogits", F16): Tol(1e-4 + ULP[F16], 1e-5,
                                     "the fp32 row, then one rounding to fp16: one ulp (2^-10) apart at most"),
    ("divergence.sign_tie", F32): Tol(2e-5, 0.0,
                                      "sign(pi - mu) is discontinuous: where |pi - mu| <= rtol (pi + mu), the CPU "
                                      "kernels' fp32 pi (~|log pi| 2^-24 ~ 1e-6 relative, 2e-5 leaving room for "
                                      "|log pi| ~ 90) and the oracle's may take opposite signs: such entries are "
                                      "allowed the difference a flipped sign makes"),
    # one-sided: the top-k partition's divergence is at most the full one (data processing), up to rounding
    ("divergence.topk_bound", F64): Tol(0.0, 1e-9,
                                        "float64 on both sides: the partition's tail bucket 1 - sum_H p and the logs "
                                        "of both forms round at ~1e-15 of O(1) values; 1e-9 absolute slack"),
    ("divergence.topk_bound", F32): Tol(0.01, 1e-7,
                                        "fp32 on both sides, a trainer tail of 1e-6 (below k fp32 ulps of 1) and KLs "
                                        "of ~1e-5: sums of mu log(mu / pi) that cancel to 1e-5, whose fp32 value lands "
                                        "~2e-7 from the float64 one (1.377e-5 vs 1.403e-5 measured): 1% of the value "
                                        "plus 1e-7 (~|log p| 2^-24 of the head's log-probs)"),
    ("divergence.topk_bound.rounded_logprobs", BF16): Tol(0.02, 1e-6,
                                                          "sampler log-probs given in bf16 (held to the same bound "
                                                          "in fp16 and fp32): half an ulp, 2^-9 relative, of "
                                                          "|log mu| <~ 5 moves each mu by ~1%, so the top-k value "
                                                          "bounds the full fp32 one only to ~2%; 1e-6 absolute "
                                                          "for fp32 rounding where the divergence is ~0"),
    # -- the Triton backend against the torch backend through the public API -------------------------
    ("backends", F32): Tol(1e-5, 1e-5,
                           "two fp32 backends on the same small inputs: the same formulas in a different "
                           "summation order (statistics and the loss, atol unscaled)"),
    # dlogits: atol scales by max(1, max |expected|)
    ("backends.dlogits", F32): Tol(1e-5, 1e-5, _F32_KERNEL_GRAD),
    ("backends.dlogits", BF16): Tol(HALF_ULP[BF16] + HALF_ULP[BF16], 1e-5,
                                    "each backend rounds its fp32 gradient to bf16 once: half an ulp on each side"),
    ("backends.dlogits@interpreter", BF16): Tol(HALF_ULP[BF16] + INTERPRETER_BF16, 1e-5,
                                                "the torch side rounds to nearest (2^-8), the interpreted Triton "
                                                "side truncates (2^-7)"),

    # -- the CUDA backend (tests/backends/test_cuda_backend.py, GPU only) -------------------------------
    ("cuda.stats", F32): Tol(2e-5, 2e-5,
                             "statistics carry only fp32 summation error (half logits upcast exactly): rtol as "
                             "('value', fp32); the absolute floor is 2e-5 because vocabularies reach 151936, "
                             "where log_norm ~ log V ~ 12 and 1e-6 of it is ~1e-5 in logprobs and entropy"),
    # dlogits divided by the row's largest |g| (atol is relative to it)
    ("cuda.dlogits", F32): Tol(2e-5, 1e-5, "the fp32 row of ('value', fp32)"),
    ("cuda.dlogits", BF16): Tol(ULP[BF16], 1e-5,
                                "one ulp: the fp32 result and the float64 truth (cast to bf16 by assert_close) may "
                                "round to neighbouring bf16 numbers"),
    ("cuda.dlogits", F16): Tol(ULP[F16], 1e-5,
                               "one ulp: the fp32 result and the float64 truth (cast to fp16 by assert_close) may "
                               "round to neighbouring fp16 numbers"),
    ("cuda.layout", F32): Tol(1e-6, 1e-6,
                              "statistics of one kernel on a strided, misaligned view and on its contiguous copy: only "
                              "the head/tail peeling of the vector loads, i.e. the fp32 summation order, changes"),
    ("cuda.layout.dlogits", F32): Tol(2e-5, 1e-6, "as ('cuda.layout', fp32), for the gradient: the fp32 row"),
    ("cuda.layout.dlogits", BF16): Tol(ULP[BF16], 1e-6, "as ('cuda.layout', fp32), then each side rounds to bf16: "
                                                         "one ulp apart at most"),
    ("cuda.layout.dlogits", F16): Tol(ULP[F16], 1e-6, "as ('cuda.layout', fp32), then each side rounds to fp16: "
                                                       "one ulp apart at most"),
    ("cuda.near_one_hot", F32): Tol(2e-5, 2e-7,
                                    "c (1 - p_y) at p_y -> 1: log_norm = log(1 + rest) carries ~6e-8 absolute error "
                                    "when rest < 1e-6, hence the absolute floor"),
    ("cuda.near_one_hot", BF16): Tol(ULP[BF16], 2e-7,
                                     "as ('cuda.near_one_hot', fp32), rounded to bf16: one ulp"),
    ("cuda.wide_offsets", BF16): Tol(ULP[BF16], 1e-7,
                                     "dlogits of the last rows of a bf16 batch beyond 2^31 elements (V = 131072): one "
                                     "ulp of bf16; the entries are p ~ 1/V ~ 8e-6, so the floor is 1e-7"),
    ("cuda.api.dlogits", BF16): Tol(2 * ULP[BF16], 1e-5,
                                    "the CUDA and the torch backends each round to bf16: one ulp on each side"),
    ("cuda.api.dlogits", F16): Tol(2 * ULP[F16], 1e-5,
                                   "the CUDA and the torch backends each round to fp16: one ulp on each side"),
    ("gpu.wide_offsets.logprobs", F32): Tol(1e-5, 1e-4,
                                            "logprobs of bf16 logits with V = 151936 against torch's fp32 "
                                            "log_softmax (not float64): both sides carry the fp32 error of a "
                                            "151936-term sum on values ~ log V ~ 12"),

    # -- the same fp32 arithmetic, reordered (compiled vs eager, view vs copy, in-place vs not) --------
    ("reordered", F32): Tol(1e-5, 1e-6,
                            "the same fp32 formulas fused or reordered (torch.compile against eager, the compiled "
                            "per-sequence stage against the eager one): a few fp32 ulps (2^-24 ~ 6e-8) per "
                            "operation over short reductions"),
    ("reordered.dlogits", F32): Tol(1e-5, 1e-7,
                                    "as ('reordered', fp32) for d loss / d logits (also a strided view or an "
                                    "in-place backward against the contiguous, out-of-place one); its entries, "
                                    "(1/N) (onehot - p) for a mean, are mostly far below 1: a smaller absolute floor"),
    ("reordered.dlogits", BF16): Tol(ULP[BF16], 1e-7,
                                     "as ('reordered.dlogits', fp32), each side then rounded to bf16 once: an fp32 "
                                     "last-bit difference (an FMA contracted in one kernel and not the other) can "
                                     "carry a value across a bf16 rounding boundary, one bf16 ulp"),
    ("layout", F32): Tol(1e-6, 1e-7,
                         "the loss of a strided view of the model output against a contiguous copy on the same "
                         "backend: the same arithmetic on the same values, only the addressing differs"),

    # -- two float64 computations that agree in exact arithmetic ------------------------------------
    ("identity", F64): Tol(1e-9, 1e-9,
                           "a permutation, padded vs packed, temperature folded into the logits, fully masked "
                           "sequences appended, the public API against the oracle's sub-steps: float64 summation "
                           "order only (~1e-15 relative per operation; terms up to exp(20)). atol scales by "
                           "max(1, max |expected|) where values can be large"),
    ("identity.shift", F64): Tol(1e-8, 1e-8,
                                 "a per-row logit shift of up to ~1e4 moves float64 rounding by 1e4 * 2^-53 ~ 1e-12 "
                                 "per logit"),
    ("identity.small", F64): Tol(1e-9, 1e-12,
                                 "float64 quantities of order 1 or smaller (IS weights, sum p^2, d loss / d "
                                 "statistic, a divergence's closed-form d / dz against autograd through the oracle): "
                                 "summation order only; 1e-12 absorbs cancellation near 0"),
    ("kept_set.full_support", F64): Tol(1e-12, 1e-12,
                                        "a kept set holding every id against no kept set, on the same float64 logits "
                                        "and per-row temperatures: the same log-softmax of z / T over the same V = 9 "
                                        "entries by another route, a few ulps (2^-53 ~ 1e-16) of O(1) values"),
    ("is_weights.doubled", F64): Tol(1e-12, 1e-12,
                                     "a token-sum loss with every is_weight 2 against twice the loss without: a "
                                     "factor 2 is exact in binary floating point, so only where the weight enters "
                                     "each term's product (a rounding or two, 2^-53 relative) can differ"),
    ("mode_paths", F64): Tol(1e-15, 0.0,
                             "the same float64 loss on the same log-probs reached through another mode (old "
                             "log-probs given or not, r = p / q either way): the same operations, at most an ulp "
                             "(2^-53 ~ 1.1e-16 relative) of reassociation; pytest's 1e-12 absolute floor covers 0"),
    ("fraction", F64): Tol(0.0, 1e-12,
                           "a fraction of tokens or sequences in float64 against one counted here: integer counts, "
                           "exact in float64, divided once (or a mean of 0/1 values): one or two roundings of a "
                           "value <= 1, ~1e-16"),
    ("fraction", F32): Tol(1e-6, 0.0,
                           "a float32 mean of 0/1 values (the count exact below 2^24, divided once) against the "
                           "float64 count: one fp32 rounding, 2^-24 ~ 6e-8 relative"),
    # -- the optimal token baseline and the variance proxies (SPEC §10) --------------------------------
    ("otb", F64): Tol(0.0, 1e-12,
                      "float64: the fast path's segmented reduction over sorted tokens against verl's loops and the "
                      "oracle (packed against padded, the metrics of the variance proxies): sums of O(1) terms in "
                      "other orders, a few roundings of 2^-53; atol scales by max(1, the largest |return|) (the "
                      "value itself for a metric)"),
    ("otb", F32): Tol(0.0, 1e-6,
                      "float32 inputs (examples/otb.py, benchmarks/baseline.py): float32 advantages and returns, "
                      "sums of O(1) terms, against the float64 oracle or against verl's and the compiled path's "
                      "other summation orders: a few 2^-24 ~ 6e-8 of the largest return; atol scales by it"),
    ("otb.returns", F64): Tol(0.0, 1e-15,
                              "a reversed cumulative sum of <= 5 O(1) float64 rewards (the advantage where the "
                              "baseline is 0) against flip-cumsum-flip: the same additions in another grouping, an "
                              "ulp or two of values below ~4 (2^-52 * 4 ~ 9e-16)"),
    ("otb.closed_form", F64): Tol(0.0, 1e-14,
                                  "one-token sequences: the baseline sum(G W) / (sum W + eps) of 4 O(1) terms "
                                  "against the same expression written out: a few ulps, atol a few times 2^-53 * "
                                  "the largest partial sum"),
    ("otb.eps", F64): Tol(0.0, 1e-7,
                          "identical trajectories: the advantage is G eps / (n W + eps), not 0, with eps = 1e-8; "
                          "returns |G| <= ~3 and n W ~ 0.5 give ~6e-8 here: below 1e-7 (a model term, not rounding)"),
    ("variance_proxy.tensor_grad_norm", F32): Tol(1e-7, 1e-7,
                                                  "a 0-d float32 grad_norm 0.7 against the Python float: 0.7 rounded "
                                                  "to float32 (2^-24 ~ 6e-8 relative) and squared, 1.2e-7 at most, "
                                                  "entering the metrics linearly; approx: the larger of 1e-7 |value| "
                                                  "and 1e-7"),
    ("verl", F64): Tol(2e-8, 2e-8,
                       "float64 against verl's own function in float64: verl's masked means and its "
                       "seq-mean-token-mean divide by n + 1e-8, a relative 1e-8 / n (n >= 1) of each "
                       "sequence's term; terms of opposite sign cancel in a total, so atol scales by the sum of "
                       "the terms' magnitudes; the rest is summation order at 1e-15"),
    ("verl.metrics", F64): Tol(1e-7, 1e-7,
                               "verl's actor/* and rollout_corr/* metrics (Python floats) against ours, float64: "
                               "verl's masked means divide by n + 1e-8, a relative 1e-8 / n that its sequence-level "
                               "metrics (means of means, exps and logs of them) carry on a few times; approx takes "
                               "the larger of 1e-7 |value| and 1e-7"),
    ("verl.actor", F64): Tol(1e-7, 1e-7,
                             "PolicyLossConfig.from_verl_actor's loss and gradient against verl's function on O(1) "
                             "terms and log-ratios (spread 0.4), unscaled: verl's 1e-8 / n deviation (see 'verl'), "
                             "amplified at most ~2x by GMPO's exponent, stays below 1e-7"),
    ("verl.plugin", F64): Tol(0.0, 1e-7,
                              "the plugin's driver-side correction and registered loss over two micro-batches "
                              "against verl's own: verl's 1e-8 / n deviation of each micro-batch's means (see "
                              "'verl'); atol scales by the sum of the terms' magnitudes (times max(1, max |grad|) "
                              "for the gradient)"),
    ("verl.is_weights", F64): Tol(1e-12, 0.0,
                                  "IS weights (token or sequence, truncated or masked) against verl's, float64: exp "
                                  "of a sum of <= 7 log-ratios in another order, a few ulps of |sum| <= ~20 in the "
                                  "exponent (~1e-15 relative); no mean, so no n + 1e-8"),
    ("same_path", F64): Tol(1e-12, 1e-14,
                            "the fused loss against token_logprobs + policy_loss on the same float64 logits: the "
                            "same stage on the same statistics, formed by a different call: a few ulps at most"),
    ("gradcheck", F64): Tol(1e-3, 1e-7,
                            "torch.autograd.gradcheck's central differences with eps = 1e-6 in float64: rounding "
                            "error ~ 2^-53 / eps ~ 1e-10 and truncation ~ eps^2 ~ 1e-12 per entry; rtol is "
                            "gradcheck's default"),

    # -- hand-computed values (pytest.approx through approx()) ------------------------------------------
    ("by_hand", F64): Tol(0.0, 1e-12,
                          "float64 results of a handful of operations on O(1) values, against the value computed "
                          "by hand: exact to a few ulps (~1e-16)"),
    ("by_hand.below_one", F64): Tol(0.0, 1e-15,
                                    "a fraction or a mean of a few values of size <= 1 (open-instruct's test vector) "
                                    "against its hand-computed value: a few ulps of 2^-53 ~ 1.1e-16"),
    ("by_hand.relative", F64): Tol(1e-12, 0.0,
                                   "float64 results of a handful of operations (products, a mean of <= 10 terms, a "
                                   "quantile's interpolation, a clamp) against the value worked by hand as a float64 "
                                   "expression: a few ulps (2^-53 ~ 1.1e-16) relative; pytest's 1e-12 absolute floor "
                                   "covers zeros"),
    ("closed_form", F64): Tol(1e-9, 0.0,
                              "float64 closed forms (1.001^T, a loss scaled by e^0.5, mean(-A lp)) against float64 "
                              "reductions over at most 1000 terms: ~1e-13 relative"),
    ("closed_form", F32): Tol(1e-6, 0.0, "a closed form evaluated in fp32 (e^20): a few ulps of 2^-24 ~ 6e-8"),
    ("head.float32.grad", BF16): Tol(HALF_ULP[BF16], 1e-5,
                                     "a float32 head's gradients, summed in float32 and rounded once to bf16: each "
                                     "element within half a bf16 ulp of itself (2^-8 of its magnitude bounds it), "
                                     "plus the float32 sums' error (1e-5 of the largest); a bf16 head's miss by 40x"),
    ("bf16_head.logprobs", BF16): Tol(0.0, ULP[BF16],
                                      "a bf16 head rounds each logit to bf16 (half an ulp of it); log p_y = z_y - lse "
                                      "moves by at most two such roundings of the largest |logit| (atol, scaled)"),
    ("compiled_lerp", F32): Tol(2**-22, 0.0, "Inductor's lerp fused (its own formula, maybe an FMA) against ATen's: "
                                             "a rounding or two of the fp32 result, 2^-23 relative each"),
    ("fp32_difference", F32): Tol(1e-5, 0.0,
                                  "the mean of fp32 differences old - (old - 0.1) with |old| <= 1: each carries up "
                                  "to ~6e-8 absolute error, ~1e-6 relative to 0.1"),
    ("spec_decimals", F64): Tol(0.0, 5e-4,
                                "a value quoted to three decimals (SPEC §8's k1/k3 table, 1.001^1000 ~ 2.717): "
                                "half a unit in the last place"),
    ("benchmark", F32): Tol(1e-4, 0.0,
                            "benchmarks/run.py's naive PyTorch loss and sum |dlogits| against rlkernels[torch] on "
                            "one small fp32 case: the same math in different fp32 summation orders; 1e-4 is the "
                            "harness's own tolerance for the loss (benchmarks/run.py TOLERANCE), held for both"),
    ("benchmark.divergences", F32): Tol(1e-4, 1e-5,
                                        "benchmarks/divergences.py's naive fp32 composition (float32 log_softmaxes, "
                                        "the partition's formulas in torch) against rlkernels' forms, mean KL + mean "
                                        "TV of 32 rows, V = 96: each side carries the fp32 log-prob error of "
                                        "('divergence', fp32); approx takes the larger of 1e-4 |value| and 1e-5"),
    # -- peers and integrations in float32 (Python floats through approx(): the larger of rtol |value| and atol) ---
    ("verl.engine", F32): Tol(1e-5, 1e-5,
                              "verl's engine path (its log-probs and ppo_loss) against the plugin's routes, float32 "
                              "over ~150 tokens of O(1) terms in other summation orders: a few fp32 roundings, "
                              "~1e-6 of max(1, |loss|) (the token-sum reaches ~20); the loss and metrics relative "
                              "to max(1, |value|), the gradient to its largest entry"),
    ("verl.sum_pi_squared", F32): Tol(0.0, 1e-5,
                                      "log-probs, entropy and sum p^2 of verl's pi_old pass through the plugin's "
                                      "routes against verl's unfused float32 values: O(1) quantities over a 96-token "
                                      "vocabulary a few fp32 roundings apart (~1e-7 observed; log-probs reach ~-6); "
                                      "atol scales by max(1, max |expected|)"),
    ("trl.trainer.value", F32): Tol(1e-5, 1e-5,
                                    "as ('trl.trainer', fp32), for a loss or a logged metric as a Python float "
                                    "(means of fp32 ratios, clip fractions, KL, entropy): 1e-5 of max(1, |value|), "
                                    "an absolute floor for metrics near 0"),
    ("trl.entropy_coef", F64): Tol(0.0, 1e-12,
                                   "the adaptive-entropy controller's coefficient, c +- delta clamped to [min, max], "
                                   "on Python floats on both sides: the same additions of O(0.1) values, an ulp "
                                   "apart at most"),
    ("hf.logits", F32): Tol(1e-5, 1e-5,
                            "the LM head's fp32 GEMM on the response rows only (logits_to_keep), or outside the "
                            "model (hidden @ W.T), against the model's full forward: dot products of H = 32 terms "
                            "possibly blocked otherwise, a few 2^-24 of O(1) logits (torch.allclose's default rtol "
                            "with atol 1e-5)"),
    ("tensor_temperature", F32): Tol(1e-6, 1e-7,
                                     "the loss with a per-row temperature tensor on the default backend against a "
                                     "float temperature on the torch backend, fp32, V = 5, 6 tokens: log-probs a few "
                                     "ulps apart (~2^-24 |log p| < 1e-7) and a mean of 6 O(1) terms"),
    ("reordered.mean", F32): Tol(1e-6, 0.0,
                                 "the mean of the same 24 fp32 token KLs by two routes (a masked sum over the count "
                                 "against Tensor.mean): fp32 summation order, a few 2^-24 ~ 6e-8 relative"),
    ("head_mass", F32): Tol(1e-5, 1e-6,
                            "the student's head mass sum over k <= 8 ids of p = exp(fp32 log p) (each ~|log p| 2^-24 "
                            "relative), averaged over the rows, against float64: ~1e-6 relative; held for float64 "
                            "logits too"),
    ("mismatch.fp32_kl", F32): Tol(0.0, 1e-7,
                                   "the mismatch study's fp32 sampler with top_p = 1: the same weights and numerics "
                                   "as the trainer, so the exact KL(mu || pi) is ~0; its fp32 sum of mu (log mu - "
                                   "log pi) rounds at a few 2^-24 ~ 6e-8"),
    ("mismatch.control_chi2", F32): Tol(0.0, 1e-4,
                                        "the on-policy control arm's sampled-token chi2, mean(r^2) - 1 with r = exp(lp "
                                        "- lp_sampler) of fp32 log-probs from two passes (~1e-6 apart): ~2 mean(delta) "
                                        "plus the fp32 rounding of 1 - 1, far below 1e-4"),
    # -- the fused-linear path: d hidden, d weight, d bias against float64 autograd through h @ W.T + b --
    # atol scales by max(1e-3, max |expected|)
    ("linear.grad", F64): Tol(1e-9, 1e-10, _F64_ORDER),
    ("linear.grad", F32): Tol(2e-5, 1e-5,
                              "the fp32 dlogits row, carried through one fp32 GEMM (G @ W, G.T @ h, a sum over "
                              "rows) whose accumulation adds ~1e-7 relative"),
    ("linear.grad", BF16): Tol(ULP[BF16], 4 * HALF_ULP[BF16],
                               "dlogits rounded once to bf16 (2^-8 each), the GEMM result rounded once more "
                               "(2^-8): one ulp relative; an entry that is a cancelling sum of V (or N) such "
                               "terms errs by 2^-8 * sum |G||W|, which the test inputs keep within 4 x the "
                               "largest entry, hence atol 4 * 2^-8 of it"),
    ("linear.grad", F16): Tol(ULP[F16], 4 * HALF_ULP[F16], "as ('linear.grad', bf16) with fp16's 2^-11"),
    ("linear.scaled", BF16): Tol(2 * ULP[BF16] + HALF_ULP[BF16], 8 * HALF_ULP[BF16],
                                 "the fused-linear one-pass form against the two-pass form under a scaled loss: each "
                                 "is within ('linear.grad', bf16) of the exact gradient, so they differ by twice "
                                 "that, plus the one-pass form's rounding of d * g (half an ulp)"),
    ("one_ulp", BF16): Tol(ULP[BF16], 0.0,
                           "a gradient rounded once to bf16 or fp16 after fp32 math, against the unrounded float64 "
                           "value: within one ulp of bf16 (the coarser of the two dtypes)"),
    # -- the trainer adapters against the trainers' own losses (tests/integrations); atol scales by the magnitude --
    ("skyrl", F64): Tol(1e-6, 1e-7, "SkyRL exponentiates every ratio in float32 (safe_exp_delta) whatever the "
                                    "inputs' dtype: its float64 loss carries float32 rounding (6e-8 relative per "
                                    "ratio, summed over tokens)"),
    ("openrlhf", F64): Tol(1e-7, 1e-9, "OpenRLHF computes in float64 here but divides its per-sample means by "
                                       "count + 1e-8: a relative 1e-8 / count rlkernels does not add"),
    ("torchtitan", F32): Tol(1e-5, 1e-5, "TorchTitan upcasts logits to float32 (compute_logprobs): two float32 "
                                         "log-softmaxes over V = 37 and a clipped sum, a few ulps each (1e-6 "
                                         "relative), 1e-5 for the gradients' products"),
    ("areal", F64): Tol(1e-6, 1e-7, "AReaL takes its rejection statistics and behaviour weights in float32 "
                                    "(.float()) and multiplies the float64 loss by them: float32 rounding of "
                                    "each weight (6e-8 relative), summed"),
    ("transcribed", F64): Tol(1e-9, 1e-12, "a float64 transcription of the trainer's own arithmetic (prime-rl, "
                                           "slime) against rlkernels in float64: the same formulas in another "
                                           "summation order"),
    ("nemo_rl", F64): Tol(1e-8, 1e-12, "a float64 transcription of NeMo-RL's loss, whose masked means divide by "
                                       "norm + 1e-8: relative 1e-8 / norm, and a sequence's own norm may be 1"),
    ("metric", F64): Tol(1e-9, 1e-12, "a trainer's logged statistic recomputed from the same float64 values: "
                                      "only the summation order differs"),
    ("metric", F32): Tol(1e-6, 1e-7, "a trainer's logged fraction it takes in float32 (OpenRLHF's "
                                     "`filtered.float().mean()`, slime's clipped-token counts over float32 totals) "
                                     "against rlkernels' float64: each k / n is exact to float32's half-ulp, 6e-8 "
                                     "relative, and slime sums a few of them"),
    # -- the collapse study's statistics (benchmarks/collapse_study.py) ------------------------------------
    ("study.t_table", F64): Tol(0.0, 2e-4, "a t-table's critical value, 2.228 at df 10, is rounded to 4 digits: "
                                           "its exact two-sided p is 0.050012, not 0.05"),
    ("study.margin", F64): Tol(1e-6, 1e-12, "a quantile of the criterion's statistic over the same resampled draws, "
                                            "scaled by 2 or all zero: exact up to float64 cumulative-sum rounding"),
    # -- the studies' served copies (benchmarks/study_model.py, benchmarks/collapse_study.py) ------------------------
    ("study.served_kernel", BF16): Tol(2.0**-7, 2.0**-8, "a served copy's attention or GEMM computed in float32 on "
                                                         "bf16 values against the same arithmetic in float64: "
                                                         "the sums differ in their last "
                                                         "float32 bits, so the one rounding of the output to bf16 "
                                                         "may land an ulp apart (2^-7 relative), and so may a "
                                                         "probability's rounding, which moves the output by at most "
                                                         "2^-8 of the largest |v| (atol scale)"),
}
assert all(t.why for t in TOL.values()), "every tolerance states its reason"


# A Triton case that takes its device from the machine (CPU tensors through the interpreter here, CUDA tensors
# compiled on a GPU) carries this mark: `interpret` without a GPU, `gpu` with one (benchmarks/gpu_check.sh
# selects -m gpu). A case marked `interpret` alone runs on CPU tensors and is skipped on a GPU machine.
TRITON_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
triton_here = pytest.mark.gpu if torch.cuda.is_available() else pytest.mark.interpret


def interpreted() -> bool:
    """True when Triton kernels run through the CPU interpreter (tests/conftest.py sets it without a GPU)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def _entry(quantity: str, dtype: torch.dtype, interpreter: bool) -> Tol:
    if interpreter and (f"{quantity}@interpreter", dtype) in TOL:
        return TOL[f"{quantity}@interpreter", dtype]
    return TOL[quantity, dtype]


def tol(quantity: str, dtype: torch.dtype = F32, *, scale: float = 1.0, interpreter: bool = False) -> Dict[str, float]:
    """assert_close keywords for TOL[quantity, dtype]: atol multiplied by `scale` (the magnitude the test
    measures errors against). interpreter=True picks the "@interpreter" row where Triton's CPU interpreter
    rounds differently from a GPU."""
    t = _entry(quantity, dtype, interpreter)
    return dict(rtol=t.rtol, atol=t.atol * scale)


def approx(expected, quantity: str, dtype: torch.dtype = F64, *, scale: float = 1.0):
    """pytest.approx with TOL[quantity, dtype], atol multiplied by `scale` (as tol()). An entry with atol 0 is a
    relative bound (pytest keeps its 1e-12 absolute floor), one with rtol 0 an absolute bound, one with both the
    larger of rtol |expected| and atol (pytest's rule: a relative bound with an absolute floor)."""
    t = TOL[quantity, dtype]
    atol = t.atol * scale
    if not (t.rtol or atol):
        return pytest.approx(expected, rel=0, abs=0)
    return pytest.approx(expected, rel=t.rtol or None, abs=atol or None)


def at_most(actual, bound, quantity: str, dtype: torch.dtype = F64) -> bool:
    """A one-sided bound up to TOL[quantity, dtype]: actual <= bound + atol + rtol |bound| for every element
    (Python floats or tensors), for a value that is at most another in exact arithmetic."""
    t = TOL[quantity, dtype]
    ok = actual <= bound + t.atol + (t.rtol * abs(bound) if t.rtol else 0.0)
    return bool(ok.all()) if isinstance(ok, torch.Tensor) else bool(ok)


# ---- inputs -----------------------------------------------------------------------------------------
# Modes of Batch.kwargs: decoupled (old + rollout log-probs), bypass (rollout only), on-policy (none).
MODES = ("decoupled", "bypass", "on-policy")
LAYOUTS = ("padded", "packed")
LOGIT_KINDS = ("normal", "offset_pos", "offset_neg", "neg_inf", "one_hot")
MISMATCH_SCALES = (0.0, 0.01, 0.3, 3.0, 50.0)
MASK_PROBABILITIES = (0.0, 0.5, 0.85, 1.0)


@dataclass
class Batch:
    logits: torch.Tensor  # [B, T, V] or [N, V]
    labels: torch.Tensor
    advantages: torch.Tensor
    response_mask: torch.Tensor
    old_logprobs: torch.Tensor
    rollout_logprobs: torch.Tensor
    ref_logprobs: torch.Tensor
    cu_seqlens: Optional[torch.Tensor]

    @property
    def padded(self) -> bool:
        return self.logits.dim() == 3

    def kwargs(self, mode: str) -> Dict[str, Optional[torch.Tensor]]:
        """Keyword tensors for a mode: decoupled (old + rollout), bypass (rollout), on-policy (none)."""
        return dict(
            old_logprobs=self.old_logprobs if mode == "decoupled" else None,
            rollout_logprobs=self.rollout_logprobs if mode in ("decoupled", "bypass") else None,
            ref_logprobs=self.ref_logprobs,
            cu_seqlens=self.cu_seqlens,
        )


def make_logits(gen: torch.Generator, shape, kind: str, dtype) -> torch.Tensor:
    V = shape[-1]
    x = torch.randn(shape, generator=gen, dtype=torch.float64) * 2
    if kind == "offset_pos":
        x = x + 1e4  # a huge common offset must change nothing (fp32 keeps ~1e-3 absolute there)
    elif kind == "offset_neg":
        x = x - 1e4
    elif kind == "neg_inf" and V > 1:
        drop = torch.rand(shape, generator=gen) < 0.4
        drop[..., 0] = False  # every row keeps a finite entry: an all -inf row has no distribution
        x = x.masked_fill(drop, float("-inf"))
    elif kind == "one_hot":
        x = torch.zeros(shape, dtype=torch.float64)
        hot = torch.randint(0, V, shape[:-1], generator=gen)
        x.scatter_(-1, hot.unsqueeze(-1), 40.0)  # p ~ 1 - (V-1) e^-40: near one-hot
    return x.to(dtype)


def make_batch(
    layout: str,
    lengths: Sequence[int],
    V: int,
    *,
    dtype: torch.dtype = F64,
    seed: int = 0,
    logit_kind: str = "normal",
    mismatch: float = 0.3,
    mask_p: float = 1.0,
) -> Batch:
    """A random batch: the one code path that makes test tensors (the `batches` strategy uses it too).

    layout "padded": logits [B, T, V] with lengths = [T] * B; "packed": logits [sum(lengths), V] and
    cu_seqlens over `lengths` (zeros allowed). Each token is in the response mask with probability
    mask_p; outside it labels may be -100 and advantages are NaN (padding may hold anything). old
    log-probs lie in (-4, 0]; rollout = old + N(0, mismatch^2); ref = old + N(0, 0.04). Half-precision
    logits come with fp32 per-token tensors.
    """
    if layout == "padded":
        assert len(set(lengths)) <= 1, f"padded rows have one length, got {lengths}"
        token_shape = (len(lengths), lengths[0] if lengths else 0)
    else:
        assert layout == "packed", layout
        token_shape = (sum(lengths),)
    gen = torch.Generator().manual_seed(seed)
    logits = make_logits(gen, token_shape + (V,), logit_kind, dtype)
    labels = torch.randint(0, V, token_shape, generator=gen)
    if logit_kind == "neg_inf":
        labels = torch.zeros(token_shape, dtype=torch.long)  # column 0 is finite in every row
    mask = torch.rand(token_shape, generator=gen) < mask_p
    labels = torch.where(mask | (torch.rand(token_shape, generator=gen) < 0.5), labels, torch.full_like(labels, -100))
    adv = torch.randn(token_shape, generator=gen, dtype=torch.float64)
    adv = torch.where(mask, adv, torch.full_like(adv, float("nan")))  # padding may hold anything
    old = -torch.rand(token_shape, generator=gen, dtype=torch.float64) * 4
    roll = old + torch.randn(token_shape, generator=gen, dtype=torch.float64) * mismatch
    ref = old + torch.randn(token_shape, generator=gen, dtype=torch.float64) * 0.2
    cu = None
    if layout == "packed":
        cu = torch.tensor([0] + torch.tensor(list(lengths), dtype=torch.long).cumsum(0).tolist(), dtype=torch.int32)
    token_dtype = F32 if dtype in (BF16, F16) else dtype
    to = lambda t: t.to(token_dtype)  # noqa: E731
    return Batch(logits, labels, to(adv), mask, to(old), to(roll), to(ref), cu)


def make_coefficients(N: int, seed: int, zero_rows=(), entropy: bool = True, dtype: torch.dtype = F32):
    """Per-row coefficients of a token-gradient kernel: c = d loss / d logprob, e = d loss / d entropy
    (None without entropy), both exactly 0 on `zero_rows`."""
    gen = torch.Generator().manual_seed(seed)
    c = torch.randn(N, generator=gen, dtype=dtype)
    e = torch.randn(N, generator=gen, dtype=dtype) if entropy else None
    for i in zero_rows:
        c[i] = 0.0
        if e is not None:
            e[i] = 0.0
    return c, e


@st.composite
def batches(draw, layout=None, max_seqs=5, max_len=8, max_vocab=19, dtype=F64, allow_empty=True):
    layout = layout or draw(st.sampled_from(LAYOUTS))
    if layout == "padded":
        S = draw(st.integers(1, max_seqs))
        T = draw(st.integers(1, max_len))
        lengths = [T] * S
    else:
        S = draw(st.integers(0 if allow_empty else 1, max_seqs))
        lengths = [draw(st.integers(0 if allow_empty else 1, max_len)) for _ in range(S)]
    V = draw(st.integers(1, max_vocab))
    kind = draw(st.sampled_from(LOGIT_KINDS))
    scale = draw(st.sampled_from(MISMATCH_SCALES))
    mask_p = draw(st.sampled_from(MASK_PROBABILITIES))
    seed = draw(st.integers(0, 2**31 - 1))
    return make_batch(layout, lengths, V, dtype=dtype, seed=seed, logit_kind=kind, mismatch=scale, mask_p=mask_p)


# ---- configurations ---------------------------------------------------------------------------------
# One generator of PolicyLossConfig keyword arguments, read by the hypothesis strategy `configs` and by the seeded
# draw of spawned ranks (`seeded_config`, tests/stage/test_batch_split.py): every loss type's own fields, the IS levels
# and modes it takes and the token masks it refuses come from its row of the stage's table (LOSS_TERMS), so a new
# loss or field is drawn without an edit here.


class _Hypothesis:
    """Choices drawn by hypothesis (shrinkable)."""

    def __init__(self, draw):
        self.draw = draw

    def choice(self, values):
        return self.draw(st.sampled_from(list(values)))

    def one_in(self, n: int) -> bool:
        return self.draw(st.integers(0, n - 1)) == 0

    def subset(self, values, max_size: int):
        return self.draw(st.lists(st.sampled_from(list(values)), max_size=max_size, unique=True))


class _Seeded:
    """The same choices from a random.Random (spawned ranks draw in lock step from one seed)."""

    def __init__(self, rng):
        self.rng = rng

    def choice(self, values):
        return self.rng.choice(list(values))

    def one_in(self, n: int) -> bool:
        return self.rng.randrange(n) == 0

    def subset(self, values, max_size: int):
        return self.rng.sample(list(values), self.rng.randint(0, max_size))


def _ratio_bound(pick):
    lo = pick.choice([0.3, 0.5, 0.9, 0.999])
    hi = pick.choice([1.001, 1.1, 2.0, 5.0])
    return (lo, hi) if pick.one_in(2) else hi


def _rollout_correction(pick, is_levels, mode: str = "decoupled", sums: bool = False) -> Optional[RolloutCorrection]:
    """A rollout correction over the option product, with an IS level the loss type takes."""
    if pick.one_in(6):
        return None
    threshold = pick.choice([2.0, 1.2, 10.0, (0.5, 5.0), (0.8, 1.25), (0.0, 3.0), (0.5, math.inf)])
    is_mode = pick.choice([None, "truncate", "mask"])
    if is_mode == "truncate" and isinstance(threshold, tuple) and threshold[1] == math.inf:
        is_mode = "mask"  # truncation at inf is no truncation: draw the mask instead
    rs = {}
    for option in pick.subset(LOG_RATIO_RS_OPTIONS, 3):
        rs[option] = _ratio_bound(pick) if option.endswith("k1") else pick.choice([0.001, 0.05, 0.5, 4.0])
        if option == "seq_all_k1" and pick.one_in(2):  # an open end (SkyRL's unset outlier threshold)
            rs[option] = pick.choice([(None, 2.0), (0.5, None), (0.0, 5.0)])
    is_level, normalize = pick.choice(is_levels), pick.one_in(2)
    rs_mode = "mask"
    if mode == "decoupled" and not sums and is_level is not None and rs and pick.one_in(3):  # rs_mode="zero_weight"
        rs_mode, normalize = "zero_weight", False
        if is_level != "token":
            rs = {option: bound for option, bound in rs.items() if not option.startswith("token_")}
    return RolloutCorrection(is_level=is_level, is_threshold=threshold, is_batch_normalize=normalize, rs=rs,
                             is_mode=is_mode, seq_tokens=pick.choice(["mask", "kept"]), rs_mode=rs_mode)


def drawable_loss_types(mode: str):
    """The loss types the generator draws in `mode`: those defined there (their row's `modes`), except the
    batch-global selections (Clip-Cov and KL-Cov select tokens by rank or at random: tests/stage/test_loss_family.py
    holds them to the reference in float64 with the generator seeded alike; and no split batch takes them) and the
    losses that read the sampler's top-k (tests/stage/test_score_centering.py draws those with their inputs)."""
    return [name for name, entry in LOSS_TERMS.items()
            if mode in entry.modes and not entry.batch_global and not entry.sampler_head]


def config_options(pick, mode: str, split: Optional[str] = None, **fixed) -> dict:
    """PolicyLossConfig keyword arguments over the whole option product, consistent with the mode; `split` ("dp",
    "cp" or None): what a split batch supports (stage.loss.check_split_options: no batch-global selection, no M2PO,
    no sequence-level ratio under cp). `fixed` overrides any draw."""
    loss_type = fixed.get("loss_type") or pick.choice(drawable_loss_types(mode))
    entry = LOSS_TERMS[loss_type]
    kl = pick.choice((None,) + KL_TYPES)  # None: no KL penalty
    kw = dict(
        loss_type=loss_type,
        clip_ratio_low=pick.choice([0.2, 0.1]),
        clip_ratio_high=pick.choice([0.2, 0.28]),
        clip_ratio_c=pick.choice([3.0, None, 1.5]),
        loss_agg_mode=pick.choice(LOSS_AGG_MODES),
        temperature=pick.choice([1.0, 0.7]),
        entropy_coeff=pick.choice([0.0, 0.01]),
        compute_entropy=pick.one_in(2),
        kl_coef=0.0 if kl is None else 0.05,
        kl_type=kl or "k3",
        rollout_correction=None if mode == "on-policy" else _rollout_correction(pick, entry.is_levels, mode,
                                                                                      entry.sums is not None),
    )
    if entry.sums is None and pick.one_in(6):  # the loss types with per-sequence sums refuse it
        kw["seq_mean_advantages"] = True
    for option in entry.options:  # the loss type's own fields, as its row declares them
        kw[option.name] = pick.choice(option.draws)
    for lo, hi in entry.ordered:
        if kw[lo] > kw[hi]:
            kw[lo], kw[hi] = kw[hi], kw[lo]
    if pick.one_in(8):
        kw["global_num_tokens"] = 13.0
        kw["global_num_seqs"] = 3.0
    if pick.one_in(8):
        kw["loss_scale_factor"] = 4.0
    # the conventions of the loss family (TRL's where they differ from verl's)
    if entry.ratio_levels and split != "cp":
        kw["ratio_level"] = pick.choice(["token", "sequence"])
    # None (TRL's: no clamp) overflows exp() in float32 where float64 does not, so the dtype comparisons
    # here draw finite clamps; tests/peers/test_trl_losses.py runs None in float64
    kw["log_ratio_clamp"] = pick.choice([20.0, 20.0, 5.0, 30.0])
    kw["seq_mean_over"] = pick.choice(["nonempty", "all"])
    kw["entropy_agg_mode"] = pick.choice((None,) + LOSS_AGG_MODES)
    kw["kl_bias_correction"] = pick.one_in(2)
    kw["kl_score_gradient"] = not kw["kl_bias_correction"] and pick.one_in(3)  # the two exclude each other
    if kw["kl_bias_correction"] and kw.get("ratio_level") == "sequence" and kw["kl_type"].startswith("k3_unclamped"):
        # per sequence, k3 x r's gradient sums (1 - e^d) r and the sequence's share of e^d r: both sides
        # (autograd in the oracle too) cancel e^d terms of up to e^40 here, so neither is an oracle
        kw["kl_type"] = "k3"
    if not entry.no_token_masks:
        kw["off_policy_mask_threshold"] = pick.choice([None, None, 0.0, 0.5])
        if split is None:
            kw["m2po_threshold"] = pick.choice([None, None, 0.04, 1.0])
            kw["m2po_quadrant"] = pick.one_in(2)
        if mode != "on-policy":  # VACO's divergence is the training policy's against the sampler
            kw["vaco_threshold"] = pick.choice([None, None, 0.05, 0.3])
            kw["vaco_divergence"] = pick.choice(VACO_DIVERGENCES)
    kw["log_ratio_sq_coef"] = pick.choice([0.0, 0.0, 1e-3, 0.1])
    kw["adaptive_entropy"] = pick.one_in(2)
    kw.update(fixed)
    return kw


@st.composite
def configs(draw, mode: str, **fixed):
    """A PolicyLossConfig over the whole option product, consistent with the mode (config_options)."""
    return PolicyLossConfig(**config_options(_Hypothesis(draw), mode, **fixed))


def seeded_config(rng, mode: str, split: Optional[str] = None, **fixed) -> PolicyLossConfig:
    """config_options drawn from a random.Random: the same configuration on every spawned rank."""
    return PolicyLossConfig(**config_options(_Seeded(rng), mode, split, **fixed))


@st.composite
def problems(draw, dtype=F64, chunk_rows=None, **batch_kw):
    """(batch, mode, config): a mode, a batch (`batches` keywords) and a configuration consistent with
    the mode; chunk_rows, if given, is a list of PolicyLossConfig.chunk_rows values to draw from."""
    mode = draw(st.sampled_from(MODES))
    batch = draw(batches(dtype=dtype, **batch_kw))
    fixed = {} if chunk_rows is None else dict(chunk_rows=draw(st.sampled_from(chunk_rows)))
    return batch, mode, draw(configs(mode, **fixed))


def assert_close(actual, expected, *, rtol, atol, name="value"):
    """allclose with NaN/inf agreement and a message naming the worst element."""
    if expected is None or actual is None:
        assert actual is None and expected is None, f"{name}: one of actual/expected is None"
        return
    a = actual.detach().to(torch.float64).cpu()
    # the oracle's value as the output dtype can hold it (beyond float32's range that is inf)
    e = expected.detach().to(actual.dtype).to(torch.float64).cpu()
    assert a.shape == e.shape, f"{name}: shape {tuple(a.shape)} != {tuple(e.shape)}"
    nan_a, nan_e = torch.isnan(a), torch.isnan(e)
    assert torch.equal(nan_a, nan_e), f"{name}: NaN pattern differs"
    inf_a, inf_e = torch.isinf(a), torch.isinf(e)
    same_inf = torch.equal(inf_a & (a > 0), inf_e & (e > 0)) and torch.equal(inf_a & (a < 0), inf_e & (e < 0))
    assert same_inf, f"{name}: inf pattern differs"
    fin = ~(nan_e | inf_e)
    if fin.any():
        err = (a[fin] - e[fin]).abs()
        bound = atol + rtol * e[fin].abs()
        worst = int(torch.argmax(err - bound))
        assert bool((err <= bound).all()), (
            f"{name}: worst element actual={a[fin][worst].item()!r} expected={e[fin][worst].item()!r} "
            f"err={err[worst].item():.3e} > bound={bound[worst].item():.3e}"
        )


# ---- the ATen ops a call runs ---------------------------------------------------------------------
# CUDA accumulates these with atomics: on floating-point tensors their result changes in the last bits from run
# to run (on integers they are exact).
ATOMIC_OPS = {"index_add", "index_add_", "scatter_add", "scatter_add_", "scatter_reduce", "scatter_reduce_",
              "index_put", "index_put_", "_index_put_impl_", "put_", "index_reduce", "index_reduce_"}


def aten_ops(fn, *args) -> Dict[str, set]:
    """{ATen op name: the dtypes of its results} of every op `fn(*args)` runs, recorded below autograd as it runs
    (rlkernels.testing.launches: the same ops make_fx would put in a graph, at a fiftieth of make_fx's cost)."""
    from rlkernels.testing.launches import count_launches

    return count_launches(fn, *args)[1].dtypes
