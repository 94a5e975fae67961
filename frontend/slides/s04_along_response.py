"""Slide 4, Part 1 section 4: along the response the Fisher adds up."""

from __future__ import annotations

import plotly.graph_objects as go

from backend.summary import AnalysisSummary
from frontend.explorer import response_series
from frontend.numbers import percent
from frontend.plots import LAYOUT, message_figure, response_labels, token_label
from frontend.slides.common import no_response, num, partial_positions

TITLE = "4. Along the response: the Fisher adds up"
CLAIM = "Across positions the cross terms average to zero, so the Fisher is a sum of token Fishers."
FORMULA = (
    r"$$\mathbb{E}\big[\mathrm{score}_i^{(u)}\,\mathrm{score}_i^{(t)}\big]=0\quad(u<t),\qquad "
    r"F_i=\mathbb{E}\Big[\sum_t f_i(s_t)\Big]$$"
)
CHANGES_WITH_CENTERING = True  # the figure shows the toggle's statistic
missing = no_response  # what the analysis must carry for this slide to teach


def figure(summary: AnalysisSummary, centering: str) -> go.Figure:
    """The toggle's statistic at each response position and its running sum."""
    response = summary.response
    if response is None:
        return message_figure(
            "Add a continuation (type or Sample one) to see the Fisher add up along the response."
        )
    label, per_position, running = response_series(response, centering)
    if max(running, default=0.0) <= 0:
        return message_figure(
            "μ is one-hot on y_t (data sampler), so the centered Fisher under μ is 0 at every position;<br>"
            "pick the uncentered view to see the mean shift², or the model sampler to see the Fisher add up."
        )
    labels = response_labels(summary)
    fig = go.Figure()
    partial = partial_positions(summary)
    opacity = [0.4 if still else 1.0 for still in partial] or None  # pale: still partial
    fig.add_trace(go.Bar(x=labels, y=per_position, name=f"{label} at the position", marker_opacity=opacity))
    fig.add_trace(go.Scatter(x=labels, y=running, name="running sum", mode="lines+markers"))
    fig.update_layout(
        **LAYOUT,
        yaxis_title=f"{label}, summed over all parameters",
        xaxis_title="response position t: token y_t predicted",
        legend={"orientation": "h", "y": -0.25},
    )
    return fig


def reading(summary: AnalysisSummary, centering: str) -> str:
    response = summary.response
    if response is None:
        return (
            "This analysis has no continuation: type one (e.g. ' coffee and') and run, or Sample one, "
            "to see the sum."
        )
    label, per_position, running = response_series(response, centering)
    total = running[-1]
    if total <= 0:
        return (
            f"With the data sampler μ is one-hot on each y_t, so over {response.T} response tokens the "
            "centered Fisher under μ is 0: all of the second moment is mean shift (slide 8). Pick the model "
            "sampler to see the Fisher add up."
        )
    peak = max(range(len(per_position)), key=per_position.__getitem__)
    token = summary.tokens.continuation[peak].text
    return (
        f"Shown: {label}. Over {response.T} response tokens it sums to {num(total)}; the position "
        f"predicting {token_label(token)} contributes the most, {num(per_position[peak])} "
        f"({percent(per_position[peak] / total)} of the sum)."
    )
