"""Slide 3, Part 1 section 3: at one position the Fisher is a spread of sensitivities."""

from __future__ import annotations

import math

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from backend.summary import AnalysisSummary, TensorTotals
from backend.vocabulary import MODULE_KINDS
from frontend.plots import (
    LAYOUT,
    LOG_TICKS,
    STAT_LABEL,
    kind_color,
    layer_label,
    stat_for_centering,
    stat_total,
)
from frontend.slides.common import num, partial_positions

TITLE = "3. One position: the Fisher is a spread of sensitivities"
CLAIM = (
    "At one prefix, a parameter's token Fisher is the variance of how strongly it moves each "
    "candidate's logit."
)
FORMULA = (
    r"$$\frac{\partial\log p(a\mid s)}{\partial\theta_i}=\kappa_{i,a}-\bar\kappa^{p}_i,\qquad "
    r"f_i(s)=\operatorname{Var}_{a\sim p}\big[\kappa_{i,a}\big]"
    r"=\tfrac12\sum_{a,b}p(a)\,p(b)\,\big(\kappa_{i,a}-\kappa_{i,b}\big)^2$$"
)
CHANGES_WITH_CENTERING = True  # the figure shows the toggle's statistic


def figure(summary: AnalysisSummary, centering: str) -> go.Figure:
    """The chosen statistic for every tensor, by layer, one trace per module kind; rho per kind.

    Each point carries its tensor's name (customdata): clicking it opens that matrix in the explorer.
    """
    stat = stat_for_centering(centering)
    fig = make_subplots(
        rows=1,
        cols=2,
        column_widths=[0.72, 0.28],
        subplot_titles=(f"{STAT_LABEL[stat]} per tensor", "ρ: share centering removes"),
    )
    for kind in MODULE_KINDS:
        tensors = [t for t in summary.tensors if t.kind == kind]
        if tensors:
            fig.add_trace(tensor_points(tensors, kind, stat), 1, 1)
    if summary.rho_available:
        kinds = summary.kinds
        rho = go.Bar(
            x=[k.kind for k in kinds],
            y=[k.totals["rho_mean"] for k in kinds],
            marker_color=[kind_color(k.kind) for k in kinds],
            showlegend=False,
            name="rho",
        )
        fig.add_trace(rho, 1, 2)
    else:
        fig.add_annotation(
            text="ρ needs the Fisher under p:<br>computing it as a second stage",
            xref="x2 domain",
            yref="y2 domain",
            x=0.5,
            y=0.5,
            showarrow=False,
        )
        fig.update_xaxes(visible=False, row=1, col=2)
    set_axes(fig, [layer_label(row.layer) for row in summary.layers], stat)
    return fig


def set_axes(fig: go.Figure, layer_labels: list[str], stat: str) -> None:
    """Layers in the model's order (not the order kinds first appear), the statistic on a log axis."""
    fig.update_xaxes(categoryorder="array", categoryarray=layer_labels, row=1, col=1)
    fig.update_yaxes(type="log", title_text=f"{stat} of the tensor (log)", **LOG_TICKS, row=1, col=1)
    fig.update_yaxes(range=[0, 1], title_text="mean ρ over the kind", row=1, col=2)
    fig.update_layout(**LAYOUT, legend={"orientation": "h", "y": -0.2})


def tensor_points(tensors: list[TensorTotals], kind: str, stat: str) -> go.Scatter:
    """One module kind's tensors as points at their layer, named in the hover and in customdata."""
    return go.Scatter(
        x=[layer_label(t.layer) for t in tensors],
        y=[t.totals[stat] for t in tensors],
        customdata=[t.name for t in tensors],
        mode="markers",
        name=kind,
        marker={"color": kind_color(kind), "size": 7},
        hovertemplate="%{customdata}<br>%{y:.4g}<extra></extra>",
    )


def reading(summary: AnalysisSummary, centering: str) -> str:
    fisher, uncentered, raw = (stat_total(summary.totals, key) for key in ("fisher", "uncentered", "raw"))
    stat = stat_for_centering(centering)
    raw_vs_fisher = (
        f"{num(raw / fisher)}× the Fisher" if fisher > 0 else "the Fisher under μ is 0 here: μ is one-hot"
    )
    return (
        f"Shown: {STAT_LABEL[stat]}. Over the whole model the centered Fisher is "
        f"{num(fisher)}, the uncentered second moment {num(uncentered)} and the raw "
        f"{num(raw)} ({raw_vs_fisher}); {where_centering_removes_most(summary)}"
    )


def where_centering_removes_most(summary: AnalysisSummary) -> str:
    """The kind with the largest mean ρ; or, before ρ is in, why it is not drawn yet."""
    known = [k for k in summary.kinds if math.isfinite(stat_total(k.totals, "rho_mean"))]
    if summary.rho_available and known:
        most_removed = max(known, key=lambda k: stat_total(k.totals, "rho_mean"))
        return (
            f"centering removes the most in the {most_removed.kind} matrices, "
            f"mean ρ = {stat_total(most_removed.totals, 'rho_mean'):.2f}."
        )
    if summary.rho_available:
        return "mean ρ is not a finite number in any kind here."
    if any(partial_positions(summary)):  # a response's partial sums no ratio per parameter
        return "ρ, the share centering removes, is a ratio per parameter: it comes with the exact result."
    return (
        "ρ, the share centering removes, needs the Fisher under p as well, "
        f"{summary.model.d_model} more backward directions per position off the policy: it is being "
        "computed as a second stage and appears here when done."
    )
