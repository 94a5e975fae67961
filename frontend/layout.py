"""The dashboard's page: controls on the left, the slide in the middle, the compare panel and the
explorer below it; one column below ~900 px (style.css).

Only components and their ids live here; what they do is in `frontend.callbacks`. The stores hold ids
and view state only (`frontend.handles`), never a summary.
"""

from __future__ import annotations

from dash import dcc, html

from frontend.compare_layout import compare_panel
from frontend.components import graph, labelled
from frontend.exports import arrays_choice
from frontend.state import CENTERINGS, ENGINES, MAX_SAMPLE_TOKENS, SAMPLER_KINDS, DashboardState

CENTERING_LABELS = {"on": "centered (Fisher)", "off": "uncentered", "raw": "raw"}


def controls(default: DashboardState) -> html.Div:
    """Model, prefix, continuation, sampler, reward and method inputs, and the Run button."""
    return html.Div(
        className="controls",
        children=[
            *text_controls(default),
            *sampler_controls(default),
            *reward_and_method(default),
            html.Button("Run", id="run", n_clicks=0, className="run-button"),
        ],
    )


def text_controls(default: DashboardState) -> list:
    """The model, the prefix with its token chips, and the optional continuation."""
    return [
        labelled(
            "Model",
            dcc.Dropdown(id="model", options=[default.model], value=default.model, clearable=False),
        ),
        labelled(
            "Prefix",
            dcc.Input(
                id="prefix",
                type="text",
                value=default.prefix,
                debounce=False,
                placeholder="She drank a cup of",
                className="text-input",
            ),
        ),
        html.Div(id="token-chips", className="chips"),
        labelled(
            "Continuation (optional)",
            dcc.Input(
                id="continuation", type="text", value="", placeholder=" coffee and", className="text-input"
            ),
        ),
        *sample_controls(default),
    ]


def number_input(id: str, value, **options) -> dcc.Input:
    """A small number field (temperature, top-k, top-p); `options` are its limits and placeholder."""
    return dcc.Input(id=id, type="number", value=value, className="num-input", **options)


def sample_controls(default: DashboardState) -> list:
    """Instead of typing a continuation: draw one from the sampler (same seed, same response)."""
    return [
        html.Div(
            className="row sample-row",
            children=[
                labelled(
                    "Sample: tokens",
                    number_input(
                        "sample_tokens", default.sample_tokens, min=1, max=MAX_SAMPLE_TOKENS, step=1
                    ),
                ),
                labelled(
                    "seed", number_input("sample_seed", default.sample_seed, min=0, step=1, placeholder="0")
                ),
                html.Button("Sample", id="sample", n_clicks=0, className="sample-button"),
            ],
        ),
        html.Div(
            "draws a response y ~ μ from the sampler below, up to the end of sequence; "
            "same seed, same response",
            className="control-hint",
        ),
        html.Div(id="continuation-caption", className="control-hint continuation-caption"),
        html.Div(id="continuation-chips", className="chips"),
    ]


def sampler_controls(default: DashboardState) -> list:
    """Sampler kind, temperature, top-k, top-p, engine and the data token: what draws μ."""
    return [
        labelled(
            "Sampler",
            dcc.RadioItems(id="sampler", options=list(SAMPLER_KINDS), value=default.sampler, inline=True),
        ),
        html.Div(
            className="row",
            children=[
                labelled(
                    "Temperature", number_input("temperature", default.temperature, min=0.01, step="any")
                ),
                labelled("top-k", number_input("top_k", None, min=1, step=1, placeholder="off")),
                labelled("top-p", number_input("top_p", default.top_p, min=0.01, max=1, step="any")),
            ],
        ),
        labelled(
            "Engine",
            dcc.RadioItems(id="engine", options=list(ENGINES), value=default.engine, inline=True),
        ),
        labelled(
            "Data token",
            dcc.Input(id="data_token", type="text", value="", className="text-input", placeholder=" coffee"),
        ),
    ]


def reward_and_method(default: DashboardState) -> list:
    """The reward (typed, or toggled with the candidate chips) and the method."""
    return [
        labelled(
            "Reward",
            dcc.Input(
                id="reward", type="text", value="", className="text-input", placeholder=" tea=1; coffee=1"
            ),
            "token=value;… (as in the CLI) — or click a candidate below",
        ),
        html.Div(id="candidate-chips", className="chips"),
        labelled(
            "Method",
            dcc.Input(id="method", type="text", value=default.method, className="text-input"),
            "exact | truncated:F | mc:S",
        ),
    ]


def slide_panel() -> html.Div:
    """The slide: navigation, title, claim, formula, figure and the sentence reading the figure."""
    return html.Div(
        id="slide-panel",
        className="slide",
        children=[
            html.Div(
                className="slide-nav",
                children=[
                    html.Button("◀", id="prev-slide", n_clicks=0, title="previous slide (←)"),
                    html.Span(id="slide-counter", className="slide-counter"),
                    html.Button("▶", id="next-slide", n_clicks=0, title="next slide (→)"),
                    dcc.RadioItems(
                        id="centering",
                        options=[{"label": CENTERING_LABELS[c], "value": c} for c in CENTERINGS],
                        value="on",
                        inline=True,
                        className="centering",
                    ),
                ],
            ),
            html.H2(id="slide-title"),
            html.P(id="slide-claim", className="claim"),
            dcc.Markdown(id="slide-formula", mathjax=True, className="formula"),
            dcc.Loading(graph("slide-graph", WAITING)),
            html.P(id="slide-reading", className="reading"),
            html.P(id="slide-example", className="slide-example"),
        ],
    )


def explorer() -> html.Div:
    """Next-token distribution, C_mu spectrum, mass per layer and per kind, a matrix heatmap, the top
    coordinates and the along-the-response view: everything drawn from the summary, except the heatmap
    (pooled views come from the API)."""
    return html.Div(
        id="explorer-panel",
        className="explorer",
        children=[
            html.H3("Explorer"),
            labelled(
                "Position",
                dcc.Dropdown(id="explorer-position", options=[], value=0, clearable=False),
                "which analysed position the next-token and spectrum views show",
            ),
            html.Div(
                className="explorer-grid",
                children=[
                    graph("next-token-graph", WAITING),
                    graph("spectrum-graph", WAITING),
                    graph("layer-graph", WAITING),
                    graph("kind-graph", WAITING),
                ],
            ),
            labelled(
                "Matrix",
                dcc.Dropdown(id="heatmap-tensor", options=[], value=None),
                "click a layer bar above (or a tensor on slide 3) to open its matrices",
            ),
            html.Div(id="heatmap-scope", className="control-hint"),
            dcc.Loading(graph("heatmap-graph", WAITING)),
            html.H4("Along the response"),
            graph("response-graph", WAITING),
            html.H4("Top coordinates"),
            html.Div(id="top-coordinates"),
        ],
    )


def exports() -> html.Div:
    return html.Div(
        className="exports",
        children=[
            html.Button("Per-tensor totals (CSV)", id="csv-button", n_clicks=0),
            dcc.Download(id="csv-download"),
            arrays_choice(),
            html.Button("Prepare full arrays (safetensors)", id="arrays-prepare", n_clicks=0),
            html.Span(id="arrays-status", className="arrays-status"),
            html.A("Download arrays", id="arrays-link", href="", target="_blank", style={"display": "none"}),
            dcc.Interval(id="arrays-poll", interval=1000, disabled=True),
            dcc.Store(id="arrays-started"),
            dcc.Input(id="share-link", type="text", readOnly=True, className="share-link"),
            dcc.Clipboard(target_id="share-link", title="copy link", className="copy-link"),
        ],
    )


# What every graph shows before its first drawing: a sentence, never empty axes.
WAITING = "Computing the analysis: its figures appear here as soon as it is in."

# The two analyses on the page: the main one ("A") and the compare panel's ("B").
SIDES = ("analysis", "b-analysis")


def analysis_stores(side: str) -> list:
    """An analysis's handle, a poll's answer (accepted only while it answers the current request), what
    there is to draw (id and kept share), and the poll timer."""
    return [
        dcc.Store(id=side),
        dcc.Store(id=f"{side}-polled"),
        dcc.Store(id=f"{side}-view"),
        dcc.Interval(id=f"{side}-poll", interval=500, disabled=True),
    ]


def page() -> html.Div:
    default = DashboardState()
    return html.Div(
        className="page",
        children=[
            dcc.Location(id="url", refresh=False),
            dcc.Location(id="url-out", refresh=False),
            dcc.Store(id="slide", data=1),
            *[store for side in SIDES for store in analysis_stores(side)],
            dcc.Store(id="autorun"),
            dcc.Store(id="restored", data=False),
            html.Header(
                className="header",
                children=[
                    html.H1("fisherscope"),
                    html.Span(
                        "where learning can happen: the token Fisher on your own prefix", className="tagline"
                    ),
                ],
            ),
            html.Div(id="message", className="message", role="alert"),
            html.Div(id="landing-note", className="landing-note"),
            html.Div(
                className="progress",
                children=[
                    html.Div(id="progress-bar", className="progress-bar"),
                    html.Span(
                        className="progress-stage",
                        children=[
                            html.Span(id="progress-stage"),
                            html.Button(
                                "cancel",
                                id="cancel",
                                n_clicks=0,
                                className="cancel-button",
                                title="stop this analysis at its next chunk of work (DELETE)",
                                hidden=True,
                            ),
                        ],
                    ),
                ],
            ),
            html.Div(
                className="main",
                children=[
                    controls(default),
                    html.Div(
                        [
                            html.Div(id="shown-banner", className="shown-banner", role="status"),
                            slide_panel(),
                            exports(),
                            compare_panel(),
                            explorer(),
                        ],
                        className="content",
                    ),
                ],
            ),
        ],
    )
