"""Off the policy rho comes as a second stage: the dashboard's handle, its stage line, and slide 3.

A finished analysis without rho asks the API for the same request with rho (`POST .../rho`), keeps the
first analysis drawn, neither greyed nor stale, while that computes, and moves the view to it once it is
done; a failed stage leaves the first drawn and says why. Pure functions and a stand-in API, no browser.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import dash
import plotly.graph_objects as go
import pytest

from backend.summary import AnalysisSummary
from frontend.api_client import ApiError
from frontend.callbacks.run import failure, polled, post
from frontend.callbacks.state import opened_handle
from frontend.handles import handle_from, is_settled, is_stale, stage_line, view_of
from frontend.slides import SLIDES, s03_one_position
from frontend.state import DashboardState
from frontend.summaries import Summaries

FIXTURE = Path(__file__).parent / "fixtures" / "summary_smollm2.json"
FIRST, WITH_RHO = "a" * 64, "r" * 64


def without_rho(summary: dict[str, Any]) -> dict[str, Any]:
    """The summary as an off-policy analysis not asked for rho gives it: every rho_mean null."""

    def cleared(node: Any) -> Any:
        if isinstance(node, dict):
            return {key: None if key == "rho_mean" else cleared(value) for key, value in node.items()}
        if isinstance(node, list):
            return [cleared(item) for item in node]
        return node

    return {**cleared(summary), "rho_available": False}


@pytest.fixture(scope="module")
def summary() -> dict[str, Any]:
    return json.loads(FIXTURE.read_text())


class StagedApi:
    """The API's answers, in order, for the analyses and the rho route; records what was asked."""

    def __init__(self, rho: list[Any] | None = None, analyses: list[Any] | None = None) -> None:
        self.rho_answers = list(rho or [])
        self.analysis_answers = list(analyses or [])
        self.calls: list[tuple[str, str]] = []

    def submit(self, body: dict[str, Any]) -> dict[str, Any]:
        self.calls.append(("submit", body["prefix"]))
        return self.analysis_answers.pop(0)

    def rho(self, analysis_id: str) -> dict[str, Any]:
        self.calls.append(("rho", analysis_id))
        return answered(self.rho_answers.pop(0))

    def analysis(self, analysis_id: str) -> dict[str, Any]:
        self.calls.append(("analysis", analysis_id))
        return answered(self.analysis_answers.pop(0))


def answered(answer: Any) -> dict[str, Any]:
    if isinstance(answer, Exception):
        raise answer
    return answer


def done(analysis_id: str, rho_available: bool) -> dict[str, Any]:
    return {"id": analysis_id, "status": "done", "progress": 1.0, "result": {"rho_available": rho_available}}


def running(analysis_id: str, progress: float) -> dict[str, Any]:
    return {"id": analysis_id, "status": "running", "progress": progress, "stage": "directions"}


def posted(api: StagedApi) -> dict[str, Any]:
    return post(api, DashboardState(prefix="She drank a cup of"))


def poll(api: StagedApi, handle: dict[str, Any]) -> dict[str, Any]:
    return polled(api, Summaries(api), handle)


def test_a_cached_analysis_without_rho_asks_for_it_and_draws_the_superset_once_done():
    api = StagedApi(
        rho=[{"id": WITH_RHO, "status": "queued", "progress": 0.0}],
        analyses=[done(FIRST, False), running(WITH_RHO, 0.4), done(WITH_RHO, True)],
    )
    handle = posted(api)
    assert api.calls == [("submit", "She drank a cup of"), ("rho", FIRST)]  # at once: never polled else
    first_view = view_of(handle)
    assert first_view is not None and first_view["id"] == FIRST
    assert not is_settled(handle) and not is_stale(handle, first_view)
    assert stage_line(handle) == "rho: queued, the Fisher under p (second stage)"

    handle = poll(api, handle)
    assert api.calls[-1] == ("analysis", WITH_RHO)
    assert view_of(handle) == first_view and not is_stale(handle, first_view)  # the first stays drawn
    assert stage_line(handle) == "rho: computing the Fisher under p (second stage), 40%"
    assert handle["progress"] == 0.4 and not is_settled(handle)

    handle = poll(api, handle)
    assert is_settled(handle) and handle["id"] == WITH_RHO and handle["request"] == FIRST
    assert view_of(handle) == {**first_view, "id": WITH_RHO}
    assert stage_line(handle) == "done"  # the stage was computed: not all from the cache
    assert len(json.dumps(handle)) < 1000  # a few fields and the controls' query, never a summary


def test_a_stage_answered_from_the_cache_switches_at_once():
    api = StagedApi(rho=[done(WITH_RHO, True)], analyses=[done(FIRST, False)])
    handle = posted(api)
    assert is_settled(handle) and view_of(handle)["id"] == WITH_RHO
    assert stage_line(handle) == "cached"


def test_an_analysis_with_rho_asks_nothing_more():
    api = StagedApi(analyses=[done(FIRST, True)])
    handle = posted(api)
    assert handle["rho"] is None and is_settled(handle)
    assert api.calls == [("submit", "She drank a cup of")]


def test_the_compare_panels_analysis_asks_for_no_rho_stage():
    """Compare draws no rho: its B analysis settles with the first answer, polled or not."""
    api = StagedApi(analyses=[done(FIRST, False)])
    handle = post(api, DashboardState(prefix="She drank a cup of"), wants_rho=False)
    assert handle["rho"] is None and is_settled(handle)
    assert api.calls == [("submit", "She drank a cup of")]
    api = StagedApi(analyses=[{"id": FIRST, "status": "queued", "progress": 0.0}, done(FIRST, False)])
    handle = post(api, DashboardState(prefix="She drank a cup of"), wants_rho=False)
    handle = poll(api, handle)
    assert handle["rho"] is None and is_settled(handle) and view_of(handle)["id"] == FIRST


def test_the_route_answering_the_analysis_itself_ends_the_stage():
    """The API's word on whether the analysis has rho, or can have it: the same id back, nothing to wait."""
    api = StagedApi(rho=[done(FIRST, False)], analyses=[done(FIRST, False)])
    handle = posted(api)
    assert is_settled(handle) and handle["rho"] is None and view_of(handle)["id"] == FIRST
    assert stage_line(handle) == "cached"


@pytest.mark.parametrize("how", ["failed", "refused"])
def test_a_failed_stage_leaves_the_first_analysis_drawn_and_says_why(how):
    if how == "failed":
        api = StagedApi(
            rho=[running(WITH_RHO, 0.1)],
            analyses=[done(FIRST, False), {"id": WITH_RHO, "status": "failed", "error": "out of memory"}],
        )
        handle = poll(api, posted(api))
    else:
        api = StagedApi(rho=[ApiError("too many requests", 429)], analyses=[done(FIRST, False)])
        handle = posted(api)
    assert is_settled(handle) and handle["status"] == "done"
    view = view_of(handle)
    assert view is not None and view["id"] == FIRST and not is_stale(handle, view)
    reason = "out of memory" if how == "failed" else "too many requests"
    assert stage_line(handle) == f"cached; rho failed, drawn without it: {reason}"
    assert failure(handle, "analysis") is dash.no_update  # no error message: the analysis did not fail


def test_a_running_analysis_asks_for_rho_on_the_poll_that_finds_it_done():
    api = StagedApi(
        rho=[running(WITH_RHO, 0.0)],
        analyses=[{"id": FIRST, "status": "queued", "progress": 0.0}, done(FIRST, False)],
    )
    handle = posted(api)
    assert handle["rho"] is None and not is_settled(handle)
    handle = poll(api, handle)
    assert api.calls[-2:] == [("analysis", FIRST), ("rho", FIRST)]
    assert handle["stage"] == "done" and handle["rho"]["id"] == WITH_RHO and not is_settled(handle)


def test_a_link_that_opens_an_analysis_by_id_gets_the_stage_too():
    api = StagedApi(rho=[running(WITH_RHO, 0.2)], analyses=[done(FIRST, False)])
    handle = poll(api, opened_handle(FIRST))
    assert api.calls == [("analysis", FIRST), ("rho", FIRST)]
    assert not is_settled(handle) and view_of(handle)["id"] == FIRST
    assert stage_line(handle) == "rho: computing the Fisher under p (second stage), 20%"


def test_the_handle_without_a_result_asks_for_no_stage():
    """An answer that carries no summary says nothing about rho: no stage is invented."""
    handle = handle_from({"id": FIRST, "status": "done"}, FIRST)
    assert handle["rho"] is None and is_settled(handle)


@pytest.mark.parametrize("centering", ["on", "off", "raw"])
def test_slide_3_without_rho_draws_the_rest_and_says_rho_comes_second(summary, centering):
    no_rho = AnalysisSummary.model_validate(without_rho(summary))
    figure = s03_one_position.figure(no_rho, centering)
    assert not [trace for trace in figure.data if trace.name == "rho"]
    assert any(trace.y for trace in figure.data)  # the tensors are drawn
    assert "second stage" in figure.layout.annotations[-1].text
    reading = s03_one_position.reading(no_rho, centering)
    assert "second stage" in reading and "appears here when done" in reading
    assert f"{summary['model']['d_model']} more backward directions per position" in reading
    for module in SLIDES:  # no other slide reads a null rho_mean
        assert isinstance(module.figure(no_rho, centering), go.Figure)
        assert len(module.reading(no_rho, centering)) > 40, module.TITLE


def test_slide_3_with_rho_names_where_centering_removes_most(summary):
    with_rho = AnalysisSummary.model_validate(summary)
    bars = next(trace for trace in s03_one_position.figure(with_rho, "on").data if trace.name == "rho")
    assert len(bars.y) == len(summary["kinds"]) and all(value is not None for value in bars.y)
    most = max(summary["kinds"], key=lambda kind: kind["totals"]["rho_mean"])
    reading = s03_one_position.reading(with_rho, "on")
    assert f"the most in the {most['kind']} matrices, mean ρ = {most['totals']['rho_mean']:.2f}" in reading
