"""Slide 6, Part 2 section 1: in the output layer a row learns only if the sampler hesitates.

The rows, their shares and the concentration bound are the engine's (`output_layer`). The bound is
null where the essay does not state it: a non-linear logit map (softcapped logits, `logit_map` true),
or a one-hot μ (1 − Σμ² = 0).
"""

from __future__ import annotations

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from backend.summary import AnalysisSummary, OutputLayer
from frontend.numbers import percent, value_and_bound
from frontend.plots import LAYOUT, token_label, unique_token_labels
from frontend.slides.common import first_position

TITLE = "6. Output layer: a row learns only if the sampler hesitates"
CLAIM = (
    "In the output layer the Fisher is exactly sparse: row c gets a gradient only if the sampler is "
    "unsure about token c."
)
FORMULA = (
    r"$$f_{(c,k)}=h_k^2\,\mu(c)\big(1-\mu(c)\big),\qquad "
    r"\sum_{c,k}f_{(c,k)}=\|h\|^2\Big(1-\sum_c\mu(c)^2\Big)$$"
)
ROWS_NAMED = 20  # the rows the engine lists, and the concentration bound's entry for them
CHANGES_WITH_CENTERING = False  # draws its own fixed quantities, whatever the toggle says


def figure(summary: AnalysisSummary, centering: str) -> go.Figure:
    """Per-row share of the output-layer Fisher, ||h||^2 mu (1 - mu), against mu itself."""
    rows = first_position(summary).output_layer.rows
    labels = unique_token_labels(rows)
    fig = make_subplots(specs=[[{"secondary_y": True}]])
    fig.add_trace(go.Bar(x=labels, y=[row.share for row in rows], name="share of output-layer Fisher"))
    mu = go.Scatter(
        x=labels,
        y=[row.mu for row in rows],
        name="μ (sampler probability)",
        mode="markers+lines",
        line={"color": "#ff7f0e"},
    )
    fig.add_trace(mu, secondary_y=True)
    top_share = max([row.share for row in rows] or [1.0])
    top_mu = max([row.mu for row in rows] or [1.0])
    fig.update_yaxes(title_text="share of Σ f_row", range=[0, 1.08 * top_share], secondary_y=False)
    # its own ticks: synced to the left axis's grid they land on odd values (0.149, 0.299, ...)
    fig.update_yaxes(
        title_text="μ", range=[0, 1.08 * top_mu], tickmode="auto", showgrid=False, secondary_y=True
    )
    fig.update_layout(**LAYOUT, legend={"orientation": "h", "y": -0.3})
    return fig


def reading(summary: AnalysisSummary, centering: str) -> str:
    output = first_position(summary).output_layer
    return rows_sentence(output) + outside_sentence(summary, output)


def rows_sentence(output: OutputLayer) -> str:
    """How much of the output-layer Fisher the two largest rows, and the rows shown, hold."""
    if output.total <= 0:
        return "μ is one-hot on one token, so every row's Fisher ‖h‖²μ(c)(1−μ(c)) is 0: no output row learns."
    rows = sorted(output.rows, key=lambda row: -row.share)
    names = " and ".join(token_label(row.text) for row in rows[:2])
    return (
        f"The rows of {names} hold {percent(sum(row.share for row in rows[:2]))} of the output-layer "
        f"Fisher (total ‖h‖²(1−Σμ²) = {output.total:.3g}); the {len(rows)} rows shown hold "
        f"{percent(sum(row.share for row in rows))}."
    )


def outside_sentence(summary: AnalysisSummary, output: OutputLayer) -> str:
    """The share of the rows beyond the 20 shown, against the essay's bound where the engine states it."""
    outside = next((b for b in output.concentration_bound if b.top_tokens == ROWS_NAMED), None)
    if outside is None:
        return ""
    others = f" The other {summary.model.vocab_size - ROWS_NAMED:,} rows share "
    share = percent(outside.share_outside)
    if outside.bound is not None:
        share, bound = value_and_bound(outside.share_outside, outside.bound)
        return f"{others}{share}, under the bound {bound}."
    if output.logit_map:
        return f"{others}{share}; the bound is not stated for a non-linear logit map (softcapped logits)."
    return f"{others}{share}; the bound is not stated for a one-hot μ (1 − Σμ² = 0)."
