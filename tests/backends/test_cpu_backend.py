"""The CPU kernels (csrc/cpu/token_passes.cpp) at the kernel level against the float64 oracle (the option
product through the public API is tests/backends/test_parity.py), and the dispatch that picks them.

Tolerances: the "value" and "dlogits" rows of cases.TOL. The kernels sum in float32 over blocks of
1,024 elements (16 lanes each) and add the block totals in float64, and their exponential is within
about one ulp of the true value, so they carry the same fp32 summation error the rows already allow.
"""

import sys
import threading

import pytest
import torch

import rlkernels
from rlkernels import backends
from rlkernels.backends.base import FOREIGN_TARGET
from rlkernels.reference import token_stats

from ..cases import LOGIT_KINDS, assert_close, make_coefficients, make_logits, tol

pytestmark = pytest.mark.skipif(not backends.available()["cpu"], reason="the CPU kernels could not be built here")


@pytest.mark.parametrize("kind", LOGIT_KINDS)
@pytest.mark.parametrize("V", [1, 15, 16, 17, 1023, 1024, 1025, 4099])  # lanes and blocks, with tails
@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_cpu_token_statistics_and_gradient_against_the_oracle(kind, V, temperature):
    """Every statistic and d logits row by row, at widths around the kernels' lane (16) and block
    (1,024) sizes, on the logit families of the suite (±1e4 offsets, -inf entries, one-hot rows),
    with skipped rows (label -1, label V), a foreign-target row and a zero-coefficient row."""
    gen = torch.Generator().manual_seed(V)
    N = 7
    logits = make_logits(gen, (N, V), kind, torch.float32)
    labels = torch.randint(0, V, (N,), generator=gen)
    if kind == "neg_inf":
        labels.zero_()
    labels[1], labels[4] = -1, V
    backend = backends.select("cpu", logits)
    got = backend.token_stats_fwd(logits, labels, temperature, True, True)
    active = (labels >= 0) & (labels < V)
    want_lp, want_h, want_s2 = token_stats(logits.double(), labels.clamp(0, V - 1), temperature=temperature)
    q = tol("kernel.stats", torch.float32)
    for name, value in (("logprobs", want_lp), ("entropy", want_h), ("sum_pi_squared", want_s2)):
        have = getattr(got, name)
        assert torch.all(have[~active] == 0), f"{name}: skipped rows must be 0"
        assert_close(have[active], value[active].float(), **q, name=name)
    lse = got.row_max / temperature + got.log_norm
    assert_close(lse[active], torch.logsumexp(logits.double() / temperature, 1)[active].float(), **q, name="lse")

    c, e = make_coefficients(N, seed=V, zero_rows=(2,))
    dl = backend.token_grad_bwd(logits, labels, got.row_max, got.log_norm, got.entropy, c, e, temperature, False)
    ref = logits.double().clone().requires_grad_(True)
    ref_lp, ref_h, _ = token_stats(ref, labels.clamp(0, V - 1), temperature=temperature)
    keep = active.double()
    loss = (c.double() * keep * ref_lp).sum() + (e.double() * keep * ref_h).sum()
    (want_grad,) = torch.autograd.grad(loss, ref)
    assert torch.all(dl[~active] == 0) and torch.all(dl[2] == 0), "skipped / zero-coefficient rows must be 0"
    scale = max(1.0, float(want_grad.abs().max()))
    assert_close(dl, want_grad.float(), **tol("kernel.dlogits", torch.float32, scale=scale), name="dlogits")


def test_auto_runs_the_cpu_kernels_on_the_cpu():
    """The dispatch: "auto" on CPU logits of a kernel dtype is the CPU kernels; float64 stays on torch."""
    assert type(backends.select("auto", torch.zeros(2, 3))).__name__ == "CpuBackend"
    assert type(backends.select("auto", torch.zeros(2, 3, dtype=torch.bfloat16))).__name__ == "CpuBackend"
    assert type(backends.select("auto", torch.zeros(2, 3, dtype=torch.float64))).__name__ == "TorchBackend"
    with pytest.raises(ValueError, match="backend='cpu': supports float16, bfloat16 and float32"):
        backends.select("cpu", torch.zeros(2, 3, dtype=torch.float64))
    logits = torch.randn(5, 11, requires_grad=True)
    with torch.autograd.profiler.profile() as prof:
        out = rlkernels.token_logprobs(logits, torch.randint(0, 11, (5,)), compute_entropy=True)
        (out.logprobs.sum() + out.entropy.sum()).backward()
    names = {evt.name for evt in prof.function_events}
    assert "rlkernels_cpu::token_stats_fwd" in names, sorted(names)
    assert "rlkernels_cpu::token_grad_bwd_out" in names, sorted(names)


def test_foreign_target_rows_with_inplace_backward():
    """In place: the gradient overwrites the logits row by row, each row read before it is written."""
    gen = torch.Generator().manual_seed(3)
    logits = make_logits(gen, (6, 33), "normal", torch.float32)
    labels = torch.tensor([3, FOREIGN_TARGET, -1, 7, FOREIGN_TARGET, 0])
    backend = backends.select("cpu", logits)
    st_ = backend.token_stats_fwd(logits, labels, 0.9, True, False)
    c, e = make_coefficients(6, seed=3)
    out = backend.token_grad_bwd(logits, labels, st_.row_max, st_.log_norm, st_.entropy, c, e, 0.9, False)
    inplace = logits.clone()
    backend.token_grad_bwd(inplace, labels, st_.row_max, st_.log_norm, st_.entropy, c, e, 0.9, True)
    assert torch.equal(inplace, out)


def test_processes_that_start_together_build_the_kernels_once(tmp_path, monkeypatch):
    """The ranks of a node (or a test run's workers) that first use the CPU backend together: one builds, the
    others wait for its library (a flock; separate opens conflict within one process too, so threads show it)."""
    from rlkernels.backends import cpu_backend

    monkeypatch.setenv("RLKERNELS_CACHE", str(tmp_path))
    builds = []

    def slow_fake_build(compiler, output):  # a stand-in compiler: half a second, then the file
        builds.append(output)
        script = f"import pathlib, time; time.sleep(0.5); pathlib.Path({str(output)!r}).write_text('')"
        return [sys.executable, "-c", script]

    monkeypatch.setattr(cpu_backend, "build_command", slow_fake_build)
    libraries = []
    threads = [threading.Thread(target=lambda: libraries.append(cpu_backend._build())) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert len(libraries) == 3 and len(set(libraries)) == 1 and libraries[0].exists()
    assert len(builds) == 1, f"{len(builds)} builds of one library"
