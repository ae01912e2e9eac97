"""The per-sequence stage called on loose [N] tensors (tests and benchmarks of the stage alone)."""

from .. import stage
from ..inputs import PreparedBatch
from ..outputs import TokenStats
from ..stage.split import LOCAL


def stage_batch(mask, segments, advantages, old=None, rollout=None, ref=None, split=LOCAL, is_weights=None):
    """The PreparedBatch the stage reads, from [N] tensors and the sequences."""
    return PreparedBatch(token_shape=tuple(mask.shape), mask=mask, segments=segments, split=split,
                         advantages=advantages, old_logprobs=old, rollout_logprobs=rollout, ref_logprobs=ref,
                         is_weights=is_weights)


def run_stage(lp, entropy, advantages, mask, old, rollout, ref, segments, config, split=LOCAL, is_weights=None,
              fn=None):
    """stage.run (or `fn`, e.g. a compiled stage with the same signature) on loose tensors."""
    batch = stage_batch(mask, segments, advantages, old, rollout, ref, split, is_weights)
    return (fn or stage.run)(TokenStats(lp, entropy, None), batch, config)
