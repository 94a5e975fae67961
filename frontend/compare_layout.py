"""The compare panel's components (docs/design.md §8): B's controls, its figures, the sets table, the CSV.

B is A with what the panel sets: every field starts empty, meaning "as A" (its placeholder shows A's
value), so changing one control compares A against A with that one thing changed.
"""

from __future__ import annotations

from dash import dcc, html

from frontend.components import graph, labelled
from frontend.state import ENGINES, SAMPLER_KINDS

AS_A = {"label": "as A", "value": ""}
# Folded rather than display: none, so the graphs inside keep the panel's width while hidden (Plotly
# sizes a graph when it draws it, and one drawn in a hidden box stays at its default width).
HIDDEN = {"height": "0", "overflow": "hidden"}


def b_controls() -> html.Div:
    """Model, prefix, temperature, top-k, top-p, engine, sampler and method of B; empty reads as A."""
    return html.Div(
        className="compare-controls",
        children=[
            labelled("Model", dcc.Dropdown(id="b_model", options=[AS_A], value="", clearable=False)),
            labelled("Prefix", dcc.Input(id="b_prefix", type="text", value="", className="text-input")),
            labelled(
                "Temperature",
                dcc.Input(id="b_temperature", type="number", min=0.01, step="any", className="num-input"),
            ),
            labelled("top-k", dcc.Input(id="b_top_k", type="text", value="", className="num-input")),
            labelled(
                "top-p",
                dcc.Input(id="b_top_p", type="number", min=0.01, max=1, step="any", className="num-input"),
            ),
            labelled(
                "Engine", dcc.RadioItems(id="b_engine", options=[AS_A, *ENGINES], value="", inline=True)
            ),
            labelled(
                "Sampler",
                dcc.RadioItems(id="b_sampler", options=[AS_A, *SAMPLER_KINDS], value="", inline=True),
            ),
            labelled("Method", dcc.Input(id="b_method", type="text", value="", className="text-input")),
        ],
    )


def compare_panel() -> html.Div:
    return html.Div(
        className="compare",
        children=[
            html.H3("Compare with a second analysis"),
            html.Div(
                "B is A with what you change here (empty fields read as A's; top-k takes a number or 'off'). "
                "Both must be of models with the same parameter names.",
                className="control-hint",
            ),
            b_controls(),
            html.Div(
                className="compare-actions",
                children=[
                    html.Button("Compare", id="compare-run", n_clicks=0, className="compare-button"),
                    html.Span(id="b-status", className="arrays-status"),
                    html.Button("Compare view (CSV)", id="compare-csv-button", n_clicks=0),
                    dcc.Download(id="compare-csv-download"),
                ],
            ),
            dcc.Interval(id="compare-retry", interval=1000, disabled=True),
            dcc.Store(id="compare-ready"),  # {a, b} once the API has answered their compare
            html.P(id="compare-reading", className="reading"),
            # folded until both analyses are in: an empty panel is one line of invitation, not four
            html.Div(
                id="compare-figures",
                style=HIDDEN,
                children=[
                    html.Div(
                        className="explorer-grid",
                        children=[graph("compare-tensors-graph"), graph("compare-sets-graph")],
                    ),
                    html.Div(id="compare-sets-table"),
                    graph("compare-next-token-graph"),
                    labelled(
                        "Matrix",
                        dcc.Dropdown(id="compare-tensor", options=[], value=None),
                        "opened: the matrix whose total changed most",
                    ),
                    dcc.Loading(graph("compare-heatmap-graph")),
                ],
            ),
        ],
    )
