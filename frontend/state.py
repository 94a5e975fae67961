"""The dashboard's whole state as a URL query string, and back.

A shared link must reopen exactly the same view, so every control lives in the query string. Parsing a
hand-edited link never raises: each bad value yields a readable message and falls back to its default.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from typing import Any
from urllib.parse import parse_qsl, urlencode

from backend.vocabulary import MODEL_ID, EngineKind, SamplerKind, format_method, parse_method

N_SLIDES = 10
SAMPLER_KINDS = tuple(kind.value for kind in SamplerKind)
ENGINES = tuple(engine.value for engine in EngineKind)
# The centering toggle: which per-parameter statistic of the summary each setting shows.
CENTERING_STAT = {"on": "fisher", "off": "uncentered", "raw": "raw"}
CENTERINGS = tuple(CENTERING_STAT)


@dataclass(frozen=True)
class DashboardState:
    """Every control of the dashboard; defaults are the on-policy, exact, centered view of slide 1."""

    model: str = "smollm2-135m"
    prefix: str = ""
    continuation: str = ""
    temperature: float = 1.0
    top_k: int | None = None
    top_p: float = 1.0
    engine: str = "model"
    sampler: str = "model"
    data_token: str = ""
    reward: dict[str, float] = field(default_factory=dict)
    method: str = "exact"
    centering: str = "on"
    slide: int = 1


def format_reward(reward: dict[str, float]) -> str:
    """`token:value;...`; a token may itself contain ':' (the value is after the last one)."""
    return ";".join(f"{token}:{value:g}" for token, value in reward.items())


def parse_reward(text: str) -> tuple[dict[str, float], list[str]]:
    """Parse `token:value;...` into a dict, with a message for every malformed entry."""
    reward: dict[str, float] = {}
    errors: list[str] = []
    for entry in text.split(";"):
        if not entry.strip():
            continue
        token, sep, value = entry.rpartition(":")
        if not sep or not token:
            errors.append(f"reward entry {entry!r} must look like token:value, e.g. ' tea:1'")
            continue
        try:
            number = float(value)
        except ValueError:
            errors.append(f"reward for {token!r} must be a number, got {value!r}")
            continue
        if not math.isfinite(number):
            errors.append(f"reward for {token!r} must be finite, got {value!r}")
            continue
        reward[token] = number
    return reward, errors


Params = dict[str, str]
# A number field: its type, its valid range, and how the message describes a valid value.
NUMBER_FIELDS: dict[str, tuple[type, Callable[[Any], bool], str]] = {
    "temperature": (float, lambda v: v > 0, "a number > 0"),
    "top_p": (float, lambda v: 0 < v <= 1, "a number in (0, 1]"),
    "top_k": (int, lambda v: v >= 1, "an integer >= 1, or empty for off"),
    "slide": (int, lambda v: 1 <= v <= N_SLIDES, f"an integer from 1 to {N_SLIDES}"),
}
CHOICE_FIELDS = {"engine": ENGINES, "sampler": SAMPLER_KINDS, "centering": CENTERINGS}


def parse_query(query: str) -> tuple[DashboardState, list[str]]:
    """Read a URL query string (with or without '?') into a state and a list of readable messages."""
    params = dict(parse_qsl(query.lstrip("?"), keep_blank_values=True))
    updates: dict[str, Any] = {}
    errors: list[str] = []
    for read in (read_texts, read_numbers, read_choices, read_method, read_reward):
        read(params, updates, errors)
    return replace(DashboardState(), **updates), errors


def read_texts(params: Params, updates: dict[str, Any], errors: list[str]) -> None:
    """The free-text fields as given; the model only if it is a model id."""
    for key in ("model", "prefix", "continuation", "data_token"):
        if key in params:
            updates[key] = params[key]
    if "model" in updates and not MODEL_ID.fullmatch(updates["model"]):
        errors.append(f"model {updates['model']!r} is not a model id (a-z, 0-9, '.', '_', '-')")
        del updates["model"]


def read_numbers(params: Params, updates: dict[str, Any], errors: list[str]) -> None:
    """Temperature, top-p, top-k (empty, 'off' or 'none' for no truncation) and the slide number."""
    for key, (kind, valid, expected) in NUMBER_FIELDS.items():
        if key not in params or (key == "top_k" and params[key] in ("", "off", "none")):
            continue
        try:
            value = kind(params[key])
        except ValueError:
            errors.append(f"{key} must be {expected}, got {params[key]!r}")
            continue
        if not valid(value) or (kind is float and not math.isfinite(value)):
            errors.append(f"{key} must be {expected}, got {params[key]!r}")
            continue
        updates[key] = value


def read_choices(params: Params, updates: dict[str, Any], errors: list[str]) -> None:
    """Engine, sampler and centering: one of the named values."""
    for key, allowed in CHOICE_FIELDS.items():
        if key not in params:
            continue
        if params[key] in allowed:
            updates[key] = params[key]
        else:
            errors.append(f"{key} must be one of {', '.join(allowed)}, got {params[key]!r}")


def read_method(params: Params, updates: dict[str, Any], errors: list[str]) -> None:
    """The method in its canonical spelling (backend.vocabulary parses it)."""
    if "method" not in params:
        return
    try:
        updates["method"] = format_method(*parse_method(params["method"]))
    except ValueError as error:
        errors.append(str(error))


def read_reward(params: Params, updates: dict[str, Any], errors: list[str]) -> None:
    """The reward entries that parse, and a message for each that does not."""
    if "reward" in params:
        reward, reward_errors = parse_reward(params["reward"])
        updates["reward"] = reward
        errors.extend(reward_errors)


def to_query(state: DashboardState) -> str:
    """The query string ('?' included) that parse_query reads back into the same state."""
    values = asdict(state)
    values["reward"] = format_reward(state.reward)
    values["top_k"] = "" if state.top_k is None else str(state.top_k)
    return "?" + urlencode(
        {key: str(value) if not isinstance(value, str) else value for key, value in values.items()}
    )


def to_request(state: DashboardState) -> dict[str, Any]:
    """The body of POST /api/v1/analyses (docs/contract.md, AnalysisCreate) for this state."""
    return {
        "model": state.model,
        "prefix": state.prefix,
        "continuation": state.continuation or None,
        "sampler": {
            "kind": state.sampler,
            "temperature": state.temperature,
            "top_k": state.top_k,
            "top_p": state.top_p,
            "engine": state.engine,
            "data_token": state.data_token or None,
        },
        "reward": dict(state.reward),
        "method": state.method,
    }
