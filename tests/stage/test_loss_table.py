"""One table of losses: the stage's (stage/policy_terms.py), the oracle's (reference/policy_terms.py) and the
docs' (docs/losses.md) list the same loss types, and the config's option tuples are read off the stage's. Each
loss's own options and refusals are declared by its row: the config checks them from there, the docs name them,
and the tests' configuration generator (tests/cases.py) draws them from there."""

import dataclasses
import random
import re
from pathlib import Path

import pytest

from rlkernels import PolicyLossConfig, RolloutCorrection, config
from rlkernels.reference.policy_terms import REFERENCE_TERMS
from rlkernels.stage.policy_terms import IS_LEVELS, LOSS_TERMS, MODES, TOKEN_MASKS

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


def _docs_rows(name):
    """The lines of docs/losses.md whose first cell names loss type `name`."""
    return [line for line in DOCS.read_text().splitlines()
            if line.startswith("| `") and name in re.findall(r"`(\w+)`", line.split("|")[1])]


def test_every_declared_option_is_a_config_field_named_in_its_loss_row():
    fields = {f.name: f for f in dataclasses.fields(PolicyLossConfig)}
    for name, entry in LOSS_TERMS.items():
        for option in entry.options:
            assert option.name in fields, f"{name}: {option.name} is not a PolicyLossConfig field"
            assert option.draws, f"{name}: {option.name} declares no values to draw"
            assert any(f"`{option.name}`" in row for row in _docs_rows(name)), \
                f"docs/losses.md: the row of {name} does not name its option {option.name}"
        assert set(entry.is_levels) <= set(IS_LEVELS) and set(entry.modes) <= set(MODES), name
        if entry.is_levels != IS_LEVELS:
            assert entry.is_level_refusal, f"{name} refuses IS levels without saying why"


@pytest.mark.parametrize("name", [n for n, e in LOSS_TERMS.items() if e.options])
def test_the_config_checks_each_option_by_its_declared_rule(name):
    """Every drawn value is accepted, and a value outside the rule is refused naming the field."""
    for option in LOSS_TERMS[name].options:
        for value in option.draws:
            if value is None and option.required:
                continue
            kw = {"loss_type": name, option.name: value}
            kw.update({o.name: o.draws[0] for o in LOSS_TERMS[name].options if o.required and o.name != option.name})
            if option.required and option.name not in kw:
                kw[option.name] = option.draws[0]
            PolicyLossConfig(**kw)
        bad = "a" if option.rule == "number" else -1.0
        with pytest.raises((TypeError, ValueError), match=f"^{option.name}: expected"):
            PolicyLossConfig(**{option.name: bad})
        if option.required:
            with pytest.raises(ValueError, match=f"^{option.name}: expected a number > 0 with loss_type={name!r}"):
                PolicyLossConfig(loss_type=name)


def test_the_config_refuses_what_a_row_refuses():
    for name, entry in LOSS_TERMS.items():
        required = {o.name: o.draws[0] for o in entry.options if o.required}
        for level in set(IS_LEVELS) - set(entry.is_levels):
            with pytest.raises(ValueError, match=f"^rollout_correction: loss_type={name!r}"):
                PolicyLossConfig(loss_type=name, rollout_correction=RolloutCorrection(is_level=level), **required)
        for mask in TOKEN_MASKS:
            kw = dict(loss_type=name, **{mask: 0.5}, **required)
            if entry.no_token_masks:
                with pytest.raises(ValueError, match=f"^loss_type: {name!r} {entry.no_token_masks}"):
                    PolicyLossConfig(**kw)
            else:
                PolicyLossConfig(**kw)


def test_the_generator_draws_every_drawable_loss_and_its_options():
    """tests/cases.py's seeded draw reaches every loss type it may draw, with the options of the row."""
    from ..cases import drawable_loss_types, seeded_config

    rng, seen = random.Random(0), {}
    for _ in range(400):
        mode = rng.choice(MODES)
        cfg = seeded_config(rng, mode)
        assert mode in LOSS_TERMS[cfg.loss_type].modes
        seen.setdefault(cfg.loss_type, set()).update(
            o.name for o in LOSS_TERMS[cfg.loss_type].options if getattr(cfg, o.name) != o.draws[0])
    assert set(seen) == {n for m in MODES for n in drawable_loss_types(m)}
    for name, moved in seen.items():  # each option was drawn away from its first value at least once
        assert moved == {o.name for o in LOSS_TERMS[name].options if len(set(o.draws)) > 1}, name
