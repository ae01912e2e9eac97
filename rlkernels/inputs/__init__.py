"""Every argument check and layout step of the public functions (SPEC §11): each public function hands its
arguments to one `prepare_*` here and gets back what the computation reads, or an error naming the argument
before any kernel runs.

    checks.py       the shared tensor checks and the value checks (one host sync per call)
    batch.py        the losses' and statistics' per-token inputs -> PreparedBatch (and rollout_correction's)
    sampler.py      the sampler's temperature, kept ids and top-k / logits (SamplerHead)
    divergences.py  a second distribution beside the logits: token_divergences, topk_distillation_loss
    baseline.py     the optimal token baseline and the variance proxies
    parity.py       logprob_parity: two log-prob tensors compared bit for bit
"""

from .baseline import check_baseline_options, prepare_baseline_rows, prepare_variance_rows
from .batch import (
    Arguments,
    CorrectionInputs,
    PreparedBatch,
    prepare_correction,
    prepare_hidden_loss,
    prepare_linear_stats,
    prepare_logits_loss,
    prepare_loss,
    prepare_policy,
    prepare_stats,
)
from .checks import check_metrics
from .divergences import (
    DistillationInputs,
    DistillationOptions,
    DivergenceInputs,
    check_wanted,
    prepare_distillation,
    prepare_divergences,
)
from .parity import DEFAULT_BUCKET_EDGES, ParityRows, prepare_parity
from .sampler import SamplerHead

__all__ = [
    "DEFAULT_BUCKET_EDGES", "Arguments", "CorrectionInputs", "DistillationInputs", "DistillationOptions",
    "DivergenceInputs", "ParityRows", "PreparedBatch", "SamplerHead", "prepare_parity", "check_baseline_options",
    "check_metrics", "check_wanted",
    "prepare_baseline_rows", "prepare_correction", "prepare_distillation", "prepare_divergences",
    "prepare_hidden_loss", "prepare_linear_stats", "prepare_logits_loss", "prepare_loss", "prepare_policy",
    "prepare_stats", "prepare_variance_rows",
]
