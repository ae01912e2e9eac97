"""The FOREIGN_TARGET row contract (backends/base.py) on every backend: a row whose target lies in
another vocabulary shard gets the row's statistics but a log-prob of 0, and the gradient of the same
row with its target label minus the + c/T on the target column. Checked against the same backend run
with the real label on the same rows, so every backend is held to its own numerics; the distributed
tests check the merged result against the single-process loss.

torch and the CPU kernels run everywhere, Triton through the interpreter on the CPU, CUDA on a GPU
with the extension.
"""

import pytest
import torch

from rlkernels import backends
from rlkernels.backends.base import FOREIGN_TARGET

from ..cases import TRITON_DEVICE, assert_close, make_coefficients, make_logits, tol, triton_here

DEVICE = TRITON_DEVICE


def _backend(name):
    if name == "cuda":
        if not torch.cuda.is_available():
            pytest.skip("needs a CUDA GPU; none on this machine (run benchmarks/gpu_check.sh on one)")
        from rlkernels.backends.cuda_backend import CudaBackend

        if not CudaBackend().is_built():
            pytest.fail("GPU present but the CUDA extension is not built")
    if name in ("triton", "cpu") and not backends.available()[name]:
        pytest.skip(f"the {name} backend is not available here")
    if name == "cpu" and DEVICE != "cpu":
        pytest.skip("the CPU kernels take CPU tensors")
    return name


@pytest.mark.parametrize("name", [
    "torch", "cpu", pytest.param("triton", marks=triton_here), pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("V", [7, 129])
def test_foreign_target_rows_are_target_rows_without_the_target(name, V):
    _backend(name)
    gen = torch.Generator().manual_seed(V)
    N, T = 9, 0.8
    logits = make_logits(gen, (N, V), "normal", torch.float32).to(DEVICE)
    logits[5] = float("-inf")  # a shard with no mass on this row
    labels = torch.randint(0, V, (N,), generator=gen).to(DEVICE)
    labels[5] = 0
    foreign = labels.clone()
    foreign[::2] = FOREIGN_TARGET
    foreign[5] = FOREIGN_TARGET
    backend = backends.select(name, logits, None, vocab_shard=True)
    own = backend.token_stats_fwd(logits, labels, T, True, True)
    got = backend.token_stats_fwd(logits, foreign, T, True, True)
    is_foreign = foreign == FOREIGN_TARGET
    q = tol("reordered", torch.float32)
    for field in ("row_max", "log_norm", "entropy", "sum_pi_squared"):
        want, have = getattr(own, field), getattr(got, field)
        finite = torch.isfinite(want)
        assert torch.equal(torch.isfinite(have), finite), field
        assert_close(have[finite], want[finite], **q, name=field)
    assert torch.all(got.logprobs[is_foreign] == 0), "a foreign row's log-prob is the owner shard's"
    assert torch.equal(got.logprobs[~is_foreign], own.logprobs[~is_foreign])

    c, e = (x.to(DEVICE) for x in make_coefficients(N, seed=V, zero_rows=(7,)))
    dl_own = backend.token_grad_bwd(logits, labels, own.row_max, own.log_norm, own.entropy, c, e, T, False)
    dl_got = backend.token_grad_bwd(logits, foreign, got.row_max, got.log_norm, got.entropy, c, e, T, False)
    want = dl_own.clone()
    rows = torch.nonzero(is_foreign).flatten()
    want[rows, labels[rows]] -= c[rows] / T  # the + c/T of the target column belongs to the owner shard
    assert_close(dl_got, want, **tol("reordered.dlogits", torch.float32, scale=float(want.abs().max())),
                 name="dlogits")
