"""The slide panel: stepping through the ten slides and drawing the current one from the summary.

Stepping runs in the browser, so held arrow keys never wait for a server round trip; drawing runs here
on the analysis's overview (`frontend.summaries`, kept by id), so the centering toggle and slide steps
ask the API nothing after the first drawing.
"""

from __future__ import annotations

from urllib.parse import urlencode

import dash
from dash import Input, Output, State, html

from backend.summary import AnalysisSummary
from frontend.api_client import ApiError
from frontend.layout import CENTERING_LABELS
from frontend.plots import message_figure
from frontend.slides import SLIDES
from frontend.slides.common import partial_response_words
from frontend.state import CENTERINGS, N_SLIDES
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
        Output("slide-example", "children"),
        Input("analysis-view", "data"),
        Input("slide", "data"),
        Input("centering", "value"),
    )
    def render_slide(view: View | None, slide: int | None, centering: str | None):
        try:
            summary = summaries.summary(view) if view else None
        except ApiError as error:
            drawn = slide_view(None, slide or 1, centering or "on", f"Could not read the analysis: {error}")
            return *drawn, []
        return *slide_view(summary, slide or 1, centering or "on"), example_offer(summary, slide or 1)

    @app.callback(Output("centering", "options"), Input("slide", "data"))
    def centering_options(slide: int | None):
        return centering_choices(slide or 1)


def centering_choices(slide: int) -> list[dict]:
    """The toggle's options, disabled on a slide whose figure does not draw its statistic; each label's
    tooltip says why (the value stays, so the compare panel and slides 1, 3, 4 keep the reader's choice)."""
    module = SLIDES[max(1, min(N_SLIDES, slide)) - 1]
    enabled = module.CHANGES_WITH_CENTERING
    why = (
        "which per-parameter statistic the figure shows"
        if enabled
        else f"slide {slide} draws fixed quantities and does not change with this; slides "
        f"{', '.join(str(n) for n, m in enumerate(SLIDES, 1) if m.CHANGES_WITH_CENTERING)} do"
    )
    return [
        {"label": html.Span(CENTERING_LABELS[c], title=why), "value": c, "disabled": not enabled}
        for c in CENTERINGS
    ]


def slide_view(summary: AnalysisSummary | None, slide: int, centering: str, why: str = NOTHING_YET) -> tuple:
    """(counter, title, claim, formula, figure, reading) of one slide; before a run, `why` instead."""
    module = SLIDES[max(1, min(N_SLIDES, slide)) - 1]
    counter = f"{slide} / {N_SLIDES}"
    if summary is None:
        figure, reading = message_figure(why), ""
    else:
        figure, reading = module.figure(summary, centering), module.reading(summary, centering)
        reading = partial_response_words(summary) + reading
    return counter, module.TITLE, module.CLAIM, module.FORMULA, figure, reading


def example_offer(summary: AnalysisSummary | None, slide: int) -> list:
    """What this analysis lacks for the slide, and a link to the essays' example that has it (a link
    without a prefix opens the landing example; its model and this slide are kept)."""
    missing = getattr(SLIDES[max(1, min(N_SLIDES, slide)) - 1], "missing", None)
    if summary is None or missing is None or (reason := missing(summary)) is None:
        return []
    href = "?" + urlencode({"model": summary.model.id, "slide": slide})
    return [
        html.Span(f"This slide teaches more than this analysis shows: {reason}. "),
        html.A("Load the essays' example", href=href, id="load-example", className="load-example"),
    ]
