"""Slide 1, Part 1 section 1: small is not sparse."""

from __future__ import annotations

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from backend.summary import AnalysisSummary, LayerTotals
from frontend.numbers import percent
from frontend.plots import (
    LAYOUT,
    LOG_TICKS,
    PARTIAL_NOTE,
    STAT_LABEL,
    layer_label,
    message_figure,
    stat_for_centering,
    stat_total,
)

TITLE = "1. Small is not sparse"
CLAIM = (
    "Reweighting what the model already samples explains why the update is small, "
    "not why it lands on a few coordinates."
)
FORMULA = (
    r"$$\mathrm{share}(q)=\frac{\sum_{i\,\in\,\text{top }q}F_i}{\sum_i F_i},"
    r"\qquad \mathrm{share}(q)=q \text{ if the Fisher were spread evenly}$$"
)
CHANGES_WITH_CENTERING = True  # the figure shows the toggle's statistic


def figure(summary: AnalysisSummary, centering: str) -> go.Figure:
    """Share of the total held by the top q of coordinates, with the uniform (dense) line for reference,
    and the statistic summed per layer."""
    stat = stat_for_centering(centering)
    if summary.concentration is None:
        return message_figure(PARTIAL_NOTE)
    curve = summary.concentration[stat]
    fig = make_subplots(
        rows=1,
        cols=2,
        column_widths=[0.45, 0.55],
        subplot_titles=("share held by the top q of coordinates", "mass per layer"),
    )
    fig.add_trace(go.Scatter(x=curve.q, y=curve.share, mode="lines", name=STAT_LABEL[stat]), 1, 1)
    dense = go.Scatter(
        x=curve.q,
        y=curve.q,
        mode="lines",
        name="dense (uniform)",
        line={"dash": "dot", "color": "grey"},
    )
    fig.add_trace(dense, 1, 1)
    fig.add_trace(layer_bars(summary.layers, stat), 1, 2)
    fig.update_xaxes(
        type="log", title_text="top share q of coordinates (fraction)", **LOG_TICKS, row=1, col=1
    )
    fig.update_yaxes(title_text="share of total", range=[0, 1.02], row=1, col=1)
    fig.update_yaxes(title_text=f"{stat}, summed over the layer", row=1, col=2)
    fig.update_layout(**LAYOUT, legend={"orientation": "h", "y": -0.2})
    return fig


def layer_bars(layers: list[LayerTotals], stat: str) -> go.Bar:
    """The statistic summed over each layer, as the engine reports it."""
    return go.Bar(
        x=[layer_label(row.layer) for row in layers],
        y=[row.totals[stat] for row in layers],
        name=f"{stat} per layer",
        marker_color="#1f77b4",
    )


def layer_share(summary: AnalysisSummary, stat: str) -> tuple[int | str, float]:
    """The layer holding the largest part of a statistic, and that part's share of the whole."""
    total = sum(stat_total(row.totals, stat) for row in summary.layers) or 1.0
    best = max(summary.layers, key=lambda row: stat_total(row.totals, stat))
    return best.layer, stat_total(best.totals, stat) / total


def reading(summary: AnalysisSummary, centering: str) -> str:
    stat = stat_for_centering(centering)
    if summary.concentration is None:
        return PARTIAL_NOTE
    at = summary.concentration[stat].at
    layer, share = layer_share(summary, stat)
    return (
        f"The top 1% of the model's {summary.model.n_params:,} coordinates hold {percent(at['0.01'])} "
        f"of the {STAT_LABEL[stat]} (0.1% hold {percent(at['0.001'])}), against 1% if it were "
        f"spread evenly; layer {layer_label(layer)} holds the most, {percent(share)} of the total."
    )
