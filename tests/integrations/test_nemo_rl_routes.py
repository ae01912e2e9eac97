"""NeMo-RL's log-prob routes (rlkernels/integrations/nemo_rl.py): AutoModel's prev / reference log-probs
(`LogprobsPostProcessor._compute_local_logprobs`) and the update forward of an input_type LOGPROB loss
(`get_next_token_logprobs_from_logits`, through `nemo_rl.algorithms.loss.utils`), against NeMo-RL's own.

NeMo-RL needs Python >= 3.13.14 and does not install here: its code is the TRANSCRIPTION at 7ea279ab
(tests/integrations/transcribed/nemo_rl_logprobs.py), written into a stand-in `nemo_rl` package on disk that each
test imports afresh through the import system, as NeMo-RL's Ray workers import NeMo-RL.
"""

import pickle
import subprocess
import sys

import pytest
import torch

from rlkernels import token_logprobs
from rlkernels.integrations import nemo_rl as rlk_nemo

from ..cases import assert_close, tol
from .trainer_imports import write_stand_in
from .transcribed import nemo_rl_logprobs as nemo

B, T, V = 3, 8, 41


@pytest.fixture
def passes(monkeypatch):
    """The rlkernels passes the routes run (so a route that fell back on NeMo-RL's code is seen)."""
    calls = []

    def counted(*args, **kwargs):
        calls.append(args[0].shape)
        return token_logprobs(*args, **kwargs)

    monkeypatch.setattr(rlk_nemo, "token_logprobs", counted)
    return calls


@pytest.fixture
def nemo_rl_modules(tmp_path, monkeypatch, passes):
    """The stand-in package on sys.path, the routes installed before it is imported; everything undone after."""
    write_stand_in(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    rlk_nemo.install()
    import nemo_rl.algorithms.loss.utils as loss_utils
    import nemo_rl.models.automodel.train as train

    yield train, loss_utils
    rlk_nemo.uninstall()
    for name in [m for m in sys.modules if m == "nemo_rl" or m.startswith("nemo_rl.")]:
        del sys.modules[name]


def _batch(dtype, seed=0, scale=3.0):
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(B, T, V, generator=g) * scale).to(dtype)
    logits[0, 2, 5] = -float("inf")  # a token NeMo-RL's sampler could not have drawn
    return logits, torch.randint(0, V, (B, T), generator=g)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("chunk", [None, 3])
def test_prev_and_reference_logprobs_match_nemo_rls(nemo_rl_modules, passes, dtype, chunk):
    """Both compute float32 log-softmax of the same values (NeMo-RL upcasts bf16 exactly): the float32 row of
    ('value', fp32), scaled by 3, the logits' spread. NeMo-RL's sequence chunks change nothing in the values."""
    train, _ = nemo_rl_modules
    assert train.LogprobsPostProcessor._compute_local_logprobs is rlk_nemo.compute_local_logprobs
    logits, input_ids = _batch(dtype)
    processor = train.LogprobsPostProcessor({"logprob_chunk_size": chunk})
    with torch.no_grad():
        ours = processor._compute_local_logprobs(logits, input_ids)
        theirs = nemo.LogprobsPostProcessor({"logprob_chunk_size": chunk})._compute_local_logprobs(logits, input_ids)
    assert ours.dtype == theirs.dtype == torch.float32 and ours.shape == theirs.shape == (B, T - 1)
    assert_close(ours, theirs, **tol("value", torch.float32, scale=3.0), name="logprobs")
    assert passes == [(B, T, V)]  # one rlkernels pass over the logits as they are
    empty = processor._compute_local_logprobs(logits[:, :1], input_ids[:, :1])
    assert empty.shape == (B, 0) and empty.dtype == torch.float32


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_update_forward_logprobs_and_gradient_match_nemo_rls(nemo_rl_modules, passes, dtype):
    """Through `prepare_loss_input`'s call site: values as above; the gradient of bf16 logits is rounded to bf16 on
    both sides (NeMo-RL's by the float32 cast's backward): the ('dlogits', dtype) row."""
    _, loss_utils = nemo_rl_modules
    assert loss_utils.get_next_token_logprobs_from_logits is rlk_nemo.get_next_token_logprobs_from_logits
    logits, input_ids = _batch(dtype, seed=1)
    weights = torch.randn(B, T - 1, generator=torch.Generator().manual_seed(2))
    results = []
    for fn in (lambda x: loss_utils.logprob_input(x, {"input_ids": input_ids}),
               lambda x: nemo.get_next_token_logprobs_from_logits(input_ids, x)):
        x = logits.clone().requires_grad_(True)
        lp = fn(x)
        (grad,) = torch.autograd.grad((weights * lp.masked_fill(lp.isinf(), 0)).sum(), x)
        results.append((lp.detach(), grad))
    (ours, our_grad), (theirs, their_grad) = results
    assert ours.dtype == theirs.dtype == torch.float32
    assert_close(ours, theirs, **tol("value", torch.float32, scale=3.0), name="logprobs")
    assert our_grad.dtype == their_grad.dtype == dtype
    assert_close(our_grad.float(), their_grad.float(), **tol("dlogits", dtype), name="dlogits")
    assert passes == [(B, T, V)]


def test_routes_refuse_what_nemo_rls_code_cannot_compute(nemo_rl_modules):
    """A token id outside the vocabulary (NeMo-RL's gather raises; never a log-prob of 0) and logits shorter than
    the input ids are refused by name."""
    train, loss_utils = nemo_rl_modules
    logits, input_ids = _batch(torch.float32)
    wild = input_ids.clone()
    wild[1, 4] = V
    with pytest.raises(ValueError, match="labels"):
        train.LogprobsPostProcessor({})._compute_local_logprobs(logits, wild)
    with pytest.raises(ValueError, match="labels"):
        loss_utils.logprob_input(logits, {"input_ids": wild})
    with pytest.raises(ValueError, match="next_token_logits"):
        loss_utils.logprob_input(logits[:, :-1], {"input_ids": input_ids})


def test_top_k_top_p_and_parallel_calls_run_nemo_rls_own(nemo_rl_modules, passes):
    """What the routes leave to NeMo-RL reaches NeMo-RL's code (the transcription raises where it stops)."""
    train, loss_utils = nemo_rl_modules
    logits, input_ids = _batch(torch.float32)
    for params in (nemo.TrainingSamplingParams(top_k=5), nemo.TrainingSamplingParams(top_p=0.9)):
        with pytest.raises(NotImplementedError, match="top-k / top-p filtering is not transcribed"):
            train.LogprobsPostProcessor({}, params)._compute_local_logprobs(logits, input_ids)
        with pytest.raises(NotImplementedError, match="top-k / top-p filtering is not transcribed"):
            loss_utils.logprob_input(logits, {"input_ids": input_ids}, sampling_params=params)
    with pytest.raises(NotImplementedError, match="vocabulary-parallel"):
        loss_utils.get_next_token_logprobs_from_logits(input_ids, logits, vocab_parallel_rank=0,
                                                       vocab_parallel_group=object())
    assert passes == []
    disabled = nemo.TrainingSamplingParams(top_k=-1, top_p=1.0, temperature=0.7)  # NeMo-RL's "off" values
    ours = train.LogprobsPostProcessor({}, disabled)._compute_local_logprobs(logits, input_ids)
    assert_close(ours, nemo.LogprobsPostProcessor({})._compute_local_logprobs(logits, input_ids),
                 **tol("value", torch.float32, scale=3.0), name="logprobs")


def test_uninstall_puts_nemo_rls_own_back(nemo_rl_modules):
    train, loss_utils = nemo_rl_modules
    model_utils = sys.modules["nemo_rl.distributed.model_utils"]
    rlk_nemo.uninstall()
    assert train.LogprobsPostProcessor._compute_local_logprobs.__module__ == "nemo_rl.models.automodel.train"
    for module in (model_utils, loss_utils):
        assert module.get_next_token_logprobs_from_logits.__module__ == "nemo_rl.distributed.model_utils"


_WORKER = """
import pickle, sys
sys.path.insert(0, sys.argv[1])
loss = pickle.loads(bytes.fromhex(sys.argv[2]))
import nemo_rl.algorithms.loss.utils as loss_utils
import nemo_rl.models.automodel.train as train
print(train.LogprobsPostProcessor._compute_local_logprobs.__module__,
      loss_utils.get_next_token_logprobs_from_logits.__module__, type(loss).__name__)
"""


@pytest.mark.parametrize("routes", [True, False])
def test_the_unpickled_loss_installs_the_routes_in_a_fresh_process(tmp_path, routes):
    """NeMo-RL pickles the loss object into its Ray workers: unpickling it there (a process that has imported
    nothing) installs the routes before NeMo-RL's modules are imported; `routes=False` leaves NeMo-RL's own."""
    write_stand_in(tmp_path)
    loss = rlk_nemo.ClippedPGLossFn({}, routes=routes)
    if routes:
        rlk_nemo.uninstall()  # this process's install, from the constructor: the test is about the child's
    out = subprocess.run([sys.executable, "-c", _WORKER, str(tmp_path), pickle.dumps(loss).hex()],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    owner = "rlkernels.integrations.nemo_rl" if routes else "nemo_rl"
    lp_owner = owner if routes else "nemo_rl.models.automodel.train"
    assert out.stdout.split() == [lp_owner, owner if routes else "nemo_rl.distributed.model_utils",
                                  "ClippedPGLossFn"]


def test_a_loss_pickled_before_the_route_options_unpickles_with_their_defaults():
    old = rlk_nemo.ClippedPGLossFn({}, input_type="logit", routes=False)
    del old.__dict__["routes"], old.__dict__["inplace_backward"]  # the state an earlier release pickled
    loaded = pickle.loads(pickle.dumps(old))
    assert loaded.routes is True and loaded.inplace_backward is True
    rlk_nemo.uninstall()
