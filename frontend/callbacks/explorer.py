"""The explorer: mass per layer and per kind, the top coordinates and the response drawn from the
overview; the position picker for the next-token and spectrum views (one position asked of the API at a
time); the matrix picker and its heatmap (one tensor's pooled block sums).

A click on a layer bar opens that layer's matrices, a click on a tensor of slide 3 opens that tensor.
Everything is read through `frontend.summaries`, by the analysis's id, on the dashboard's server.
"""

from __future__ import annotations

from typing import Any

import dash
from dash import Input, Output, State, ctx, html

from backend.summary import AnalysisSummary
from frontend import explorer
from frontend.api_client import ApiError
from frontend.numbers import percent
from frontend.plots import (
    STAT_LABEL,
    is_vocabulary_sized,
    layer_label,
    message_figure,
    row_token,
    stat_for_centering,
    token_label,
    vocabulary,
)
from frontend.summaries import Summaries, View, position_entries

TOP_COORDINATES = 15
NO_ANALYSIS = "No analysis yet."


def register(app: dash.Dash, summaries: Summaries) -> None:
    register_summary_views(app, summaries)
    register_position_choice(app, summaries)
    register_position_views(app, summaries)
    register_matrix_choice(app, summaries)
    register_heatmap(app, summaries)


def register_summary_views(app: dash.Dash, summaries: Summaries) -> None:
    """Mass per layer and per kind, the top coordinates and the response view, for the toggle's stat."""

    @app.callback(
        Output("layer-graph", "figure"),
        Output("kind-graph", "figure"),
        Output("top-coordinates", "children"),
        Output("response-graph", "figure"),
        Input("analysis-view", "data"),
        Input("centering", "value"),
    )
    def render_explorer(view: View | None, centering: str | None):
        try:
            summary = summaries.summary(view) if view else None
        except ApiError as error:
            summary, why = None, str(error)
        else:
            why = NO_ANALYSIS
        if summary is None:
            empty = message_figure(why)
            return empty, empty, [], empty
        centering = centering or "on"
        return (
            explorer.layer_mass(summary, centering),
            explorer.kind_mass(summary, centering),
            top_coordinates_table(summary, stat_for_centering(centering)),
            explorer.response_view(summary, centering),
        )


def register_position_choice(app: dash.Dash, summaries: Summaries) -> None:
    """The position picker: one option per analysed position; the choice is kept where it still exists."""

    @app.callback(
        Output("explorer-position", "options"),
        Output("explorer-position", "value"),
        Input("analysis-view", "data"),
        State("explorer-position", "value"),
    )
    def choose_position(view: View | None, position: int | None):
        try:
            summary = summaries.summary(view) if view else None
        except ApiError:
            summary = None
        if summary is None:
            return [], 0
        options = position_options(summary)
        return options, position if isinstance(position, int) and 0 <= position < len(options) else 0


def register_position_views(app: dash.Dash, summaries: Summaries) -> None:
    """The next-token distribution and the C_mu spectrum at the chosen position (asked of the API)."""

    @app.callback(
        Output("next-token-graph", "figure"),
        Output("spectrum-graph", "figure"),
        Input("analysis-view", "data"),
        Input("explorer-position", "value"),
    )
    def render_position(view: View | None, position: int | None):
        if not view:
            empty = message_figure(NO_ANALYSIS)
            return empty, empty
        index = position if isinstance(position, int) and position >= 0 else 0
        try:
            summary = summaries.position(view, index)
        except ApiError as error:
            failed = message_figure(str(error))
            return failed, failed
        return explorer.position_next_token(summary), explorer.position_spectrum(summary, index)


def position_options(summary: AnalysisSummary) -> list[dict[str, Any]]:
    """One option per analysed position: the prefix's next token, then each response token."""
    continuation = summary.tokens.continuation
    options = []
    for entry in position_entries(summary):
        index = entry.index
        target = entry.target or (continuation[index] if index < len(continuation) else None)
        what = f"predicting {token_label(target.text)}" if target else "the next token"
        options.append({"label": f"{index + 1}: after {entry.context_length} tokens, {what}", "value": index})
    return options


def top_coordinates_table(summary: AnalysisSummary, stat: str) -> html.Table | html.Div:
    """The largest single coordinates of the toggle's statistic, with their share of the model total."""
    if summary.top_coordinates is None:
        return html.Div("the top coordinates come with the exact result (this is a partial one)")
    rows = summary.top_coordinates.get(stat, [])[:TOP_COORDINATES]
    total = summary.totals.get(stat) or 0.0
    # the engine lists only non-zero coordinates: an empty list with a zero total means all are zero
    if not any(row.value for row in rows) and not total:
        return html.Div(f"the {STAT_LABEL.get(stat, stat)} is 0 at every coordinate here")
    if not rows:
        return html.Div(f"no top coordinates stored for {stat}")
    shapes = {tensor.name: tensor.shape for tensor in summary.tensors}
    known = vocabulary(summary)
    header = html.Tr([html.Th("tensor"), html.Th("coordinate"), html.Th(stat), html.Th("share of total")])
    body = [
        html.Tr(
            [
                html.Td(row.tensor),
                html.Td(coordinate(row.index, shapes.get(row.tensor, []), summary, known)),
                html.Td(f"{row.value:.4g}"),
                html.Td(percent(row.value / total) if total > 0 else "–"),
            ]
        )
        for row in rows
    ]
    return html.Table([header, *body], className="top-table")


def coordinate(index: list[int], shape: list[int], summary: AnalysisSummary, known: dict[int, str]) -> str:
    """A coordinate as a reader names it: a vocabulary row by its token (`' coffee', col 17`), any other
    by its indices (`[3, 17]`, `[260]`)."""
    if index and is_vocabulary_sized(shape, summary):
        rest = f", col {index[1]}" if len(index) > 1 else ""
        return f"{row_token(index[0], known)}{rest}"
    return str(index)


def register_matrix_choice(app: dash.Dash, summaries: Summaries) -> None:
    """Which matrices the picker offers (after a click, that layer's or that tensor's) and which is open."""

    @app.callback(
        Output("heatmap-tensor", "options"),
        Output("heatmap-tensor", "value"),
        Output("heatmap-scope", "children"),
        Input("analysis-view", "data"),
        Input("layer-graph", "clickData"),
        Input("slide-graph", "clickData"),
        State("centering", "value"),
    )
    def choose_matrix(view: View | None, layer_click: dict | None, slide_click: dict | None, centering):
        try:
            summary = summaries.summary(view) if view else None
        except ApiError:
            summary = None
        if summary is None:
            return [], None, ""
        stat = stat_for_centering(centering or "on")
        if ctx.triggered_id == "layer-graph" and layer_click:
            return matrices_of_layer(summary, str(layer_click["points"][0]["customdata"][0]), stat)
        opened = slide_click["points"][0].get("customdata") if slide_click else None
        if ctx.triggered_id == "slide-graph" and is_tensor(summary, opened):
            return matrices_around(summary, str(opened), stat)
        return all_matrices(summary, stat)


def register_heatmap(app: dash.Dash, summaries: Summaries) -> None:
    """The open matrix's pooled block sums, asked of the API for the toggle's statistic."""

    @app.callback(
        Output("heatmap-graph", "figure"),
        Input("heatmap-tensor", "value"),
        Input("centering", "value"),
        State("analysis-view", "data"),
    )
    def render_heatmap(tensor: str | None, centering: str | None, view: View | None):
        if not tensor or not view:
            return message_figure("Pick a matrix, or click a layer bar, to see where its mass sits.")
        if view.get("kept_share") is not None:
            return message_figure("The matrix views come with the finished analysis (this is a partial one).")
        stat = stat_for_centering(centering or "on")
        try:
            pooled = summaries.pooled(view["id"], tensor, stat)
            summary = summaries.summary(view)
        except ApiError as error:
            return message_figure(str(error))
        rows = [pooled.view.row_edges[-1]]  # the matrix's rows (the view's `shape` is the grid of blocks)
        known = vocabulary(summary) if is_vocabulary_sized(rows, summary) else None
        return explorer.heatmap(pooled, known)


MatrixChoice = tuple[list[str], str | None, str]  # (options, value, scope line)


def is_tensor(summary: AnalysisSummary, name: Any) -> bool:
    return isinstance(name, str) and any(tensor.name == name for tensor in summary.tensors)


def matrices_of_layer(summary: AnalysisSummary, layer: str, stat: str) -> MatrixChoice:
    """A clicked layer bar: that layer's tensors, the largest `stat` first and opened."""
    names = explorer.tensors_of_layer(summary, layer, stat)
    scope = f"layer {layer_label(int(layer) if layer.isdigit() else layer)}: "
    count = "1 tensor" if len(names) == 1 else f"{len(names)} tensors, largest {stat} first"
    return names, names[0] if names else None, scope + count


def matrices_around(summary: AnalysisSummary, name: str, stat: str) -> MatrixChoice:
    """A clicked tensor on slide 3: its layer's tensors, with it opened."""
    layer = next(str(t.layer) for t in summary.tensors if t.name == name)
    return explorer.tensors_of_layer(summary, layer, stat), name, f"opened from slide 3: {name}"


def all_matrices(summary: AnalysisSummary, stat: str) -> MatrixChoice:
    """No click: every tensor, with the one holding the largest `stat` opened."""
    everything = [tensor.name for tensor in summary.tensors]
    largest = max(summary.tensors, key=lambda tensor: tensor.totals.get(stat) or 0.0).name
    return everything, largest, f"all {len(everything)} tensors; opened: the largest {stat}, {largest}"
