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
from frontend.exports import CSV_FILENAME, tensor_totals_csv
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
    """Prepare starts the export and the poll; a new analysis hides the link of the last one."""

    @app.callback(
        Output("arrays-status", "children"),
        Output("arrays-link", "href"),
        Output("arrays-link", "style"),
        Output("arrays-poll", "disabled"),
        Output("arrays-started", "data"),
        Input("arrays-prepare", "n_clicks"),
        Input("arrays-poll", "n_intervals"),
        Input("analysis-view", "data"),
        State("arrays-started", "data"),
    )
    def prepare_arrays(_clicks, _ticks, view: View | None, started: float | None):
        if ctx.triggered_id in (None, "analysis-view"):
            return "", "", HIDDEN, True, None
        if not view:
            return "run an analysis first", "", HIDDEN, True, None
        if view.get("kept_share") is not None:
            return "the arrays come with the finished analysis", "", HIDDEN, True, None
        return arrays_progress(api, public, view["id"], started or time.time())


def arrays_progress(api: ApiClient, public: ApiClient, analysis_id: str, started: float) -> tuple[Any, ...]:
    """(status, link, link style, poll disabled, started) after one ask for the arrays."""
    try:
        answer = api.arrays_status(analysis_id)
    except ApiError as error:
        return f"could not prepare the arrays: {error}", "", HIDDEN, True, None
    if answer["ready"]:
        size = f" ({answer['bytes'] / 1e6:.1f} MB)" if answer.get("bytes") else ""
        return f"ready{size}", public.arrays_url(analysis_id), {}, True, None
    return f"preparing the arrays… {time.time() - started:.0f} s", "", HIDDEN, False, started
