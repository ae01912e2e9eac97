"""One table of losses: the stage's (stage/policy_terms.py), the oracle's (reference/policy_terms.py) and the
docs' (docs/losses.md) list the same loss types, and the config's option tuples are read off the stage's."""

import re
from pathlib import Path

from rlkernels import config
from rlkernels.reference.policy_terms import REFERENCE_TERMS
from rlkernels.stage.policy_terms import LOSS_TERMS

DOCS = Path(__file__).resolve().parents[2] / "docs" / "losses.md"


def test_the_stage_and_the_oracle_define_the_same_loss_types():
    assert set(LOSS_TERMS) == set(REFERENCE_TERMS)
    assert len(LOSS_TERMS) >= 16


def test_the_config_reads_the_table():
    assert config.LOSS_TYPES == tuple(LOSS_TERMS)
    assert set(config.SEQUENCE_RATIO_LOSSES) == {n for n, e in LOSS_TERMS.items() if e.ratio_levels}
    assert set(config.COVARIANCE_LOSSES) == {n for n, e in LOSS_TERMS.items() if e.batch_global}


def test_every_loss_type_has_a_row_in_the_docs():
    first_cells = [line.split("|")[1] for line in DOCS.read_text().splitlines() if line.startswith("| `")]
    documented = {name for cell in first_cells for name in re.findall(r"`(\w+)`", cell)}
    missing = set(LOSS_TERMS) - documented
    assert not missing, f"loss types without a row in docs/losses.md: {sorted(missing)}"
