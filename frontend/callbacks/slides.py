"""The slide panel: stepping through the ten slides and drawing the current one from the summary.

Stepping runs in the browser, so held arrow keys never wait for a server round trip; drawing reads only
the summary already in the browser, so the centering toggle and slide steps never ask the API anything.
"""

from __future__ import annotations

import dash
from dash import Input, Output, State

from frontend.plots import message_figure
from frontend.slides import SLIDES
from frontend.state import N_SLIDES

STEP = """function(prev, next, slide) {
    const trigger = (dash_clientside.callback_context.triggered[0] || {}).prop_id || "";
    const step = trigger.startsWith("prev-slide") ? -1 : 1;
    return Math.min(N_SLIDES, Math.max(1, (slide || 1) + step));
}""".replace("N_SLIDES", str(N_SLIDES))


def register(app: dash.Dash) -> None:
    app.clientside_callback(
        STEP,
        Output("slide", "data", allow_duplicate=True),
        Input("prev-slide", "n_clicks"),
        Input("next-slide", "n_clicks"),
        State("slide", "data"),
        prevent_initial_call=True,
    )

    @app.callback(
        Output("slide-counter", "children"),
        Output("slide-title", "children"),
        Output("slide-claim", "children"),
        Output("slide-formula", "children"),
        Output("slide-graph", "figure"),
        Output("slide-reading", "children"),
        Input("summary", "data"),
        Input("slide", "data"),
        Input("centering", "value"),
    )
    def render_slide(summary: dict | None, slide: int | None, centering: str | None):
        return slide_view(summary, slide or 1, centering or "on")


def slide_view(summary: dict | None, slide: int, centering: str) -> tuple:
    """(counter, title, claim, formula, figure, reading) of one slide; before a run, a prompt instead."""
    module = SLIDES[max(1, min(N_SLIDES, slide)) - 1]
    counter = f"{slide} / {N_SLIDES}"
    if not summary:
        figure, reading = message_figure("Type a prefix and press Run."), ""
    else:
        figure, reading = module.figure(summary, centering), module.reading(summary, centering)
    return counter, module.TITLE, module.CLAIM, module.FORMULA, figure, reading
