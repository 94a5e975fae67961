"""Slide 10, Part 2 section 5: sparsity is not a defect (training-inference mismatch).

Per output row c of the top tokens, the engine reports the on-policy Fisher `row_fisher_p` =
g'^2 ||h||^2 p(1 - p) and the mean shift squared `row_shift_sq` = g'^2 ||h||^2 (mu - p)^2. The update
a single draw of c gives its row, (1 - p) g' ||h||, is the same row's sqrt(Fisher) times
sqrt((1 - p) / p): the essay's contrast is that ratio, large exactly for the rarely sampled tokens.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import plotly.graph_objects as go

from backend.summary import AnalysisSummary
from frontend.plots import LAYOUT, token_label
from frontend.slides.common import first_position, no_shift, sampler_settings

TITLE = "10. Sparsity is not a defect"
CLAIM = "Under training–inference mismatch, centering is what keeps numerical noise out of the update."
FORMULA = (
    r"$$\underbrace{\big(1-p(c)\big)\lVert h\rVert}_{\text{update when }c\text{ is drawn}}"
    r"=\sqrt{\tfrac{1-p(c)}{p(c)}}\;"
    r"\underbrace{\sqrt{p(c)\big(1-p(c)\big)}\,\lVert h\rVert}_{\sqrt{f^{p}_c}},"
    r"\qquad m_c=\big(\mu(c)-p(c)\big)\,h$$"
)
CHANGES_WITH_CENTERING = False  # draws its own fixed quantities, whatever the toggle says
missing = no_shift  # what the analysis must carry for this slide to teach


@dataclass(frozen=True)
class Row:
    """One output row's per-draw update, on-policy sqrt(Fisher) and mean shift norm (all with g')."""

    text: str
    p: float
    mu: float
    update: float
    sqrt_fisher: float
    shift: float

    @property
    def ratio(self) -> float:
        """update / sqrt(Fisher) = sqrt((1 - p) / p)."""
        return self.update / self.sqrt_fisher if self.sqrt_fisher > 0 else math.inf


def head_rows(summary: AnalysisSummary) -> list[Row]:
    """The top tokens' rows with p > 0, ordered by p (rarest first)."""
    rows = []
    for token in first_position(summary).p.top:
        p = token.p
        if p <= 0:
            continue
        sqrt_fisher = math.sqrt(max(token.row_fisher_p, 0.0))
        rows.append(
            Row(
                text=token.text,
                p=p,
                mu=token.mu,
                update=sqrt_fisher * math.sqrt((1 - p) / p),
                sqrt_fisher=sqrt_fisher,
                shift=math.sqrt(max(token.row_shift_sq, 0.0)),
            )
        )
    return sorted(rows, key=lambda row: row.p)


def figure(summary: AnalysisSummary, centering: str) -> go.Figure:
    """Per-draw update and sqrt(on-policy Fisher) per row against p, log-log; the shifted rows marked."""
    rows = head_rows(summary)
    ps = [row.p for row in rows]
    labels = [token_label(row.text) for row in rows]
    fig = go.Figure()
    update = go.Scatter(
        x=ps, y=[row.update for row in rows], name="update when drawn (1−p)‖h‖", mode="lines+markers"
    )
    fig.add_trace(update)
    fisher = go.Scatter(
        x=ps,
        y=[row.sqrt_fisher for row in rows],
        name="√ on-policy Fisher √(p(1−p))‖h‖",
        mode="lines+markers",
        text=labels,
        textposition="bottom center",
    )
    fig.add_trace(fisher)
    shifted = [row for row in rows if row.shift > 0]
    shift = go.Scatter(
        x=[row.p for row in shifted],
        y=[row.shift for row in shifted],
        name="mean shift |μ−p|‖h‖ (red: μ > p, drawn more than p would)",
        mode="markers+text",
        text=[token_label(row.text) for row in shifted],
        textposition="top center",
        textfont={"size": 9},
        marker={
            "symbol": "x",
            "size": 9,
            "color": ["#d62728" if row.mu > row.p else "#1f77b4" for row in shifted],
        },
    )
    fig.add_trace(shift)
    fig.update_xaxes(type="log", title_text="p(c), the model's probability of the row's token")
    fig.update_yaxes(type="log", title_text="per row (‖·‖ over the row)")
    fig.update_layout(**LAYOUT, legend={"orientation": "h", "y": -0.3})
    return fig


def reading(summary: AnalysisSummary, centering: str) -> str:
    drawn = [row for row in head_rows(summary) if row.mu > 0]
    if not drawn:
        return "No row of the top tokens is drawn by this sampler, so no row receives a per-draw update."
    shifted = [row for row in drawn if row.shift > 0]
    if not shifted:
        return (
            f"{contrast_sentence(drawn)} Here μ = p exactly (engine model, no temperature or truncation), "
            "so there is no shift to inject; switch the engine to bf16 to see the mismatch."
        )
    why = ", ".join([f"engine {summary.sampler.engine}", *sampler_settings(summary)])
    over = sum(1 for row in shifted if row.mu > row.p)
    return (
        f"{contrast_sentence(drawn)} The sampler ({why}) shifts {len(shifted)} of these {len(drawn)} "
        f"drawn rows by (μ−p)h, {over} of them drawn more often than p would; centering removes all of it."
    )


def contrast_sentence(drawn: list[Row]) -> str:
    """The rarest drawn row's update against its sqrt(Fisher), and the likeliest's for contrast."""
    rarest, likeliest = drawn[0], drawn[-1]
    sentence = (
        f"Drawn, the rarest shown token {token_label(rarest.text)} (p = {rarest.p:.2g}) moves its row by "
        f"{rarest.update:.3g}, √((1−p)/p) = {rarest.ratio:.3g} times its √Fisher {rarest.sqrt_fisher:.2g}"
    )
    if likeliest is rarest:
        return sentence + "."
    return (
        f"{sentence}; the likeliest, {token_label(likeliest.text)} (p = {likeliest.p:.2g}), by "
        f"{likeliest.ratio:.3g} times its own."
    )
