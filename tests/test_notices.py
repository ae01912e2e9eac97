"""A step that rejects every response token: `rollout_corr/rollout_rs_all_rejected` is 1 exactly then, and a warning
says so once per process, read without a host synchronisation of its own (rlkernels/notices.py). The warning is
process state: its cases run in fresh interpreters."""

import subprocess
import sys
import textwrap

import pytest
import torch

import rlkernels
from rlkernels import RolloutCorrection

from .cases import make_batch

FLAG = "rollout_corr/rollout_rs_all_rejected"


def _correction(mask, bounds):
    g = torch.Generator().manual_seed(0)
    train = -torch.rand(4, 16, generator=g)
    rollout = train + 0.05 * torch.randn(4, 16, generator=g)
    return rlkernels.rollout_correction(train, rollout, mask, config=RolloutCorrection.geo_rs(bounds=bounds))


@pytest.mark.filterwarnings("ignore:rlkernels. the rollout correction rejected")
@pytest.mark.parametrize("bounds, mask, flag", [
    ((0.999, 1.001), torch.ones(4, 16), 1.0),   # verl's band against a 0.05-nat mismatch: nothing kept
    ((0.5, 2.0), torch.ones(4, 16), 0.0),       # a band that fits: everything kept
    ((0.999, 1.001), torch.zeros(4, 16), 0.0),  # nothing to reject is not "rejected everything"
])
def test_the_flag_is_set_exactly_when_rejection_keeps_no_token(bounds, mask, flag):
    out = _correction(mask, bounds)
    assert float(out.metrics[FLAG]) == flag
    assert flag == float(bool(mask.any()) and not bool(out.mask.any()))


def test_no_rejection_option_no_flag():
    batch = make_batch("padded", [5, 5], 11, dtype=torch.float32)
    out = rlkernels.decoupled_ppo_loss(batch.logits, batch.labels, batch.advantages, batch.response_mask,
                                       old_logprobs=batch.old_logprobs, rollout_logprobs=batch.rollout_logprobs,
                                       rollout_correction=RolloutCorrection.token_tis())
    assert FLAG not in out.metrics


_STEP = """
import warnings
import torch, rlkernels
from rlkernels import PolicyLossConfig, RolloutCorrection
torch.manual_seed(0)
B, T, V = 4, 16, 1000
logits = torch.randn(B, T, V, requires_grad=True)
labels = torch.randint(0, V, (B, T))
lp = torch.log_softmax(logits.detach(), -1).gather(-1, labels[..., None]).squeeze(-1)

def step(bounds=(0.999, 1.001), **kw):
    return rlkernels.decoupled_ppo_loss(logits, labels, torch.randn(B, T), torch.ones(B, T),
        old_logprobs=lp + 0.01 * torch.randn(B, T), rollout_logprobs=lp + 0.05 * torch.randn(B, T),
        config=PolicyLossConfig(rollout_correction=RolloutCorrection.geo_rs_token_tis(bounds=bounds)), **kw)
"""


def _run(body: str) -> subprocess.CompletedProcess:
    code = _STEP + textwrap.dedent(body)
    return subprocess.run([sys.executable, "-W", "always::UserWarning", "-c", code], capture_output=True, text=True,
                          timeout=300)


def test_it_warns_once_per_process_at_the_users_line():
    """The issue's batch with verl's band: the first rejecting step warns, pointing at the caller's line; later ones
    (and reading the metrics) stay quiet."""
    run = _run("""
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out = step()
            step(); step()
            rlkernels.metrics_to_floats(out.metrics)
        assert float(out.loss) == 0.0 and float(out.metrics["rollout_corr/rollout_rs_all_rejected"]) == 1.0
        texts = [str(w.message) for w in caught if "rejected every response token" in str(w.message)]
        assert len(texts) == 1, texts
        assert caught[0].filename == "<string>", caught[0].filename  # the user's call, not rlkernels' internals
        print("ok")
    """)
    assert run.returncode == 0 and run.stdout.strip() == "ok", run.stderr[-2000:]


def test_a_step_that_keeps_tokens_never_warns():
    run = _run("""
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out = step(bounds=(0.5, 2.0))
            rlkernels.metrics_to_floats(out.metrics)
        assert not [w for w in caught if "rejected every" in str(w.message)]
        print("ok")
    """)
    assert run.returncode == 0 and run.stdout.strip() == "ok", run.stderr[-2000:]


def test_without_validation_it_warns_when_the_metrics_are_read():
    """validate=False reads nothing on the hot path (tests/test_api.py forbids every host read there): the warning
    comes with the user's own synchronisation, metrics_to_floats."""
    run = _run("""
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out = step(validate=False)
            quiet = not [w for w in caught if "rejected every" in str(w.message)]
            rlkernels.metrics_to_floats(out.metrics)
        assert quiet and len([w for w in caught if "rejected every" in str(w.message)]) == 1
        print("ok")
    """)
    assert run.returncode == 0 and run.stdout.strip() == "ok", run.stderr[-2000:]


@pytest.mark.gpu
def test_on_cuda_the_flag_reaches_the_host_without_a_sync():
    """CUDA: the call enqueues a non-blocking copy; a later call reads it once its event has completed."""
    run = _run("""
        logits = logits.detach().cuda().requires_grad_(True); labels = labels.cuda(); lp = lp.cuda()
        _randn = torch.randn
        torch.randn = lambda *s, **k: _randn(*s, **k).cuda()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            step()
            quiet = not [w for w in caught if "rejected every" in str(w.message)]
            torch.cuda.synchronize()
            step(bounds=(0.5, 2.0))  # reads the first step's completed copy
        assert quiet and len([w for w in caught if "rejected every" in str(w.message)]) == 1
        print("ok")
    """)
    assert run.returncode == 0 and run.stdout.strip() == "ok", run.stderr[-2000:]
