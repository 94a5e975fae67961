"""Plotly figures as pure functions of the summary JSON (docs/contract.md, "Summary JSON").

Nothing here talks to the API or to Dash: every figure is computed from the numbers the engine already
produced, so the centering toggle only changes which stored statistic is read (fisher, uncentered or
raw), never triggers a recomputation, and every figure can be tested without a browser.
"""

from __future__ import annotations

import itertools
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
KIND_ORDER = [
    "embedding",
    "position",
    "qkv",
    "q",
    "k",
    "v",
    "o",
    "router",
    "gate_up",
    "gate",
    "up",
    "down",
    "norm",
    "head",
    "other",
]
KIND_COLOR = {
    "embedding": "#8c564b",
    "position": "#c49c94",
    "qkv": "#17becf",
    "router": "#bcbd22",
    "gate_up": "#7f7f7f",
    "other": "#c7c7c7",
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
LOG_TICKS = {"tickformat": ".1~e"}  # 5e+3, 1e+4: no SI prefixes (µ, k) nor bare minor digits on log axes
LAYOUT: dict[str, Any] = {
    "template": "plotly_white",
    "margin": {"l": 60, "r": 20, "t": 50, "b": 50},
    "height": 420,
}


def stat_for_centering(centering: str) -> str:
    """The per-parameter statistic a centering setting shows: on -> fisher, off -> uncentered, raw -> raw."""
    if centering not in CENTERING_STAT:
        raise ValueError(f"centering must be one of {sorted(CENTERING_STAT)}, got {centering!r}")
    return CENTERING_STAT[centering]


def token_label(text: str) -> str:
    """A token's text in quotes, so a leading space (' tea' vs 'tea') and newlines stay visible."""
    return "'" + text.replace("\n", "\\n").replace("\t", "\\t") + "'"


def unique_token_labels(tokens: list[dict[str, Any]]) -> list[str]:
    """Category labels for tokens, one per token: quoted text, plus `#id` where texts collide.

    Plotly merges bars that share a category, so several tokens that decode to the same text (byte
    pieces shown as U+FFFD, or ' tea' at two positions) would otherwise stack into one bar.
    """
    labels = [token_label(str(token["text"])) for token in tokens]
    counts: dict[str, int] = {}
    for label in labels:
        counts[label] = counts.get(label, 0) + 1
    unique = []
    for label, token in zip(labels, tokens, strict=True):
        needs_id = counts[label] > 1 or "\ufffd" in label
        unique.append(f"{label} #{token['id']}" if needs_id and "id" in token else label)
    seen: dict[str, int] = {}
    for i, label in enumerate(unique):  # same text and same id (or no id): number them
        seen[label] = seen.get(label, 0) + 1
        if seen[label] > 1:
            unique[i] = f"{label} ({seen[label]})"
    return unique


def small_title(text: str) -> dict[str, Any]:
    """A figure title in the explorer's small font, so a long title fits above its plot."""
    return {"text": text, "font": {"size": 13}}


def message_figure(message: str) -> go.Figure:
    """An empty figure that says why there is nothing to plot (e.g. no continuation was given)."""
    fig = go.Figure()
    fig.add_annotation(
        text=message, showarrow=False, x=0.5, y=0.5, xref="paper", yref="paper", font={"size": 15}
    )
    fig.update_layout(**{**LAYOUT, "height": 300}, xaxis_visible=False, yaxis_visible=False)
    return fig


def all_zero_figure(stat: str) -> go.Figure:
    """What to show when a statistic is 0 for every parameter (the centered Fisher under a one-hot μ)."""
    return message_figure(
        f"The {STAT_LABEL[stat]} is 0 for every parameter here<br>"
        "(μ is one-hot: the data sampler); pick 'uncentered' to see the mean shift."
    )


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
    fig.update_xaxes(
        type="log", title_text="top share q of coordinates (fraction)", **LOG_TICKS, row=1, col=1
    )
    fig.update_yaxes(title_text="share of total", range=[0, 1.02], row=1, col=1)
    fig.update_yaxes(title_text=f"{stat}, summed over the layer", row=1, col=2)
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
                "id": token.get("id", -1),
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
    labels = unique_token_labels(position["p"]["top"][: len(rows)])
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
    fig.update_yaxes(type="log", title_text=f"{stat} of the tensor (log)", **LOG_TICKS, row=1, col=1)
    fig.update_yaxes(range=[0, 1], title_text="mean ρ over the kind", row=1, col=2)
    fig.update_layout(**LAYOUT, legend={"orientation": "h", "y": -0.2})
    return fig


RESPONSE_SERIES = {"fisher": "fisher_total", "uncentered": "uncentered_total", "raw": "uncentered_total"}


def response_series(summary: Summary, centering: str) -> tuple[str, list[float], list[float]]:
    """(label, per-position totals, running sum) of the statistic the toggle picks along the response.

    The raw second moment is not kept per position, so `raw` shows the uncentered one and says so.
    """
    stat = stat_for_centering(centering)
    response = summary["response"]
    per_position = list(response[RESPONSE_SERIES[stat]])
    running = (
        list(response["fisher_running"]) if stat == "fisher" else list(itertools.accumulate(per_position))
    )
    label = STAT_LABEL["uncentered" if stat == "raw" else stat]
    if stat == "raw":
        label += " (raw is not kept per position)"
    return label, per_position, running


def response_fisher(summary: Summary, centering: str = "on") -> go.Figure:
    """Slide 4: the toggle's statistic at each response position and its running sum."""
    response = summary.get("response")
    if not response:
        return message_figure("Add a continuation to see the Fisher add up along the response.")
    label, per_position, running = response_series(summary, centering)
    if max(running, default=0.0) <= 0:
        return message_figure(
            "μ is one-hot on y_t (data sampler), so the centered Fisher under μ is 0 at every position;<br>"
            "pick the uncentered view to see the mean shift², or the model sampler to see the Fisher add up."
        )
    labels = response_labels(summary)
    fig = go.Figure()
    fig.add_trace(go.Bar(x=labels, y=per_position, name=f"{label} at the position"))
    fig.add_trace(go.Scatter(x=labels, y=running, name="running sum", mode="lines+markers"))
    fig.update_layout(
        **LAYOUT,
        yaxis_title=f"{label}, summed over all parameters",
        xaxis_title="response position t: token y_t predicted",
        legend={"orientation": "h", "y": -0.25},
    )
    return fig


def response_view(summary: Summary, centering: str) -> go.Figure:
    """Explorer: along the response, the toggle's totals and running sum, p(y_t) and chi^2 per position."""
    response = summary.get("response")
    if not response:
        return message_figure("No continuation: add one to see the along-the-response view.")
    label, per_position, running = response_series(summary, centering)
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
    fig.add_trace(go.Bar(x=labels, y=response["p_target"], name="p(y_t)", marker_color="#2ca02c"), 2, 1)
    fig.add_trace(go.Bar(x=labels, y=response["chi2"], name="χ²_t", marker_color="#d62728"), 3, 1)
    fig.update_yaxes(type="log", title_text="p (log)", **LOG_TICKS, row=2, col=1)
    fig.update_yaxes(type="log", title_text="χ² (log)", **LOG_TICKS, row=3, col=1)
    fig.update_layout(**{**LAYOUT, "height": 620}, legend={"orientation": "h", "y": -0.12})
    return fig


def response_labels(summary: Summary) -> list[str]:
    continuation = summary["tokens"].get("continuation") or []
    return [f"{t + 1}: {label}" for t, label in enumerate(unique_token_labels(continuation))]


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
    labels = unique_token_labels(rows)
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


def spectrum(summary: Summary, position_index: int = 0) -> go.Figure:
    """Slide 7 and explorer: eigenvalues of C_mu (log scale) and of the uncentered matrix, with the
    numerical rank and the rank bound n - 1 (n = tokens mu can draw) marked."""
    spec = summary["positions"][position_index]["spectrum"]
    eigenvalues = spec["eigenvalues"]
    if not eigenvalues or max(eigenvalues) <= 0:
        return message_figure(
            "C_μ is zero here: μ is one-hot on one token<br>(data sampler), so nothing varies."
        )
    index = list(range(1, len(eigenvalues) + 1))
    floor = max(eigenvalues[0], 1e-30) * 1e-12
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
        go.Scatter(x=index, y=[max(v, floor) for v in eigenvalues], name="centered C_μ", mode="lines")
    )
    fig.add_vline(
        x=max(spec["numerical_rank"], 1),
        line_dash="dash",
        line_color="grey",
        annotation_text=f"numerical rank {spec['numerical_rank']}",
        annotation_position="top left",
    )
    bound = spec["rank_bound"]
    if bound < len(eigenvalues):
        fig.add_vline(
            x=max(bound, 1),
            line_dash="dot",
            line_color="#d62728",
            annotation_text=f"rank bound n − 1 = {bound:,}",
            annotation_position="bottom left",
        )
        bound_note = f"rank bound n − 1 = {bound:,} (marked)"
    else:
        bound_note = f"rank bound n − 1 = {bound:,} lies beyond d = {len(eigenvalues)}: not binding"
    fig.update_layout(
        **LAYOUT,
        title=small_title(f"C_μ spectrum at position {position_index + 1}; {bound_note}"),
        xaxis_title="eigenvalue index (1 = largest)",
        yaxis_title="eigenvalue (log scale)",
        yaxis_type="log",
        yaxis_tickformat=LOG_TICKS["tickformat"],
        legend={"orientation": "h", "y": -0.2},
    )
    return fig


def positive_or_none(values: list[float]) -> list[float | None]:
    """Zeros cannot sit on a log axis: leave a gap rather than a point at an invented floor."""
    return [value if value > 0 else None for value in values]


def shift_growth(summary: Summary) -> go.Figure:
    """Slide 8: squared accumulated mean shift against the sum of per-position terms along the response."""
    response = summary.get("response")
    if not response:
        return message_figure("Add a continuation to see the mean shift accumulate.")
    growth = response["shift_growth"]
    labels = response_labels(summary)
    fig = go.Figure()
    fig.add_trace(
        go.Scatter(
            x=labels,
            y=positive_or_none(growth["accumulated_shift_sq"]),
            name="‖Σ_t m(s_t)‖²: accumulated shift",
            mode="lines+markers",
            line={"color": "#d62728"},
        )
    )
    if "sum_shift_sq" in growth:
        fig.add_trace(
            go.Scatter(
                x=labels,
                y=positive_or_none(growth["sum_shift_sq"]),
                name="Σ_t ‖m(s_t)‖²: the shifts one by one",
                mode="lines+markers",
                line={"color": "#ff7f0e", "dash": "dot"},
            )
        )
    if max(growth["sum_variances"], default=0.0) > 0:
        fig.add_trace(
            go.Scatter(
                x=labels,
                y=positive_or_none(growth["sum_variances"]),
                name="Σ_t Fisher under μ (centered)",
                mode="lines+markers",
                line={"color": "#1f77b4"},
            )
        )
    else:
        fig.add_annotation(
            text="Σ_t Fisher under μ is 0 (μ one-hot): not drawn on the log axis",
            showarrow=False,
            xref="paper",
            yref="paper",
            x=0.02,
            y=0.98,
            xanchor="left",
        )
    fig.update_layout(
        **LAYOUT,
        yaxis_type="log",
        yaxis_tickformat=LOG_TICKS["tickformat"],
        yaxis_title="summed over all parameters (log)",
        xaxis_title="response position t: token y_t",
        legend={"orientation": "h", "y": -0.25},
    )
    return fig


def decade_label(exponent: int) -> str:
    """10^k as a reader writes it: 1 and 10 plainly, higher and negative powers with a superscript."""
    if exponent == 0:
        return "1"
    if exponent == 1:
        return "10"
    return f"10<sup>{exponent}</sup>".replace("<sup>-", "<sup>−")


def decade_exponents(low: int, high: int, most: int = 10) -> list[int]:
    """Whole decades from `low` to `high` (inclusive), thinned to a step of 1, 2, 5, 10, ... so that at
    most `most` ticks are labelled however many decades the data span."""
    span = max(high - low, 1)
    steps = (mantissa * 10**power for power in itertools.count() for mantissa in (1, 2, 5))
    step = next(step for step in steps if span / step <= most)
    first = math.ceil(low / step) * step
    return list(range(first, high + 1, step))


def decade_range(log10_values: list[float]) -> tuple[int, int]:
    """Whole-decade axis bounds strictly around the values (in log10 units): every point, and every
    bar's top, lies inside the axis instead of on its edge."""
    low = math.floor(min(log10_values))
    if low == min(log10_values):
        low -= 1
    return low, math.floor(max(log10_values)) + 1


def chi2_decade_ranges(
    positive_chi2: list[float], log10_sums: list[float]
) -> tuple[tuple[int, int], tuple[int, int]]:
    """Whole-decade ranges (log10 units) of slide 9's two axes: chi^2_t on the left, the running
    log10(1 + chi^2) on the right. The sums start at 0 (the product at 1); chi^2_t below 1
    (p(y_t) > 1/2) opens decades under it. Both axes take one shared range, so a decade on the left is
    a decade on the right, unless that would squeeze the bars into less than half the height (a long
    response whose product spans hundreds of decades)."""
    log10_chi2 = [math.log10(value) for value in positive_chi2]
    left = (min(0, decade_range(log10_chi2)[0]), decade_range(log10_chi2)[1]) if log10_chi2 else (0, 1)
    right = (0, decade_range(log10_sums)[1])
    shared = (min(left[0], right[0]), max(left[1], right[1]))
    if 2 * (left[1] - left[0]) >= shared[1] - shared[0]:
        return shared, shared
    return left, right


def chi2_growth(summary: Summary) -> go.Figure:
    """Slide 9: chi^2 per position (left) and 1 + chi^2(D || pi) of the response so far (right), against
    the floor (1 + c)^t with c the smallest per-position chi^2.

    For a one-hot D on the response, 1 + chi^2(D || pi) = 1/pi(y) = prod_t (1 + chi^2_t), so the right
    axis shows exp(sum_t log(1 + chi^2_t)). It is drawn in log10 units on a linear axis labelled in whole
    decades rather than as the product on a log axis: the product overflows a float after a few hundred
    tokens, its logarithm never does. Both axes have explicit ranges and tick values; left to itself,
    Plotly syncs an overlaying axis's ticks to the primary one ('sync'), which on a log primary axis gives
    odd labels and a range that cuts the running sum off.
    """
    response = summary.get("response")
    if not response:
        return message_figure("Add a continuation to see the χ² signal grow along the response.")
    labels = response_labels(summary)
    chi2 = response["chi2"]
    positive = [value for value in chi2 if value > 0]
    floor = min(chi2)
    log10_running = [total / math.log(10) for total in response["log_one_plus_chi2_cum"]]
    log10_floor = [(t + 1) * math.log1p(floor) / math.log(10) for t in range(len(labels))]

    fig = make_subplots(specs=[[{"secondary_y": True}]])
    fig.add_trace(
        go.Bar(x=labels, y=positive_or_none(chi2), name="χ²_t = 1/p(y_t) − 1 (left)", marker_color="#1f77b4")
    )
    fig.add_trace(
        go.Scatter(
            x=labels,
            y=log10_running,
            customdata=response["log_one_plus_chi2_cum"],
            hovertemplate="1 + χ² = 10^%{y:.2f}<br>Σ log(1+χ²_t) = %{customdata:.2f}<extra></extra>",
            name="1 + χ²(D‖π) = ∏(1+χ²_t) up to t (right)",
            mode="lines+markers",
            line={"color": "#d62728"},
        ),
        secondary_y=True,
    )
    fig.add_trace(
        go.Scatter(
            x=labels,
            y=log10_floor,
            hovertemplate="(1+c)^t = 10^%{y:.2f}<extra></extra>",
            name="(1+c)^t, c = min χ²_t (right)",
            mode="lines",
            line={"color": "#2ca02c", "dash": "dot"},
        ),
        secondary_y=True,
    )

    left, right = chi2_decade_ranges(positive, log10_running + log10_floor)
    left_ticks, right_ticks = decade_exponents(*left), decade_exponents(*right)
    fig.update_yaxes(
        title_text="χ²_t per position (log)",
        type="log",
        range=list(left),
        tickmode="array",
        tickvals=[10.0**k for k in left_ticks],
        ticktext=[decade_label(k) for k in left_ticks],
        secondary_y=False,
    )
    fig.update_yaxes(
        title_text="1 + χ²(D‖π) of the response so far (log)",
        range=list(right),
        tickmode="array",
        tickvals=right_ticks,
        ticktext=[decade_label(k) for k in right_ticks],
        showgrid=left != right,  # one shared range: the left axis's grid lines serve both
        gridcolor="#f4e4e4",
        secondary_y=True,
    )
    fig.update_layout(**LAYOUT, legend={"orientation": "h", "y": -0.25})
    return fig


def engine_shift_rows(summary: Summary) -> go.Figure:
    """Slide 10: output-row shift (mu_c - p_c) h against the row's on-policy Fisher, per top token."""
    position = summary["positions"][0]
    h_norm_sq = position["output_layer"]["h_norm_sq"]
    top = position["p"]["top"]
    labels = unique_token_labels(top)
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
    labels = unique_token_labels(top)
    fig = go.Figure()
    fig.add_trace(go.Bar(x=labels, y=[tok["p"] for tok in top], name="p (model)"))
    fig.add_trace(go.Bar(x=labels, y=[tok["mu"] for tok in top], name="μ (sampler)"))
    context = summary["positions"][position_index]["context_length"]
    fig.update_layout(
        **{**LAYOUT, "margin": {**LAYOUT["margin"], "b": 90}},
        barmode="group",
        title=small_title(f"next token after {context} tokens: p against μ (top {len(top)})"),
        yaxis_title="probability",
        xaxis_tickangle=-45,
        legend={"orientation": "h", "y": 1.02, "x": 1, "xanchor": "right", "yanchor": "bottom"},
    )
    return fig


def kind_mass(summary: Summary, centering: str) -> go.Figure:
    """Explorer: the chosen statistic summed per module kind."""
    stat = stat_for_centering(centering)
    kinds = summary["kinds"]
    return group_mass(
        kinds,
        [k["kind"] for k in kinds],
        stat,
        "kind",
        f"{STAT_LABEL[stat]} per module kind",
        bar={"marker_color": [KIND_COLOR.get(k["kind"], "grey") for k in kinds]},
    )


def layer_mass(summary: Summary, centering: str) -> go.Figure:
    """Explorer: the chosen statistic summed per layer; each bar carries its layer key for clicks."""
    stat = stat_for_centering(centering)
    layers = summary["layers"]
    total = sum(row["totals"][stat] for row in layers) or 1.0
    return group_mass(
        layers,
        [layer_label(row["layer"]) for row in layers],
        stat,
        "layer",
        f"{STAT_LABEL[stat]} per layer (click a bar to open its matrices)",
        bar={
            "customdata": [[str(row["layer"]), row["totals"][stat] / total] for row in layers],
            "hovertemplate": "%{x}: %{y:.4g} (%{customdata[1]:.1%} of the total)<br>click: open its matrices"
            "<extra></extra>",
            "marker_color": "#1f77b4",
        },
        xaxis_title="layer",
    )


def group_mass(
    groups: list[dict[str, Any]],
    labels: list[str],
    stat: str,
    group: str,
    title: str,
    bar: dict[str, Any],
    **layout: Any,
) -> go.Figure:
    """One bar per group (module kind or layer) of `stat` summed over the group, or the all-zero note
    when every bar would be 0; `bar` and `layout` add to the bar trace and the figure layout."""
    if not any(row["totals"][stat] > 0 for row in groups):
        return all_zero_figure(stat)
    fig = go.Figure(go.Bar(x=labels, y=[row["totals"][stat] for row in groups], **bar))
    fig.update_layout(
        **LAYOUT, title=small_title(title), yaxis_title=f"{stat}, summed over the {group}", **layout
    )
    return fig


def tensors_of_layer(summary: Summary, layer: str, stat: str) -> list[str]:
    """The tensors of one layer (key as in `layers`, as a string): matrices first, largest `stat` first."""
    tensors = [t for t in summary["tensors"] if str(t["layer"]) == layer]
    ordered = sorted(tensors, key=lambda t: (len(t["shape"]) != 2, -t["totals"].get(stat, 0.0)))
    return [t["name"] for t in ordered]


def heatmap(pooled: dict[str, Any], tensor: str, stat: str) -> go.Figure:
    """Explorer: a pooled view (block sums) of one matrix, from GET .../tensors/{name}."""
    values = pooled["values"]
    if not any(value for row in values for value in row):
        return message_figure(f"{tensor}: the {STAT_LABEL.get(stat, stat)} is 0 in every block.")
    row_edges, col_edges = pooled["row_edges"], pooled["col_edges"]
    fig = go.Figure(
        go.Heatmap(
            z=values, x=col_edges[:-1], y=row_edges[:-1], colorscale="Viridis", colorbar={"title": stat}
        )
    )
    fig.update_layout(
        **LAYOUT,
        title=small_title(f"{tensor}: {stat}, sums over {pooled['shape'][0]}×{pooled['shape'][1]} blocks"),
        xaxis_title="column (input)",
        yaxis_title="row (output)",
        yaxis_autorange="reversed",
    )
    if pooled["shape"][0] == 1:  # a vector (norm weight): one row of blocks, no row axis to read
        fig.update_layout(yaxis_showticklabels=False, yaxis_title="vector", height=260)
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
