"""Every slide has a title, claim and formula from the essays, a figure, and a sentence reading it."""

from __future__ import annotations

import json
import re
from pathlib import Path

import plotly.graph_objects as go
import pytest

from frontend.slides import (
    SLIDES,
    s02_gradient_covariance,
    s06_output_layer,
    s07_hidden_directions,
    s10_not_a_defect,
)

FIXTURE = Path(__file__).parent / "fixtures" / "summary_smollm2.json"
ESSAYS = Path(__file__).resolve().parents[2] / "shared" / "seeds"


@pytest.fixture(scope="module")
def summary() -> dict:
    return json.loads(FIXTURE.read_text())


def test_ten_slides_in_order():
    assert len(SLIDES) == 10
    for number, module in enumerate(SLIDES, start=1):
        assert module.TITLE.startswith(f"{number}. ")
        assert module.FORMULA.startswith("$$") and module.FORMULA.endswith("$$")
        assert module.CLAIM.endswith(".")


@pytest.mark.skipif(not ESSAYS.exists(), reason="essays not present")
def test_titles_come_from_the_essays():
    text = " ".join(path.read_text() for path in ESSAYS.glob("00[01]_*.txt")).replace("’", "'")
    for module in SLIDES:
        title = module.TITLE.split(". ", 1)[1].split(":")[0].replace("χ²", "χ²")
        assert title.lower() in text.lower(), title


REAL_FIXTURE = Path(__file__).parent / "fixtures" / "summary_tiny_random.json"


@pytest.mark.parametrize("centering", ["on", "off", "raw"])
def test_every_slide_reads_an_engine_summary(centering):
    """A summary written by workers.engine on tiny-random (prefix + continuation, no reward)."""
    engine_summary = json.loads(REAL_FIXTURE.read_text())
    for module in SLIDES:
        assert isinstance(module.figure(engine_summary, centering), go.Figure)
        assert len(module.reading(engine_summary, centering)) > 40, module.TITLE


RESPONSE_FIXTURE = Path(__file__).parent / "fixtures" / "summary_smollm2_response.json"


@pytest.mark.parametrize("centering", ["on", "off", "raw"])
def test_every_slide_draws_and_reads_its_figure(summary, centering):
    with_response = json.loads(RESPONSE_FIXTURE.read_text())
    for number, module in enumerate(SLIDES, start=1):
        summary_for_slide = with_response if number in (4, 8, 9) else summary
        figure = module.figure(summary_for_slide, centering)
        assert isinstance(figure, go.Figure)
        assert len(figure.data) > 0
        sentence = module.reading(summary_for_slide, centering)
        assert re.search(r"\d", sentence), module.TITLE


def test_output_layer_reading_names_the_two_largest_rows(summary):
    rows = sorted(summary["positions"][0]["output_layer"]["rows"], key=lambda row: -row["share"])
    sentence = s06_output_layer.reading(summary, "on")
    share = rows[0]["share"] + rows[1]["share"]
    assert f"'{rows[0]['text']}' and '{rows[1]['text']}'" in sentence
    assert f"{100 * share:.0f}%" in sentence


def test_spectrum_reading_quotes_the_ranks(summary):
    spectrum = summary["positions"][0]["spectrum"]
    sentence = s07_hidden_directions.reading(summary, "on")
    assert f"numerical rank {spectrum['numerical_rank']}" in sentence
    assert f"{spectrum['effective_rank']:.1f}" in sentence


def test_without_reward_the_gradient_slide_says_so(summary):
    no_reward = json.loads(json.dumps(summary))
    for position in no_reward["positions"]:
        position["reward"] = None
        for token in position["p"]["top"]:
            token["reward"] = 0.0
    assert "gradient is zero" in s02_gradient_covariance.reading(no_reward, "on")


def test_on_policy_has_no_engine_shift(summary):
    on_policy = json.loads(json.dumps(summary))
    for token in on_policy["positions"][0]["p"]["top"]:
        token["mu"] = token["p"]
    assert "no shift" in s10_not_a_defect.reading(on_policy, "on")


def test_response_slides_without_continuation_ask_for_one(summary):
    prefix_only = {**summary, "response": None}
    for module in SLIDES[3:4] + SLIDES[7:9]:
        assert "continuation" in module.reading(prefix_only, "on")
