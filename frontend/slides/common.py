"""What every slide module provides, and the small helpers the sentences that read figures share."""

from __future__ import annotations

from typing import Any, Protocol

import plotly.graph_objects as go

from frontend.plots import Summary


class SlideModule(Protocol):
    """One essay section: TITLE, CLAIM (one sentence), FORMULA (LaTeX for MathJax), figure and reading.
    CHANGES_WITH_CENTERING: whether the figure draws the centering toggle's statistic (else the toggle
    is disabled on that slide, with the reason shown)."""

    TITLE: str
    CLAIM: str
    FORMULA: str
    CHANGES_WITH_CENTERING: bool

    def figure(self, summary: Summary, centering: str) -> go.Figure: ...

    def reading(self, summary: Summary, centering: str) -> str: ...


# What a slide may need beyond a prefix; a module that needs one defines `missing(summary) -> str | None`
# (what this analysis lacks for it, or None), and the slide panel then offers the essays' example.


def no_response(summary: Summary) -> str | None:
    return None if summary.get("response") else "this analysis has no response to add up along"


def no_shift(summary: Summary) -> str | None:
    totals = summary["totals"]
    if totals["mean_shift_sq"] > 1e-12 * max(totals["fisher"], 1e-30):
        return None
    return "here μ = p (model engine, temperature 1, no truncation): there is no mean shift to see"


def no_varying_reward(summary: Summary) -> str | None:
    reward = first_position(summary).get("reward")
    if reward and reward.get("std", 0) > 0:
        return None
    return "this analysis has no reward that varies over the likely next tokens"


def num(value: float) -> str:
    """A number in 3 significant digits."""
    return f"{value:.3g}"


def first_position(summary: Summary) -> dict[str, Any]:
    """The prefix's next-token position, the one the single-position slides read."""
    return summary["positions"][0]


def sampler_settings(summary: Summary) -> list[str]:
    """The sampler's temperature, and its top-k and top-p where they truncate: ['temperature 0.7', ...]."""
    sampler = summary["sampler"]
    parts = [f"temperature {sampler.get('temperature', 1.0):g}"]
    if sampler.get("top_k"):
        parts.append(f"top-k {sampler['top_k']}")
    if sampler.get("top_p", 1.0) < 1.0:
        parts.append(f"top-p {sampler['top_p']:g}")
    return parts
