"""The control inputs of the page as one list, read into a validated `DashboardState` and back.

The state and run callbacks both read every control: their ids, and the one validation path (write the
values as a URL query and parse it, as a shared link is parsed), are defined here.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any
from urllib.parse import urlencode

from dash import html

from frontend.state import ANALYSIS_FIELDS, B_FIELDS, DashboardState, format_reward, parse_query

CONTROL_IDS = [*ANALYSIS_FIELDS, "centering"]  # the controls that make an analysis, and the view's
# The compare panel's fields: empty (None, "") means "as A"; b_top_k takes "off" for no truncation.
B_CONTROL_IDS = [f"b_{key}" for key in B_FIELDS]
ALL_CONTROL_IDS = CONTROL_IDS + B_CONTROL_IDS


def state_from_controls(
    values: list[Any], slide: int, compare: str | None = None
) -> tuple[DashboardState, list[str]]:
    """Validate the controls (CONTROL_IDS, or ALL_CONTROL_IDS with the compare panel's) by writing them as
    a query and parsing it: one validation path for the page and for a shared link."""
    if len(values) not in (len(CONTROL_IDS), len(ALL_CONTROL_IDS)):
        expected = f"{len(CONTROL_IDS)} or {len(ALL_CONTROL_IDS)}"
        raise ValueError(f"expected {expected} control values, got {len(values)}")
    raw = dict(zip(ALL_CONTROL_IDS, values, strict=False))
    reward = raw.pop("reward") or ""
    query_state = {key: "" if value is None else str(value) for key, value in raw.items()}
    query = urlencode({**query_state, "reward": reward, "slide": str(slide or 1), "compare": compare or ""})
    return parse_query(query)


def controls_from_state(state: DashboardState) -> list[Any]:
    """The control values, in ALL_CONTROL_IDS order, that show `state` (B's absent overrides empty)."""
    values = asdict(state)
    values["reward"] = format_reward(state.reward)
    for key in B_FIELDS:
        value = state.b.get(key, "")
        values[f"b_{key}"] = "off" if key == "top_k" and key in state.b and value is None else value
    return [values[key] for key in ALL_CONTROL_IDS]


def message_block(errors: list[str]) -> list[Any]:
    """The message area's children: one line per readable error."""
    return [html.Div(error) for error in errors]
