"""Run posts the analysis; a cached one arrives at once, otherwise its status is polled to the end.

The progress bar and stage follow the API's `progress` and `stage`; a refused request or a failed
analysis shows the API's own message.
"""

from __future__ import annotations

from typing import Any

import dash
from dash import Input, Output, State, ctx, html
from dash.exceptions import PreventUpdate

from frontend.api_client import ApiClient, ApiError
from frontend.callbacks.controls import CONTROL_IDS, message_block, state_from_controls
from frontend.state import to_request


def register(app: dash.Dash, api: ApiClient) -> None:
    register_submit(app, api)
    register_poll(app, api)


def progress_style(progress: float) -> dict[str, str]:
    """The progress bar's width for a progress in [0, 1] (clamped; missing counts as 0)."""
    return {"width": f"{100 * max(0.0, min(1.0, float(progress or 0.0))):.0f}%"}


def register_submit(app: dash.Dash, api: ApiClient) -> None:
    """The Run button, or a shared link's autorun: validate the controls and POST the analysis."""

    @app.callback(
        Output("analysis-id", "data"),
        Output("summary", "data"),
        Output("poll", "disabled"),
        Output("message", "children", allow_duplicate=True),
        Output("progress-bar", "style"),
        Output("progress-stage", "children"),
        Input("run", "n_clicks"),
        Input("autorun", "data"),
        [State(key, "value") for key in CONTROL_IDS],
        State("slide", "data"),
        prevent_initial_call=True,
    )
    def submit(_clicks, autorun, *values):
        if ctx.triggered_id == "autorun" and not autorun:
            raise PreventUpdate  # a link without a prefix, or with a bad value, does not run anything
        state, errors = state_from_controls(list(values[:-1]), values[-1])
        if not state.prefix:
            errors.append("type a prefix, e.g. 'She drank a cup of'")
        if errors:
            return dash.no_update, dash.no_update, True, message_block(errors), dash.no_update, ""
        try:
            body = api.submit(to_request(state))
        except ApiError as error:
            return dash.no_update, dash.no_update, True, [html.Div(str(error))], {"width": "0%"}, ""
        return submitted(body)


def submitted(body: dict[str, Any]) -> tuple[Any, ...]:
    """The API's answer to the POST: a cached analysis arrives whole, a queued one starts the poll."""
    if body.get("status") == "done" and body.get("result"):
        return body["id"], body["result"], True, [], {"width": "100%"}, "cached"
    return body["id"], dash.no_update, False, [], progress_style(body.get("progress", 0.0)), "queued"


def register_poll(app: dash.Dash, api: ApiClient) -> None:
    """Every poll tick: the analysis's status, until it is done or failed."""

    @app.callback(
        Output("summary", "data", allow_duplicate=True),
        Output("poll", "disabled", allow_duplicate=True),
        Output("message", "children", allow_duplicate=True),
        Output("progress-bar", "style", allow_duplicate=True),
        Output("progress-stage", "children", allow_duplicate=True),
        Input("poll", "n_intervals"),
        State("analysis-id", "data"),
        prevent_initial_call=True,
    )
    def poll(_n: int, analysis_id: str | None):
        if not analysis_id:
            raise PreventUpdate
        try:
            body = api.analysis(analysis_id)
        except ApiError as error:
            return dash.no_update, True, [html.Div(str(error))], dash.no_update, ""
        return polled(body)


def polled(body: dict[str, Any]) -> tuple[Any, ...]:
    """(summary, poll disabled, message, bar, stage) for one status answer."""
    status = body.get("status")
    if status == "done":
        return body["result"], True, [], progress_style(1.0), "done"
    if status == "failed":
        failure = [html.Div(f"the analysis failed: {body.get('error', 'no reason given')}")]
        return dash.no_update, True, failure, progress_style(0.0), "failed"
    stage = body.get("stage") or status or ""
    return dash.no_update, False, dash.no_update, progress_style(body.get("progress", 0.0)), stage
