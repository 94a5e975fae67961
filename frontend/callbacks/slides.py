"""The slide panel: stepping through the ten slides and drawing the current one from the summary.

Stepping runs in the browser, so held arrow keys never wait for a server round trip; drawing runs here
on the analysis's overview (`frontend.summaries`, kept by id), so the centering toggle and slide steps
ask the API nothing after the first drawing.
"""

from __future__ import annotations

import dash
from dash import Input, Output, State

from frontend.api_client import ApiError
from frontend.plots import message_figure
from frontend.slides import SLIDES
from frontend.state import N_SLIDES
from frontend.summaries import Summaries, View

NOTHING_YET = (
    "Nothing drawn yet:<br>the analysis appears here as soon as it is in (Run or Sample starts one)."
)

STEP = """function(prev, next, slide) {
    const trigger = (dash_clientside.callback_context.triggered[0] || {}).prop_id || "";
    const step = trigger.startsWith("prev-slide") ? -1 : 1;
    return Math.min(N_SLIDES, Math.max(1, (slide || 1) + step));
}""".replace("N_SLIDES", str(N_SLIDES))


def register(app: dash.Dash, summaries: Summaries) -> None:
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
        Input("analysis-view", "data"),
        Input("slide", "data"),
        Input("centering", "value"),
    )
    def render_slide(view: View | None, slide: int | None, centering: str | None):
        try:
            summary = summaries.summary(view) if view else None
        except ApiError as error:
            return slide_view(None, slide or 1, centering or "on", f"Could not read the analysis: {error}")
        return slide_view(summary, slide or 1, centering or "on")


def slide_view(summary: dict | None, slide: int, centering: str, why: str = NOTHING_YET) -> tuple:
    """(counter, title, claim, formula, figure, reading) of one slide; before a run, `why` instead."""
    module = SLIDES[max(1, min(N_SLIDES, slide)) - 1]
    counter = f"{slide} / {N_SLIDES}"
    if not summary:
        figure, reading = message_figure(why), ""
    else:
        figure, reading = module.figure(summary, centering), module.reading(summary, centering)
    return counter, module.TITLE, module.CLAIM, module.FORMULA, figure, reading
