"""The trainers' own loss code for the parity tests (rlkernels.testing.trainers), or a module-level skip that says
what to install: CI installs all four (README's test command), so none is skipped there; and the stand-in NeMo-RL
package its route tests import (NeMo-RL does not install here)."""

import textwrap
from pathlib import Path

import pytest


def trainer_or_skip(loader: str, name: str):
    """rlkernels.testing.trainers.<loader>() (the trainer `name`'s modules), or skip the calling test module."""
    try:
        from rlkernels.testing import trainers

        return getattr(trainers, loader)()
    except ImportError as exc:  # pragma: no cover - reported by the skip
        pytest.skip(f"{name} is not importable here ({exc})", allow_module_level=True)


def write_stand_in(root: Path) -> None:
    """A `nemo_rl` package whose model_utils and automodel train modules are the transcription, and whose loss
    utils bind `get_next_token_logprobs_from_logits` from model_utils and call it as `prepare_loss_input` does
    (tests/integrations/transcribed/nemo_rl_logprobs.py)."""
    from .transcribed import nemo_rl_logprobs

    transcription = Path(nemo_rl_logprobs.__file__).read_text()
    modules = {"distributed/model_utils.py": transcription, "models/automodel/train.py": transcription,
               "algorithms/loss/utils.py": textwrap.dedent("""
                   from nemo_rl.distributed.model_utils import get_next_token_logprobs_from_logits


                   def logprob_input(logits, data, sampling_params=None):
                       # prepare_loss_input's LOGPROB branch (loss/utils.py lines 84-94 @7ea279ab), local call
                       return get_next_token_logprobs_from_logits(
                           input_ids=data["input_ids"], next_token_logits=logits, seq_index=data.get("seq_index"),
                           vocab_parallel_rank=None, vocab_parallel_group=None, context_parallel_group=None,
                           sampling_params=sampling_params, chunk_size=None)
               """)}
    for relative, text in modules.items():
        path = root / "nemo_rl" / relative
        for package in [root / "nemo_rl", *[p for p in path.parents if root / "nemo_rl" in p.parents]]:
            package.mkdir(parents=True, exist_ok=True)
            (package / "__init__.py").touch()
        path.write_text(text)
