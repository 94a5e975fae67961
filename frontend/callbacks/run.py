"""Run (or Sample) posts the main analysis; every analysis on the page is polled to the end.

Run posts the controls as they are; Sample posts them with the typed continuation replaced by a response
drawn from the sampler (seed and length from its fields). A cached analysis arrives at once, otherwise
its handle (`frontend.handles`) is polled: the progress bar and stage follow it, a partial result is
drawn as soon as it is in, and a refused request or a failed analysis shows the API's own message. A
finished analysis without rho asks for its rho stage at once, and the poll follows that too.

Whatever is drawn stays until the new analysis has something to draw, so the page says which analysis
that is: a banner names it whenever the controls describe another one, and the slide and the explorer
are greyed while a newer analysis computes or after a run failed.
"""

from __future__ import annotations

from typing import Any

import dash
from dash import Input, Output, State, ctx, html
from dash.exceptions import PreventUpdate

from backend.vocabulary import CANCELLED, LANDING_CONTINUATION, LANDING_PREFIX
from frontend.api_client import ApiClient, ApiError, partial_result
from frontend.callbacks.controls import CONTROL_IDS, message_block, state_from_controls
from frontend.handles import (
    FAILED,
    Handle,
    handle_from,
    is_cancellable,
    is_settled,
    is_stale,
    progress_style,
    refused,
    rho_answered,
    rho_failed,
    rho_pending,
    stage_line,
    view_of,
)
from frontend.layout import SIDES
from frontend.shown import analysis_query, describe, differing, shown_state
from frontend.state import DashboardState, to_request
from frontend.summaries import Summaries, View

STALE_PANELS = ("slide-panel", "explorer-panel")  # greyed while they show an earlier analysis

# A poll's answer replaces the handle only while it answers the request the page still waits for: a
# slow answer about an analysis the reader has since replaced (Run pressed again) is dropped. In the
# browser, because only there is "the current handle" known when the answer lands.
ACCEPT_POLL = """function(polled, current) {
    const unchanged = window.dash_clientside.no_update;
    if (!polled || !current || polled.request !== current.request) { return unchanged; }
    return JSON.stringify(polled) === JSON.stringify(current) ? unchanged : polled;
}"""


def register(app: dash.Dash, api: ApiClient, summaries: Summaries) -> None:
    register_submit(app, api)
    for side in SIDES:
        register_tracking(app, api, summaries, side)
    register_progress(app)
    register_cancel(app, api)
    register_shown(app)


def sampled(controls: dict[str, Any]) -> dict[str, Any]:
    """The controls Sample posts: no typed continuation, a response drawn with the seed (0 when empty)."""
    seed = controls.get("sample_seed")
    return {**controls, "continuation": "", "sample_seed": 0 if seed in (None, "") else seed}


def sample_of(state: DashboardState) -> dict[str, int] | None:
    """The seed and length of a sampled response, kept in the handle for the continuation's caption."""
    if state.sample_seed is None:
        return None
    return {"seed": state.sample_seed, "max_tokens": state.sample_tokens}


def post(api: ApiClient, state: DashboardState, wants_rho: bool = True) -> Handle:
    """POST the state's request; the handle of the API's answer (raises ApiError with its message).
    ``wants_rho``: a finished answer without rho starts its rho stage at once."""
    body = api.submit(to_request(state))
    cached = body.get("status") == "done"
    query = analysis_query(state)
    handle = handle_from(body, body["id"], cached, sample=sample_of(state), query=query, wants_rho=wants_rho)
    return with_rho_asked(api, handle)


def is_landing_response_elsewhere(controls: dict[str, Any]) -> bool:
    """The essays' example's response still in the box under a prefix the reader typed: a response
    is a response to its own prefix, so a new prefix runs without it (the reader's own stays)."""
    return controls.get("continuation") == LANDING_CONTINUATION and controls.get("prefix") != LANDING_PREFIX


def register_submit(app: dash.Dash, api: ApiClient) -> None:
    """The Run and Sample buttons, or a link's autorun: validate the controls and POST the analysis."""

    @app.callback(
        Output("analysis", "data"),
        Output("message", "children", allow_duplicate=True),
        Output("continuation", "value", allow_duplicate=True),
        Output("sample_seed", "value", allow_duplicate=True),
        Output("landing-note", "children", allow_duplicate=True),
        Input("run", "n_clicks"),
        Input("sample", "n_clicks"),
        Input("autorun", "data"),
        [State(key, "value") for key in CONTROL_IDS],
        State("slide", "data"),
        prevent_initial_call=True,
    )
    def submit(_run, _sample, autorun, *values):
        if ctx.triggered_id == "autorun" and not autorun:
            raise PreventUpdate  # a link with a bad value does not run anything
        controls = dict(zip(CONTROL_IDS, values[:-1], strict=True))
        by_hand = ctx.triggered_id in ("run", "sample")
        note = "" if by_hand else dash.no_update  # the landing's prompt goes once the reader runs their own
        shown: tuple[Any, Any] = (dash.no_update, dash.no_update)
        if ctx.triggered_id == "sample":
            controls = sampled(controls)
            shown = ("", controls["sample_seed"])
        elif by_hand and is_landing_response_elsewhere(controls):
            controls = {**controls, "continuation": ""}  # the landing's response belongs to its prefix
            shown = ("", dash.no_update)
        state, errors = state_from_controls(list(controls.values()), values[-1])
        if not state.prefix:
            errors.append("type a prefix, e.g. 'She drank a cup of'")
        if errors:
            return dash.no_update, message_block(errors), dash.no_update, dash.no_update, note
        try:
            handle = post(api, state)
        except ApiError as error:
            # a refused run is a failed handle: the drawing left on screen is greyed and named
            return refused(str(error), analysis_query(state)), dash.no_update, *shown, note
        return handle, [], *shown, note


def register_tracking(app: dash.Dash, api: ApiClient, summaries: Summaries, side: str) -> None:
    """Poll one analysis until it settles; derive what there is to draw (`<side>-view`) from its handle."""

    @app.callback(
        Output(f"{side}-polled", "data"),
        Input(f"{side}-poll", "n_intervals"),
        State(side, "data"),
        prevent_initial_call=True,
    )
    def poll(_ticks: int, handle: Handle | None):
        if is_settled(handle):
            raise PreventUpdate
        assert handle is not None
        return polled(api, summaries, handle)

    app.clientside_callback(
        ACCEPT_POLL,
        Output(side, "data", allow_duplicate=True),
        Input(f"{side}-polled", "data"),
        State(side, "data"),
        prevent_initial_call=True,
    )

    @app.callback(
        Output(f"{side}-poll", "disabled"),
        Output(f"{side}-view", "data"),
        Input(side, "data"),
        State(f"{side}-view", "data"),
    )
    def follow(handle: Handle | None, view: dict | None):
        drawable = view_of(handle)
        # the last drawing stays until the new analysis has something to draw; an equal view is no change
        return is_settled(handle), drawable if drawable and drawable != view else dash.no_update


def polled(api: ApiClient, summaries: Summaries, handle: Handle) -> Handle:
    """The handle after one GET; a partial result is kept for drawing, an unreachable API is a failure.
    A handle whose analysis is done follows its rho stage instead."""
    if rho_pending(handle):
        return rho_polled(api, handle)
    try:
        body = api.analysis(handle["id"])
        partial = partial_result(body)
    except ApiError as error:
        reason = str(error)
        if error.status == 404:  # a link's analysis, from another server or a cleared cache
            reason = f"analysis {handle['id'][:12]}… is not on this server; run it again (Run, or Compare)"
        return {**handle, "status": FAILED, "stage": "failed", "error": reason}
    if partial is not None:
        summaries.remember_partial(body["id"], partial.kept_share, partial.result)
    return with_rho_asked(api, answered_handle(body, handle))


def answered_handle(body: dict[str, Any], handle: Handle) -> Handle:
    """The handle after an answer of the API about its analysis (a poll's GET, a DELETE): the same
    request, sample, query and rho wish."""
    return handle_from(
        body,
        handle["request"],
        sample=handle.get("sample"),
        query=handle.get("query"),
        wants_rho=handle.get("wants_rho", True),
    )


def with_rho_asked(api: ApiClient, handle: Handle) -> Handle:
    """A finished analysis without rho asks for its rho stage now, so a cached answer (never polled)
    starts it too; else the handle as it is."""
    return rho_polled(api, handle) if rho_pending(handle) else handle


def rho_polled(api: ApiClient, handle: Handle) -> Handle:
    """Ask for the rho stage (POST, the first time) or how it is going (GET); a refusal or an
    unreachable API fails the stage only, the first analysis stays drawn."""
    stage_id = handle["rho"]["id"]
    try:
        body = api.rho(handle["id"]) if stage_id is None else api.analysis(stage_id)
    except ApiError as error:
        return rho_failed(handle, str(error))
    return rho_answered(handle, body)


def register_progress(app: dash.Dash) -> None:
    """The main analysis's progress bar, its stage, and the reason when it failed."""

    @app.callback(
        Output("progress-bar", "style"),
        Output("progress-stage", "children"),
        Output("message", "children", allow_duplicate=True),
        Input("analysis", "data"),
        prevent_initial_call=True,
    )
    def show_progress(handle: Handle | None):
        if not handle:
            raise PreventUpdate
        return progress_style(handle.get("progress")), stage_line(handle), failure(handle, "analysis")


def register_cancel(app: dash.Dash, api: ApiClient) -> None:
    """The cancel button beside the stage, while the main analysis is queued or running: a DELETE, after
    which the poll follows the analysis to its end (failed, as cancelled, within a chunk of work)."""

    @app.callback(Output("cancel", "hidden"), Input("analysis", "data"))
    def show_cancel(handle: Handle | None) -> bool:
        return not is_cancellable(handle)

    @app.callback(
        Output("analysis", "data", allow_duplicate=True),
        Input("cancel", "n_clicks"),
        State("analysis", "data"),
        prevent_initial_call=True,
    )
    def cancel(clicks: int, handle: Handle | None):
        if not clicks or not is_cancellable(handle):
            raise PreventUpdate
        assert handle is not None
        return cancelled(api, handle)


def cancelled(api: ApiClient, handle: Handle) -> Handle:
    """The handle after a DELETE of its analysis: failed at once (it was queued) or cancelling (its
    worker stops within a chunk; the poll goes on until it has); a refusal is said on the stage line."""
    try:
        body = api.cancel(handle["id"])
    except ApiError as error:  # done meanwhile (409), or the API away: the next poll says which
        return {**handle, "stage": f"could not cancel: {error}"}
    return answered_handle(body, handle)


def failure(handle: Handle, what: str) -> Any:
    """The message area for a failed analysis (the API's reason), else no change."""
    if handle.get("status") != FAILED:
        return dash.no_update
    error = handle.get("error") or "no reason given"
    if error == CANCELLED:
        return [html.Div(f"the {what} was cancelled; press Run (or Sample) to run it again")]
    return [html.Div(f"the {what} failed: {error}")]


def register_shown(app: dash.Dash) -> None:
    """The banner naming the analysis on screen, and the greying of the panels that draw it."""

    @app.callback(
        Output("shown-banner", "children"),
        *[Output(panel, "className") for panel in STALE_PANELS],
        Input("analysis-view", "data"),
        Input("analysis", "data"),
        [Input(key, "value") for key in CONTROL_IDS],
        State("slide", "data"),
    )
    def show_what_is_drawn(view: View | None, handle: Handle | None, *values):
        stale = is_stale(handle, view)
        classes = [f"{panel.removesuffix('-panel')}{' stale' if stale else ''}" for panel in STALE_PANELS]
        return banner(view, handle, list(values[:-1]), values[-1]), *classes


def banner(view: View | None, handle: Handle | None, controls: list[Any], slide: int | None) -> list[Any]:
    """'showing: <analysis>' and why it is worth saying, or nothing when the view matches the controls."""
    if not view:
        return []
    wanted, errors = state_from_controls(controls, slide or 1)
    shown = shown_state(view.get("query"))
    what = describe(shown) if shown else f"analysis {view['id'][:12]}…"
    changed = differing(shown, wanted) if shown else []
    reasons = []
    if handle and handle.get("status") == FAILED and view.get("id") == handle.get("id"):
        reasons.append(
            "the run stopped before it finished (see the message above); this is its last partial result"
        )
    elif handle and handle.get("status") == FAILED:
        reasons.append("the last run failed; this is the analysis before it")
    elif is_stale(handle, view):
        assert handle is not None
        requested = shown_state(handle.get("query"))
        stage = handle.get("stage") or "queued"
        reasons.append(f"a new analysis is computing ({stage}); this is the one before it")
        if requested and not differing(requested, wanted):
            changed = []  # the controls are what is computing: nothing to press
    if changed:
        reasons.append(f"the controls differ ({', '.join(changed)}): press Run to analyse them")
    elif errors:
        reasons.append("some controls are not valid (see the message above)")
    if not reasons:
        return []
    return [html.Strong("showing: "), html.Span(what, className="shown-what"), html.Div("; ".join(reasons))]
