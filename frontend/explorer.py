"""The explorer's figures: any analysed position, any layer, any matrix, the whole response.

The slides read one position each; the explorer lets the reader pick. Two of its views are also a
slide's figure and are defined here once: the C_mu spectrum (slide 7) and the along-the-response series
of the toggle's statistic (slide 4). Every figure is a pure function of the summary, except the
heatmap, which draws the pooled view the API returns for one tensor.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from backend.schemas import TensorView
from backend.summary import (
    AnalysisSummary,
    KindTotals,
    LayerTotals,
    PositionSummary,
    ResponseSummary,
    Spectrum,
)
from frontend.numbers import percent
from frontend.plots import (
    LAYOUT,
    LOG_TICKS,
    STAT_LABEL,
    all_zero_figure,
    kind_color,
    layer_label,
    log_tickvals,
    message_figure,
    response_labels,
    small_title,
    stat_for_centering,
    stat_total,
    token_label,
    unique_token_labels,
)

ROW_LABELS = 12  # token-named rows on a vocabulary heatmap's axis: more would overlap at 420 px


def next_token(summary: AnalysisSummary, position_index: int = 0) -> go.Figure:
    """The model's p against the sampler's mu for the top next tokens at one position of the summary."""
    return position_next_token(summary.positions[position_index])


def position_next_token(position: PositionSummary) -> go.Figure:
    """The model's p against the sampler's mu for the top next tokens of one position's summary."""
    top = position.p.top
    labels = unique_token_labels(top)
    fig = go.Figure()
    fig.add_trace(go.Bar(x=labels, y=[tok.p for tok in top], name="p (model)"))
    fig.add_trace(go.Bar(x=labels, y=[tok.mu for tok in top], name="μ (sampler)"))
    fig.update_layout(
        **{**LAYOUT, "margin": {**LAYOUT["margin"], "b": 90}},
        barmode="group",
        title=small_title(f"next token after {position.context_length} tokens (top {len(top)})"),
        yaxis_title="probability",
        xaxis_tickangle=-45,
        legend={"orientation": "h", "y": 1.02, "x": 1, "xanchor": "right", "yanchor": "bottom"},
    )
    return fig


# a response's first partial reads C_mu over mu's most probable tokens only (docs/contract.md)
SPECTRUM_PENDING = (
    "C_μ's spectrum comes with the next partial result: this first one reads C_μ over μ's most probable "
    "tokens only, whose leading directions give its lower bound of the Fisher."
)


def spectrum(summary: AnalysisSummary, position_index: int = 0) -> go.Figure:
    """Eigenvalues of C_mu (log scale) and of the uncentered matrix, with the numerical rank and the rank
    bound n - 1 (n = tokens mu can draw) marked. Slide 7 shows the first position."""
    return position_spectrum(summary.positions[position_index], position_index)


def position_spectrum(position: PositionSummary, position_index: int) -> go.Figure:
    """The C_mu spectrum of one position's summary (`position_index` counts from 0, shown from 1)."""
    spec = position.spectrum
    if spec is None:
        return message_figure(SPECTRUM_PENDING)
    eigenvalues = spec.eigenvalues
    if not eigenvalues or max(eigenvalues) <= 0:
        return message_figure(
            "C_μ is zero here: μ is one-hot on one token<br>(data sampler), so nothing varies."
        )
    fig = spectrum_curves(spec)
    rank = max(spec.numerical_rank, 1)
    fig.add_vline(
        x=rank,
        line_dash="dash",
        line_color="grey",
        annotation_text=f"numerical rank {spec.numerical_rank}",
        annotation_position=f"top {label_side(rank, len(eigenvalues))}",
    )
    bound_note = mark_rank_bound(fig, spec.rank_bound, len(eigenvalues))
    fig.update_layout(
        **LAYOUT,
        title=small_title(f"C_μ spectrum at position {position_index + 1}; {bound_note}"),
        xaxis_title="eigenvalue index (1 = largest)",
        xaxis_range=[0, len(eigenvalues) + 1],  # the marks' labels must not stretch the axis below 0
        yaxis_title="eigenvalue (log scale)",
        yaxis_type="log",
        yaxis_tickformat=LOG_TICKS["tickformat"],
        legend={"orientation": "h", "y": -0.2},
    )
    return fig


def spectrum_curves(spec: Spectrum) -> go.Figure:
    """The uncentered and centered eigenvalues, held 12 decades under the largest on the log axis."""
    eigenvalues = spec.eigenvalues
    index = list(range(1, len(eigenvalues) + 1))
    floor = max(eigenvalues[0], 1e-30) * 1e-12
    fig = go.Figure()
    fig.add_trace(
        go.Scatter(
            x=index,
            y=[max(v, floor) for v in spec.uncentered_eigenvalues],
            name="uncentered C_μ + w̄w̄ᵀ",
            mode="lines",
            line={"dash": "dot"},
        )
    )
    fig.add_trace(
        go.Scatter(x=index, y=[max(v, floor) for v in eigenvalues], name="centered C_μ", mode="lines")
    )
    return fig


def label_side(x: float, dimension: int) -> str:
    """Which side of a vertical mark its label goes: towards the middle, so it stays inside the plot."""
    return "right" if x < dimension / 2 else "left"


def mark_rank_bound(fig: go.Figure, bound: int, dimension: int) -> str:
    """Mark the rank bound n - 1 where it lies inside the spectrum; the title's note on it."""
    if bound >= dimension:
        return f"rank bound n − 1 = {bound:,} lies beyond d = {dimension}: not binding"
    fig.add_vline(
        x=max(bound, 1),
        line_dash="dot",
        line_color="#d62728",
        annotation_text=f"rank bound n − 1 = {bound:,}",
        annotation_position=f"bottom {label_side(bound, dimension)}",
    )
    return f"rank bound n − 1 = {bound:,} (marked)"


def response_series(response: ResponseSummary, centering: str) -> tuple[str, list[float], list[float]]:
    """(label, per-position totals, running sum) of the statistic the toggle picks along the response.

    The raw second moment is not kept per position, so `raw` shows the uncentered one and says so.
    """
    stat = stat_for_centering(centering)
    centered = stat == "fisher"
    per_position = list(response.fisher_total if centered else response.uncentered_total)
    running = list(response.fisher_running if centered else response.uncentered_running)
    label = STAT_LABEL["uncentered" if stat == "raw" else stat]
    if stat == "raw":
        label += " (raw is not kept per position)"
    return label, per_position, running


def response_view(summary: AnalysisSummary, centering: str) -> go.Figure:
    """Along the response: the toggle's totals and running sum, p(y_t) and chi^2 per position."""
    response = summary.response
    if response is None:
        return message_figure("No continuation: type or Sample one to see the along-the-response view.")
    label, per_position, running = response_series(response, centering)
    labels = response_labels(summary)
    fig = make_subplots(
        rows=3,
        cols=1,
        shared_xaxes=True,
        vertical_spacing=0.08,
        subplot_titles=(
            f"{label} per position and running sum",
            "p(y_t): model probability of the token",
            "χ²_t = 1/p(y_t) − 1",
        ),
    )
    fig.add_trace(go.Bar(x=labels, y=per_position, name="at the position", marker_color="#1f77b4"), 1, 1)
    fig.add_trace(go.Scatter(x=labels, y=running, name="running sum", mode="lines+markers"), 1, 1)
    fig.add_trace(go.Bar(x=labels, y=response.p_target, name="p(y_t)", marker_color="#2ca02c"), 2, 1)
    fig.add_trace(go.Bar(x=labels, y=response.chi2, name="χ²_t", marker_color="#d62728"), 3, 1)
    for row, values, title in ((2, response.p_target, "p (log)"), (3, response.chi2, "χ² (log)")):
        ticks = {"tickmode": "array", "tickvals": log_tickvals(values)}
        fig.update_yaxes(type="log", title_text=title, **LOG_TICKS, **ticks, row=row, col=1)
    fig.update_layout(**{**LAYOUT, "height": 620}, legend={"orientation": "h", "y": -0.12})
    return fig


def kind_mass(summary: AnalysisSummary, centering: str) -> go.Figure:
    """The chosen statistic summed per module kind."""
    stat = stat_for_centering(centering)
    kinds = summary.kinds
    return group_mass(
        kinds,
        [k.kind for k in kinds],
        stat,
        "kind",
        f"{STAT_LABEL[stat]} per module kind",
        bar={"marker_color": [kind_color(k.kind) for k in kinds]},
    )


def layer_mass(summary: AnalysisSummary, centering: str) -> go.Figure:
    """The chosen statistic summed per layer; each bar carries its layer key for clicks."""
    stat = stat_for_centering(centering)
    layers = summary.layers
    total = sum(stat_total(row.totals, stat) for row in layers) or 1.0
    return group_mass(
        layers,
        [layer_label(row.layer) for row in layers],
        stat,
        "layer",
        f"{STAT_LABEL[stat]} per layer (click a bar to open its matrices)",
        bar={
            "customdata": [[str(row.layer), percent(stat_total(row.totals, stat) / total)] for row in layers],
            "hovertemplate": "%{x}: %{y:.4g} (%{customdata[1]} of the total)<br>click: open its matrices"
            "<extra></extra>",
            "marker_color": "#1f77b4",
        },
        # every layer labelled (Plotly skips every other category label once they crowd)
        xaxis={
            "title": "layer",
            "tickmode": "linear",
            "dtick": 1,
            "tickangle": -90,
            "tickfont": {"size": 10},
        },
    )


def group_mass(
    groups: Sequence[LayerTotals | KindTotals],
    labels: list[str],
    stat: str,
    group: str,
    title: str,
    bar: dict[str, Any],
    **layout: Any,
) -> go.Figure:
    """One bar per group (module kind or layer) of `stat` summed over the group, or the all-zero note
    when every bar would be 0; `bar` and `layout` add to the bar trace and the figure layout."""
    if not any(stat_total(row.totals, stat) > 0 for row in groups):
        return all_zero_figure(stat)
    fig = go.Figure(go.Bar(x=labels, y=[row.totals[stat] for row in groups], **bar))
    fig.update_layout(
        **LAYOUT, title=small_title(title), yaxis_title=f"{stat}, summed over the {group}", **layout
    )
    return fig


def tensors_of_layer(summary: AnalysisSummary, layer: str, stat: str) -> list[str]:
    """The tensors of one layer (key as in `layers`, as a string): matrices first, largest `stat` first."""
    tensors = [t for t in summary.tensors if str(t.layer) == layer]
    ordered = sorted(tensors, key=lambda t: (len(t.shape) != 2, -(t.totals.get(stat) or 0.0)))
    return [t.name for t in ordered]


def block_tokens(
    row_edges: list[int], known: dict[int, str], first: list[str] | None = None, most: int = 3
) -> list[str]:
    """Per block of vocabulary rows, the tokens the summary knows inside it (a few, quoted); a block
    holding none of them is named by its first row's token (``first``, the API's ``row_tokens``)."""
    names = []
    for i, (start, stop) in enumerate(zip(row_edges[:-1], row_edges[1:], strict=True)):
        inside = [token_label(known[row]) for row in sorted(known) if start <= row < stop]
        more = f" +{len(inside) - most}" if len(inside) > most else ""
        if inside:
            names.append(", ".join(inside[:most]) + more)
        else:
            names.append(f"from {token_label(first[i])}" if first and i < len(first) else "")
    return names


def heatmap(view: TensorView, known: dict[int, str] | None = None) -> go.Figure:
    """A pooled view (block sums) of one matrix, from GET .../tensors/{name}. `known`: token texts by id,
    for a matrix whose rows are the vocabulary: each block's rows are then named by their tokens."""
    tensor, stat, pooled = view.tensor, view.stat, view.view
    values = pooled.values
    if not any(value for row in values for value in row):
        return message_figure(f"{tensor}: the {STAT_LABEL.get(stat, stat)} is 0 in every block.")
    row_edges, col_edges = pooled.row_edges, pooled.col_edges
    rows = block_tokens(row_edges, known, view.row_tokens) if known is not None else None
    hover = "rows %{y}, columns from %{x}<br>%{z:.4g}<extra></extra>"
    if rows:
        hover = "rows from %{y} (tokens: %{customdata})<br>columns from %{x}<br>%{z:.4g}<extra></extra>"
    fig = go.Figure(
        go.Heatmap(
            z=values,
            x=col_edges[:-1],
            y=row_edges[:-1],
            colorscale="Viridis",
            colorbar={"title": stat},
            customdata=[[name or "none known"] * len(values[0]) for name in rows] if rows else None,
            hovertemplate=hover,
        )
    )
    fig.update_layout(
        **LAYOUT,
        title=small_title(f"{tensor}: {stat}, sums over {pooled.shape[0]}×{pooled.shape[1]} blocks"),
        xaxis_title="column (input)",
        yaxis_title="row (output)",
        yaxis_autorange="reversed",
    )
    if pooled.shape[0] == 1:  # a vector (norm weight): one row of blocks, no row axis to read
        fig.update_layout(yaxis_showticklabels=False, yaxis_title="vector", height=260)
    if rows and any(rows):  # a row axis of the vocabulary: label the heaviest blocks holding known tokens
        named = [i for i, name in enumerate(rows) if name and not name.startswith("from ")]
        heaviest = sorted(sorted(named, key=lambda i: -sum(values[i]))[:ROW_LABELS])
        labelled = [(row_edges[i], rows[i].split(", ")[0]) for i in heaviest]
        fig.update_yaxes(
            title_text="row (output token)",
            tickmode="array",
            tickvals=[edge for edge, _ in labelled],
            ticktext=[name for _, name in labelled],
            tickfont={"size": 10},
        )
    return fig
