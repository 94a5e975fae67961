"""The control inputs of the page as one list, read into a validated `DashboardState` and back.

The state and run callbacks both read every control: their ids, and the one validation path (write the
values as a URL query and parse it, as a shared link is parsed), are defined here.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any
from urllib.parse import urlencode

from dash import html

from frontend.state import DashboardState, format_reward, parse_query

CONTROL_IDS = [
    "model",
    "prefix",
    "continuation",
    "temperature",
    "top_k",
    "top_p",
    "engine",
    "sampler",
    "data_token",
    "reward",
    "method",
    "centering",
]


def state_from_controls(values: list[Any], slide: int) -> tuple[DashboardState, list[str]]:
    """Validate the controls by writing them as a query and parsing it: one validation path for both."""
    raw = dict(zip(CONTROL_IDS, values, strict=True))
    reward = raw.pop("reward") or ""
    query_state = {key: "" if value is None else str(value) for key, value in raw.items()}
    query = urlencode({**query_state, "reward": reward, "slide": str(slide or 1)})
    return parse_query(query)


def controls_from_state(state: DashboardState) -> list[Any]:
    """The control values, in CONTROL_IDS order, that show `state`."""
    values = asdict(state)
    values["reward"] = format_reward(state.reward)
    return [values[key] for key in CONTROL_IDS]


def message_block(errors: list[str]) -> list[Any]:
    """The message area's children: one line per readable error."""
    return [html.Div(error) for error in errors]
