"""Every slide has a title, claim and formula from the essays, a figure, and a sentence reading it."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import plotly.graph_objects as go
import pytest

from backend.schemas import ComparePublic, SetComparison
from backend.summary import AnalysisOverview, AnalysisSummary, PositionSummary
from frontend.numbers import percent as pct
from frontend.numbers import value_and_bound
from frontend.plots import token_label
from frontend.slides import (
    SLIDES,
    s02_gradient_covariance,
    s06_output_layer,
    s07_hidden_directions,
    s10_not_a_defect,
)

FIXTURE = Path(__file__).parent / "fixtures" / "summary_smollm2.json"
DATA_FIXTURE = Path(__file__).parent / "fixtures" / "summary_smollm2_data.json"


@pytest.fixture(scope="module")
def summary() -> dict:
    return json.loads(FIXTURE.read_text())


def typed(summary: dict) -> AnalysisSummary:
    """The summary as the dashboard holds it: checked against the wire model where it enters."""
    return AnalysisSummary.model_validate(summary)


def test_ten_slides_in_order():
    assert len(SLIDES) == 10
    for number, module in enumerate(SLIDES, start=1):
        assert module.TITLE.startswith(f"{number}. ")
        assert module.FORMULA.startswith("$$") and module.FORMULA.endswith("$$")
        assert module.CLAIM.endswith(".")


def test_titles_are_the_essay_headings_the_design_records():
    """docs/design.md §5 lists each slide with the essay heading it carries (as the essays spell it):
    every title is its slide's heading, numbered as the deck is."""
    table = (
        (Path(__file__).resolve().parents[1] / "docs" / "design.md").read_text().split("## 5. The slides")[1]
    )
    rows = re.findall(r"^\| (\d+) \| Part [12], (?:\d+\. )?(.+?) \|", table, flags=re.MULTILINE)
    assert [int(number) for number, _ in rows] == list(range(1, 11))
    for module, (number, heading) in zip(SLIDES, rows, strict=True):
        assert f"{number}. {heading}" == module.TITLE, (module.TITLE, heading)


REAL_FIXTURE = Path(__file__).parent / "fixtures" / "summary_tiny_random.json"


@pytest.mark.parametrize("centering", ["on", "off", "raw"])
def test_every_slide_reads_an_engine_summary(centering):
    """A summary written by workers.engine on tiny-random (prefix + continuation, no reward)."""
    engine_summary = typed(json.loads(REAL_FIXTURE.read_text()))
    for module in SLIDES:
        assert isinstance(module.figure(engine_summary, centering), go.Figure)
        assert len(module.reading(engine_summary, centering)) > 40, module.TITLE


RESPONSE_FIXTURE = Path(__file__).parent / "fixtures" / "summary_smollm2_response.json"


@pytest.mark.parametrize("centering", ["on", "off", "raw"])
def test_every_slide_draws_and_reads_its_figure(summary, centering):
    with_response = typed(json.loads(RESPONSE_FIXTURE.read_text()))
    for number, module in enumerate(SLIDES, start=1):
        summary_for_slide = with_response if number in (4, 8, 9) else typed(summary)
        figure = module.figure(summary_for_slide, centering)
        assert isinstance(figure, go.Figure)
        assert len(figure.data) > 0
        sentence = module.reading(summary_for_slide, centering)
        assert re.search(r"\d", sentence), module.TITLE


def test_output_layer_reading_names_the_two_largest_rows(summary):
    rows = sorted(summary["positions"][0]["output_layer"]["rows"], key=lambda row: -row["share"])
    sentence = s06_output_layer.reading(typed(summary), "on")
    share = rows[0]["share"] + rows[1]["share"]
    assert f"'{rows[0]['text']}' and '{rows[1]['text']}'" in sentence
    assert f"{100 * share:.0f}%" in sentence


def test_spectrum_reading_quotes_the_ranks(summary):
    spectrum = summary["positions"][0]["spectrum"]
    sentence = s07_hidden_directions.reading(typed(summary), "on")
    assert f"numerical rank {spectrum['numerical_rank']}" in sentence
    assert f"{spectrum['effective_rank']:.1f}" in sentence


def test_without_reward_the_gradient_slide_says_so(summary):
    no_reward = json.loads(json.dumps(summary))
    for position in no_reward["positions"]:
        position["reward"] = None
        for token in position["p"]["top"]:
            token["reward"] = 0.0
    assert "gradient is zero" in s02_gradient_covariance.reading(typed(no_reward), "on")


def test_gradient_reading_sums_the_engines_rewarded_rows(summary):
    position = summary["positions"][0]
    rewarded = [token for token in position["p"]["top"] if token["reward"] != 0]
    assert [token["text"] for token in rewarded] == [" tea"]
    (tea,) = rewarded
    sentence = s02_gradient_covariance.reading(typed(summary), "on")
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
    assert "no shift" in s10_not_a_defect.reading(typed(on_policy), "on")
    # the engine's own on-policy summary: model sampler at temperature 1, engine model
    engine_on_policy = json.loads(RESPONSE_FIXTURE.read_text())
    assert engine_on_policy["sampler"]["on_policy"] is True
    assert "no shift" in s10_not_a_defect.reading(typed(engine_on_policy), "on")


def test_a_rare_drawn_token_gets_a_full_size_update_at_near_zero_fisher(summary):
    """Part 2 section 5: a token the model rarely samples has a near-zero Fisher, yet when drawn its row
    receives (1 - p) h; the update over sqrt(Fisher) is sqrt((1 - p) / p), largest for the rarest."""
    position = summary["positions"][0]
    h_norm = math.sqrt(position["output_layer"]["h_norm_sq"])
    assert position["output_layer"]["logit_map"] is False  # g' = 1: the update is (1 - p) ||h|| exactly
    rows = s10_not_a_defect.head_rows(typed(summary))
    for row in rows:
        assert row.update == pytest.approx((1 - row.p) * h_norm, rel=1e-9)
        assert row.sqrt_fisher == pytest.approx(math.sqrt(row.p * (1 - row.p)) * h_norm, rel=1e-6)
        assert row.ratio == pytest.approx(math.sqrt((1 - row.p) / row.p), rel=1e-6)
    rarest, likeliest = rows[0], rows[-1]
    assert rarest.ratio > 5 * likeliest.ratio  # the contrast the essay draws
    sentence = s10_not_a_defect.reading(typed(summary), "on")
    assert f"{token_label(rarest.text)} (p = {rarest.p:.2g})" in sentence
    assert f"√((1−p)/p) = {math.sqrt((1 - rarest.p) / rarest.p):.3g} times" in sentence
    assert f"by {likeliest.ratio:.3g} times its own" in sentence
    # the shift: temperature 0.7 moves every shown row; centering removes it (mean shift (mu - p) h)
    top = position["p"]["top"]
    over = sum(1 for token in top if token["mu"] > token["p"])
    assert f"shifts {len(top)} of these {len(top)} drawn rows by (μ−p)h, {over} of them" in sentence
    assert "Centering removes all of it" in sentence or "centering removes all of it" in sentence


def test_the_mismatch_slide_draws_log_axes_ordered_by_p(summary):
    figure = s10_not_a_defect.figure(typed(summary), "on")
    assert figure.layout.xaxis.type == "log" and figure.layout.yaxis.type == "log"
    update, fisher, shift = figure.data
    assert list(update.x) == sorted(update.x) and list(fisher.x) == list(update.x)
    # below p = 1/2 the per-draw update exceeds sqrt(Fisher), above it falls short: (1-p) vs sqrt(p(1-p))
    for p, u, f in zip(update.x, update.y, fisher.y, strict=True):
        assert (u > f) == (p < 0.5)
    assert len(shift.x) == len(summary["positions"][0]["p"]["top"])  # every row is shifted at T = 0.7


def test_output_layer_reading_quotes_the_bound(summary):
    output = summary["positions"][0]["output_layer"]
    outside = next(bound for bound in output["concentration_bound"] if bound["top_tokens"] == 20)
    sentence = s06_output_layer.reading(typed(summary), "on")
    others = summary["model"]["vocab_size"] - 20
    # the share rounded down, its bound up: both 7.9% to the nearest, printed as two numbers in order
    assert pct(outside["share_outside"]) == pct(outside["bound"]) == "7.9%"
    assert f"The other {others:,} rows share 7.9%, under the bound 8%." in sentence


def test_output_layer_reading_with_a_null_bound_under_a_logit_map(summary):
    """Softcapped logits: the engine states no bound, and the reading says why instead of quoting one."""
    softcapped = json.loads(json.dumps(summary))
    output = softcapped["positions"][0]["output_layer"]
    output["logit_map"] = True
    for bound in output["concentration_bound"]:
        bound["bound"] = None
    sentence = s06_output_layer.reading(typed(softcapped), "on")
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
    sentence = s06_output_layer.reading(typed(data), "on")
    assert "no output row learns" in sentence
    assert "the bound is not stated for a one-hot μ" in sentence


@pytest.mark.parametrize("centering", ["on", "off", "raw"])
def test_every_slide_reads_the_data_sampler(centering):
    """A one-hot μ: the centered Fisher is 0 everywhere, and no reading divides by it."""
    data = json.loads(DATA_FIXTURE.read_text())
    assert data["totals"]["fisher"] == 0.0
    for module in SLIDES:
        assert isinstance(module.figure(typed(data), centering), go.Figure)
        assert len(module.reading(typed(data), centering)) > 40, module.TITLE


def test_response_slides_without_continuation_ask_for_one(summary):
    prefix_only = typed({**summary, "response": None})
    for module in SLIDES[3:4] + SLIDES[7:9]:
        assert "continuation" in module.reading(prefix_only, "on")


class RecordingApi:
    """The API's answers for one analysis, counting what the dashboard asks (cache tests count calls)."""

    def __init__(self, summary: dict, status: dict | None = None) -> None:
        self.summary = summary
        self.status = status
        self.calls: list[tuple] = []

    def analysis(self, analysis_id: str) -> dict:
        self.calls.append(("analysis", analysis_id))
        assert self.status is not None
        return self.status

    def overview(self, analysis_id: str) -> AnalysisOverview:
        self.calls.append(("overview", analysis_id))
        index = [
            {"index": i, "context_length": p["context_length"], "target": p.get("target")}
            for i, p in enumerate(self.summary["positions"])
        ]
        overview = {**self.summary, "positions": self.summary["positions"][:1], "position_index": index}
        return AnalysisOverview.model_validate({**overview, "vocabulary": {}})

    def position(self, analysis_id: str, index: int) -> PositionSummary:
        self.calls.append(("position", analysis_id, index))
        return PositionSummary.model_validate(self.summary["positions"][index])


ID_A, ID_B = "a" * 64, "b" * 64
NO_SETS = SetComparison(q=[], overlap=[], jaccard=[], chance_overlap=[], chance_jaccard=[])


def test_a_partial_result_draws_every_slide_and_says_what_comes_at_the_end(summary):
    """While an exact analysis runs the dashboard draws the partial summary (no concentration, top
    coordinates or overlap yet) and its stage says how much of the C_mu trace it covers; the poll keeps
    the partial it read, so drawing it asks the API nothing more."""
    from frontend.callbacks.explorer import top_coordinates_table
    from frontend.callbacks.run import polled
    from frontend.callbacks.slides import slide_view
    from frontend.handles import handle_from, is_settled, progress_style, view_of
    from frontend.plots import PARTIAL_NOTE
    from frontend.summaries import Summaries

    partial = typed({**summary, "concentration": None, "top_coordinates": None, "overlap": None})
    for module in SLIDES:
        assert isinstance(module.figure(partial, "on"), go.Figure)
        assert isinstance(module.reading(partial, "on"), str)
    assert SLIDES[0].reading(partial, "on") == PARTIAL_NOTE
    assert "partial" in str(top_coordinates_table(partial, "fisher"))
    body = {
        "id": ID_A,
        "status": "running",
        "progress": 0.4,
        "stage": "directions",
        "partial": {"kept_share": 0.63, "result": partial},
    }
    api = RecordingApi(summary, body)
    summaries = Summaries(api)
    handle = polled(api, summaries, handle_from({**body, "partial": None}, ID_A))
    assert handle["stage"] == "partial: 63% of the C_mu trace" and not is_settled(handle)
    assert progress_style(handle["progress"]) == {"width": "40%"}
    assert view_of(handle) == {"id": ID_A, "kept_share": 0.63, "query": None}
    assert summaries.summary(view_of(handle)) is partial
    assert slide_view(summaries.summary(view_of(handle)), 1, "on")[5] == PARTIAL_NOTE
    assert api.calls == [("analysis", ID_A)]


def test_the_browser_holds_a_handle_of_fixed_size_whatever_the_response():
    """What a callback posts back about an analysis is its handle: the same fields and about the same
    size for a 64-token response as for a prefix (the whole summary used to go back, and got a 413)."""
    from frontend.handles import handle_from, view_of

    response = json.loads(RESPONSE_FIXTURE.read_text())
    small = handle_from({"id": ID_A, "status": "done", "result": {"positions": [1]}}, ID_A, cached=True)
    large = handle_from(
        {"id": ID_B, "status": "done", "result": {**response, "positions": response["positions"] * 32}},
        ID_A,
        sample={"seed": 3, "max_tokens": 64},
    )
    assert set(small) == set(large)
    assert len(json.dumps(large)) < 400 and "result" not in large
    assert (small["stage"], large["stage"]) == ("cached", "done")
    # a sampled request follows to the concrete response's analysis; the handle keeps what was asked
    assert (large["request"], large["id"]) == (ID_A, ID_B)
    assert view_of(large) == {"id": ID_B, "kept_share": None, "query": None}


def test_a_failed_or_queued_analysis_has_nothing_to_draw():
    from frontend.handles import handle_from, is_settled, view_of

    failed = handle_from({"id": ID_A, "status": "failed", "error": "out of memory"}, ID_A)
    assert failed["error"] == "out of memory" and is_settled(failed) and view_of(failed) is None
    queued = handle_from({"id": ID_A, "status": "queued", "stage": None, "progress": 0.0}, ID_A)
    assert queued["stage"] == "queued" and not is_settled(queued) and view_of(queued) is None


def test_a_finished_analysis_is_read_once_per_view(summary):
    """Slide steps and toggles redraw from the kept overview; each position is asked for once; the
    first position comes with the overview; the oldest answers make room for new ones."""
    from frontend.summaries import Summaries, position_entries

    response = json.loads(RESPONSE_FIXTURE.read_text())
    api = RecordingApi(response)
    summaries = Summaries(api, size=3)
    view = {"id": ID_A, "kept_share": None}
    for number in range(1, 11):
        SLIDES[number - 1].figure(summaries.summary(view), "on")
    positions = typed(response).positions
    assert summaries.position(view, 0) == positions[0]
    assert summaries.position(view, 2) == positions[2]
    assert summaries.position(view, 2) == positions[2]
    assert api.calls == [("overview", ID_A), ("position", ID_A, 2)]
    entries = position_entries(summaries.summary(view))
    assert [e.index for e in entries] == list(range(len(response["positions"])))
    for other in ("c", "d", "e"):
        summaries.overview(other * 64)
    summaries.summary(view)
    assert api.calls[-1] == ("overview", ID_A)  # evicted by three newer answers, asked again


def test_callbacks_asking_at_once_fetch_an_overview_once(summary):
    """A new analysis sets off every figure's callback at the same time: one asks, the rest wait."""
    import threading
    import time

    from frontend.summaries import Summaries

    class SlowApi(RecordingApi):
        def overview(self, analysis_id: str) -> AnalysisOverview:
            release.wait(timeout=10)
            return super().overview(analysis_id)

    release = threading.Event()
    api = SlowApi(summary)
    summaries = Summaries(api)
    view = {"id": ID_A, "kept_share": None}
    answers: list[AnalysisSummary] = []
    threads = [threading.Thread(target=lambda: answers.append(summaries.summary(view))) for _ in range(6)]
    for thread in threads:
        thread.start()
    time.sleep(0.3)  # every thread reaches the cache while the first answer is still out
    release.set()
    for thread in threads:
        thread.join(timeout=10)
    assert len(answers) == 6 and all(answer is answers[0] for answer in answers)
    assert api.calls == [("overview", ID_A)]


def test_a_link_to_an_analysis_this_server_lacks_says_so():
    """A compare link opens B by id; another server (or a cleared cache) answers 404: a sentence, no poll."""
    from frontend.api_client import ApiError
    from frontend.callbacks.run import polled
    from frontend.handles import is_settled, view_of
    from frontend.summaries import Summaries

    class MissingApi(RecordingApi):
        def analysis(self, analysis_id: str) -> dict:
            raise ApiError(f"no analysis with id {analysis_id!r}; POST /api/v1/analyses first", 404)

    api = MissingApi({})
    opened = {"request": ID_B, "id": ID_B, "status": "queued", "progress": 0.0, "stage": "opening"}
    handle = polled(api, Summaries(api), opened)
    assert is_settled(handle) and view_of(handle) is None
    assert handle["error"].startswith("analysis bbbbbbbbbbbb… is not on this server; run it again")


def test_a_compare_asked_before_its_top_q_sets_are_written_is_asked_again(summary):
    """The API answers 409 until both analyses' top-q sets are on disk: the panel retries (and only a
    compare that answered is kept); a refusal (different parameter names, 422) is said, not retried."""
    from frontend.api_client import ApiError
    from frontend.callbacks.compare import NotReady, fetch
    from frontend.summaries import Summaries

    class ComparingApi(RecordingApi):
        answers: list = []

        def compare(self, a: str, b: str) -> ComparePublic:
            self.calls.append(("compare", a, b))
            answer = self.answers.pop(0)
            if isinstance(answer, Exception):
                raise answer
            return answer

    api = ComparingApi(summary)
    done_a, done_b = {"id": ID_A, "kept_share": None}, {"id": ID_B, "kept_share": None}
    api.answers = [
        ApiError("the top-q sets are not on disk yet", 409),
        ComparePublic(a=ID_A, b=ID_B, sets=NO_SETS, tensors=[]),
        ApiError("the two analyses are of models with different parameter names", 422),
    ]
    summaries = Summaries(api)
    with pytest.raises(NotReady) as not_yet:
        fetch(summaries, done_a, done_b)
    assert not_yet.value.retry
    compare, overview_a, overview_b, labels = fetch(summaries, done_a, done_b)
    assert compare.a == ID_A and labels == ("A", "B (the same analysis as A)")
    fetch(summaries, done_a, done_b)  # kept: not asked again
    assert [call for call in api.calls if call[0] == "compare"] == [("compare", ID_A, ID_B)] * 2
    with pytest.raises(NotReady) as refused:
        fetch(summaries, done_a, {"id": "c" * 64, "kept_share": None})
    assert not refused.value.retry and "different parameter names" in str(refused.value)
    with pytest.raises(NotReady, match="Waiting for A to finish"):
        fetch(summaries, {"id": ID_A, "kept_share": 0.5}, done_b)


def test_a_share_just_under_its_bound_never_reads_above_it_nor_as_zero():
    assert value_and_bound(0.04712, 0.04718) == ("4.7%", "4.8%")
    assert value_and_bound(0.02, 0.31) == ("2%", "31%")
    assert value_and_bound(2.2e-16, 3e-16) == ("<0.0001%", "<0.0001%")  # a positive share is never "0%"


def test_a_slide_the_analysis_cannot_fill_offers_the_essays_example(summary):
    """The prefix fixture (off-policy, rewarded, no response) cannot draw the response slides; the
    on-policy response fixture cannot show a shift; each offer links to the landing example at that
    slide with the same model, and a slide the analysis fills offers nothing."""
    from frontend.callbacks.slides import example_offer

    on_policy_response = json.loads(RESPONSE_FIXTURE.read_text())
    wanting = {
        n
        for n in range(1, 11)
        if example_offer(typed(summary), n) or example_offer(typed(on_policy_response), n)
    }
    assert wanting == {2, 4, 5, 8, 9, 10}
    assert all(not example_offer(typed(summary), n) for n in (1, 2, 3, 5, 6, 7, 10))
    assert all(not example_offer(typed(on_policy_response), n) for n in (1, 3, 4, 6, 7, 8, 9))
    link = example_offer(typed(summary), 8)[1]
    assert link.href == f"?model={summary['model']['id']}&slide=8"
    no_reward = {**on_policy_response, "positions": [{**on_policy_response["positions"][0], "reward": None}]}
    assert "no reward" in example_offer(typed(no_reward), 2)[0].children


def test_a_responses_partial_says_rho_comes_with_the_exact_result():
    """A response's partial has no rho (a ratio per parameter): slide 3 draws without it and says when it
    comes, not that a second stage computes it."""
    from frontend.slides import s03_one_position

    response = json.loads(RESPONSE_FIXTURE.read_text())
    assert response["method"]["name"] == "exact"

    def without_rho(group: dict) -> dict:
        return {**group, "totals": {**group["totals"], "rho_mean": None}}

    partial = typed(
        {
            **response,
            "concentration": None,
            "top_coordinates": None,
            "overlap": None,
            "rho_available": False,
            "totals": without_rho(response)["totals"],
            "kinds": [without_rho(k) for k in response["kinds"]],
            "layers": [without_rho(layer) for layer in response["layers"]],
            "tensors": [without_rho(t) for t in response["tensors"]],
            "positions": [{**p, "kept_share": 0.5} for p in response["positions"]],
        }
    )
    assert isinstance(s03_one_position.figure(partial, "on"), go.Figure)
    reading = s03_one_position.reading(partial, "on")
    assert "comes with the exact result" in reading and "second stage" not in reading


def test_a_first_partial_says_whose_directions_its_fisher_holds():
    """A response's partial says what its Fisher holds: the largest directions of C_mu, or, in a first
    partial that read C_mu over mu's most probable tokens (its spectrum pending), of that part."""
    from frontend.slides.common import partial_response_words

    response = json.loads(RESPONSE_FIXTURE.read_text())
    running = {**response, "concentration": None, "top_coordinates": None, "overlap": None}
    positions = [{**p, "kept_share": 0.5} for p in response["positions"]]
    refined = partial_response_words(typed({**running, "positions": positions}))
    first = partial_response_words(
        typed({**running, "positions": [{**p, "spectrum": None} for p in positions]})
    )
    assert "largest directions of C_μ so far" in refined
    assert "largest directions of C_μ's part over μ's most probable tokens so far" in first
