"""Slide 10, Part 2 section 5: sparsity is not a defect (training-inference mismatch).

Per top token the engine reports the output row's mean shift squared `row_shift_sq`, g'^2 ||h||^2
(mu - p)^2, and its on-policy Fisher `row_fisher_p`, g'^2 ||h||^2 p (1 - p); the slide draws both.
"""

from __future__ import annotations

import math
from typing import Any

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from frontend.plots import LAYOUT, Summary, token_label, unique_token_labels
from frontend.slides.common import first_position, sampler_settings

TITLE = "10. Sparsity is not a defect"
CLAIM = "Under training–inference mismatch, centering is what keeps numerical noise out of the update."
FORMULA = r"$$m_{(c,k)}=\big(\mu(c)-p(c)\big)\,h_k,\qquad f^{p}_{(c,k)}=h_k^2\,p(c)\big(1-p(c)\big)$$"


def figure(summary: Summary, centering: str) -> go.Figure:
    """Output-row shift (mu_c - p_c) h against the row's on-policy Fisher, per top token."""
    top = first_position(summary)["p"]["top"]
    labels = unique_token_labels(top)
    fig = make_subplots(specs=[[{"secondary_y": True}]])
    shift = go.Bar(
        x=labels,
        y=[token["row_shift_sq"] for token in top],
        name="row mean shift² = (μ−p)²‖h‖²",
        marker_color="#d62728",
    )
    fig.add_trace(shift)
    fisher_p = go.Scatter(
        x=labels,
        y=[token["row_fisher_p"] for token in top],
        name="on-policy row Fisher p(1−p)‖h‖²",
        mode="markers+lines",
    )
    fig.add_trace(fisher_p, secondary_y=True)
    # both from 0 with their own ticks: left to itself Plotly syncs the right axis's ticks to the left
    # one's grid, which puts negative values on an axis of a non-negative quantity
    top_shift = max([token["row_shift_sq"] for token in top] or [1.0]) or 1.0
    top_fisher = max([token["row_fisher_p"] for token in top] or [1.0]) or 1.0
    fig.update_yaxes(title_text="row mean shift²", range=[0, 1.08 * top_shift], secondary_y=False)
    fig.update_yaxes(
        title_text="on-policy row Fisher",
        range=[0, 1.08 * top_fisher],
        tickmode="auto",
        showgrid=False,
        secondary_y=True,
    )
    fig.update_layout(**LAYOUT, legend={"orientation": "h", "y": -0.3})
    return fig


def shift_ratio(token: dict[str, Any]) -> float:
    """The row's shift² relative to its on-policy Fisher (infinite for a shift where p(1 - p) = 0)."""
    shift, fisher_p = token["row_shift_sq"], token["row_fisher_p"]
    if fisher_p > 0:
        return shift / fisher_p
    return math.inf if shift > 0 else 0.0


def reading(summary: Summary, centering: str) -> str:
    top = first_position(summary)["p"]["top"]
    worst = max(top, key=shift_ratio)
    if shift_ratio(worst) == 0:
        return (
            "Here μ = p exactly (engine model, no temperature or truncation), so there is no shift; "
            "switch the engine to bf16 to see the mismatch."
        )
    rarest = min(top, key=lambda token: token["p"])
    why = ", ".join([f"engine {summary['sampler']['engine']}", *sampler_settings(summary)])
    return (
        f"Sampler ({why}): relative to its on-policy Fisher, the shift is largest on the row of "
        f"{token_label(worst['text'])} (shift²/Fisher = {shift_ratio(worst):.2g}); the rarest shown token "
        f"{token_label(rarest['text'])} (p = {rarest['p']:.2g}) has {shift_ratio(rarest):.2g}. "
        "Centering removes all of it."
    )
