"""The recent-studies list of the study page: each study's name (or id), model, prompts and status; a
click opens it.

Why a link (`?study=ID`) rather than a callback: the URL is the page's state, so opening a study from
the list is the same as opening its share link, and the browser's back button returns.
"""

from __future__ import annotations

import time
from typing import Any

import dash
from dash import Input, Output, html

from frontend.api_client import ApiError
from frontend.studies.client import StudyClient


def recent_list(items: list[dict[str, Any]], current: str | None, now: float) -> html.Ul | html.Div:
    """One line per study, newest first; the one on the page is marked."""
    if not items:
        return html.Div("none yet: Run one above", className="control-hint")
    lines = []
    for item in items:
        label = item.get("name") or f"{item['id'][:12]}…"
        age = _age(now - item["created"]) if item.get("created") else ""
        prompts = f"{item['prompts']} prompt{'s' if item['prompts'] != 1 else ''}"
        lines.append(
            html.Li(
                [
                    html.A(label, href=f"?study={item['id']}", className="recent-study-link"),
                    html.Span(
                        f" {item['model']} · {prompts} · ",
                        className="control-hint",
                    ),
                    html.Span(item["status"], className=f"recent-status status-{item['status']}"),
                    html.Span(f" · {age}" if age else "", className="control-hint"),
                ],
                className="recent-study current" if item["id"] == current else "recent-study",
            )
        )
    return html.Ul(lines, className="recent-studies-list")


def _age(seconds: float) -> str:
    for unit, size in (("d", 86400), ("h", 3600), ("min", 60)):
        if seconds >= size:
            return f"{seconds // size:.0f} {unit} ago"
    return "just now"


def register_recent(app: dash.Dash, client: StudyClient) -> None:
    """The list, read every few seconds and whenever a study is run or opened."""

    @app.callback(
        Output("recent-studies", "children"),
        Input("recent-poll", "n_intervals"),
        Input("study", "data"),
    )
    def show_recent(_ticks: int | None, study: dict[str, Any] | None):
        try:
            items = client.recent()
        except ApiError as error:
            return html.Div(f"could not list the studies: {error}", className="control-hint")
        return recent_list(items, (study or {}).get("id"), time.time())
