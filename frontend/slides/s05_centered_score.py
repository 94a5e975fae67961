"""Slide 5, Part 1 section 5: what this needs is a centered score."""

from __future__ import annotations

import plotly.graph_objects as go

from backend.summary import AnalysisSummary
from frontend.numbers import percent
from frontend.plots import LAYOUT, layer_label, stat_total
from frontend.slides.common import no_shift, num, sampler_settings

TITLE = "5. What this needs: a centered score"
CLAIM = (
    "None of this needs on-policy sampling. It needs the score centered under the distribution "
    "that drew the samples."
)
FORMULA = (
    r"$$c_i^{(t)}=\kappa_{i,y_t}-\bar\kappa^{\mu}_i(s_t),\qquad G_i=\operatorname{Cov}_{\mu}(A,c_i),"
    r"\qquad |G_i|\le\operatorname{std}_{\mu}(A)\sqrt{F^{\mu}_i}$$"
)
CHANGES_WITH_CENTERING = False  # draws its own fixed quantities, whatever the toggle says
missing = no_shift  # what the analysis must carry for this slide to teach


def figure(summary: AnalysisSummary, centering: str) -> go.Figure:
    """Centered Fisher and the mean shift squared stacked per layer (their sum is the uncentered one)."""
    layers = summary.layers
    labels = [layer_label(row.layer) for row in layers]
    fig = go.Figure()
    fig.add_trace(go.Bar(x=labels, y=[row.totals["fisher"] for row in layers], name="centered Fisher"))
    shift = go.Bar(
        x=labels,
        y=[row.totals["mean_shift_sq"] for row in layers],
        name="mean shift² (uncentered − centered)",
        marker_color="#d62728",
    )
    fig.add_trace(shift)
    fig.update_layout(
        **LAYOUT, barmode="stack", yaxis_title="per layer", legend={"orientation": "h", "y": -0.2}
    )
    return fig


def sampler_text(summary: AnalysisSummary) -> str:
    """`kind model, temperature 0.7, top-k 40, engine bf16`: what drew the samples."""
    sampler = summary.sampler
    return ", ".join([f"kind {sampler.kind}", *sampler_settings(summary), f"engine {sampler.engine}"])


def reading(summary: AnalysisSummary, centering: str) -> str:
    shift, fisher, uncentered = (
        stat_total(summary.totals, key) for key in ("mean_shift_sq", "fisher", "uncentered")
    )
    if shift <= 1e-12 * max(fisher, 1e-30):
        return (
            f"With the sampler ({sampler_text(summary)}) μ = p, so the mean shift is zero and the plain "
            "softmax score is already centered; lower the temperature or pick the bf16 engine to see it."
        )
    if fisher <= 0:
        return (
            f"With the sampler ({sampler_text(summary)}) μ is one-hot, so the centered Fisher is 0: the "
            f"uncentered second moment, {num(uncentered)}, is mean shift² alone."
        )
    return (
        f"With the sampler ({sampler_text(summary)}) the mean shift² adds {num(shift)} "
        f"to the centered Fisher {num(fisher)}: without centering the second moment is "
        f"{percent(shift / fisher)} larger."
    )
