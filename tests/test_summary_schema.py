"""The summary's typed wire models (backend/summary.py) hold what the engine writes: every fixture,
a partial result, a reward answered from the kept Fisher; and they refuse a summary that drifted."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
from pydantic import ValidationError

from backend.settings import Settings
from backend.summary import AnalysisSummary, checked_summary
from backend.vocabulary import Sampler
from tests.test_engine import _job as engine_job
from tests.test_engine import _token as token_id
from workers.jobs import analyze_job

FIXTURES = sorted((Path(__file__).parent / "fixtures").glob("summary_*.json"))


@pytest.mark.parametrize("path", FIXTURES, ids=[path.stem for path in FIXTURES])
def test_every_fixture_summary_has_the_contracts_shape(path: Path):
    summary = AnalysisSummary.model_validate(json.loads(path.read_text()))
    assert summary.positions and summary.model.n_params > 0


def test_partial_results_and_the_final_one_validate(tiny_random):
    tea = str(token_id(tiny_random, " tea"))
    job = engine_job(tiny_random, sampler=Sampler(temperature=0.7), reward={tea: 1.0})
    partials: list[dict] = []
    settings = Settings(engine_memory_bytes=1 << 16)  # small chunks: several partial results
    analysis = analyze_job(
        tiny_random, job, settings, on_partial=lambda summary, kept: partials.append(summary)
    )
    assert partials, "the small memory budget should have given partial results"
    for partial in partials:
        parsed = AnalysisSummary.model_validate(partial)
        assert parsed.concentration is None and parsed.timing is None and parsed.cost is None
    final = AnalysisSummary.model_validate(analysis.summary)
    assert final.overlap is not None and final.timing is not None and final.timing.fisher_reused is False
    row = final.positions[0].p.top[0]
    assert row.row_policy_grad is not None and row.row_bound is not None


def test_a_summary_that_drifted_is_refused_naming_the_field():
    summary = json.loads(FIXTURES[0].read_text())
    missing = copy.deepcopy(summary)
    del missing["positions"][0]["spectrum"]["trace"]
    with pytest.raises(ValidationError, match="positions.0.spectrum.trace"):
        checked_summary(missing)
    extra = copy.deepcopy(summary)
    extra["model"]["new_field"] = 1
    with pytest.raises(ValidationError, match="model.new_field"):
        checked_summary(extra)
    assert checked_summary(summary) is summary  # a good one passes unchanged
