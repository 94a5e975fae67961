"""The compare panel (docs/design.md §8): post B (A with the panel's overrides), follow it, draw the
two side by side, and export the view as CSV.

B is polled like A (`frontend.callbacks.run`); its figures need both finished. Everything is read by id
through `frontend.summaries`: the compare (sets and per-tensor totals), both overviews, and the pooled
views of the open matrix. The top-q sets are written just after an analysis is stored, so a compare
asked in between answers 409: the panel then asks again each second until it answers, and only then
(`compare-ready`) do the matrix picker, the difference heatmap and the CSV read it.
"""

from __future__ import annotations

import dash
from dash import Input, Output, State, html
from dash.exceptions import PreventUpdate

from backend.schemas import ComparePublic, SetComparison
from backend.summary import AnalysisOverview
from frontend import compare_figures as figures
from frontend.api_client import ApiClient, ApiError
from frontend.callbacks.controls import ALL_CONTROL_IDS, message_block, state_from_controls
from frontend.callbacks.run import failure, post
from frontend.compare_layout import HIDDEN
from frontend.exports import COMPARE_CSV_FILENAME, compare_csv
from frontend.handles import Handle, stage_line
from frontend.numbers import percent
from frontend.plots import message_figure, stat_for_centering
from frontend.state import state_b
from frontend.summaries import Summaries, View

INVITE = "Change a control above and press Compare to put a second analysis beside this one."
VIEWS = ("analysis-view", "b-analysis-view")


class NotReady(Exception):
    """Nothing to compare yet; `str()` says why, and `retry` whether asking again soon may help."""

    def __init__(self, why: str, retry: bool = False) -> None:
        super().__init__(why)
        self.retry = retry


def register(app: dash.Dash, api: ApiClient, summaries: Summaries) -> None:
    register_submit(app, api)
    register_status(app)
    register_views(app, summaries)
    register_matrix(app, summaries)
    register_heatmap(app, summaries)
    register_csv(app, summaries)


def register_submit(app: dash.Dash, api: ApiClient) -> None:
    """Compare: validate every control, POST B = A with the panel's overrides."""

    @app.callback(
        Output("b-analysis", "data", allow_duplicate=True),
        Output("message", "children", allow_duplicate=True),
        Input("compare-run", "n_clicks"),
        [State(key, "value") for key in ALL_CONTROL_IDS],
        State("slide", "data"),
        prevent_initial_call=True,
    )
    def submit_b(_clicks, *values):
        state, errors = state_from_controls(list(values[:-1]), values[-1])
        b = state_b(state)
        if not b.prefix:
            errors.append("type a prefix for A (or for B in the compare panel)")
        if errors:
            return dash.no_update, message_block(errors)
        try:
            return post(api, b, wants_rho=False), []  # compare reads no rho: no second stage
        except ApiError as error:
            return dash.no_update, [html.Div(f"the compared analysis: {error}")]


def register_status(app: dash.Dash) -> None:
    @app.callback(
        Output("b-status", "children"),
        Output("message", "children", allow_duplicate=True),
        Input("b-analysis", "data"),
        prevent_initial_call=True,
    )
    def show_status(handle: Handle | None):
        if not handle:
            raise PreventUpdate
        progress = "" if handle.get("status") in ("done", "failed") else f" {100 * handle['progress']:.0f}%"
        return f"B: {stage_line(handle) or handle.get('status')}{progress}", failure(
            handle, "compared analysis"
        )


def both(view_a: View | None, view_b: View | None) -> tuple[str, str]:
    """The ids of two finished analyses, or NotReady saying what is missing."""
    if not view_b:
        raise NotReady(INVITE)
    if not view_a or view_a.get("kept_share") is not None:
        raise NotReady("Waiting for A to finish.")
    if view_b.get("kept_share") is not None:
        raise NotReady("Waiting for B to finish.")
    return view_a["id"], view_b["id"]


Fetched = tuple[ComparePublic, AnalysisOverview, AnalysisOverview, tuple[str, str]]


def fetch(summaries: Summaries, view_a: View | None, view_b: View | None) -> Fetched:
    """(compare, overview of A, overview of B, labels), or NotReady."""
    a, b = both(view_a, view_b)
    try:
        compare = summaries.compare(a, b)
        overview_a, overview_b = summaries.overview(a), summaries.overview(b)
    except ApiError as error:
        raise NotReady(str(error), retry=error.status == 409) from None
    return compare, overview_a, overview_b, figures.side_labels(overview_a, overview_b)


def register_views(app: dash.Dash, summaries: Summaries) -> None:
    """Per-tensor scatter, top-q sets against chance, next tokens side by side, the sets table."""

    @app.callback(
        Output("compare-tensors-graph", "figure"),
        Output("compare-sets-graph", "figure"),
        Output("compare-next-token-graph", "figure"),
        Output("compare-sets-table", "children"),
        Output("compare-reading", "children"),
        Output("compare-retry", "disabled"),
        Output("compare-figures", "style"),
        Output("compare-ready", "data"),
        Input("analysis-view", "data"),
        Input("b-analysis-view", "data"),
        Input("centering", "value"),
        Input("compare-retry", "n_intervals"),
    )
    def render(view_a: View | None, view_b: View | None, centering: str | None, _retry):
        try:
            compare, overview_a, overview_b, labels = fetch(summaries, view_a, view_b)
        except NotReady as why:
            empty = message_figure(str(why))
            return empty, empty, empty, [], str(why), not why.retry, HIDDEN, None
        stat = stat_for_centering(centering or "on")
        return (
            figures.tensor_scatter(compare, stat, labels),
            figures.sets_figure(compare.sets),
            figures.next_tokens(overview_a.positions[0], overview_b.positions[0], labels),
            sets_table(compare.sets),
            figures.reading(compare, labels),
            True,
            {},
            {"a": compare.a, "b": compare.b},
        )


def sets_table(sets: SetComparison) -> html.Table:
    """The numbers of the sets figure: overlap and Jaccard at each q, each beside chance."""
    header = html.Tr(
        [html.Th(text) for text in ("top q", "overlap |A∩B|/|A|", "chance q", "Jaccard", "chance q/(2−q)")]
    )
    rows = [
        html.Tr(
            [
                html.Td(f"{100 * q:g}%"),
                *(
                    html.Td(percent(shares[i]))
                    for shares in (sets.overlap, sets.chance_overlap, sets.jaccard, sets.chance_jaccard)
                ),
            ]
        )
        for i, q in enumerate(sets.q)
    ]
    return html.Table([header, *rows], className="top-table compare-sets")


def ready(summaries: Summaries, pair: dict | None) -> Fetched:
    """(compare, overview of A, overview of B, labels) of a pair the panel has drawn (kept: no request)."""
    if not pair:
        raise NotReady(INVITE)
    view_a: View = {"id": pair["a"], "kept_share": None}
    view_b: View = {"id": pair["b"], "kept_share": None}
    return fetch(summaries, view_a, view_b)


def register_matrix(app: dash.Dash, summaries: Summaries) -> None:
    """The matrices both analyses share; the one whose total changed most is opened."""

    @app.callback(
        Output("compare-tensor", "options"),
        Output("compare-tensor", "value"),
        Input("compare-ready", "data"),
        State("compare-tensor", "value"),
        State("centering", "value"),
    )
    def choose(pair: dict | None, current: str | None, centering: str | None):
        try:
            compare, overview_a, _, _ = ready(summaries, pair)
        except NotReady:
            return [], None
        matrices = [t.name for t in overview_a.tensors if len(t.shape) == 2]
        if current in matrices:
            return matrices, current
        return matrices, figures.largest_change(compare, matrices, stat_for_centering(centering or "on"))


def register_heatmap(app: dash.Dash, summaries: Summaries) -> None:
    @app.callback(
        Output("compare-heatmap-graph", "figure"),
        Input("compare-tensor", "value"),
        Input("centering", "value"),
        State("compare-ready", "data"),
    )
    def render_difference(tensor: str | None, centering: str | None, pair: dict | None):
        if not pair:
            return message_figure(INVITE)
        if not tensor:
            return message_figure("Pick a matrix to see where B's mass differs from A's.")
        stat = stat_for_centering(centering or "on")
        try:
            pooled_a = summaries.pooled(pair["a"], tensor, stat)
            pooled_b = summaries.pooled(pair["b"], tensor, stat)
        except ApiError as error:
            return message_figure(str(error))
        return figures.difference_heatmap(pooled_a, pooled_b)


def register_csv(app: dash.Dash, summaries: Summaries) -> None:
    @app.callback(
        Output("compare-csv-download", "data"),
        Output("message", "children", allow_duplicate=True),
        Input("compare-csv-button", "n_clicks"),
        State("compare-ready", "data"),
        prevent_initial_call=True,
    )
    def export(_clicks: int, pair: dict | None):
        try:
            compare, _, _, labels = ready(summaries, pair)
        except NotReady as why:
            return dash.no_update, [html.Div(f"nothing to export yet: {why}")]
        return {"content": compare_csv(compare, labels), "filename": COMPARE_CSV_FILENAME}, dash.no_update
