"""The export buttons: the per-tensor totals as a CSV download, and the full per-parameter arrays.

The arrays (safetensors) are written by the worker on the first ask; the dashboard polls the API until
the file exists, then shows a link the browser downloads from the public API address.
"""

from __future__ import annotations

import time
from typing import Any

import dash
from dash import Input, Output, State, ctx, html
from dash.exceptions import PreventUpdate

from frontend.api_client import ApiClient, ApiError
from frontend.exports import (
    ARRAYS_DTYPE_ID,
    ARRAYS_STATS_ID,
    CSV_FILENAME,
    arrays_query,
    tensor_totals_csv,
)
from frontend.summaries import Summaries, View

HIDDEN = {"display": "none"}


def register(app: dash.Dash, api: ApiClient, public: ApiClient, summaries: Summaries) -> None:
    register_csv(app, summaries)
    register_arrays(app, api, public)


def register_csv(app: dash.Dash, summaries: Summaries) -> None:
    @app.callback(
        Output("csv-download", "data"),
        Output("message", "children", allow_duplicate=True),
        Input("csv-button", "n_clicks"),
        State("analysis-view", "data"),
        prevent_initial_call=True,
    )
    def export_csv(_clicks: int, view: View | None):
        if not view:
            raise PreventUpdate
        try:
            summary = summaries.summary(view)
        except ApiError as error:
            return dash.no_update, [html.Div(f"could not export the totals: {error}")]
        return {"content": tensor_totals_csv(summary), "filename": CSV_FILENAME}, dash.no_update


def register_arrays(app: dash.Dash, api: ApiClient, public: ApiClient) -> None:
    """Prepare starts the export of the chosen stats and dtype, and the poll; a new analysis or a new
    choice hides the link of the last one.

    The choice controls (`frontend.exports.arrays_choice`) are read where the page has them; a page
    without them downloads the API's defaults."""
    choosing = _has_component(app.layout, ARRAYS_STATS_ID) and _has_component(app.layout, ARRAYS_DTYPE_ID)
    choice_inputs = [Input(ARRAYS_STATS_ID, "value"), Input(ARRAYS_DTYPE_ID, "value")] if choosing else []

    @app.callback(
        Output("arrays-status", "children"),
        Output("arrays-link", "href"),
        Output("arrays-link", "style"),
        Output("arrays-poll", "disabled"),
        Output("arrays-started", "data"),
        Input("arrays-prepare", "n_clicks"),
        Input("arrays-poll", "n_intervals"),
        Input("analysis-view", "data"),
        *choice_inputs,
        State("arrays-started", "data"),
    )
    def prepare_arrays(_clicks, _ticks, view: View | None, *rest: Any):
        *choice, started = rest
        if ctx.triggered_id in (None, "analysis-view", ARRAYS_STATS_ID, ARRAYS_DTYPE_ID):
            return "", "", HIDDEN, True, None
        if not view:
            return "run an analysis first", "", HIDDEN, True, None
        if view.get("kept_share") is not None:
            return "the arrays come with the finished analysis", "", HIDDEN, True, None
        if choice and not choice[0]:
            return "choose at least one statistic", "", HIDDEN, True, None
        query = arrays_query(*choice) if choice else arrays_query(None, None)
        return arrays_progress(api, public, view["id"], query, started or time.time())


def _has_component(layout: Any, component_id: str) -> bool:
    if callable(layout):
        layout = layout()
    if getattr(layout, "id", None) == component_id:
        return True
    children = getattr(layout, "children", None)
    if isinstance(children, list | tuple):
        return any(_has_component(child, component_id) for child in children)
    return children is not None and not isinstance(children, str) and _has_component(children, component_id)


def arrays_progress(
    api: ApiClient, public: ApiClient, analysis_id: str, query: dict[str, str], started: float
) -> tuple[Any, ...]:
    """(status, link, link style, poll disabled, started) after one ask for the chosen arrays."""
    try:
        answer = api.arrays_status(analysis_id, query)
    except ApiError as error:
        return f"could not prepare the arrays: {error}", "", HIDDEN, True, None
    if answer["ready"]:
        size = f" ({answer['bytes'] / 1e6:.1f} MB)" if answer.get("bytes") else ""
        return f"ready{size}", public.arrays_url(analysis_id, query), {}, True, None
    return f"preparing the arrays… {time.time() - started:.0f} s", "", HIDDEN, False, started
