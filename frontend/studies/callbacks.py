"""What the study page does: URL -> form once per load, Run -> POST, a study polled to the end, the URL
kept up to date, and the share link.

Why a study is opened by id and never re-posted from a link: a link restores the view from the cache
(GET by id computes nothing); a study the server does not have is a sentence saying so, and Run is the
one thing that computes. The drawing of a finished study is in `frontend.studies.results`.
"""

from __future__ import annotations

import time
from typing import Any

import dash
from dash import Input, Output, State, ctx, html
from dash.exceptions import PreventUpdate

from frontend.api_client import ApiError
from frontend.studies.client import StudyClient, is_settled, status_of
from frontend.studies.form import DEFAULTS, FIELD_IDS, parse_query, request_body, study_id_in, to_query
from frontend.studies.panels import progress_panel
from frontend.studies.recent import register_recent

FIELD_INPUTS = [Input(key, "value") for key in FIELD_IDS]
FIELD_STATES = [State(key, "value") for key in FIELD_IDS]


def register(app: dash.Dash, client: StudyClient) -> None:
    register_restore(app, client)
    register_submit(app, client)
    register_tracking(app, client)
    register_url(app)
    register_recent(app, client)


def message_block(errors: list[str]) -> list[Any]:
    return [html.Div(error) for error in errors]


def model_ids(client: StudyClient) -> list[str]:
    """The model ids the API serves (the form's default alone when the API cannot say)."""
    try:
        return [model["id"] for model in client.models() if model.get("available", True)]
    except (ApiError, KeyError, TypeError):
        return [DEFAULTS["model"]]


def register_restore(app: dash.Dash, client: StudyClient) -> None:
    """URL -> form, the study it names and the density in view, once per page load."""

    @app.callback(
        [Output(key, "value") for key in FIELD_IDS]
        + [Output("study", "data"), Output("message", "children"), Output("model", "options")]
        + [Output("view-q", "value"), Output("link-tensor", "data"), Output("compare-id", "value")]
        + [Output("restored", "data")],
        Input("url", "pathname"),
        State("url", "search"),
        State("restored", "data"),
    )
    def restore(_pathname: str, search: str | None, restored: bool | None):
        if restored:
            raise PreventUpdate  # Location fires again on every URL write; a page reads its URL once
        link, errors = parse_query(search or "")
        models = model_ids(client)
        values = dict(link.values)
        if values["model"] not in models:
            if values["model"] != DEFAULTS["model"]:  # a link's model; the default falls back quietly
                errors.append(
                    f"model {values['model']!r} is not served here; choose one of {', '.join(models)}"
                )
            values["model"] = models[0] if models else DEFAULTS["model"]
        study = {"id": link.study, "asked": time.time()} if link.study else None
        return [values[key] for key in FIELD_IDS] + [
            study,
            message_block(errors),
            models,
            link.view_q,
            link.tensor,
            link.compare,
            True,
        ]


def register_submit(app: dash.Dash, client: StudyClient) -> None:
    """Run: the form as a request, POSTed; the API's refusal (its `detail`) is shown as it says it."""

    @app.callback(
        Output("study", "data", allow_duplicate=True),
        Output("message", "children", allow_duplicate=True),
        Input("run", "n_clicks"),
        FIELD_STATES,
        prevent_initial_call=True,
    )
    def submit(_clicks: int, *values: Any):
        body, errors = request_body(dict(zip(FIELD_IDS, values, strict=True)))
        if body is None:
            return dash.no_update, message_block(errors)
        try:
            answer = client.submit(body)
        except ApiError as error:
            return dash.no_update, message_block([f"the API refused the study: {error}"])
        return {"id": answer.id, "asked": time.time()}, []


def register_tracking(app: dash.Dash, client: StudyClient) -> None:
    """The study on the page, asked for at once and then every POLL_MS until it is done or failed."""

    @app.callback(
        Output("status", "data"),
        Output("poll", "disabled"),
        Output("message", "children", allow_duplicate=True),
        Input("study", "data"),
        Input("poll", "n_intervals"),
        State("status", "data"),
        prevent_initial_call=True,
    )
    def track(study: dict[str, Any] | None, _ticks: int | None, status: dict[str, Any] | None):
        if not study or not study.get("id"):
            raise PreventUpdate
        if ctx.triggered_id == "poll" and status and status.get("id") == study["id"] and is_settled(status):
            raise PreventUpdate  # a tick that was already on its way when the study settled
        try:
            answer = status_of(client.study(study["id"]))
        except ApiError as error:
            reason = unavailable(study["id"], error)
            return (
                {"id": study["id"], "status": "missing", "error": reason, "parts": []},
                True,
                message_block([reason]),
            )
        message: Any = dash.no_update if ctx.triggered_id == "poll" else []
        return answer, is_settled(answer), message

    @app.callback(Output("progress", "children"), Input("status", "data"))
    def show_progress(status: dict[str, Any] | None):
        if status and status.get("status") == "missing":
            return []
        return progress_panel(status)


def unavailable(study_id: str, error: ApiError) -> str:
    """Why a study cannot be shown, as a sentence (never the API's stack)."""
    if error.status == 404:
        return (
            f"There is no study {study_id[:12]}… on this server (a link from another server, or its results "
            "were cleared). Press Run to compute the study in the form."
        )
    if error.status is None:
        return f"The API did not answer, so study {study_id[:12]}… cannot be shown now: {error}"
    return f"Study {study_id[:12]}… cannot be shown: {error}"


def register_url(app: dash.Dash) -> None:
    """Form, study and view -> URL on every change; the share link is that URL."""

    @app.callback(
        Output("url-out", "search"),
        FIELD_INPUTS,
        Input("study", "data"),
        Input("view-q", "value"),
        Input("mask-tensor", "value"),
        Input("compare-id", "value"),
        State("restored", "data"),
        prevent_initial_call=True,
    )
    def write_url(*values: Any):
        *fields, study, view_q, tensor, compare, restored = values
        if not restored:
            raise PreventUpdate
        fields_by_id = dict(zip(FIELD_IDS, fields, strict=True))
        return to_query(fields_by_id, (study or {}).get("id"), view_q, tensor, study_id_in(compare))

    app.clientside_callback(
        "function(search) { return window.location.origin + window.location.pathname + (search || ''); }",
        Output("share-link", "value"),
        Input("url-out", "search"),
    )
