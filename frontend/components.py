"""Small pieces every part of the page builds from: a labelled control and the graphs' config."""

from __future__ import annotations

from dash import dcc, html

from frontend.plots import message_figure

# typed with dcc.Graph's own TypedDict, so a misspelt option or a wrong export format is a type error
GRAPH_CONFIG: dcc.Graph.Config = {"displaylogo": False, "toImageButtonOptions": {"format": "png", "scale": 2}}


def labelled(label: str, component, hint: str | None = None) -> html.Div:
    children = [html.Label(label, className="control-label"), component]
    if hint:
        children.append(html.Div(hint, className="control-hint"))
    return html.Div(children, className="control")


def graph(id: str, waiting: str | None = None) -> dcc.Graph:
    """A graph; `waiting`: the sentence it shows until its callback first draws it (Dash would otherwise
    draw empty -1..6 axes for an instant)."""
    figure = message_figure(waiting) if waiting else None
    return dcc.Graph(id=id, config=GRAPH_CONFIG, **({"figure": figure} if figure else {}))
