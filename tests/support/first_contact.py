"""A new user's first compiled steps, run as a script in a fresh interpreter (tests/test_first_contact.py).

Nothing of rlkernels is imported or built before the first compiled call: the CPU kernels' lazy build
and load, the CUDA extension probe and the Triton import all happen while Dynamo traces that call.
Each scenario compares the compiled result with eager and checks that per-step hyperparameters do
not recompile after Dynamo's warm-up. Prints one line per scenario; exits non-zero on the first
failure. Tiny shapes: the cost is compilation, not arithmetic. The comparison's rtol and atol come on the
command line (tests/test_first_contact.py passes TOL "reordered", fp32): importing tests/cases.py here would
import rlkernels before the first compiled call.
"""

import sys

import torch

BOUND = {}  # rtol, atol: set from the command line


def close(a, b, what):
    # fp32, the same formulas compiled and eager: only the order of a few reductions differs
    if not torch.allclose(a, b, **BOUND):
        raise AssertionError(f"{what}: compiled {a} != eager {b}")


class Counter:
    """A torch.compile backend that counts graphs and compiles each with `inner`."""

    def __init__(self, inner):
        self.graphs, self.inner = 0, inner

    def __call__(self, gm, example_inputs):
        self.graphs += 1
        from torch._dynamo.backends.registry import lookup_backend

        return lookup_backend(self.inner)(gm, example_inputs)


def batch(N=11, V=19, seed=0):
    g = torch.Generator().manual_seed(seed)
    return dict(labels=torch.randint(0, V, (N,), generator=g), advantages=torch.randn(N, generator=g),
                response_mask=torch.rand(N, generator=g) < 0.8, old_logprobs=-torch.rand(N, generator=g) * 3,
                rollout_logprobs=-torch.rand(N, generator=g) * 3), torch.randn(N, V, generator=g)


def compiled_step(compile_backend):
    """A training step under fullgraph, with a schedule of hyperparameters that changes every step."""
    import rlkernels

    kw, logits0 = batch()
    cu = torch.tensor([0, 4, 11])
    schedule = [dict(clip_ratio_high=0.28, entropy_coeff=0.01, temperature=1.0, global_num_tokens=9.0),
                dict(clip_ratio_high=0.25, entropy_coeff=0.02, temperature=0.9, global_num_tokens=7.0),
                dict(clip_ratio_high=0.31, entropy_coeff=0.005, temperature=1.2, global_num_tokens=8.0)]

    def step(logits, hp):
        out = rlkernels.decoupled_ppo_loss(logits, **kw, cu_seqlens=cu, validate=False,
                                           rollout_correction=rlkernels.RolloutCorrection.seq_mis(), **hp)
        return out.loss, out.metrics["rollout_corr/kl"]

    counter = Counter(compile_backend)
    compiled = torch.compile(step, fullgraph=True, backend=counter)
    for i, hp in enumerate(schedule):
        if i == 2:
            warm = counter.graphs  # Dynamo specialises a float once, then makes it dynamic
        x = logits0.clone().requires_grad_(True)
        loss, kl = compiled(x, hp)
        loss.backward()
        e = logits0.clone().requires_grad_(True)
        eager_loss, eager_kl = step(e, hp)
        eager_loss.backward()
        close(loss.detach(), eager_loss.detach(), f"loss at step {i}")
        close(kl, eager_kl, f"rollout_corr/kl at step {i}")
        close(x.grad, e.grad, f"dlogits at step {i}")
    if counter.graphs != warm:
        raise AssertionError(f"{compile_backend}: recompiled after warm-up ({counter.graphs} graphs)")


def one_sequence(compile_backend):
    """[N, V] without cu_seqlens: one sequence (Dynamo specialises a one-segment batch)."""
    import rlkernels

    kw, logits0 = batch(seed=1)

    def step(logits):
        return rlkernels.decoupled_ppo_loss(logits, **kw, validate=False, loss_agg_mode="seq-mean-token-mean").loss

    x = logits0.clone().requires_grad_(True)
    torch.compile(step, fullgraph=True, backend=compile_backend)(x).backward()
    e = logits0.clone().requires_grad_(True)
    step(e).backward()
    close(x.grad, e.grad, "dlogits")


def no_grad_logprobs(compile_backend):
    """The old/reference log-prob pass trainers run under torch.no_grad()."""
    import rlkernels

    kw, logits = batch(seed=2)

    def old_logprobs(x):
        with torch.no_grad():
            stats = rlkernels.token_logprobs(x, kw["labels"], compute_entropy=True, validate=False)
        return stats.logprobs, stats.entropy

    got = torch.compile(old_logprobs, fullgraph=True, backend=compile_backend)(logits)
    for g, e, name in zip(got, old_logprobs(logits), ("logprobs", "entropy")):
        close(g, e, name)


def fused_linear(compile_backend):
    """The loss from hidden states and the LM head (logits formed a chunk at a time, inside the op)."""
    import rlkernels

    kw, _ = batch(seed=3)
    g = torch.Generator().manual_seed(3)
    hidden0, weight0 = torch.randn(11, 8, generator=g), torch.randn(19, 8, generator=g)

    def step(hidden, weight, clip):
        return rlkernels.linear_decoupled_ppo_loss(hidden, weight, **kw, validate=False, clip_ratio_high=clip).loss

    counter = Counter(compile_backend)
    compiled = torch.compile(step, fullgraph=True, backend=counter)
    for i, clip in enumerate((0.2, 0.27, 0.3)):
        if i == 2:
            warm = counter.graphs
        h, w = hidden0.clone().requires_grad_(True), weight0.clone().requires_grad_(True)
        compiled(h, w, clip).backward()
        he, we = hidden0.clone().requires_grad_(True), weight0.clone().requires_grad_(True)
        step(he, we, clip).backward()
        close(h.grad, he.grad, f"d hidden at step {i}")
        close(w.grad, we.grad, f"d weight at step {i}")
    if counter.graphs != warm:
        raise AssertionError(f"fused-linear: recompiled after warm-up ({counter.graphs} graphs)")


def loss_only(compile_backend):
    """metrics="loss_only": eagerly the fused stage (the CPU kernels' op, built on first use), compiled the torch
    stage traced into the graph (the fused stage never runs inside one): the same loss and gradient."""
    import rlkernels
    from rlkernels.stage import fused

    kw, logits0 = batch(seed=4)
    config = rlkernels.PolicyLossConfig(metrics="loss_only", validate=False, entropy_coeff=0.01,
                                        rollout_correction=rlkernels.RolloutCorrection.geo_rs(bounds=(0.5, 2.0)))

    def step(logits):
        return rlkernels.decoupled_ppo_loss(logits, **kw, cu_seqlens=torch.tensor([0, 5, 5, 11]), config=config).loss

    x = logits0.clone().requires_grad_(True)
    loss = torch.compile(step, fullgraph=True, backend=compile_backend)(x)
    loss.backward()
    e = logits0.clone().requires_grad_(True)
    eager = step(e)
    eager.backward()
    if fused.implementation(config, e.device) != "cpu":
        raise AssertionError("metrics='loss_only' did not take the CPU kernels' fused stage eagerly")
    close(loss.detach(), eager.detach(), "loss")
    close(x.grad, e.grad, "dlogits")


SCENARIOS = {"compiled_step": compiled_step, "one_sequence": one_sequence, "no_grad_logprobs": no_grad_logprobs,
             "fused_linear": fused_linear, "loss_only": loss_only}

if __name__ == "__main__":
    # argv: rtol, atol, then scenario@backend pairs, in turn; the first is the process's first call
    BOUND.update(rtol=float(sys.argv[1]), atol=float(sys.argv[2]))
    for run in sys.argv[3:]:
        name, compile_backend = run.split("@")
        SCENARIOS[name](compile_backend)
        torch._dynamo.reset()
        print(f"ok {name} {compile_backend}", flush=True)
    from rlkernels import backends

    print("backends", backends.available(), flush=True)
