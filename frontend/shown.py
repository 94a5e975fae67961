"""What the page shows, in words: the analysis on screen against the analysis the controls describe.

The controls can be edited, and a run can take minutes or fail, so the drawing on screen and the
controls often describe two different analyses. The page says so (a banner naming what is drawn) and
its share link names what is drawn, never the edited controls. Pure functions of `DashboardState`.
"""

from __future__ import annotations

from dataclasses import replace

from frontend.plots import token_label
from frontend.state import ANALYSIS_FIELDS, DashboardState, format_reward, parse_query, to_query

FIELD_WORDS = {"sample_seed": "sample seed", "sample_tokens": "sample length", "data_token": "data token"}


def analysis_query(state: DashboardState) -> str:
    """The query of the analysis a state asks for (view settings and the compare panel left out)."""
    return to_query(replace(state, slide=1, centering="on", compare="", b={}))


def differing(shown: DashboardState, controls: DashboardState) -> list[str]:
    """The analysis fields in which the controls differ from what is shown, in words."""
    same_sample = shown.sample_seed is None and controls.sample_seed is None
    fields = [
        key
        for key in ANALYSIS_FIELDS
        if getattr(shown, key) != getattr(controls, key) and not (key == "sample_tokens" and same_sample)
    ]
    return [FIELD_WORDS.get(key, key) for key in fields]


def describe(state: DashboardState) -> str:
    """One line naming an analysis: model, prefix, response, sampler, reward and method."""
    parts = [state.model, f"prefix {token_label(state.prefix)}"]
    if state.sample_seed is not None:
        parts.append(f"sampled response (seed {state.sample_seed}, up to {state.sample_tokens} tokens)")
    elif state.continuation:
        parts.append(f"continuation {token_label(state.continuation)}")
    sampler = f"sampler {state.sampler}, temperature {state.temperature:g}, top-p {state.top_p:g}"
    if state.top_k is not None:
        sampler += f", top-k {state.top_k}"
    if state.data_token:
        sampler += f", data token {token_label(state.data_token)}"
    parts += [sampler, f"engine {state.engine}"]
    if state.reward:
        parts.append(f"reward {format_reward(state.reward)}")
    parts.append(f"method {state.method}")
    return " · ".join(parts)


def shown_state(query: str | None) -> DashboardState | None:
    """The state a view's query describes (None for an analysis a link opened by id alone)."""
    return parse_query(query)[0] if query else None


def link_query(query: str, slide: int, centering: str, compare: str = "", b: dict | None = None) -> str:
    """The share link's query: the drawn analysis, with the view's slide, centering and compare."""
    state = parse_query(query)[0]
    return to_query(replace(state, slide=slide, centering=centering, compare=compare, b=b or {}))
