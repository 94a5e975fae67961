"""The study page's figures: pure functions of a finished study's typed summary (``StudySummary``).

Why each share sits beside a baseline: a mask that holds 40% of its coordinates in one layer says
something only next to that layer's share of all parameters (where a random mask of the same density
would put 40% too), and an estimator's top-q overlap with the exact mask only next to chance (q).
"""

from __future__ import annotations

import plotly.graph_objects as go

from backend.study_schemas import StudyMaskView
from backend.study_summary import EstimatorComparison, Estimators, GroupMaskShare, ResponseRecord
from backend.update_schemas import UpdateGroup
from frontend.numbers import percent
from frontend.studies.form import density_label

MASK_COLOR = "#d62728"
PARAMS_COLOR = "#9aa5b1"
UPDATES_COLOR = "#1f77b4"
ESTIMATOR_COLORS = {"mc_fisher": "#1f77b4", "empirical_fisher": "#ff7f0e"}
ESTIMATOR_NAMES = {"mc_fisher": "Monte Carlo Fisher", "empirical_fisher": "empirical Fisher"}
LEGEND_NAMES = {"mc_fisher": "MC Fisher", "empirical_fisher": "empirical Fisher"}
REWARD_COLORS = {None: "#1f77b4", 0.0: "#9aa5b1", 1.0: "#2ca02c"}
FONT = {"family": "system-ui, -apple-system, Segoe UI, Roboto, DejaVu Sans, sans-serif", "size": 12}


def _layout(figure: go.Figure, title: str, height: int = 320) -> go.Figure:
    figure.update_layout(
        title={"text": title, "x": 0, "xanchor": "left", "y": 0.98, "yanchor": "top", "font": {"size": 14}},
        height=height,
        margin={"l": 60, "r": 20, "t": 64, "b": 40},
        font=FONT,
        plot_bgcolor="#fff",
        paper_bgcolor="#fff",
        legend={"orientation": "h", "y": 1.0, "yanchor": "bottom", "x": 0, "xanchor": "left"},
        barmode="group",
    )
    figure.update_yaxes(gridcolor="#eee", zeroline=False)
    return figure


def mask_groups_figure(rows: list[GroupMaskShare], n_params: int, q: float, by: str) -> go.Figure:
    """The top-q mask's share per group (layer or module kind) beside the group's share of parameters."""
    groups = [row.group for row in rows]
    hover = [
        f"{row.count:,} of the mask's coordinates; {row.size:,} parameters; "
        f"{percent(row.density, 3)} of the group is in the mask (q = {density_label(q)})"
        for row in rows
    ]
    figure = go.Figure(
        [
            go.Bar(
                x=groups,
                y=[row.share_of_mask for row in rows],
                name=f"share of the top-{density_label(q)} mask",
                marker_color=MASK_COLOR,
                hovertext=hover,
                hovertemplate="%{x}: %{y:.2%} of the mask<br>%{hovertext}<extra></extra>",
            ),
            _parameters_bar(groups, [row.size for row in rows], n_params, "share of all parameters"),
        ]
    )
    _layout(figure, f"Top-{density_label(q)} mask per {by}", height=340)
    return _share_axes(figure)


def _parameters_bar(groups: list[str], sizes: list[int], n_params: int, name: str) -> go.Bar:
    """Each group's share of all parameters: where a random set of any density would put its share."""
    return go.Bar(
        x=groups,
        y=[size / n_params if n_params else 0.0 for size in sizes],
        name=name,
        marker_color=PARAMS_COLOR,
        hovertemplate="%{x}: %{y:.2%} of the parameters<extra></extra>",
    )


def _share_axes(figure: go.Figure) -> go.Figure:
    figure.update_xaxes(type="category", automargin=True)
    figure.update_yaxes(tickformat=".0%", title="share", rangemode="tozero")
    return figure


def estimator(estimators: Estimators, key: str) -> EstimatorComparison:
    """The entry of ``key`` (a key of ESTIMATOR_NAMES)."""
    return estimators.mc_fisher if key == "mc_fisher" else estimators.empirical_fisher


def estimator_overlap_figure(estimators: Estimators) -> go.Figure:
    """Each estimator's top-q set against the exact F's (overlap |A n B| / |A|), beside chance (q)."""
    figure = go.Figure()
    fractions: list[float] = []
    for key, name in ESTIMATOR_NAMES.items():
        compared = estimator(estimators, key).top_q_vs_fisher
        if compared is None:
            continue
        fractions = compared.q
        figure.add_bar(
            x=[density_label(q) for q in compared.q],
            y=compared.overlap,
            name=LEGEND_NAMES[key],
            marker_color=ESTIMATOR_COLORS[key],
            hovertemplate=f"{name}, top %{{x}}: %{{y:.2%}} of its set is in the exact F's<extra></extra>",
        )
    if fractions:
        figure.add_scatter(
            x=[density_label(q) for q in fractions],
            y=fractions,
            mode="markers",
            name="chance",
            marker={"symbol": "line-ew-open", "size": 28, "color": "#222", "line": {"width": 3}},
            hovertemplate="chance for unrelated sets of density %{x}: %{y:.2%}<extra></extra>",
        )
    _layout(figure, "Top-q overlap with the exact F's set", height=340)
    figure.update_xaxes(type="category")
    figure.update_yaxes(tickformat=".0%", range=[0, 1.05], title="overlap")
    return figure


def response_fisher_figure(responses: list[ResponseRecord], rewarded: bool) -> go.Figure:
    """Each response's Fisher total (sum over its positions), coloured by its reward when there is one."""
    figure = go.Figure()
    for reward, color in REWARD_COLORS.items():
        chosen = [r for r in responses if _reward_key(r.reward) == reward]
        if not chosen:
            continue
        name = "responses" if reward is None else f"reward {reward:g}"
        figure.add_bar(
            x=[response_label(r) for r in chosen],
            y=[r.totals["fisher"] for r in chosen],
            name=name,
            marker_color=color,
            hovertemplate="%{x}: F = %{y:.4g}<extra></extra>",
            showlegend=rewarded,
        )
    _layout(figure, "Fisher total per response (sum over its positions)", height=260)
    figure.update_xaxes(
        type="category", categoryorder="array", categoryarray=[response_label(r) for r in responses]
    )
    figure.update_yaxes(title="F", rangemode="tozero")
    return figure


def response_label(response: ResponseRecord) -> str:
    return f"P{response.prompt_index + 1}·R{response.response_index + 1}"


def _reward_key(reward: float | None) -> float | None:
    return None if reward is None else float(reward >= 0.5)


def mask_heatmap_figure(view: StudyMaskView) -> go.Figure:
    """One parameter's top-q mask inside the matrix: the share of each block's coordinates in the mask,
    on a colour scale that starts at 0 (white) and whose middle is q (what a random mask would give)."""
    pooled, q = view.view, float(view.q)
    rows, cols = pooled.row_edges, pooled.col_edges
    density, hover = [], []
    for i, counts in enumerate(pooled.values):
        size_r = rows[i + 1] - rows[i]
        density_row, hover_row = [], []
        for j, count in enumerate(counts):
            size = size_r * (cols[j + 1] - cols[j])
            density_row.append(count / size if size else 0.0)
            hover_row.append(
                f"rows {rows[i]}–{rows[i + 1] - 1}, columns {cols[j]}–{cols[j + 1] - 1}<br>"
                f"{int(count):,} of {size:,} coordinates in the mask"
            )
        density.append(density_row)
        hover.append(hover_row)
    top = max((max(row) for row in density), default=0.0)
    figure = go.Figure(
        go.Heatmap(
            z=density,
            x=[(cols[j] + cols[j + 1] - 1) / 2 for j in range(len(cols) - 1)],
            y=[(rows[i] + rows[i + 1] - 1) / 2 for i in range(len(rows) - 1)],
            zmin=0.0,
            zmax=max(top, 2 * q),
            colorscale=[[0.0, "#ffffff"], [min(q / max(top, 2 * q), 0.5), "#fcbba1"], [1.0, MASK_COLOR]],
            colorbar={"title": {"text": "in the mask"}, "tickformat": ".1%"},
            text=hover,
            hovertemplate="%{text}<br>%{z:.2%} of the block (q = " + f"{q:.2%}" + ")<extra></extra>",
        )
    )
    shape = " × ".join(str(n) for n in view.shape)
    share = view.count / view.size if view.size else 0.0
    held = f"{view.count:,} in the top-{density_label(q)} mask"
    title = f"{view.tensor} [{shape}]: {held} ({percent(share, 3)} of it)"
    _layout(figure, title, height=420)
    figure.update_yaxes(autorange="reversed", title="row (output)" if len(view.shape) > 1 else "")
    figure.update_xaxes(title="column (input)" if len(view.shape) > 1 else "coordinate")
    return figure


def updates_groups_figure(
    updates: list[UpdateGroup], mask: list[GroupMaskShare], n_params: int, q: float, by: str
) -> go.Figure:
    """Per group: its share of the coordinates the run changed visibly in bf16, beside the top-q mask's
    share and the group's share of all parameters (where a random set would land)."""
    changed = sum(row.changed_bf16 for row in updates)
    in_mask = {row.group: row.share_of_mask for row in mask}
    groups = [row.group for row in updates]
    figure = go.Figure(
        [
            go.Bar(
                x=groups,
                y=[row.changed_bf16 / changed if changed else 0.0 for row in updates],
                name="the run's updates (bf16)",
                marker_color=UPDATES_COLOR,
                hovertext=[
                    f"{row.changed_bf16:,} of its {row.params:,} parameters changed in bf16 "
                    f"({percent(row.changed_bf16_share, 3)}); {percent(row.changed_share, 3)} changed at all"
                    for row in updates
                ],
                hovertemplate="%{x}: %{y:.2%} of the updates<br>%{hovertext}<extra></extra>",
            ),
            go.Bar(
                x=groups,
                y=[in_mask.get(group, 0.0) for group in groups],
                name=f"top-{density_label(q)} mask",
                marker_color=MASK_COLOR,
                hovertemplate="%{x}: %{y:.2%} of the mask<extra></extra>",
            ),
            _parameters_bar(groups, [row.params for row in updates], n_params, "all parameters"),
        ]
    )
    _layout(figure, f"Updates per {by}: shares", height=360)
    # three entries wrap on a half-width figure: below the axis they cover no title
    figure.update_layout(legend={"y": -0.18, "yanchor": "top"}, margin={"t": 40, "b": 80})
    return _share_axes(figure)
