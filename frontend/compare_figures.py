"""The compare panel's figures (docs/design.md §8): two analyses of the same parameters, side by side.

Pure functions of what the API returns: the compare (`GET /compare`: per-tensor totals of both, and the
overlap and Jaccard of their top-q Fisher sets beside chance), the two overviews (next-token
distributions, what each request was) and two pooled views of one matrix (the difference heatmap).
"""

from __future__ import annotations

import math
from typing import Any

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from backend.schemas import ComparePublic, SetComparison, TensorView
from backend.summary import AnalysisSummary, PositionSummary
from backend.vocabulary import MODULE_KINDS
from frontend.numbers import percent
from frontend.plots import (
    LAYOUT,
    LOG_TICKS,
    STAT_LABEL,
    kind_color,
    message_figure,
    small_title,
    token_label,
    unique_token_labels,
)

TOP_TOKENS = 12
A_COLOR, B_COLOR = "#1f77b4", "#ff7f0e"


def request_parts(summary: AnalysisSummary) -> dict[str, str]:
    """What an analysis's request was, part by part, in words (the parts two labels are made from)."""
    sampler = summary.sampler
    method = summary.method
    prefix = "".join(token.text for token in summary.tokens.prefix)
    how = {"truncated": f":{method.fraction}", "mc": f":{method.samples}"}
    return {
        "model": summary.model.id,
        "prefix": f"prefix {token_label(prefix)}",
        "sampler": f"sampler {sampler.kind}",
        "temperature": f"temperature {sampler.temperature:g}",
        "top_k": f"top-k {sampler.top_k}" if sampler.top_k else "no top-k",
        "top_p": f"top-p {sampler.top_p:g}",
        "engine": f"engine {sampler.engine}",
        "method": f"method {method.name}{how.get(method.name, '')}",
    }


def side_labels(summary_a: AnalysisSummary, summary_b: AnalysisSummary) -> tuple[str, str]:
    """'A: temperature 1' and 'B: temperature 0.7': each named by what differs between the two."""
    parts_a, parts_b = request_parts(summary_a), request_parts(summary_b)
    differ = [key for key in parts_a if parts_a[key] != parts_b[key]]
    if not differ:
        same_response = responses(summary_a) == responses(summary_b)
        if same_response:
            return "A", "B (the same analysis as A)"
        return (
            f"A: response {len(responses(summary_a))} tokens",
            f"B: response {len(responses(summary_b))} tokens",
        )
    return "A: " + ", ".join(parts_a[key] for key in differ), "B: " + ", ".join(
        parts_b[key] for key in differ
    )


def responses(summary: AnalysisSummary) -> list[int]:
    return [token.id for token in summary.tokens.continuation]


def tensor_scatter(compare: ComparePublic, stat: str, labels: tuple[str, str]) -> go.Figure:
    """Each tensor's total `stat` in A (x) against B (y), log-log, one colour per module kind, with the
    y = x line: a point above it holds more in B. Zeros cannot sit on a log axis and are counted instead."""
    pairs = [t for t in compare.tensors if t.a[stat] > 0 and t.b[stat] > 0]
    if not pairs:
        return message_figure(f"No tensor has a {STAT_LABEL[stat]} above 0 in both analyses.")
    fig = go.Figure()
    for kind in [*MODULE_KINDS, *sorted({t.kind for t in pairs} - set(MODULE_KINDS))]:
        tensors = [t for t in pairs if t.kind == kind]
        if tensors:
            fig.add_trace(
                go.Scatter(
                    x=[t.a[stat] for t in tensors],
                    y=[t.b[stat] for t in tensors],
                    customdata=[t.name for t in tensors],
                    mode="markers",
                    name=kind,
                    marker={"color": kind_color(kind), "size": 7},
                    hovertemplate="%{customdata}<br>A: %{x:.4g}<br>B: %{y:.4g}<extra></extra>",
                )
            )
    values = [side[stat] for t in pairs for side in (t.a, t.b)]
    low, high = min(values), max(values)
    fig.add_trace(
        go.Scatter(
            x=[low, high], y=[low, high], mode="lines", name="y = x", line={"dash": "dot", "color": "grey"}
        )
    )
    left_out = len(compare.tensors) - len(pairs)
    note = f" ({left_out} tensors with a 0 left out)" if left_out else ""
    fig.update_layout(
        **LAYOUT,
        title=small_title(f"{STAT_LABEL[stat]} per tensor, B against A{note}"),
        xaxis={"type": "log", "title": labels[0], "dtick": 1, **LOG_TICKS},  # whole decades only
        yaxis={"type": "log", "title": labels[1], "dtick": 1, **LOG_TICKS},
        legend={"orientation": "h", "y": -0.25},
    )
    return fig


def percent_ticks(low: float) -> dict[str, Any]:
    """Whole-decade ticks written as percentages (0.1%, 1%, 10%, 100%) from `low` up to 1."""
    exponents = range(math.floor(math.log10(low)), 1)
    values = [10.0**k for k in exponents]
    return {"tickvals": values, "ticktext": [f"{100 * v:g}%" for v in values]}


def sets_figure(sets: SetComparison) -> go.Figure:
    """Overlap and Jaccard of the two top-q Fisher sets at each q, beside their chance values (q and
    q / (2 - q)) for independent random sets; log axis, so chance stays visible under the bars."""
    qs = [f"top {100 * q:g}%" for q in sets.q]
    fig = go.Figure()
    for shares, name, color in (
        (sets.overlap, "overlap |A∩B| / |A|", "#2ca02c"),
        (sets.jaccard, "Jaccard |A∩B| / |A∪B|", "#9467bd"),
    ):
        fig.add_trace(
            go.Bar(
                x=qs,
                y=shares,
                name=name,
                marker_color=color,
                text=[percent(value) for value in shares],  # a positive overlap never reads 0%
                textposition="outside",
            )
        )
    for chance, name, symbol in (
        (sets.chance_overlap, "chance overlap = q", "diamond-open"),
        (sets.chance_jaccard, "chance Jaccard = q/(2−q)", "x"),
    ):
        fig.add_trace(
            go.Scatter(
                x=qs,
                y=chance,
                name=name,
                mode="markers+lines",
                line={"dash": "dot", "color": "grey"},
                marker={"symbol": symbol, "size": 10, "color": "#444", "line": {"width": 2}},
            )
        )
    positive = [
        v
        for shares in (sets.overlap, sets.jaccard, sets.chance_overlap, sets.chance_jaccard)
        for v in shares
        if v > 0
    ]
    low = min(positive, default=1e-3) / 3
    fig.update_layout(
        **LAYOUT,
        barmode="group",
        title=small_title("top-q sets by the centered Fisher: shared between A and B, against chance"),
        yaxis={
            "type": "log",
            "range": [math.log10(low), math.log10(1.6)],
            "title": "share",
            **percent_ticks(low),
        },
        legend={"orientation": "h", "y": -0.2},
    )
    return fig


def next_tokens(
    position_a: PositionSummary, position_b: PositionSummary, labels: tuple[str, str]
) -> go.Figure:
    """The two next-token distributions side by side: p (model) and μ (sampler) of each one's top tokens."""
    fig = make_subplots(rows=1, cols=2, shared_yaxes=True, subplot_titles=labels, horizontal_spacing=0.06)
    for col, (position, side, color) in enumerate(
        ((position_a, "A", A_COLOR), (position_b, "B", B_COLOR)), 1
    ):
        top = position.p.top[:TOP_TOKENS]
        tokens = unique_token_labels(top)
        p = go.Bar(
            x=tokens, y=[t.p for t in top], name="p (model)", marker_color="#7f7f7f", showlegend=col == 1
        )
        fig.add_trace(p, 1, col)
        fig.add_trace(
            go.Bar(x=tokens, y=[t.mu for t in top], name=f"μ (sampler) of {side}", marker_color=color),
            1,
            col,
        )
    fig.update_annotations(font_size=13)
    fig.update_layout(
        **{**LAYOUT, "margin": {**LAYOUT["margin"], "b": 130}},
        barmode="group",
        yaxis_title="probability",
        legend={"orientation": "h", "y": -0.45, "x": 0},
    )
    fig.update_xaxes(tickangle=-45)
    return fig


def difference_heatmap(view_a: TensorView, view_b: TensorView) -> go.Figure:
    """B − A of one matrix's statistic, block by block (the API's pooled sums on the same grid): red where
    B holds more, blue where A does, white where they agree."""
    tensor, stat, pooled_a, pooled_b = view_a.tensor, view_a.stat, view_a.view, view_b.view
    if (pooled_a.row_edges, pooled_a.col_edges) != (pooled_b.row_edges, pooled_b.col_edges):
        return message_figure(
            f"{tensor}: the two pooled views have different block grids; no difference drawn."
        )
    a, b = pooled_a.values, pooled_b.values
    difference = [
        [vb - va for va, vb in zip(row_a, row_b, strict=True)] for row_a, row_b in zip(a, b, strict=True)
    ]
    if not any(value for row in difference for value in row):
        return message_figure(
            f"{tensor}: the {STAT_LABEL.get(stat, stat)} is the same in A and B in every block."
        )
    row_edges, col_edges = pooled_a.row_edges, pooled_a.col_edges
    fig = go.Figure(
        go.Heatmap(
            z=difference,
            x=col_edges[:-1],
            y=row_edges[:-1],
            customdata=[
                [[va, vb] for va, vb in zip(row_a, row_b, strict=True)]
                for row_a, row_b in zip(a, b, strict=True)
            ],
            hovertemplate="rows from %{y}, columns from %{x}<br>B − A: %{z:.3g}<br>A: %{customdata[0]:.3g}"
            "<br>B: %{customdata[1]:.3g}<extra></extra>",
            colorscale="RdBu",
            reversescale=True,
            zmid=0,
            colorbar={"title": "B − A"},
        )
    )
    shape = pooled_a.shape
    fig.update_layout(
        **LAYOUT,
        title=small_title(f"{tensor}: {stat} of B − A, sums over {shape[0]}×{shape[1]} blocks"),
        xaxis_title="column (input)",
        yaxis_title="row (output)",
        yaxis_autorange="reversed",
    )
    if shape[0] == 1:  # a vector (norm weight): one row of blocks
        fig.update_layout(yaxis_showticklabels=False, yaxis_title="vector", height=260)
    return fig


def largest_change(compare: ComparePublic, matrices: list[str], stat: str) -> str | None:
    """The matrix whose total `stat` differs most between A and B (where a heatmap has most to show)."""
    by_name = {t.name: t for t in compare.tensors}
    known = [name for name in matrices if name in by_name]
    if not known:
        return None
    return max(known, key=lambda name: abs(by_name[name].b[stat] - by_name[name].a[stat]))


def reading(compare: ComparePublic, labels: tuple[str, str]) -> str:
    """The top-1% sets against chance, and the model totals of both, in one sentence each."""
    sets = compare.sets
    k = min(range(len(sets.q)), key=lambda i: abs(sets.q[i] - 0.01))
    total_a = sum(t.a["fisher"] for t in compare.tensors)
    total_b = sum(t.b["fisher"] for t in compare.tensors)
    ratio = f" ({total_b / total_a:.3g}× A's)" if total_a > 0 else ""
    return (
        f"{labels[0]} against {labels[1]}. The top {100 * sets.q[k]:g}% of coordinates by centered Fisher "
        f"overlap by {percent(sets.overlap[k])} (chance {percent(sets.chance_overlap[k])}), Jaccard "
        f"{percent(sets.jaccard[k])} (chance {percent(sets.chance_jaccard[k])}). Total Fisher: A "
        f"{total_a:.3g}, B {total_b:.3g}{ratio}."
    )
