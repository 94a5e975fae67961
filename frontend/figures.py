"""Plotly figures as pure functions of the summary JSON (docs/contract.md, "Summary JSON").

Nothing here talks to the API or to Dash: every figure is computed from the numbers the engine already
produced, so the centering toggle only changes which stored statistic is read (fisher, uncentered or
raw), never triggers a recomputation, and every figure can be tested without a browser.
"""

from __future__ import annotations

import math
from typing import Any

import plotly.graph_objects as go
from plotly.subplots import make_subplots

Summary = dict[str, Any]

CENTERING_STAT = {"on": "fisher", "off": "uncentered", "raw": "raw"}
STAT_LABEL = {
    "fisher": "centered Fisher",
    "uncentered": "uncentered second moment",
    "raw": "raw second moment",
}
KIND_ORDER = ["embedding", "q", "k", "v", "o", "gate", "up", "down", "norm", "head"]
KIND_COLOR = {
    "embedding": "#8c564b",
    "q": "#1f77b4",
    "k": "#aec7e8",
    "v": "#ff7f0e",
    "o": "#ffbb78",
    "gate": "#2ca02c",
    "up": "#98df8a",
    "down": "#d62728",
    "norm": "#9467bd",
    "head": "#e377c2",
}
LAYOUT = {"template": "plotly_white", "margin": {"l": 60, "r": 20, "t": 50, "b": 50}, "height": 420}


def stat_for_centering(centering: str) -> str:
    """The per-parameter statistic a centering setting shows: on -> fisher, off -> uncentered, raw -> raw."""
    if centering not in CENTERING_STAT:
        raise ValueError(f"centering must be one of {sorted(CENTERING_STAT)}, got {centering!r}")
    return CENTERING_STAT[centering]


def token_label(text: str) -> str:
    """A token's text in quotes, so a leading space (' tea' vs 'tea') and newlines stay visible."""
    return "'" + text.replace("\n", "\\n").replace("\t", "\\t") + "'"


def message_figure(message: str) -> go.Figure:
    """An empty figure that says why there is nothing to plot (e.g. no continuation was given)."""
    fig = go.Figure()
    fig.add_annotation(
        text=message, showarrow=False, x=0.5, y=0.5, xref="paper", yref="paper", font={"size": 15}
    )
    fig.update_layout(**{**LAYOUT, "height": 300}, xaxis_visible=False, yaxis_visible=False)
    return fig


def layer_label(layer: Any) -> str:
    return f"L{layer}" if isinstance(layer, int) else str(layer)


def concentration_curve(summary: Summary, centering: str) -> go.Figure:
    """Share of the total held by the top q of coordinates, with the uniform (dense) line for reference."""
    stat = stat_for_centering(centering)
    curve = summary["concentration"][stat]
    fig = make_subplots(
        rows=1,
        cols=2,
        column_widths=[0.45, 0.55],
        subplot_titles=("share held by the top q of coordinates", "mass per layer"),
    )
    fig.add_trace(go.Scatter(x=curve["q"], y=curve["share"], mode="lines", name=STAT_LABEL[stat]), 1, 1)
    fig.add_trace(
        go.Scatter(
            x=curve["q"],
            y=curve["q"],
            mode="lines",
            name="dense (uniform)",
            line={"dash": "dot", "color": "grey"},
        ),
        1,
        1,
    )
    layers = summary["layers"]
    fig.add_trace(
        go.Bar(
            x=[layer_label(row["layer"]) for row in layers],
            y=[row["totals"][stat] for row in layers],
            name=f"{stat} per layer",
            marker_color="#1f77b4",
        ),
        1,
        2,
    )
    fig.update_xaxes(type="log", title_text="top share q of coordinates", row=1, col=1)
    fig.update_yaxes(title_text="share of total", range=[0, 1.02], row=1, col=1)
    fig.update_yaxes(title_text=stat, row=1, col=2)
    fig.update_layout(**LAYOUT, legend={"orientation": "h", "y": -0.2})
    return fig


def reward_rows(position: dict[str, Any]) -> list[dict[str, float | str]]:
    """Per output row c of the top tokens: Fisher, |policy gradient| and the Cauchy-Schwarz bound.

    Row c of the LM head has kappa_{(c,k),a} = 1[a=c] h_k, so its policy gradient is
    mu_c (r_c - rbar) h and its Fisher ||h||^2 mu_c (1 - mu_c) (Part 2, section 1): both follow
    exactly from mu, the reward and ||h||^2, which the summary holds.
    """
    reward = position.get("reward") or {"mean": 0.0, "std": 0.0}
    h_norm = math.sqrt(position["output_layer"]["h_norm_sq"])
    rows = []
    for token in position["p"]["top"]:
        mu = token["mu"]
        fisher = h_norm**2 * mu * (1.0 - mu)
        rows.append(
            {
                "text": token["text"],
                "reward": token.get("reward", 0.0),
                "fisher": fisher,
                "grad": abs(mu * (token.get("reward", 0.0) - reward["mean"])) * h_norm,
                "bound": reward["std"] * math.sqrt(fisher),
            }
        )
    return rows


def gradient_vs_bound(summary: Summary) -> go.Figure:
    """Slide 2: per output row |G| against std(r) sqrt(F); overlap of top-q sets against random."""
    position = summary["positions"][0]
    rows = reward_rows(position)[:12]
    fig = make_subplots(
        rows=1,
        cols=2,
        column_widths=[0.6, 0.4],
        subplot_titles=(
            "output rows: |gradient| vs bound std(r)·√F",
            "top-q by Fisher ∩ top-q by |gradient|",
        ),
    )
    labels = [token_label(str(row["text"])) for row in rows]
    fig.add_trace(
        go.Bar(x=labels, y=[row["bound"] for row in rows], name="bound std(r)·√F", marker_color="#aec7e8"),
        1,
        1,
    )
    fig.add_trace(
        go.Bar(x=labels, y=[row["grad"] for row in rows], name="|policy gradient|", marker_color="#d62728"),
        1,
        1,
    )
    overlap = summary.get("overlap")
    if overlap:
        qs = [f"{100 * q:g}%" for q in overlap["q"]]
        fig.add_trace(
            go.Bar(x=qs, y=overlap["fisher_vs_policy_grad"], name="overlap", marker_color="#2ca02c"), 1, 2
        )
        fig.add_trace(
            go.Scatter(
                x=qs,
                y=overlap["baseline"],
                name="random baseline",
                mode="lines+markers",
                line={"dash": "dot", "color": "grey"},
            ),
            1,
            2,
        )
    else:
        fig.add_annotation(
            text="set a reward to see the overlap",
            showarrow=False,
            xref="x2 domain",
            yref="y2 domain",
            x=0.5,
            y=0.5,
        )
    fig.update_layout(**LAYOUT, barmode="group", legend={"orientation": "h", "y": -0.25})
    fig.update_yaxes(title_text="per row (‖·‖ over the row)", row=1, col=1)
    fig.update_yaxes(title_text="share of the top-q gradient set", range=[0, 1], row=1, col=2)
    return fig


def per_tensor_stat(summary: Summary, centering: str) -> go.Figure:
    """Slide 3: the chosen statistic for every tensor, by layer, one trace per module kind; rho per kind."""
    stat = stat_for_centering(centering)
    fig = make_subplots(
        rows=1,
        cols=2,
        column_widths=[0.72, 0.28],
        subplot_titles=(f"{STAT_LABEL[stat]} per tensor", "ρ: share centering removes"),
    )
    for kind in KIND_ORDER:
        tensors = [t for t in summary["tensors"] if t["kind"] == kind]
        if not tensors:
            continue
        fig.add_trace(
            go.Scatter(
                x=[layer_label(t["layer"]) for t in tensors],
                y=[t["totals"][stat] for t in tensors],
                customdata=[t["name"] for t in tensors],
                mode="markers",
                name=kind,
                marker={"color": KIND_COLOR[kind], "size": 7},
                hovertemplate="%{customdata}<br>%{y:.4g}<extra></extra>",
            ),
            1,
            1,
        )
    kinds = summary["kinds"]
    fig.add_trace(
        go.Bar(
            x=[k["kind"] for k in kinds],
            y=[k["totals"]["rho_mean"] for k in kinds],
            marker_color=[KIND_COLOR.get(k["kind"], "grey") for k in kinds],
            showlegend=False,
            name="rho",
        ),
        1,
        2,
    )
    categories = [layer_label(row["layer"]) for row in summary["layers"]]
    fig.update_xaxes(categoryorder="array", categoryarray=categories, row=1, col=1)
    fig.update_yaxes(type="log", title_text=stat, row=1, col=1)
    fig.update_yaxes(range=[0, 1], row=1, col=2)
    fig.update_layout(**LAYOUT, legend={"orientation": "h", "y": -0.2})
    return fig


def response_fisher(summary: Summary) -> go.Figure:
    """Slide 4: Fisher total at each response position and its running sum."""
    response = summary.get("response")
    if not response:
        return message_figure("Add a continuation to see the Fisher add up along the response.")
    labels = response_labels(summary)
    fig = go.Figure()
    fig.add_trace(go.Bar(x=labels, y=response["fisher_total"], name="Fisher at the position"))
    fig.add_trace(
        go.Scatter(x=labels, y=response["fisher_running"], name="running sum", mode="lines+markers")
    )
    fig.update_layout(**LAYOUT, yaxis_title="total centered Fisher", xaxis_title="position (token predicted)")
    return fig


def response_labels(summary: Summary) -> list[str]:
    continuation = summary["tokens"].get("continuation") or []
    return [f"{t + 1}: {token_label(tok['text'])}" for t, tok in enumerate(continuation)]


def mean_shift_per_layer(summary: Summary) -> go.Figure:
    """Slide 5: centered Fisher and the mean shift squared stacked per layer (their sum is uncentered)."""
    layers = summary["layers"]
    labels = [layer_label(row["layer"]) for row in layers]
    fig = go.Figure()
    fig.add_trace(go.Bar(x=labels, y=[row["totals"]["fisher"] for row in layers], name="centered Fisher"))
    fig.add_trace(
        go.Bar(
            x=labels,
            y=[row["totals"]["mean_shift_sq"] for row in layers],
            name="mean shift² (uncentered − centered)",
            marker_color="#d62728",
        )
    )
    fig.update_layout(
        **LAYOUT, barmode="stack", yaxis_title="per layer", legend={"orientation": "h", "y": -0.2}
    )
    return fig


def output_rows(summary: Summary) -> go.Figure:
    """Slide 6: per-row share of the output-layer Fisher, ||h||^2 mu (1 - mu), against mu itself."""
    position = summary["positions"][0]
    rows = position["output_layer"]["rows"]
    labels = [token_label(row["text"]) for row in rows]
    fig = make_subplots(specs=[[{"secondary_y": True}]])
    fig.add_trace(go.Bar(x=labels, y=[row["share"] for row in rows], name="share of output-layer Fisher"))
    fig.add_trace(
        go.Scatter(
            x=labels,
            y=[row["mu"] for row in rows],
            name="μ (sampler probability)",
            mode="markers+lines",
            line={"color": "#ff7f0e"},
        ),
        secondary_y=True,
    )
    top_share = max([row["share"] for row in rows] or [1.0])
    top_mu = max([row["mu"] for row in rows] or [1.0])
    fig.update_yaxes(title_text="share of Σ f_row", range=[0, 1.08 * top_share], secondary_y=False)
    fig.update_yaxes(title_text="μ", range=[0, 1.08 * top_mu], showgrid=False, secondary_y=True)
    fig.update_layout(**LAYOUT, legend={"orientation": "h", "y": -0.3})
    return fig


def spectrum(summary: Summary) -> go.Figure:
    """Slide 7: eigenvalues of C_mu and of the uncentered matrix, with the numerical rank marked."""
    spec = summary["positions"][0]["spectrum"]
    index = list(range(1, len(spec["eigenvalues"]) + 1))
    floor = max(spec["eigenvalues"][0], 1e-30) * 1e-12
    fig = go.Figure()
    fig.add_trace(
        go.Scatter(
            x=index,
            y=[max(v, floor) for v in spec["uncentered_eigenvalues"]],
            name="uncentered C_μ + w̄w̄ᵀ",
            mode="lines",
            line={"dash": "dot"},
        )
    )
    fig.add_trace(
        go.Scatter(x=index, y=[max(v, floor) for v in spec["eigenvalues"]], name="centered C_μ", mode="lines")
    )
    fig.add_vline(
        x=spec["numerical_rank"],
        line_dash="dash",
        line_color="grey",
        annotation_text=f"numerical rank {spec['numerical_rank']}",
    )
    fig.update_layout(
        **LAYOUT,
        xaxis_title="eigenvalue index",
        yaxis_title="eigenvalue",
        yaxis_type="log",
        legend={"orientation": "h", "y": -0.2},
    )
    return fig


def shift_growth(summary: Summary) -> go.Figure:
    """Slide 8: squared accumulated mean shift against the sum of variances along the response."""
    response = summary.get("response")
    if not response:
        return message_figure("Add a continuation to see the mean shift accumulate.")
    growth = response["shift_growth"]
    labels = response_labels(summary)
    fig = go.Figure()
    fig.add_trace(
        go.Scatter(
            x=labels,
            y=growth["accumulated_shift_sq"],
            name="‖Σ_t m(s_t)‖² (uncentered extra)",
            mode="lines+markers",
            line={"color": "#d62728"},
        )
    )
    fig.add_trace(
        go.Scatter(
            x=labels,
            y=growth["sum_variances"],
            name="Σ_t Fisher (centered)",
            mode="lines+markers",
            line={"color": "#1f77b4"},
        )
    )
    fig.update_layout(
        **LAYOUT, yaxis_type="log", xaxis_title="response position", legend={"orientation": "h", "y": -0.2}
    )
    return fig


def chi2_growth(summary: Summary) -> go.Figure:
    """Slide 9: chi^2 per position and log(1 + chi^2) accumulated against T log(1 + min chi^2)."""
    response = summary.get("response")
    if not response:
        return message_figure("Add a continuation to see the χ² signal grow along the response.")
    labels = response_labels(summary)
    floor = min(response["chi2"])
    fig = make_subplots(specs=[[{"secondary_y": True}]])
    fig.add_trace(go.Bar(x=labels, y=response["chi2"], name="χ²(one-hot(y_t) ‖ p) = 1/p(y_t) − 1"))
    fig.add_trace(
        go.Scatter(x=labels, y=response["log_one_plus_chi2_cum"], name="Σ log(1+χ²_t)", mode="lines+markers"),
        secondary_y=True,
    )
    fig.add_trace(
        go.Scatter(
            x=labels,
            y=[(t + 1) * math.log1p(floor) for t in range(len(labels))],
            name="T·log(1+c), c = min χ²",
            mode="lines",
            line={"dash": "dot"},
        ),
        secondary_y=True,
    )
    fig.update_yaxes(title_text="χ² per position", type="log", secondary_y=False)
    fig.update_yaxes(title_text="log(1 + χ²(D‖π))", secondary_y=True)
    fig.update_layout(**LAYOUT, legend={"orientation": "h", "y": -0.25})
    return fig


def engine_shift_rows(summary: Summary) -> go.Figure:
    """Slide 10: output-row shift (mu_c - p_c) h against the row's on-policy Fisher, per top token."""
    position = summary["positions"][0]
    h_norm_sq = position["output_layer"]["h_norm_sq"]
    top = position["p"]["top"]
    labels = [token_label(tok["text"]) for tok in top]
    fig = make_subplots(specs=[[{"secondary_y": True}]])
    fig.add_trace(
        go.Bar(
            x=labels,
            y=[(tok["mu"] - tok["p"]) ** 2 * h_norm_sq for tok in top],
            name="row mean shift² = (μ−p)²‖h‖²",
            marker_color="#d62728",
        )
    )
    fig.add_trace(
        go.Scatter(
            x=labels,
            y=[tok["p"] * (1 - tok["p"]) * h_norm_sq for tok in top],
            name="on-policy row Fisher p(1−p)‖h‖²",
            mode="markers+lines",
        ),
        secondary_y=True,
    )
    fig.update_layout(**LAYOUT, legend={"orientation": "h", "y": -0.3})
    return fig


def next_token(summary: Summary, position_index: int = 0) -> go.Figure:
    """Explorer: the model's p against the sampler's mu for the top next tokens."""
    top = summary["positions"][position_index]["p"]["top"]
    labels = [token_label(tok["text"]) for tok in top]
    fig = go.Figure()
    fig.add_trace(go.Bar(x=labels, y=[tok["p"] for tok in top], name="p (model)"))
    fig.add_trace(go.Bar(x=labels, y=[tok["mu"] for tok in top], name="μ (sampler)"))
    fig.update_layout(**LAYOUT, barmode="group", yaxis_title="probability")
    return fig


def kind_mass(summary: Summary, centering: str) -> go.Figure:
    """Explorer: the chosen statistic summed per module kind."""
    stat = stat_for_centering(centering)
    kinds = summary["kinds"]
    fig = go.Figure(
        go.Bar(
            x=[k["kind"] for k in kinds],
            y=[k["totals"][stat] for k in kinds],
            marker_color=[KIND_COLOR.get(k["kind"], "grey") for k in kinds],
        )
    )
    fig.update_layout(**LAYOUT, yaxis_title=f"{stat} per module kind")
    return fig


def heatmap(pooled: dict[str, Any], tensor: str, stat: str) -> go.Figure:
    """Explorer: a pooled view (block sums) of one matrix, from GET .../tensors/{name}."""
    values = pooled["values"]
    row_edges, col_edges = pooled["row_edges"], pooled["col_edges"]
    fig = go.Figure(
        go.Heatmap(
            z=values, x=col_edges[:-1], y=row_edges[:-1], colorscale="Viridis", colorbar={"title": stat}
        )
    )
    fig.update_layout(
        **LAYOUT,
        title=f"{tensor}: {stat}, block sums {pooled['shape'][0]}×{pooled['shape'][1]}",
        xaxis_title="column (input)",
        yaxis_title="row (output)",
        yaxis_autorange="reversed",
    )
    return fig


def tensor_totals_csv(summary: Summary) -> str:
    """Per-tensor totals of every statistic as CSV, for the export button."""
    keys = list(summary["totals"].keys())
    lines = [",".join(["name", "layer", "kind", "numel", *keys])]
    for tensor in summary["tensors"]:
        values = [repr(tensor["totals"].get(key, "")) for key in keys]
        lines.append(
            ",".join([tensor["name"], str(tensor["layer"]), tensor["kind"], str(tensor["numel"]), *values])
        )
    return "\n".join(lines) + "\n"
