"""The dashboard's server before Dash sees a request: who may open it, and requests only a browser sends.

Why: the dashboard holds the server's API token, so when the server has one, opening the dashboard is
driving the service and needs the token too (HTTP Basic, asked by the browser itself, any user name);
a share link never carries it. And Dash answers a malformed callback request or an unknown script path
with an HTML 500 (a KeyError deep inside it): those are refused here with a 4xx that says what is wrong.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import dash
import flask
from dash.exceptions import DependencyException
from werkzeug.exceptions import HTTPException

from backend.credentials import presented_token, token_matches
from frontend.api_client import TOKEN_VARIABLE

CALLBACK_PATH = "_dash-update-component"
log = logging.getLogger(__name__)


def guard_dash_server(app: dash.Dash, token: str | None = None) -> None:
    """Install the checks on ``app``'s Flask server; ``token`` defaults to $FISHERSCOPE_API_TOKEN."""
    token = token if token is not None else os.environ.get(TOKEN_VARIABLE) or None
    server: flask.Flask = app.server

    @server.before_request
    def _check() -> Any:
        presented = presented_token(flask.request.headers.get("Authorization"))
        if token is not None and not token_matches(presented, token):
            return _refusal(
                401,
                "this dashboard needs the server's API token: give it as the password (any user name)",
                {"WWW-Authenticate": 'Basic realm="fisherscope", charset="UTF-8"'},
            )
        if flask.request.method == "POST" and flask.request.path.endswith(CALLBACK_PATH):
            problem = callback_problem(app, flask.request.get_json(silent=True))
            if problem is not None:
                return _refusal(400, f"not a request of this dashboard: {problem}")
        return None

    @server.errorhandler(DependencyException)
    def _unknown_script(_: DependencyException) -> Any:
        return _refusal(404, "no such script of the dashboard")

    @server.errorhandler(Exception)
    def _failed(error: Exception) -> Any:
        """A callback that cannot use the values it was sent (a hand-made request with an object where
        the page sends text) answers 400 in JSON; the traceback goes to the log, where a bug shows too."""
        if isinstance(error, HTTPException):
            return error
        log.error("dashboard request %s failed", flask.request.path, exc_info=error)
        name = type(error).__name__
        if flask.request.path.endswith(CALLBACK_PATH):
            return _refusal(400, f"the dashboard could not use this request's values ({name}); reload")
        return _refusal(500, f"the dashboard failed ({name}); the server's log has the details")


def callback_problem(app: dash.Dash, body: Any) -> str | None:
    """What makes ``body`` unlike the callback requests Dash's renderer sends, or None."""
    if not isinstance(body, dict):
        return "the body is not a JSON object"
    callback = app.callback_map.get(body.get("output")) if isinstance(body.get("output"), str) else None
    if callback is None:
        return "no callback has this output"
    for field in ("inputs", "state"):
        values = body.get(field, [])
        expected = len(callback.get(field, []))
        if not isinstance(values, list) or len(values) != expected:
            return f"'{field}' must be a list of {expected}"
        if not all(_is_prop(value) for value in values):
            return f"every item of '{field}' needs an id and a property"
    if not isinstance(body.get("outputs", []), dict | list):
        return "'outputs' must be an object or a list"
    changed = body.get("changedPropIds", [])
    if not isinstance(changed, list) or not all(isinstance(item, str) for item in changed):
        return "'changedPropIds' must be a list of strings"
    return None


def _is_prop(value: Any) -> bool:
    if isinstance(value, list):  # a pattern-matching input: one entry per matched component
        return all(_is_prop(item) for item in value)
    return isinstance(value, dict) and "id" in value and isinstance(value.get("property"), str)


def _refusal(status: int, detail: str, headers: dict[str, str] | None = None) -> flask.Response:
    response = flask.jsonify({"detail": detail})
    response.status_code = status
    for name, value in (headers or {}).items():
        response.headers[name] = value
    return response
