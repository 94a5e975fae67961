"""The URL is the whole state: read into the controls once per page load, written back on every change.

Also the small views of that state: the share link, the prefix's token chips, the candidate chips that
toggle a token's reward, the chips of the analysed continuation (a sampled one is shown, never typed),
and the compare panel's placeholders (A's values, which B's empty fields stand for).
"""

from __future__ import annotations

import time
from typing import Any
from urllib.parse import urlencode

import dash
from dash import ALL, Input, Output, State, ctx, html
from dash.exceptions import PreventUpdate

from backend.summary import AnalysisSummary, TokenText
from frontend.api_client import ApiClient, ApiError
from frontend.callbacks.controls import (
    ALL_CONTROL_IDS,
    B_CONTROL_IDS,
    controls_from_state,
    message_block,
)
from frontend.compare_layout import AS_A
from frontend.handles import Handle
from frontend.plots import token_label, unique_token_labels
from frontend.shown import link_query
from frontend.state import (
    DashboardState,
    format_reward,
    is_landing,
    parse_query,
    parse_reward,
    with_landing,
)
from frontend.summaries import Summaries, View

CANDIDATES = 12  # how many of the likeliest next tokens are offered as reward chips
# B's fields whose placeholder shows A's value (the choices show "as A" as an option instead)
B_PLACEHOLDERS = ("prefix", "temperature", "top_k", "top_p", "method")


def register(app: dash.Dash, api: ApiClient, summaries: Summaries) -> None:
    register_restore(app, api)
    register_write_url(app)
    register_token_chips(app, api)
    register_candidates(app, summaries)
    register_continuation(app, summaries)
    register_b_placeholders(app)


def model_ids(api: ApiClient) -> list[str]:
    """The model ids the API serves (the default alone when the API cannot say)."""
    try:
        return [model["id"] for model in api.models() if model.get("available", True)]
    except (ApiError, KeyError, TypeError):
        return [DashboardState().model]


def landing_note(state: DashboardState) -> str:
    """The one line a first visit reads above the essays' example."""
    return (
        f"This is the essays' example, {state.prefix!r} on {state.model}: type your own prefix and "
        "press Run, or Sample a response to it."
    )


def register_restore(app: dash.Dash, api: ApiClient) -> None:
    """URL -> controls, once per page load; a link with a prefix and no bad value runs at once, and a
    link with `compare=<id>` opens that analysis beside it (polled like any other)."""

    @app.callback(
        [Output(key, "value") for key in ALL_CONTROL_IDS]
        + [Output("slide", "data"), Output("message", "children"), Output("autorun", "data")]
        + [Output("model", "options"), Output("b_model", "options"), Output("restored", "data")]
        + [Output("landing-note", "children"), Output("b-analysis", "data")],
        Input("url", "pathname"),
        State("url", "search"),
        State("restored", "data"),
    )
    def restore(_pathname: str, search: str | None, restored: bool | None):
        if restored:
            raise PreventUpdate  # Location re-fires on every URL write; the URL is read once per page load
        state, errors = parse_query(with_landing(search or ""))
        models = model_ids(api)
        if state.model not in models:
            errors.append(f"model {state.model!r} is not served here; choose one of {', '.join(models)}")
        autorun = time.time() if state.prefix and not errors else None
        note = landing_note(state) if is_landing(search or "") and autorun else ""
        # the compare panel's B reads no rho: no second stage for it
        b_handle = opened_handle(state.compare, wants_rho=False) if state.compare else None
        return [
            *controls_from_state(state),
            *(state.slide, message_block(errors), autorun),
            *(models, [AS_A, *models], True, note, b_handle),
        ]


def opened_handle(analysis_id: str, wants_rho: bool = True) -> Handle:
    """The handle of an analysis a link names by id: nothing known yet, the poll asks the API
    (``wants_rho``: as ``handles.handle_from``)."""
    return {
        "request": analysis_id,
        "id": analysis_id,
        "status": "queued",
        "progress": 0.0,
        "stage": "opening",
        "wants_rho": wants_rho,
    }


def register_write_url(app: dash.Dash) -> None:
    """What is drawn -> URL, and the share link (the page's own URL) in the browser.

    The link names the analysis on screen (before anything is drawn, the one computing), with the
    slide, the centering and the compare panel as they are: never controls edited since, so a link
    reopens exactly what its sender saw.
    """

    @app.callback(
        Output("url-out", "search"),
        Input("analysis-view", "data"),
        Input("analysis", "data"),
        Input("slide", "data"),
        Input("centering", "value"),
        Input("b-analysis", "data"),
        [Input(key, "value") for key in B_CONTROL_IDS],
        prevent_initial_call=True,
    )
    def write_url(view, handle, slide, centering, b_handle, *b_values):
        query = drawn_query(view, handle)
        b, errors = b_overrides(list(b_values))
        if not query or errors:
            raise PreventUpdate
        compare = b_handle["id"] if b_handle and b_handle.get("status") != "failed" else ""
        return link_query(query, slide or 1, centering or "on", compare, b)

    app.clientside_callback(
        "function(search) { return window.location.origin + window.location.pathname + (search || ''); }",
        Output("share-link", "value"),
        Input("url-out", "search"),
    )


def drawn_query(view: View | None, handle: Handle | None) -> str | None:
    """The query of the analysis on screen; before anything is drawn, of the one on its way."""
    if view:
        return view.get("query")
    if handle and handle.get("status") != "failed":
        return handle.get("query")
    return None


def b_overrides(values: list[Any]) -> tuple[dict[str, Any], list[str]]:
    """The compare panel's overrides (B_CONTROL_IDS order), read as a link's `b_` keys are."""
    pairs = zip(B_CONTROL_IDS, values, strict=True)
    query = urlencode({key: "" if value is None else str(value) for key, value in pairs})
    state, errors = parse_query(query)
    return state.b, errors


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
            html.Span(token_label(token.text), title=f"id {token.id}", className="chip") for token in tokens
        ]


def register_candidates(app: dash.Dash, summaries: Summaries) -> None:
    """The likeliest next tokens as chips; a click adds the token to the reward, a second removes it."""

    @app.callback(
        Output("candidate-chips", "children"), Input("analysis-view", "data"), Input("reward", "value")
    )
    def show_candidates(view: View | None, reward_text: str | None):
        if not view:
            return []
        try:
            return candidate_chips(summaries.summary(view), parse_reward(reward_text or "")[0])
        except ApiError:
            return []  # the slide says why; the chips only offer tokens

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


def candidate_chips(summary: AnalysisSummary, reward: dict[str, float] | None = None) -> list[Any]:
    """The likeliest next tokens as buttons that toggle their reward; `#id` where the text is ambiguous.
    A token the reward names is marked, with its value, so the chips say what the reward is."""
    top = summary.positions[0].p.top[:CANDIDATES]
    reward = reward or {}
    chips = []
    for token, label in zip(top, unique_token_labels(top), strict=True):
        key = token.text if label == token_label(token.text) else f"#{token.id}"
        value = reward.get(key)
        chips.append(
            html.Button(
                label if value is None else f"{label} = {value:g}",
                id={"type": "candidate", "token": key},
                className="chip candidate" if value is None else "chip candidate rewarded",
                title=f"p = {token.p:.3g}: "
                + ("click to reward" if value is None else f"reward {value:g}; click to remove"),
            )
        )
    return chips


def register_continuation(app: dash.Dash, summaries: Summaries) -> None:
    """The analysed response as chips (a sampled one is shown here, the typed field stays empty); typing
    a continuation leaves sampling, so Run analyses what was typed."""

    @app.callback(
        Output("continuation-chips", "children"),
        Output("continuation-caption", "children"),
        Input("analysis-view", "data"),
        State("analysis", "data"),
    )
    def show_continuation(view: View | None, handle: Handle | None):
        if not view:
            return [], ""
        try:
            summary = summaries.summary(view)
        except ApiError:
            return [], ""
        tokens = summary.tokens.continuation
        sample = handle.get("sample") if handle and handle.get("id") == view["id"] else None
        return continuation_chips(tokens), continuation_caption(len(tokens), sample)

    @app.callback(
        Output("sample_seed", "value", allow_duplicate=True),
        Input("continuation", "value"),
        State("sample_seed", "value"),
        prevent_initial_call=True,
    )
    def leave_sampling(continuation: str | None, seed: int | None):
        if not continuation or seed is None:
            raise PreventUpdate
        return None


def continuation_chips(tokens: list[TokenText]) -> list[Any]:
    return [
        html.Span(token_label(token.text), title=f"id {token.id}", className="chip response-chip")
        for token in tokens
    ]


def continuation_caption(count: int, sample: dict[str, int] | None) -> str:
    """What the chips are: the typed continuation, or the response drawn (and whether it ended early)."""
    if not count:
        return "" if sample is None else "the sampled response is empty: the model ended it at once"
    if sample is None:
        return f"analysed continuation: {count} tokens"
    ended = " (it reached the end of sequence)" if count < sample["max_tokens"] else ""
    return f"sampled response, seed {sample['seed']}: {count} tokens{ended}"


def register_b_placeholders(app: dash.Dash) -> None:
    """B's empty fields read as A's: each shows A's current value as its placeholder."""

    @app.callback(
        [Output(f"b_{key}", "placeholder") for key in B_PLACEHOLDERS],
        [Input(key, "value") for key in B_PLACEHOLDERS],
    )
    def show_a(*values):
        return [placeholder(key, value) for key, value in zip(B_PLACEHOLDERS, values, strict=True)]


def placeholder(key: str, value: Any) -> str:
    """`as A (0.7)`; A's empty top-k is `off`, an empty text field is just `as A`."""
    if key == "top_k" and value in (None, ""):
        return "as A (off)"
    return "as A" if value in (None, "") else f"as A ({value})"
