"""What every figure shares: the layout, labels, colours and axis helpers, defined once.

Figures are pure functions of the summary (`backend.summary.AnalysisSummary`, docs/contract.md): the
engine reports every number a figure shows, and the frontend only draws. The centering toggle therefore
only changes which stored statistic is read (fisher, uncentered or raw), never triggers a recomputation,
and every figure can be tested without a browser. The slides (`frontend.slides`) and the explorer
(`frontend.explorer`) build their figures from the helpers here.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from typing import Any, Protocol

import plotly.graph_objects as go

from backend.summary import AnalysisOverview, AnalysisSummary, Totals
from frontend.state import CENTERING_STAT


class Token(Protocol):
    """A token as the summary lists it: the prefix's, the response's, a candidate, an output row."""

    @property
    def id(self) -> int: ...

    @property
    def text(self) -> str: ...


STAT_LABEL = {
    "fisher": "centered Fisher",
    "uncentered": "uncentered second moment",
    "raw": "raw second moment",
}
# One colour per module kind, keyed (and ordered) as backend.vocabulary.MODULE_KINDS.
KIND_COLOR = {
    "embedding": "#8c564b",
    "position": "#c49c94",
    "qkv": "#17becf",
    "q": "#1f77b4",
    "k": "#aec7e8",
    "v": "#ff7f0e",
    "o": "#ffbb78",
    "router": "#bcbd22",
    "gate_up": "#7f7f7f",
    "gate": "#2ca02c",
    "up": "#98df8a",
    "down": "#d62728",
    "norm": "#9467bd",
    "head": "#e377c2",
    "other": "#c7c7c7",
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


def stat_total(totals: Totals, stat: str) -> float:
    """One statistic of a totals map as a number to add and compare: the summary sends a non-finite
    total as null (backend/fastjson.py), read here as NaN, which is never above 0 and never raises."""
    value = totals[stat]
    return math.nan if value is None else value


def kind_color(kind: str) -> str:
    """The colour of a module kind; grey for a kind the vocabulary does not name."""
    return KIND_COLOR.get(kind, "grey")


def token_label(text: str) -> str:
    """A token's text in quotes, so a leading space (' tea' vs 'tea') and newlines stay visible."""
    return "'" + text.replace("\n", "\\n").replace("\t", "\\t") + "'"


def unique_token_labels(tokens: Sequence[Token]) -> list[str]:
    """Category labels for tokens, one per token: quoted text, plus `#id` where texts collide.

    Plotly merges bars that share a category, so several tokens that decode to the same text (byte
    pieces shown as U+FFFD, or ' tea' at two positions) would otherwise stack into one bar.
    """
    labels = [token_label(token.text) for token in tokens]
    counts = {label: labels.count(label) for label in labels}
    unique = []
    for label, token in zip(labels, tokens, strict=True):
        needs_id = counts[label] > 1 or "\ufffd" in label
        unique.append(f"{label} #{token.id}" if needs_id else label)
    seen: dict[str, int] = {}
    for i, label in enumerate(unique):  # same text and same id: number them
        seen[label] = seen.get(label, 0) + 1
        if seen[label] > 1:
            unique[i] = f"{label} ({seen[label]})"
    return unique


def response_labels(summary: AnalysisSummary) -> list[str]:
    """One axis label per response position: `t: 'token'`. The position already makes each label
    unique, so a repeated token (' She' twice) reads as itself; a byte piece (U+FFFD) keeps its id."""
    labels = []
    for t, token in enumerate(summary.tokens.continuation):
        label = token_label(token.text)
        labels.append(f"{t + 1}: {label} #{token.id}" if "\ufffd" in label else f"{t + 1}: {label}")
    return labels


def layer_label(layer: int | str) -> str:
    """`L3` for a numbered layer; a named group (embedding, head) as it is."""
    return f"L{layer}" if isinstance(layer, int) else str(layer)


TITLE_WIDTH = 48  # characters of a small title per line: a half-width graph at 1400 px, a phone's width


def small_title(text: str) -> dict[str, Any]:
    """A figure title in the explorer's small font, broken into lines so a long title is never cut off
    at the figure's edge (Plotly does not wrap titles); anchored at the top of the margin."""
    return {"text": wrapped(text, TITLE_WIDTH), "font": {"size": 13}, "y": 0.985, "yanchor": "top"}


def vocabulary(summary: AnalysisSummary) -> dict[int, str]:
    """The token texts the summary carries, by id: the prefix, the response, each position's top next
    tokens and output rows (where the largest Fisher of a vocabulary-sized tensor sits: the tokens fed
    in and the tokens the sampler hesitates between), and the rows of the top coordinates that the
    API's overview names (`vocabulary`)."""
    pieces: list[Token] = [*summary.tokens.prefix, *summary.tokens.continuation]
    for position in summary.positions:
        pieces += position.p.top
        pieces += position.output_layer.rows
    known: dict[int, str] = {}
    for piece in pieces:
        known.setdefault(piece.id, piece.text)
    if isinstance(summary, AnalysisOverview):  # the API's, for top coordinates
        for token_id, text in summary.vocabulary.items():
            known.setdefault(int(token_id), text)
    return known


def is_vocabulary_sized(shape: list[int], summary: AnalysisSummary) -> bool:
    """A tensor whose rows are the vocabulary's tokens (the embedding, the output layer)."""
    size = summary.model.vocab_size
    return bool(size) and len(shape) >= 1 and shape[0] == size


def row_token(row: int, known: dict[int, str]) -> str:
    """A vocabulary row named by its token: `' coffee'`, or `token #7042` when the summary lacks it."""
    return token_label(known[row]) if row in known else f"token #{row}"


# what a figure says while only a partial result is in (the exact pass computes it at the end)
PARTIAL_NOTE = "Computed when the exact analysis finishes: this is a partial result (the largest directions)."


def wrapped(text: str, width: int = 64) -> str:
    """Plotly never wraps an annotation: break a long message at spaces (kept as given if it has breaks)."""
    if "<br>" in text or len(text) <= width:
        return text
    lines, line = [], ""
    for word in text.split(" "):
        if line and len(line) + 1 + len(word) > width:
            lines.append(line)
            line = word
        else:
            line = f"{line} {word}" if line else word
    return "<br>".join([*lines, line])


def message_figure(message: str) -> go.Figure:
    """An empty figure that says why there is nothing to plot (e.g. no continuation was given)."""
    fig = go.Figure()
    fig.add_annotation(
        text=wrapped(message), showarrow=False, x=0.5, y=0.5, xref="paper", yref="paper", font={"size": 15}
    )
    fig.update_layout(**{**LAYOUT, "height": 300}, xaxis_visible=False, yaxis_visible=False)
    return fig


def all_zero_figure(stat: str) -> go.Figure:
    """What to show when a statistic is 0 for every parameter (the centered Fisher under a one-hot μ)."""
    return message_figure(
        f"The {STAT_LABEL[stat]} is 0 for every parameter here<br>"
        "(μ is one-hot: the data sampler); pick 'uncentered' to see the mean shift."
    )


def positive_or_none(values: Sequence[float | None]) -> list[float | None]:
    """Zeros cannot sit on a log axis: leave a gap rather than a point at an invented floor; a null (a
    value the summary could not send as a finite number) is a gap too."""
    return [value if value is not None and value > 0 else None for value in values]


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


def log_tickvals(values: Sequence[float | None]) -> list[float]:
    """Where a log axis over `values` is labelled: 1, 2 and 5 of each decade over a short span (left to
    itself, Plotly labels every minor tick there and the labels run into each other), whole decades,
    thinned to at most ten, over a long one."""
    positive = [value for value in values if value is not None and 0 < value < math.inf]
    if not positive:
        return []
    low, high = math.floor(math.log10(min(positive))), math.ceil(math.log10(max(positive)))
    if high - low <= 3:
        return [mantissa * 10.0**k for k in range(low, high + 1) for mantissa in (1, 2, 5)]
    return [10.0**k for k in decade_exponents(low, high)]


def decade_range(log10_values: list[float]) -> tuple[int, int]:
    """Whole-decade axis bounds strictly around the values (in log10 units): every point, and every
    bar's top, lies inside the axis instead of on its edge."""
    low = math.floor(min(log10_values))
    if low == min(log10_values):
        low -= 1
    return low, math.floor(max(log10_values)) + 1
