"""Slide 2, Part 1 section 2: the gradient is a covariance, the Fisher a variance.

The output rows' numbers are the engine's (`row_fisher`, `row_policy_grad`, `row_bound` of each top
token, the last two only when a reward is set); the overlap of the top-q sets is `summary.overlap`.
"""

from __future__ import annotations

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from backend.summary import AnalysisSummary, CandidateRow, Overlap
from frontend.numbers import percent
from frontend.plots import LAYOUT, token_label, unique_token_labels
from frontend.slides.common import first_position, no_varying_reward

TITLE = "2. The gradient is a covariance, the Fisher a variance"
CLAIM = (
    "On the model's own samples the score averages to zero, so the expected gradient is a covariance "
    "and the Fisher is a variance."
)
FORMULA = (
    r"$$G_i=\mathbb{E}\big[A\cdot\mathrm{score}_i\big]=\operatorname{Cov}(A,\mathrm{score}_i),\qquad "
    r"F_i=\operatorname{Var}(\mathrm{score}_i),\qquad |G_i|\le\operatorname{std}(A)\sqrt{F_i}$$"
)
ROWS_SHOWN = 12
CHANGES_WITH_CENTERING = False  # draws its own fixed quantities, whatever the toggle says
missing = no_varying_reward  # what the analysis must carry for this slide to teach


def or_zero(values: list[float | None]) -> list[float]:
    """The engine's `row_policy_grad` or `row_bound` of each token; without a reward (null) both are 0."""
    return [value or 0.0 for value in values]


def figure(summary: AnalysisSummary, centering: str) -> go.Figure:
    """Per output row |G| against std(r) sqrt(F); overlap of the top-q sets against random."""
    top = first_position(summary).p.top[:ROWS_SHOWN]
    fig = make_subplots(
        rows=1,
        cols=2,
        column_widths=[0.6, 0.4],
        subplot_titles=(
            "output rows: |gradient| vs bound std(r)·√F",
            "top-q by Fisher ∩ top-q by |gradient|",
        ),
    )
    labels = unique_token_labels(top)
    bound = go.Bar(
        x=labels,
        y=or_zero([token.row_bound for token in top]),
        name="bound std(r)·√F",
        marker_color="#aec7e8",
    )
    fig.add_trace(bound, 1, 1)
    gradient = go.Bar(
        x=labels,
        y=or_zero([token.row_policy_grad for token in top]),
        name="|policy gradient|",
        marker_color="#d62728",
    )
    fig.add_trace(gradient, 1, 1)
    add_overlap(fig, summary.overlap, partial=summary.concentration is None)
    fig.update_layout(**LAYOUT, barmode="group", legend={"orientation": "h", "y": -0.25})
    fig.update_yaxes(title_text="per row (‖·‖ over the row)", row=1, col=1)
    fig.update_yaxes(title_text="share of the top-q gradient set", range=[0, 1], row=1, col=2)
    return fig


def add_overlap(fig: go.Figure, overlap: Overlap | None, partial: bool = False) -> None:
    """Right panel: the top-q overlap of Fisher and |gradient| against its random baseline."""
    if overlap is None:
        fig.add_annotation(
            text="computed when the analysis finishes" if partial else "set a reward to see the overlap",
            showarrow=False,
            xref="x2 domain",
            yref="y2 domain",
            x=0.5,
            y=0.5,
        )
        return
    qs = [f"{100 * q:g}%" for q in overlap.q]
    fig.add_trace(go.Bar(x=qs, y=overlap.fisher_vs_policy_grad, name="overlap", marker_color="#2ca02c"), 1, 2)
    baseline = go.Scatter(
        x=qs,
        y=overlap.baseline,
        name="random baseline",
        mode="lines+markers",
        line={"dash": "dot", "color": "grey"},
    )
    fig.add_trace(baseline, 1, 2)


def reading(summary: AnalysisSummary, centering: str) -> str:
    position = first_position(summary)
    rewarded = [token for token in position.p.top if token.reward != 0]
    if not rewarded or position.reward is None or position.reward.std == 0:
        return (
            "No reward varies over the likely next tokens, so the gradient is zero everywhere; click "
            "candidate tokens to give them a reward and see the bound at work."
        )
    return rows_sentence(rewarded, position.output_layer.total) + overlap_sentence(summary)


def rows_sentence(rewarded: list[CandidateRow], output_total: float) -> str:
    """How much of the output-layer Fisher the rewarded rows hold, and their gradient against the bound."""
    share = sum(token.row_fisher for token in rewarded) / output_total
    gradient = sum(or_zero([token.row_policy_grad for token in rewarded]))
    bound = sum(or_zero([token.row_bound for token in rewarded]))
    ratio = gradient / bound if bound else 0.0
    verdict = (
        "the reward barely tells the rewarded tokens apart"
        if ratio < 0.25
        else "the reward separates the rewarded tokens from the rest"
    )
    names = " and ".join(token_label(token.text) for token in rewarded[:3])
    one = len(rewarded) == 1
    return (
        f"The rewarded row{'' if one else 's'} {names} hold{'s' if one else ''} {percent(share)} of the "
        f"output-layer Fisher; {'its' if one else 'their'} gradient is {percent(ratio)} of the bound "
        f"std(r)·√F: {verdict}."
    )


def overlap_sentence(summary: AnalysisSummary) -> str:
    """The top-1% overlap of Fisher and |gradient| against random, where the engine measured it."""
    overlap = summary.overlap
    if overlap is None or 0.01 not in overlap.q:
        return ""
    k = overlap.q.index(0.01)
    return (
        f" The top 1% of coordinates by Fisher hold {percent(overlap.fisher_vs_policy_grad[k])} of "
        f"the top 1% by |gradient|, against {percent(overlap.baseline[k])} at random."
    )
