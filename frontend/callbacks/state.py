"""The URL is the whole state: read into the controls once per page load, written back on every change.

Also the small views of that state: the share link, the prefix's token chips, and the candidate chips
that toggle a token's reward.
"""

from __future__ import annotations

import time
from typing import Any

import dash
from dash import ALL, Input, Output, State, ctx, html
from dash.exceptions import PreventUpdate

from frontend.api_client import ApiClient, ApiError
from frontend.callbacks.controls import CONTROL_IDS, controls_from_state, message_block, state_from_controls
from frontend.plots import token_label, unique_token_labels
from frontend.state import DashboardState, format_reward, parse_query, parse_reward, to_query

CANDIDATES = 12  # how many of the likeliest next tokens are offered as reward chips


def register(app: dash.Dash, api: ApiClient) -> None:
    register_restore(app, api)
    register_write_url(app)
    register_token_chips(app, api)
    register_candidates(app)


def model_ids(api: ApiClient) -> list[str]:
    """The model ids the API serves (the default alone when the API cannot say)."""
    try:
        return [model["id"] for model in api.models() if model.get("available", True)]
    except (ApiError, KeyError, TypeError):
        return [DashboardState().model]


def register_restore(app: dash.Dash, api: ApiClient) -> None:
    """URL -> controls, once per page load; a link with a prefix and no bad value runs at once."""

    @app.callback(
        [Output(key, "value") for key in CONTROL_IDS]
        + [Output("slide", "data"), Output("message", "children"), Output("autorun", "data")]
        + [Output("model", "options"), Output("restored", "data")],
        Input("url", "pathname"),
        State("url", "search"),
        State("restored", "data"),
    )
    def restore(_pathname: str, search: str | None, restored: bool | None):
        if restored:
            raise PreventUpdate  # Location re-fires on every URL write; the URL is read once per page load
        state, errors = parse_query(search or "")
        models = model_ids(api)
        if state.model not in models:
            errors.append(f"model {state.model!r} is not served here; choose one of {', '.join(models)}")
        autorun = time.time() if state.prefix and not errors else None
        return [*controls_from_state(state), state.slide, message_block(errors), autorun, models, True]


def register_write_url(app: dash.Dash) -> None:
    """Controls -> URL on every valid change, and the share link (the page's own URL) in the browser."""

    @app.callback(
        Output("url-out", "search"),
        [Input(key, "value") for key in CONTROL_IDS],
        Input("slide", "data"),
        prevent_initial_call=True,
    )
    def write_url(*values):
        state, errors = state_from_controls(list(values[:-1]), values[-1])
        if errors:
            raise PreventUpdate
        return to_query(state)

    app.clientside_callback(
        "function(search) { return window.location.origin + window.location.pathname + (search || ''); }",
        Output("share-link", "value"),
        Input("url-out", "search"),
    )


def register_token_chips(app: dash.Dash, api: ApiClient) -> None:
    """How the prefix splits into the model's tokens, as chips under the prefix."""

    @app.callback(Output("token-chips", "children"), Input("prefix", "value"), Input("model", "value"))
    def token_chips(prefix: str | None, model: str | None):
        if not prefix or not model:
            return []
        try:
            tokens = api.tokenize(model, prefix)
        except ApiError as error:
            return [html.Span(str(error), className="chip-error")]
        return [
            html.Span(token_label(token["text"]), title=f"id {token['id']}", className="chip")
            for token in tokens
        ]


def register_candidates(app: dash.Dash) -> None:
    """The likeliest next tokens as chips; a click adds the token to the reward, a second removes it."""

    @app.callback(Output("candidate-chips", "children"), Input("summary", "data"))
    def show_candidates(summary: dict | None):
        return candidate_chips(summary) if summary else []

    @app.callback(
        Output("reward", "value", allow_duplicate=True),
        Input({"type": "candidate", "token": ALL}, "n_clicks"),
        State("reward", "value"),
        prevent_initial_call=True,
    )
    def toggle_reward(clicks: list[int | None], reward_text: str | None):
        if not ctx.triggered_id or not any(clicks):
            raise PreventUpdate
        return format_reward(toggled(parse_reward(reward_text or "")[0], ctx.triggered_id["token"]))


def toggled(reward: dict[str, float], token: str) -> dict[str, float]:
    """The reward with `token` removed if it had one, else given reward 1."""
    if token in reward:
        return {key: value for key, value in reward.items() if key != token}
    return {**reward, token: 1.0}


def candidate_chips(summary: dict[str, Any]) -> list[Any]:
    """The likeliest next tokens as buttons that toggle their reward; `#id` where the text is ambiguous."""
    top = summary["positions"][0]["p"]["top"][:CANDIDATES]
    chips = []
    for token, label in zip(top, unique_token_labels(top), strict=True):
        key = token["text"] if label == token_label(token["text"]) else f"#{token['id']}"
        chips.append(
            html.Button(
                label,
                id={"type": "candidate", "token": key},
                className="chip candidate",
                title=f"p = {token['p']:.3g}: click to reward",
            )
        )
    return chips
