"""What every slide module provides, and small formatting helpers for the sentences that read figures."""

from __future__ import annotations

from typing import Any, Protocol

import plotly.graph_objects as go

Summary = dict[str, Any]


class SlideModule(Protocol):
    """One essay section: TITLE, CLAIM (one sentence), FORMULA (LaTeX for MathJax), figure and reading."""

    TITLE: str
    CLAIM: str
    FORMULA: str

    def figure(self, summary: Summary, centering: str) -> go.Figure: ...

    def reading(self, summary: Summary, centering: str) -> str: ...


def pct(share: float) -> str:
    """A share as a percentage with two significant digits for small values (0.4%, 32%)."""
    value = 100.0 * share
    if value == 0:
        return "0%"
    return f"{value:.2g}%" if abs(value) < 10 else f"{value:.0f}%"


def num(value: float) -> str:
    """A number in 3 significant digits."""
    return f"{value:.3g}"


def quoted(text: str) -> str:
    return "'" + text.replace("\n", "\\n") + "'"


def first_position(summary: Summary) -> dict[str, Any]:
    return summary["positions"][0]


def prefix_text(summary: Summary) -> str:
    return "".join(token["text"] for token in summary["tokens"]["prefix"])


def layer_share(summary: Summary, stat: str) -> tuple[Any, float]:
    """The layer holding the largest part of a statistic, and that part's share of the whole."""
    total = sum(row["totals"][stat] for row in summary["layers"]) or 1.0
    best = max(summary["layers"], key=lambda row: row["totals"][stat])
    return best["layer"], best["totals"][stat] / total
