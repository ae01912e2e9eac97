"""The gradient formed in the forward on the logits path (SPEC §2.4): one program per row reads the row, forms its
statistics, forms the token's coefficients (c_t, e_t) from them in the fused stage's own operations, and reads the
row again to write dlogits. The second read follows the first within the program, so on a GPU it is served from L2
(a row of 151,936 bf16 logits is 297 KiB) rather than HBM: fwd + bwd moves the logits twice (a read and the
gradient's write) where the two-pass form moves them three times (two reads and a write).

Each token's coefficients are functions of its own log-prob and of constants the stage decides beforehand from the
proximal and rollout log-probs (stage/fused.py `forward_factors`, the stage kernels' factors mode: the aggregation
weight a_t, the IS weight, the batch normalisation's factor, the entropy coefficient): the PPO family's clip, dual
clip, IS weights, rejection, KL penalties and entropy bonus, every aggregation. The arithmetic is
`token_stats_fwd`'s, the stage's (`stage.ppo_term`, `stage.kl_and_grad`, `_finish_kernel`'s products) and
`token_grad_bwd`'s, in their order, so the log-probs, the entropy and dlogits are the two-pass form's bits.
"""

import torch
import triton
import triton.language as tl

from ..stage_options import TokenFactors
from ..temperature import row_temperature
from .aot_spec import AotSpec, LoopGate
from .stage import kl_and_grad, on_mask, ppo_term
from .tl_math import (
    LN2,
    LOG2E,
    TRITON_DTYPES,
    all_vocab_configs,
    grouped_rows,
    row_block_labels,
    row_inverse_temperature,
    slot_merge,
    vocab_config,
)
from .token_grad import _dlogit, _grad_block, _row_full_blocks
from .token_stats import device_guard, grouped_strides, row_stream, stream_shape


@triton.jit
def _row_coefficients(lp, offs_n, mask_n, mask_ptr, adv_ptr, old_ptr, ref_ptr, a_ptr, w_ptr, factor_ptr,
                      ratio_clamp, clip_lo, clip_hi, clip_c, kl_coef, PROXIMAL: tl.constexpr, WEIGHTED: tl.constexpr,
                      NORMALIZE: tl.constexpr, RATIO_CLAMP: tl.constexpr, DUAL_CLIP: tl.constexpr,
                      KL_TYPE: tl.constexpr, KL_STRAIGHT: tl.constexpr):
    """c_t of the rows' tokens from their log-probs, as the fused stage forms it: the inputs on the mask
    (on_mask), ppo_term's derivative times the IS weight over the factor, times a_t, plus the KL's."""
    m = tl.load(mask_ptr + offs_n, mask=mask_n, other=0) != 0
    lp = tl.where(m, lp, 0.0)
    adv = on_mask(adv_ptr, offs_n, mask_n, m)
    if PROXIMAL != 0:
        l_old = on_mask(old_ptr, offs_n, mask_n, m)
    else:
        l_old = lp
    _, grad = ppo_term(lp, l_old, adv, ratio_clamp, clip_lo, clip_hi, clip_c, RATIO_CLAMP, DUAL_CLIP)
    if WEIGHTED:
        grad = grad * tl.load(w_ptr + offs_n, mask=mask_n, other=0.0)
    if NORMALIZE:
        grad = grad / tl.load(factor_ptr)
    a = tl.load(a_ptr + offs_n, mask=mask_n, other=0.0)
    coef = a * grad
    if KL_TYPE != 0:
        _, dkl = kl_and_grad(lp, on_mask(ref_ptr, offs_n, mask_n, m), KL_TYPE, KL_STRAIGHT)
        coef = (kl_coef * a) * dkl + coef
    return coef


@triton.jit
def _forward_gradient_kernel(
    # the rows and what the pass writes
    logits_ptr, labels_ptr, dlogits_ptr, inv_t_ptr, logprobs_ptr, entropy_ptr,
    # the stage's factors ([N] but factor_ptr, one value)
    mask_ptr, adv_ptr, old_ptr, ref_ptr, a_ptr, w_ptr, factor_ptr, coef_entropy_ptr,
    # shapes and strides
    N, V, rows_per_group, stride_logits_g, stride_logits_n, stride_dlogits_g, stride_dlogits_n,
    # scalars
    temperature, ratio_clamp, clip_lo, clip_hi, clip_c, kl_coef,
    # constexpr: the pass
    HAS_ENTROPY: tl.constexpr, ENTROPY_TERM: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr,
    ROW_TEMPERATURE: tl.constexpr, VECTOR: tl.constexpr,
    # constexpr: the stage's option set
    PROXIMAL: tl.constexpr, WEIGHTED: tl.constexpr, NORMALIZE: tl.constexpr, RATIO_CLAMP: tl.constexpr,
    DUAL_CLIP: tl.constexpr, KL_TYPE: tl.constexpr, KL_STRAIGHT: tl.constexpr,
):
    # Long on purpose: the statistics, the coefficients and the gradient of a row are one program's work, each
    # phase the statements of the kernel it replaces (token_stats_fwd, the stage, token_grad_bwd), in their order.
    # Grid (cdiv(N, BLOCK_N),), rows on axis 0. Hazards as in those kernels: -inf is the max identity, p = 0 terms
    # are 0, a row without a finite logit has p = 0, a row outside the loss (label -1) reads nothing and writes zeros.
    CHAIN: tl.constexpr = VECTOR * logits_ptr.dtype.element_ty.primitive_bitwidth == 128
    offs_n, mask_n, labels, valid = row_block_labels(labels_ptr, N, V, BLOCK_N)
    row_ptrs = grouped_rows(logits_ptr, offs_n, rows_per_group, stride_logits_g, stride_logits_n)
    out_ptrs = grouped_rows(dlogits_ptr, offs_n, rows_per_group, stride_dlogits_g, stride_dlogits_n)
    inv_t = row_inverse_temperature(inv_t_ptr, offs_n, mask_n, temperature, BLOCK_N, ROW_TEMPERATURE)
    k = inv_t * LOG2E
    has_target = valid & (labels >= 0)  # valid: in the pass (row_block_labels)
    z_y = tl.load(row_ptrs + labels, mask=has_target, other=0.0).to(tl.float32)

    # -- the statistics (token_stats_fwd's stream and merge)
    m, sum_e, sum_ed, _ = row_stream(row_ptrs, valid, V, k, HAS_ENTROPY, False, CHAIN, BLOCK_N, BLOCK_V, VECTOR, 1)
    row_max, row_sum_e, dm, beta = slot_merge(m, sum_e, k)
    has_mass = row_sum_e != 0.0
    log_norm = tl.log(row_sum_e)
    logprob = tl.where(has_target, tl.where(has_mass, (z_y - row_max) * inv_t - log_norm, float("-inf")), 0.0)
    tl.store(logprobs_ptr + offs_n, logprob, mask=mask_n)
    h = tl.zeros([BLOCK_N], tl.float32)
    if HAS_ENTROPY:
        row_sum_ed = tl.sum(beta * (sum_ed + dm * sum_e), axis=1)
        h = tl.where(valid & has_mass, log_norm - LN2 * row_sum_ed / row_sum_e, 0.0)
        tl.store(entropy_ptr + offs_n, h, mask=mask_n)

    # -- the token's coefficients (the fused stage's)
    c = _row_coefficients(logprob, offs_n, mask_n, mask_ptr, adv_ptr, old_ptr, ref_ptr, a_ptr, w_ptr, factor_ptr,
                          ratio_clamp, clip_lo, clip_hi, clip_c, kl_coef, PROXIMAL, WEIGHTED, NORMALIZE, RATIO_CLAMP,
                          DUAL_CLIP, KL_TYPE, KL_STRAIGHT)
    c = tl.where(valid, c, 0.0)

    # -- dlogits (token_grad_bwd over the whole row)
    if ENTROPY_TERM:
        e = tl.load(coef_entropy_ptr + offs_n, mask=valid, other=0.0)
        active = valid & ((c != 0.0) | (e != 0.0))
        a = -(c + e * h) * inv_t
        q = -e * LN2 * inv_t
    else:
        active = valid & (c != 0.0)
        a = -c * inv_t
        q = a
    # the statistics as token_grad_bwd loads them: on its active rows, 0 elsewhere
    h = tl.where(active, h, 0.0)
    row_max = tl.where(active, row_max, 0.0)
    log_norm = tl.where(active, log_norm, 0.0)
    log_norm = tl.where(log_norm == float("-inf"), float("inf"), log_norm)
    b = log_norm * LOG2E
    c_t = c * inv_t
    grad_cols = tl.arange(0, BLOCK_V)
    rows_in_2d, rows_out = active[:, None], mask_n[:, None]
    if BLOCK_N == 1:
        v_whole = (V // BLOCK_V) * BLOCK_V
        _row_full_blocks(row_ptrs, out_ptrs, 0, v_whole, grad_cols, active, row_max, k, b, a, q, ENTROPY_TERM,
                         BLOCK_V)
        if v_whole < V:
            in_row = (v_whole + grad_cols)[None, :] < V
            _grad_block(row_ptrs, out_ptrs, v_whole, grad_cols, rows_in_2d & in_row, rows_out & in_row, row_max, k,
                        b, a, q, ENTROPY_TERM)
    else:
        for v0 in range(0, V, BLOCK_V):
            in_row = (v0 + grad_cols)[None, :] < V
            _grad_block(row_ptrs, out_ptrs, v0, grad_cols, rows_in_2d & in_row, rows_out & in_row, row_max, k, b,
                        a, q, ENTROPY_TERM)
    tl.debug_barrier()
    g_y = _dlogit(z_y, row_max, k, b, a, q, ENTROPY_TERM) + c_t
    tl.store(out_ptrs + labels, g_y.to(out_ptrs.dtype.element_ty), mask=active & has_target)


# The tiers a program of which holds at most this many rows: those of V > 1024, where a program streams one row (every
# LLM vocabulary). The two-pass kernels' stacked tiers hold 2, 8 and 32 rows, which with the coefficients and both
# phases' state took up to 139 registers per thread on sm_90 (fp32, entropy and every flag on: 19% occupancy, below
# the AOT gate's floor) and spilled on gfx942 / gfx950 at 2 rows.
MAX_ROWS_PER_PROGRAM = 1


def covers(V: int) -> bool:
    """Whether the kernel runs a vocabulary of V entries: its tier (vocab_config, as the two-pass kernels pick it,
    whose bits it reproduces) holds at most MAX_ROWS_PER_PROGRAM rows per program."""
    return vocab_config(V).BLOCK_N <= MAX_ROWS_PER_PROGRAM


_STAGE_OPTIONS = ("PROXIMAL", "WEIGHTED", "NORMALIZE", "RATIO_CLAMP", "DUAL_CLIP", "KL_TYPE", "KL_STRAIGHT")
COEFFICIENT_HYPERPARAMETERS = ("ratio_clamp", "clip_lo", "clip_hi", "clip_c", "kl_coef")


def forward_gradient(logits: torch.Tensor, labels: torch.Tensor, temperature, out: torch.Tensor,
                     factors: TokenFactors, codes: dict, hyper: dict, compute_entropy: bool, *, block_v: int = None,
                     block_n: int = None):
    """The statistics and dlogits of every row in one launch (see the module docstring).

    Args:
        logits: (N, V) or (B, T, V) float16/bfloat16/float32 with unit stride along V (the caller copies otherwise).
        labels: (N,) integer; -1 on the rows outside the loss (they read nothing and get zeros).
        temperature: T > 0, or an (N,) tensor of per-row temperatures.
        out: dlogits, shaped like logits (its own strides, unit stride along V), written in the logits dtype.
        factors: the stage's decisions (TokenFactors); codes: stage_options.option_codes of the call's option set;
            hyper: its float hyperparameters (COEFFICIENT_HYPERPARAMETERS are read).
        compute_entropy: the entropy of every row (its gradient term where factors.coef_entropy is given).
        block_v, block_n: test hooks overriding the launch heuristic.
    Returns:
        (logprobs, entropy or None), (N,) float32, as token_stats_fwd's.
    """
    V = logits.shape[-1]
    N = logits.numel() // V if V else 0
    dev = logits.device
    logprobs = torch.empty(N, dtype=torch.float32, device=dev)
    entropy = torch.empty(N, dtype=torch.float32, device=dev) if compute_entropy else None
    if N == 0:
        return logprobs, entropy
    rows_per_group, stride_g, stride_n = grouped_strides(logits)
    _, out_stride_g, out_stride_n = grouped_strides(out)
    cfg = vocab_config(V, block_v, block_n)
    scalar, inv_t = row_temperature(temperature)
    f32 = lambda t: None if t is None else t.to(torch.float32).contiguous()  # noqa: E731
    vectors = [f32(t) for t in (factors.advantages, factors.proximal, factors.ref, factors.a, factors.weights,
                                factors.factor, factors.coef_entropy)]
    anything = vectors[0]  # a pointer for what the option set compiles out
    adv, old, ref, a, w, factor, e = (anything if t is None else t for t in vectors)
    with device_guard(logits):
        _forward_gradient_kernel[(triton.cdiv(N, cfg.BLOCK_N),)](
            logits, labels.to(torch.int64).contiguous(), out, anything if inv_t is None else inv_t, logprobs,
            logprobs if entropy is None else entropy, factors.mask.contiguous(), adv, old, ref, a, w, factor, e,
            N, V, rows_per_group, stride_g, stride_n, out_stride_g, out_stride_n,
            scalar, *(float(hyper[name]) for name in COEFFICIENT_HYPERPARAMETERS),
            HAS_ENTROPY=compute_entropy, ENTROPY_TERM=factors.coef_entropy is not None, BLOCK_N=cfg.BLOCK_N,
            BLOCK_V=cfg.BLOCK_V, ROW_TEMPERATURE=inv_t is not None,
            VECTOR=stream_shape(cfg, logits.element_size())["VECTOR"],
            **{name: codes[name] for name in _STAGE_OPTIONS},
            num_warps=cfg.num_warps, num_stages=1,
        )
    return logprobs, entropy


# The hottest loop's static gate on sm_90 (aot.LOOP_GATE_TARGET), SASS instructions per element by (logits dtype
# width, the entropy term): of the two loops (the statistics' stream and the gradient's), the hotter, as either
# compiler reaches it (Triton 3.9 or 3.6: bf16 8.12 and 10.62, fp32 7.81 and 10.69), a quarter above, rounded up to
# the next quarter; no barrier in a loop; one non-ftz ex2, once per row outside the loops: the policy ratio's
# tl.exp, the fused stage's own, whose bits the coefficient must reproduce.
LOOP_GATES = {(16, False): 8.5, (16, True): 11.0, (32, False): 8.25, (32, True): 11.0}


def aot_specs():
    """Each logits dtype and tier it covers with the entropy term on and off, under two of the stage's option sets
    (the plainest, and every flag on with a KL type), per-row temperatures on one of them."""
    option_sets = [
        dict(PROXIMAL=1, WEIGHTED=False, NORMALIZE=0, RATIO_CLAMP=False, DUAL_CLIP=False, KL_TYPE=0, KL_STRAIGHT=False),
        dict(PROXIMAL=2, WEIGHTED=True, NORMALIZE=2, RATIO_CLAMP=True, DUAL_CLIP=True, KL_TYPE=4, KL_STRAIGHT=True),
    ]
    pointers = ("logits_ptr", "labels_ptr", "dlogits_ptr", "inv_t_ptr", "logprobs_ptr", "entropy_ptr", "mask_ptr",
                "adv_ptr", "old_ptr", "ref_ptr", "a_ptr", "w_ptr", "factor_ptr", "coef_entropy_ptr")
    specs = []
    for dtype in TRITON_DTYPES.values():
        types = dict(zip(pointers, (f"*{dtype}", "*i64", f"*{dtype}") + ("*fp32",) * 3 + ("*i1",)
                         + ("*fp32",) * 7))
        for i, options in enumerate(option_sets):
            for entropy in (False, True):
                for cfg in (c for c in all_vocab_configs() if c.BLOCK_N <= MAX_ROWS_PER_PROGRAM):
                    constexprs = dict(options, HAS_ENTROPY=entropy, ENTROPY_TERM=entropy, BLOCK_N=cfg.BLOCK_N,
                                      BLOCK_V=cfg.BLOCK_V, ROW_TEMPERATURE=i == 1,
                                      VECTOR=stream_shape(cfg, 4 if dtype == "fp32" else 2)["VECTOR"])
                    signature = {**types, "N": "i32", "V": "i32", "rows_per_group": "i32", "stride_logits_g": "i64",
                                 "stride_logits_n": "i32", "stride_dlogits_g": "i64", "stride_dlogits_n": "i32",
                                 "temperature": "fp32", **{name: "fp32" for name in COEFFICIENT_HYPERPARAMETERS},
                                 **{k: "constexpr" for k in constexprs}}
                    specs.append(AotSpec(
                        name=(f"forward_gradient[{dtype},set={i},BLOCK_N={cfg.BLOCK_N},BLOCK_V={cfg.BLOCK_V},"
                              f"ENTROPY={int(entropy)}]"),
                        fn=_forward_gradient_kernel, signature=signature, constexprs=constexprs,
                        num_warps=cfg.num_warps, num_stages=1,
                        loop_gate=LoopGate(elements=cfg.BLOCK_V // (32 * cfg.num_warps), non_ftz=1,
                                           per_element=LOOP_GATES[32 if dtype == "fp32" else 16, entropy]),
                        # what the JIT sees on a real launch: 16-byte aligned allocations, V % 16 == 0
                        aligned=pointers + ("V", "stride_logits_g", "stride_logits_n", "stride_dlogits_g",
                                            "stride_dlogits_n")))
    return specs
