"""Slide 9, Part 2 section 3 (continued): the same cost, booked as a chi^2 signal.

For a one-hot D on the response, 1 + chi^2(D || pi) = 1/pi(y) = prod_t (1 + chi^2_t); the engine reports
chi^2_t and the running sum of log(1 + chi^2_t). The figure draws that sum in log10 units on a linear axis
labelled in whole decades rather than the product on a log axis: the product overflows a float after a
few hundred tokens, its logarithm never does.
"""

from __future__ import annotations

import math

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from backend.summary import AnalysisSummary
from frontend.plots import (
    LAYOUT,
    decade_exponents,
    decade_label,
    decade_range,
    message_figure,
    positive_or_none,
    response_labels,
)
from frontend.slides.common import no_response, num

TITLE = "9. The same cost, booked as a χ² signal"
CLAIM = (
    "The bound still holds, but its signal scale grows at least exponentially with distance from the model."
)
FORMULA = (
    r"$$|G^{\text{SFT}}_i|\le\sqrt{\chi^2(D\,\|\,\pi_\theta)+(1-b)^2}\,\sqrt{F_i},\qquad "
    r"1+\chi^2(D\,\|\,\pi_\theta)\ \ge\ (1+c)^T$$"
)
Range = tuple[int, int]
CHANGES_WITH_CENTERING = False  # draws its own fixed quantities, whatever the toggle says
missing = no_response  # what the analysis must carry for this slide to teach


def figure(summary: AnalysisSummary, centering: str) -> go.Figure:
    """chi^2 per position (left) and 1 + chi^2(D || pi) of the response so far (right), against the floor
    (1 + c)^t with c the smallest per-position chi^2."""
    response = summary.response
    if response is None:
        return message_figure("Add a continuation (type or Sample one) to see the χ² signal grow.")
    labels = response_labels(summary)
    chi2 = response.chi2
    log10_running = in_log10(response.log_one_plus_chi2_cum)
    log10_floor = in_log10(response.log_one_plus_chi2_floor)
    fig = make_subplots(specs=[[{"secondary_y": True}]])
    fig.add_trace(
        go.Bar(x=labels, y=positive_or_none(chi2), name="χ²_t = 1/p(y_t) − 1 (left)", marker_color="#1f77b4")
    )
    for trace in right_traces(labels, log10_running, log10_floor, response.log_one_plus_chi2_cum):
        fig.add_trace(trace, secondary_y=True)
    positive = [value for value in chi2 if value is not None and value > 0]
    left, right = chi2_decade_ranges(
        positive, [value for value in log10_running + log10_floor if value is not None]
    )
    set_decade_axes(fig, left, right)
    fig.update_layout(**LAYOUT, legend={"orientation": "h", "y": -0.25})
    return fig


def in_log10(log_values: list[float | None]) -> list[float | None]:
    """Natural logarithms in log10 units; a null (an infinite term: p(y_t) = 0) stays a gap."""
    return [None if value is None else value / math.log(10) for value in log_values]


def right_traces(
    labels: list[str],
    log10_running: list[float | None],
    log10_floor: list[float | None],
    log_cum: list[float | None],
) -> list[go.Scatter]:
    """The running 1 + chi^2 of the response and the floor (1 + c)^t, both in log10 units."""
    running = go.Scatter(
        x=labels,
        y=log10_running,
        customdata=log_cum,
        hovertemplate="1 + χ² = 10^%{y:.2f}<br>Σ log(1+χ²_t) = %{customdata:.2f}<extra></extra>",
        name="1 + χ²(D‖π) = ∏(1+χ²_t) up to t (right)",
        mode="lines+markers",
        line={"color": "#d62728"},
    )
    floor = go.Scatter(
        x=labels,
        y=log10_floor,
        hovertemplate="(1+c)^t = 10^%{y:.2f}<extra></extra>",
        name="(1+c)^t, c = min χ²_t (right)",
        mode="lines",
        line={"color": "#2ca02c", "dash": "dot"},
    )
    return [running, floor]


def chi2_decade_ranges(positive_chi2: list[float], log10_sums: list[float]) -> tuple[Range, Range]:
    """Whole-decade ranges (log10 units) of the two axes: chi^2_t on the left, the running
    log10(1 + chi^2) on the right. The sums start at 0 (the product at 1); chi^2_t below 1
    (p(y_t) > 1/2) opens decades under it. Both axes take one shared range, so a decade on the left is
    a decade on the right, unless that would squeeze the bars into less than half the height (a long
    response whose product spans hundreds of decades)."""
    log10_chi2 = [math.log10(value) for value in positive_chi2]
    left = (min(0, decade_range(log10_chi2)[0]), decade_range(log10_chi2)[1]) if log10_chi2 else (0, 1)
    right = (0, decade_range(log10_sums)[1])
    shared = (min(left[0], right[0]), max(left[1], right[1]))
    if 2 * (left[1] - left[0]) >= shared[1] - shared[0]:
        return shared, shared
    return left, right


def set_decade_axes(fig: go.Figure, left: Range, right: Range) -> None:
    """Explicit ranges and whole-decade ticks on both axes. Left to itself, Plotly syncs an overlaying
    axis's ticks to the primary one ('sync'), which on a log primary axis gives odd labels and a range
    that cuts the running sum off."""
    left_ticks, right_ticks = decade_exponents(*left), decade_exponents(*right)
    fig.update_yaxes(
        title_text="χ²_t per position (log)",
        type="log",
        range=list(left),
        tickmode="array",
        tickvals=[10.0**k for k in left_ticks],
        ticktext=[decade_label(k) for k in left_ticks],
        secondary_y=False,
    )
    fig.update_yaxes(
        title_text="1 + χ²(D‖π) of the response so far (log)",
        range=list(right),
        tickmode="array",
        tickvals=right_ticks,
        ticktext=[decade_label(k) for k in right_ticks],
        showgrid=left != right,  # one shared range: the left axis's grid lines serve both
        gridcolor="#f4e4e4",
        secondary_y=True,
    )


def reading(summary: AnalysisSummary, centering: str) -> str:
    response = summary.response
    if response is None:
        return "This analysis has no continuation: type or Sample one to see χ² per position and its product."
    # a null is an infinite term (p(y_t) = 0), which the summary cannot send as a number
    chi2 = [math.inf if value is None else value for value in response.chi2]
    log_total = response.log_one_plus_chi2_cum[-1]
    log_total = math.inf if log_total is None else log_total
    return (
        f"Per position χ² runs from {num(min(chi2))} to {num(max(chi2))}; over {response.T} tokens "
        f"Σ log(1+χ²) = {log_total:.2f}, so 1 + χ² ≥ {num(math.exp(log_total))} for this response "
        f"(the (1+c)^T floor with c = {num(min(chi2))} is {num((1 + min(chi2)) ** response.T)})."
    )
