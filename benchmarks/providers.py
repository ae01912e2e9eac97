"""Who computes the loss: rlkernels backends, the naive PyTorch baseline (eager and compiled), verl
and Liger-Kernel. Each provider turns the shared inputs into a zero-argument function returning the
loss (op "ppo") or the per-token log-probs (op "logprobs"); the harness times and measures it.

`skip_reason` says why a provider does not take part in a (op, case, shape, device), or None.
"""

from typing import Callable, Optional

import torch

import rlkernels
from rlkernels import backends as rk_backends
from rlkernels.testing.peers import import_verl

from .naive import naive_decoupled_ppo_loss, naive_token_logprobs
from .problems import Case

# On CPU, Liger's chunked loss needs an identity lm_head of V x V (logits -> "hidden states"):
# V = 32768 would be a 4 GiB weight and 4 TFLOP of matmul per pass, so it only runs at small V.
LIGER_CPU_MAX_VOCAB = 8192


def naive_kwargs(case: Case) -> dict:
    rc = case.rollout_correction
    if rc.is_icepop or rc.is_batch_normalize:
        raise NotImplementedError("the naive baseline writes truncated IS only")
    return dict(is_level=rc.is_level, is_threshold=rc.is_threshold, rs=tuple(rc.rs), clip_ratio_c=case.clip_ratio_c)


# ---------------------------------------------------------------- providers
class Provider:
    name = ""
    kind = ""  # "rlkernels", "baseline" or "peer"
    ops = ("ppo", "logprobs")

    def skip_reason(self, op: str, case: Optional[Case], V: int, device: str) -> Optional[str]:
        return None if op in self.ops else f"{self.name} does not provide op {op!r}"

    def build(self, op: str, case: Optional[Case], x: dict) -> Callable[[], torch.Tensor]:
        raise NotImplementedError


class RLKernels(Provider):
    kind = "rlkernels"

    def __init__(self, backend: str, numerics: str = "default"):
        self.backend, self.numerics = backend, numerics
        # numerics="vllm" (the engine's log-prob order, docs/numerics.md) is named beside the backend
        self.name = f"rlkernels[{backend}]" if numerics == "default" else f"rlkernels[{backend}+{numerics}]"

    def skip_reason(self, op, case, V, device):
        if not rk_backends.available().get(self.backend, False):
            return f"backend {self.backend!r} is not available in this process"
        if self.backend in ("triton", "cuda") and device != "cuda":
            return f"backend {self.backend!r} is measured on CUDA only (the CPU interpreter is not a speed path)"
        if self.backend == "cpu" and device != "cpu":
            return "backend 'cpu' runs on CPU tensors only"
        return super().skip_reason(op, case, V, device)

    def build(self, op, case, x):
        if op == "logprobs":
            return lambda: rlkernels.token_logprobs(x["logits"], x["labels"], backend=self.backend,
                                                    numerics=self.numerics).logprobs
        config = case.config(self.backend).with_overrides(numerics=self.numerics)
        return lambda: rlkernels.decoupled_ppo_loss(
            x["logits"], x["labels"], x["advantages"], x["response_mask"], old_logprobs=x["old_logprobs"],
            rollout_logprobs=x["rollout_logprobs"], cu_seqlens=x["cu_seqlens"], config=config,
        ).loss


class Naive(Provider):
    kind = "baseline"

    def __init__(self, compiled: bool):
        self.compiled = compiled
        self.name = "naive+compile" if compiled else "naive"

    def build(self, op, case, x):
        if op == "logprobs":
            fn = naive_token_logprobs
            if self.compiled:
                fn = torch.compile(fn)
            return lambda: fn(x["logits"], x["labels"])
        kwargs = naive_kwargs(case)

        def loss(logits, labels, advantages, mask, old, rollout, cu):
            return naive_decoupled_ppo_loss(logits, labels, advantages, mask, old, rollout, cu, **kwargs)

        fn = torch.compile(loss) if self.compiled else loss
        return lambda: fn(
            x["logits"], x["labels"], x["advantages"], x["response_mask"], x["old_logprobs"], x["rollout_logprobs"],
            x["cu_seqlens"],
        )


def _verl_threshold(bound) -> str:
    return f"{bound[0]}_{bound[1]}" if isinstance(bound, tuple) else str(bound)


class Verl(Provider):
    """verl's rollout correction + "vanilla" policy loss on top of the naive log-probs (padded [S, T])."""

    name = "verl"
    kind = "peer"
    ops = ("ppo",)

    def skip_reason(self, op, case, V, device):
        reason = super().skip_reason(op, case, V, device)
        if reason:
            return reason
        try:
            import_verl()
        except Exception as exc:  # noqa: BLE001 - any import failure means "not comparable here"
            return f"verl does not import: {type(exc).__name__}: {exc}"
        return None

    def build(self, op, case, x):
        helper, core_algos, ActorConfig = import_verl()
        rc = case.rollout_correction
        actor = ActorConfig(
            strategy="fsdp", rollout_n=1, ppo_micro_batch_size_per_gpu=1, clip_ratio_low=0.2, clip_ratio_high=0.2,
            # verl always applies the dual clip; c = 1e9 never binds here, i.e. it is off
            clip_ratio_c=case.clip_ratio_c if case.clip_ratio_c is not None else 1e9,
        )
        policy_loss = core_algos.get_policy_loss_fn("vanilla")
        lengths = x["seq_lengths"]
        S, T = len(lengths), max(lengths)
        cu = x["cu_seqlens"].long()
        N = x["labels"].numel()
        seq_id = torch.repeat_interleave(torch.arange(S, device=cu.device), cu[1:] - cu[:-1])
        flat = seq_id * T + (torch.arange(N, device=cu.device) - cu[seq_id])

        def pad(t):  # [N] -> [S, T], zero padding; differentiable (index_copy)
            return t.new_zeros(S * T).index_copy(0, flat, t).view(S, T)

        mask = pad(x["response_mask"].float())
        old, rollout, adv = pad(x["old_logprobs"]), pad(x["rollout_logprobs"]), pad(x["advantages"])
        rs = ",".join(o for o, _ in rc.rs) or None
        rs_threshold = ",".join(_verl_threshold(b) for _, b in rc.rs) or None

        def run():
            logprobs = pad(naive_token_logprobs(x["logits"], x["labels"]))
            weights_proto, final_mask, _metrics = helper.compute_rollout_correction_and_rejection_mask(
                old, rollout, mask, rollout_is=rc.is_level, rollout_is_threshold=rc.is_threshold,
                rollout_rs=rs, rollout_rs_threshold=rs_threshold,
            )
            weights = None if weights_proto is None else weights_proto.batch["rollout_is_weights"]
            loss, _ = policy_loss(old, logprobs, adv, final_mask, "token-mean", actor, weights)
            return loss

        return run


class Liger(Provider):
    """Liger-Kernel's GRPO loss, token-level TIS via `vllm_is_ratio`, loss_type "dapo" (token mean).

    CPU: the chunked torch module, fed logits as hidden states through an identity lm_head.
    CUDA: the Triton `triton_grpo_loss`, which takes (B, T + 1, V) logits."""

    name = "liger"
    kind = "peer"
    ops = ("ppo",)

    def skip_reason(self, op, case, V, device):
        reason = super().skip_reason(op, case, V, device)
        if reason:
            return reason
        rc = case.rollout_correction
        if case.layout != "uniform" or rc.rs or rc.is_level != "token" or case.clip_ratio_c is not None:
            return "Liger's GRPO loss supports only token-level IS weights, no rejection, no dual clip, padded batches"
        try:
            if device == "cuda":
                import liger_kernel.transformers.grpo_loss  # noqa: F401
            else:
                import liger_kernel.chunked_loss  # noqa: F401
        except Exception as exc:  # noqa: BLE001
            return f"liger_kernel does not import: {type(exc).__name__}: {exc}"
        if device != "cuda" and V > LIGER_CPU_MAX_VOCAB:
            gib = V * V * 4 / 2**30
            return (f"CPU path needs a V x V identity lm_head ({gib:.1f} GiB, {2 * V * V / 1e9:.0f} GFLOP/token-row); "
                    f"only V <= {LIGER_CPU_MAX_VOCAB}")
        return None

    def build(self, op, case, x):
        lengths = x["seq_lengths"]
        B, T = len(lengths), lengths[0]
        logits = x["logits"]
        V = logits.shape[1]
        C = case.rollout_correction.is_threshold
        mask = x["response_mask"].view(B, T)
        old = x["old_logprobs"].view(B, T)
        is_ratio = (torch.exp((x["old_logprobs"] - x["rollout_logprobs"]).clamp(-20, 20)).clamp(max=C)).view(B, T)
        is_ratio = is_ratio * mask
        ids = x["labels"].view(B, T)
        adv = x["seq_advantages"]
        if logits.is_cuda:
            from liger_kernel.transformers.grpo_loss import triton_grpo_loss

            # its own input: (B, T + 1, V), the last position of each row is dropped by the kernel
            big = torch.zeros(B, T + 1, V, dtype=logits.dtype, device=logits.device)
            big[:, :T] = logits.detach().view(B, T, V)
            big.requires_grad_(True)
            x["liger_logits"] = big  # the harness differentiates w.r.t. this tensor
            maskf = mask.float()
            return lambda: triton_grpo_loss(
                big, old, None, ids, adv, maskf, temperature=1.0, beta=0.0, eps_low=0.2, eps_high=0.2,
                inplace=False, loss_type="dapo", reduce=True, vllm_is_ratio=is_ratio,
            )[0]
        from liger_kernel.chunked_loss import LigerFusedLinearGRPOLoss

        module = LigerFusedLinearGRPOLoss(
            beta=0.0, use_ref_model=False, compiled=False, loss_type="dapo", epsilon_low=0.2, epsilon_high=0.2,
            temperature=1.0,
        )
        weight = torch.eye(V, dtype=logits.dtype, device=logits.device)  # logits -> hidden states, exactly
        hidden = logits.view(B, T, V)
        return lambda: module(hidden, weight, ids, mask.long(), adv, old_per_token_logps=old, vllm_is_ratio=is_ratio)[0]


PROVIDERS = {p.name: p for p in (
    Naive(False), Naive(True), Verl(), Liger(), RLKernels("torch"), RLKernels("cpu"), RLKernels("triton"),
    RLKernels("cuda"), RLKernels("cpu", "vllm"), RLKernels("triton", "vllm"),
)}
REFERENCE = "rlkernels[torch]"


def provider_names() -> list:
    return list(PROVIDERS)
