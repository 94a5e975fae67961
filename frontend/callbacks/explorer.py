"""The explorer: mass per layer and per kind, the top coordinates and the response drawn from the summary;
the position picker for the next-token and spectrum views; the matrix picker and its heatmap.

A click on a layer bar opens that layer's matrices, a click on a tensor of slide 3 opens that tensor; the
heatmap is the only view that asks the API (for the pooled block sums of one tensor).
"""

from __future__ import annotations

from typing import Any

import dash
from dash import Input, Output, State, ctx, html

from frontend import explorer
from frontend.api_client import ApiClient, ApiError
from frontend.plots import STAT_LABEL, layer_label, message_figure, stat_for_centering, token_label

TOP_COORDINATES = 15


def register(app: dash.Dash, api: ApiClient) -> None:
    register_summary_views(app)
    register_position_choice(app)
    register_position_views(app)
    register_matrix_choice(app)
    register_heatmap(app, api)


def register_summary_views(app: dash.Dash) -> None:
    """Mass per layer and per kind, the top coordinates and the response view, for the toggle's stat."""

    @app.callback(
        Output("layer-graph", "figure"),
        Output("kind-graph", "figure"),
        Output("top-coordinates", "children"),
        Output("response-graph", "figure"),
        Input("summary", "data"),
        Input("centering", "value"),
    )
    def render_explorer(summary: dict | None, centering: str | None):
        if not summary:
            empty = message_figure("No analysis yet.")
            return empty, empty, [], empty
        centering = centering or "on"
        return (
            explorer.layer_mass(summary, centering),
            explorer.kind_mass(summary, centering),
            top_coordinates_table(summary, stat_for_centering(centering)),
            explorer.response_view(summary, centering),
        )


def register_position_choice(app: dash.Dash) -> None:
    """The position picker: one option per analysed position; the choice is kept where it still exists."""

    @app.callback(
        Output("explorer-position", "options"),
        Output("explorer-position", "value"),
        Input("summary", "data"),
        State("explorer-position", "value"),
    )
    def choose_position(summary: dict | None, position: int | None):
        if not summary:
            return [], 0
        options = position_options(summary)
        return options, position if isinstance(position, int) and 0 <= position < len(options) else 0


def register_position_views(app: dash.Dash) -> None:
    """The next-token distribution and the C_mu spectrum at the chosen position."""

    @app.callback(
        Output("next-token-graph", "figure"),
        Output("spectrum-graph", "figure"),
        Input("summary", "data"),
        Input("explorer-position", "value"),
    )
    def render_position(summary: dict | None, position: int | None):
        if not summary:
            empty = message_figure("No analysis yet.")
            return empty, empty
        index = position if isinstance(position, int) and 0 <= position < len(summary["positions"]) else 0
        return explorer.next_token(summary, index), explorer.spectrum(summary, index)


def position_options(summary: dict[str, Any]) -> list[dict[str, Any]]:
    """One option per analysed position: the prefix's next token, then each response token."""
    continuation = summary["tokens"].get("continuation") or []
    options = []
    for index, position in enumerate(summary["positions"]):
        target = position.get("target") or (continuation[index] if index < len(continuation) else None)
        what = f"predicting {token_label(target['text'])}" if target else "the next token"
        options.append(
            {"label": f"{index + 1}: after {position['context_length']} tokens, {what}", "value": index}
        )
    return options


def top_coordinates_table(summary: dict[str, Any], stat: str) -> html.Table | html.Div:
    """The largest single coordinates of the toggle's statistic, with their share of the model total."""
    rows = summary["top_coordinates"].get(stat, [])[:TOP_COORDINATES]
    # the engine lists only non-zero coordinates: an empty list with a zero total means all are zero
    if not any(row["value"] for row in rows) and not summary["totals"].get(stat):
        return html.Div(f"the {STAT_LABEL.get(stat, stat)} is 0 at every coordinate here")
    if not rows:
        return html.Div(f"no top coordinates stored for {stat}")
    total = summary["totals"].get(stat) or 0.0
    header = html.Tr(
        [html.Th("tensor"), html.Th("index [row, col]"), html.Th(stat), html.Th("share of total")]
    )
    body = [
        html.Tr(
            [
                html.Td(row["tensor"]),
                html.Td(str(row["index"])),
                html.Td(f"{row['value']:.4g}"),
                html.Td(f"{100 * row['value'] / total:.2g}%" if total > 0 else "–"),
            ]
        )
        for row in rows
    ]
    return html.Table([header, *body], className="top-table")


def register_matrix_choice(app: dash.Dash) -> None:
    """Which matrices the picker offers (after a click, that layer's or that tensor's) and which is open."""

    @app.callback(
        Output("heatmap-tensor", "options"),
        Output("heatmap-tensor", "value"),
        Output("heatmap-scope", "children"),
        Input("summary", "data"),
        Input("layer-graph", "clickData"),
        Input("slide-graph", "clickData"),
        State("centering", "value"),
    )
    def choose_matrix(summary: dict | None, layer_click: dict | None, slide_click: dict | None, centering):
        if not summary:
            return [], None, ""
        stat = stat_for_centering(centering or "on")
        if ctx.triggered_id == "layer-graph" and layer_click:
            return matrices_of_layer(summary, str(layer_click["points"][0]["customdata"][0]), stat)
        opened = slide_click["points"][0].get("customdata") if slide_click else None
        if ctx.triggered_id == "slide-graph" and is_tensor(summary, opened):
            return matrices_around(summary, str(opened), stat)
        return all_matrices(summary, stat)


def register_heatmap(app: dash.Dash, api: ApiClient) -> None:
    """The open matrix's pooled block sums, asked of the API for the toggle's statistic."""

    @app.callback(
        Output("heatmap-graph", "figure"),
        Input("heatmap-tensor", "value"),
        Input("centering", "value"),
        State("analysis-id", "data"),
    )
    def render_heatmap(tensor: str | None, centering: str | None, analysis_id: str | None):
        if not tensor or not analysis_id:
            return message_figure("Pick a matrix, or click a layer bar, to see where its mass sits.")
        stat = stat_for_centering(centering or "on")
        try:
            return explorer.heatmap(api.pooled(analysis_id, tensor, stat), tensor, stat)
        except ApiError as error:
            return message_figure(str(error))


MatrixChoice = tuple[list[str], str | None, str]  # (options, value, scope line)


def is_tensor(summary: dict[str, Any], name: Any) -> bool:
    return isinstance(name, str) and any(tensor["name"] == name for tensor in summary["tensors"])


def matrices_of_layer(summary: dict[str, Any], layer: str, stat: str) -> MatrixChoice:
    """A clicked layer bar: that layer's tensors, the largest `stat` first and opened."""
    names = explorer.tensors_of_layer(summary, layer, stat)
    scope = f"layer {layer_label(int(layer) if layer.isdigit() else layer)}: "
    count = "1 tensor" if len(names) == 1 else f"{len(names)} tensors, largest {stat} first"
    return names, names[0] if names else None, scope + count


def matrices_around(summary: dict[str, Any], name: str, stat: str) -> MatrixChoice:
    """A clicked tensor on slide 3: its layer's tensors, with it opened."""
    layer = next(str(t["layer"]) for t in summary["tensors"] if t["name"] == name)
    return explorer.tensors_of_layer(summary, layer, stat), name, f"opened from slide 3: {name}"


def all_matrices(summary: dict[str, Any], stat: str) -> MatrixChoice:
    """No click: every tensor, with the one holding the largest `stat` opened."""
    everything = [tensor["name"] for tensor in summary["tensors"]]
    largest = max(summary["tensors"], key=lambda tensor: tensor["totals"].get(stat, 0.0))["name"]
    return everything, largest, f"all {len(everything)} tensors; opened: the largest {stat}, {largest}"
