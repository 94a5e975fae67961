"""What every slide module provides, and the small helpers the sentences that read figures share."""

from __future__ import annotations

from typing import Protocol

import plotly.graph_objects as go

from backend.summary import AnalysisSummary, PositionSummary
from frontend.plots import stat_total


class SlideModule(Protocol):
    """One essay section: TITLE, CLAIM (one sentence), FORMULA (LaTeX for MathJax), figure and reading.
    CHANGES_WITH_CENTERING: whether the figure draws the centering toggle's statistic (else the toggle
    is disabled on that slide, with the reason shown)."""

    TITLE: str
    CLAIM: str
    FORMULA: str
    CHANGES_WITH_CENTERING: bool

    def figure(self, summary: AnalysisSummary, centering: str) -> go.Figure: ...

    def reading(self, summary: AnalysisSummary, centering: str) -> str: ...


# What a slide may need beyond a prefix; a module that needs one defines `missing(summary) -> str | None`
# (what this analysis lacks for it, or None), and the slide panel then offers the essays' example.


def no_response(summary: AnalysisSummary) -> str | None:
    return None if summary.response is not None else "this analysis has no response to add up along"


def no_shift(summary: AnalysisSummary) -> str | None:
    if stat_total(summary.totals, "mean_shift_sq") > 1e-12 * max(stat_total(summary.totals, "fisher"), 1e-30):
        return None
    return "here μ = p (model engine, temperature 1, no truncation): there is no mean shift to see"


def no_varying_reward(summary: AnalysisSummary) -> str | None:
    reward = first_position(summary).reward
    if reward is not None and reward.std > 0:
        return None
    return "this analysis has no reward that varies over the likely next tokens"


def num(value: float) -> str:
    """A number in 3 significant digits."""
    return f"{value:.3g}"


def first_position(summary: AnalysisSummary) -> PositionSummary:
    """The prefix's next-token position, the one the single-position slides read."""
    return summary.positions[0]


def sampler_settings(summary: AnalysisSummary) -> list[str]:
    """The sampler's temperature, and its top-k and top-p where they truncate: ['temperature 0.7', ...]."""
    sampler = summary.sampler
    return [
        f"temperature {sampler.temperature:g}",
        *([f"top-k {sampler.top_k}"] if sampler.top_k else []),
        *([f"top-p {sampler.top_p:g}"] if sampler.top_p < 1.0 else []),
    ]


def partial_positions(summary: AnalysisSummary) -> list[bool]:
    """Per response position, whether its Fisher is still partial: a running exact analysis's partial
    result (no concentration yet) whose position carries less than its whole trace(C_mu). Empty for a
    prefix, a finished analysis, or a method that never takes the whole trace."""
    if summary.concentration is not None or summary.response is None or summary.method.name != "exact":
        return []
    return [position.kept_share < 1 for position in summary.positions]


def partial_response_words(summary: AnalysisSummary) -> str:
    """What a running response's partial result holds, before a slide's own reading."""
    partial = partial_positions(summary)
    if not any(partial):
        return ""
    least = min(p.kept_share for p, still in zip(summary.positions, partial, strict=True) if still)
    exact = len(partial) - sum(partial)
    # a first partial may read C_mu over mu's most probable tokens only, its spectrum pending
    whose = (
        "of C_μ's part over μ's most probable tokens"
        if any(p.spectrum is None for p in summary.positions)
        else "of C_μ"
    )
    return (
        f"Still computing: {exact} of {len(partial)} positions are exact; at the others (pale) the Fisher "
        f"holds the largest directions {whose} so far (at least {least:.0%} of its trace), a lower bound. "
        "The mean shift, χ² and the first moments are complete at every position. "
    )
