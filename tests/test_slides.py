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
from frontend.slides.common import pct

FIXTURE = Path(__file__).parent / "fixtures" / "summary_smollm2.json"
DATA_FIXTURE = Path(__file__).parent / "fixtures" / "summary_smollm2_data.json"
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


def test_gradient_reading_sums_the_engines_rewarded_rows(summary):
    position = summary["positions"][0]
    rewarded = [token for token in position["p"]["top"] if token["reward"] != 0]
    assert [token["text"] for token in rewarded] == [" tea"]
    (tea,) = rewarded
    sentence = s02_gradient_covariance.reading(summary, "on")
    share = tea["row_fisher"] / position["output_layer"]["total"]
    assert f"The rewarded row ' tea' holds {pct(share)} of the output-layer Fisher" in sentence
    assert f"its gradient is {pct(tea['row_policy_grad'] / tea['row_bound'])} of the bound" in sentence
    overlap = summary["overlap"]
    assert f"hold {pct(overlap['fisher_vs_policy_grad'][1])} of the top 1% by |gradient|" in sentence


def test_on_policy_has_no_engine_shift(summary):
    on_policy = json.loads(json.dumps(summary))
    for token in on_policy["positions"][0]["p"]["top"]:
        token["mu"] = token["p"]
        token["row_fisher"] = token["row_fisher_p"]
        token["row_shift_sq"] = 0.0
    assert "no shift" in s10_not_a_defect.reading(on_policy, "on")
    # the engine's own on-policy summary: model sampler at temperature 1, engine model
    engine_on_policy = json.loads(RESPONSE_FIXTURE.read_text())
    assert engine_on_policy["sampler"]["on_policy"] is True
    assert "no shift" in s10_not_a_defect.reading(engine_on_policy, "on")


def test_mismatch_reading_ranks_rows_by_the_engines_shift_over_fisher(summary):
    top = summary["positions"][0]["p"]["top"]
    ratios = [token["row_shift_sq"] / token["row_fisher_p"] for token in top]
    worst = top[ratios.index(max(ratios))]
    rarest = min(top, key=lambda token: token["p"])
    sentence = s10_not_a_defect.reading(summary, "on")
    assert sentence.startswith("Sampler (engine model, temperature 0.7): ")
    assert f"on the row of '{worst['text']}' (shift²/Fisher = {max(ratios):.2g})" in sentence
    rare_ratio = rarest["row_shift_sq"] / rarest["row_fisher_p"]
    assert f"'{rarest['text']}' (p = {rarest['p']:.2g}) has {rare_ratio:.2g}" in sentence


def test_output_layer_reading_quotes_the_bound(summary):
    output = summary["positions"][0]["output_layer"]
    outside = next(bound for bound in output["concentration_bound"] if bound["top_tokens"] == 20)
    sentence = s06_output_layer.reading(summary, "on")
    others = summary["model"]["vocab_size"] - 20
    assert f"The other {others:,} rows share {pct(outside['share_outside'])}, under the bound " in sentence
    assert sentence.endswith(f"{pct(outside['bound'])}.")


def test_output_layer_reading_with_a_null_bound_under_a_logit_map(summary):
    """Softcapped logits: the engine states no bound, and the reading says why instead of quoting one."""
    softcapped = json.loads(json.dumps(summary))
    output = softcapped["positions"][0]["output_layer"]
    output["logit_map"] = True
    for bound in output["concentration_bound"]:
        bound["bound"] = None
    sentence = s06_output_layer.reading(softcapped, "on")
    assert "the bound is not stated for a non-linear logit map" in sentence
    assert "under the bound" not in sentence
    outside = next(bound for bound in output["concentration_bound"] if bound["top_tokens"] == 20)
    assert f"rows share {pct(outside['share_outside'])}; " in sentence


def test_output_layer_reading_with_a_null_bound_under_a_one_hot_mu():
    """The data sampler: μ one-hot, 1 − Σμ² = 0, so the engine states no bound and no row learns."""
    data = json.loads(DATA_FIXTURE.read_text())
    output = data["positions"][0]["output_layer"]
    assert output["logit_map"] is False and output["total"] == 0.0
    assert all(bound["bound"] is None for bound in output["concentration_bound"])
    sentence = s06_output_layer.reading(data, "on")
    assert "no output row learns" in sentence
    assert "the bound is not stated for a one-hot μ" in sentence


@pytest.mark.parametrize("centering", ["on", "off", "raw"])
def test_every_slide_reads_the_data_sampler(centering):
    """A one-hot μ: the centered Fisher is 0 everywhere, and no reading divides by it."""
    data = json.loads(DATA_FIXTURE.read_text())
    assert data["totals"]["fisher"] == 0.0
    for module in SLIDES:
        assert isinstance(module.figure(data, centering), go.Figure)
        assert len(module.reading(data, centering)) > 40, module.TITLE


def test_response_slides_without_continuation_ask_for_one(summary):
    prefix_only = {**summary, "response": None}
    for module in SLIDES[3:4] + SLIDES[7:9]:
        assert "continuation" in module.reading(prefix_only, "on")
