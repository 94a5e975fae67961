"""The dashboard's whole state as a URL query string, and back.

A shared link must reopen exactly the same view, so every control lives in the query string. Parsing a
hand-edited link never raises: each bad value yields a readable message and falls back to its default.

Two requests live in one state: the main analysis ("A"), and the one the compare panel puts beside it
("B"). B is A with the panel's overrides (`b_temperature=0.7`, ...: the `b_` keys of the query), so a
panel left alone compares A with itself, and `compare=<id>` names the B analysis a link opens.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from typing import Any
from urllib.parse import parse_qsl, urlencode

from backend.vocabulary import (
    LANDING_CONTINUATION,
    LANDING_PREFIX,
    LANDING_REWARD,
    LANDING_TEMPERATURE,
    LANDING_TOP_K,
    MODEL_ID_RULE,
    EngineKind,
    Method,
    SamplerKind,
    is_model_id,
)

N_SLIDES = 10
SAMPLER_KINDS = tuple(kind.value for kind in SamplerKind)
ENGINES = tuple(engine.value for engine in EngineKind)
# The centering toggle: which per-parameter statistic of the summary each setting shows.
CENTERING_STAT = {"on": "fisher", "off": "uncentered", "raw": "raw"}
CENTERINGS = tuple(CENTERING_STAT)
# The limits of a sampled continuation, as backend.schemas.SampleSpec states them (a test pins them).
MAX_SAMPLE_TOKENS = 1024
MAX_SEED = 2**63 - 1
# The controls of A that the compare panel can override for B, in the panel's order.
B_FIELDS = ("model", "prefix", "temperature", "top_k", "top_p", "engine", "sampler", "method")
ANALYSIS_ID = re.compile(r"[0-9a-f]{64}")
NO_TOP_K = ("", "off", "none")  # how a query writes "no top-k truncation"


@dataclass(frozen=True)
class DashboardState:
    """Every control of the dashboard; defaults are the on-policy, exact, centered view of slide 1."""

    model: str = "smollm2-135m"
    prefix: str = LANDING_PREFIX
    continuation: str = ""
    # a response drawn from the sampler instead of a typed continuation: set when sample_seed is not None
    sample_seed: int | None = None
    # a response's cost grows with every position (SmolLM2-135M exact: about 11 s each on 2 cores), so
    # the first sample is short; a link always states its length, so this changes no shared view
    sample_tokens: int = 8
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
    compare: str = ""  # the B analysis's id, once the compare panel has run
    b: dict[str, Any] = field(default_factory=dict)  # B's overrides of A's controls (keys: B_FIELDS)


def is_landing(query: str) -> bool:
    """A first visit: no prefix in the link, so the dashboard shows the essays' example."""
    return "prefix" not in dict(parse_qsl(query.lstrip("?"), keep_blank_values=True))


# The fields that make an analysis, in the order the controls show them; slide, centering and the
# compare panel only change the view.
ANALYSIS_FIELDS = (
    "model",
    "prefix",
    "continuation",
    "sample_seed",
    "sample_tokens",
    "temperature",
    "top_k",
    "top_p",
    "engine",
    "sampler",
    "data_token",
    "reward",
    "method",
)


def landing_state() -> DashboardState:
    """The essays' example (backend.vocabulary). Its request is the one `fisherscope serve` computes at
    start, so a first visit reads it from the cache."""
    return DashboardState(
        prefix=LANDING_PREFIX,
        continuation=LANDING_CONTINUATION,
        reward=dict(LANDING_REWARD),
        temperature=LANDING_TEMPERATURE,
        top_k=LANDING_TOP_K,
    )


def with_landing(query: str) -> str:
    """A first visit's query with the essays' example under it: the link's own keys (`model=`,
    `slide=`, ...) still win, since parse_query keeps the last value of a key."""
    if not is_landing(query):
        return query
    return to_query(landing_state()) + "&" + query.lstrip("?")


def state_b(state: DashboardState) -> DashboardState:
    """The compare panel's request: A with B's overrides (continuation, sample and reward as A's)."""
    return replace(state, **state.b)


def format_reward(reward: dict[str, float]) -> str:
    """`token=value;...`, as the CLI writes a reward; a token may itself contain '=' or ':' (the value
    is after the last '=')."""
    return ";".join(f"{token}={value:g}" for token, value in reward.items())


def parse_reward(text: str) -> tuple[dict[str, float], list[str]]:
    """Parse `token=value;...` into a dict, with a message for every malformed entry. The older
    `token:value` is still read: an entry without '=' splits at its last ':'."""
    reward: dict[str, float] = {}
    errors: list[str] = []
    for entry in text.split(";"):
        if not entry.strip():
            continue
        token, sep, value = entry.rpartition("=" if "=" in entry else ":")
        if not sep or not token:
            errors.append(f"reward entry {entry!r} must look like token=value, e.g. ' tea=1'")
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
    "sample_seed": (int, lambda v: 0 <= v <= MAX_SEED, "an integer >= 0, or empty for a typed continuation"),
    "sample_tokens": (
        int,
        lambda v: 1 <= v <= MAX_SAMPLE_TOKENS,
        f"an integer from 1 to {MAX_SAMPLE_TOKENS}",
    ),
}
OPTIONAL_NUMBERS = {"top_k": NO_TOP_K, "sample_seed": ("",)}  # the values that mean "not set"
CHOICE_FIELDS = {"engine": ENGINES, "sampler": SAMPLER_KINDS, "centering": CENTERINGS}


def parse_query(query: str) -> tuple[DashboardState, list[str]]:
    """Read a URL query string (with or without '?') into a state and a list of readable messages."""
    params = dict(parse_qsl(query.lstrip("?"), keep_blank_values=True))
    updates: dict[str, Any] = {}
    errors: list[str] = []
    for read in (read_texts, read_numbers, read_choices, read_method, read_reward):
        read(params, updates, errors)
    read_sample(updates, errors)
    read_compare(params, updates, errors)
    return replace(DashboardState(), **updates), errors


def read_texts(params: Params, updates: dict[str, Any], errors: list[str]) -> None:
    """The free-text fields as given; the model only if it is a model id."""
    for key in ("model", "prefix", "continuation", "data_token"):
        if key in params:
            updates[key] = params[key]
    if "model" in updates and not is_model_id(updates["model"]):
        errors.append(f"model {updates['model']!r} is not a model id ({MODEL_ID_RULE})")
        del updates["model"]


def read_numbers(params: Params, updates: dict[str, Any], errors: list[str]) -> None:
    """Temperature, top-p, top-k (empty, 'off' or 'none' for no truncation) and the slide number."""
    for key, (kind, valid, expected) in NUMBER_FIELDS.items():
        if key not in params or params[key] in OPTIONAL_NUMBERS.get(key, ()):
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
        updates["method"] = str(Method.parse(params["method"]))
    except ValueError as error:
        errors.append(str(error))


def read_reward(params: Params, updates: dict[str, Any], errors: list[str]) -> None:
    """The reward entries that parse, and a message for each that does not."""
    if "reward" in params:
        reward, reward_errors = parse_reward(params["reward"])
        updates["reward"] = reward
        errors.extend(reward_errors)


def read_sample(updates: dict[str, Any], errors: list[str]) -> None:
    """A typed continuation and a sampled one exclude each other; a link with both keeps the sample."""
    if updates.get("continuation") and updates.get("sample_seed") is not None:
        errors.append(
            "give a continuation or a sample_seed, not both: showing the sampled response "
            f"(seed {updates['sample_seed']}), not {updates['continuation']!r}"
        )
        updates["continuation"] = ""


def read_compare(params: Params, updates: dict[str, Any], errors: list[str]) -> None:
    """`compare=<id>` and B's overrides (`b_<field>`), read as A's fields are; messages name the b_ key."""
    if params.get("compare"):
        if ANALYSIS_ID.fullmatch(params["compare"]):
            updates["compare"] = params["compare"]
        else:
            errors.append(f"compare must be an analysis id (64 hex characters), got {params['compare']!r}")
    # an empty b_ value is no override (the panel's empty field reads "as A")
    own = {key[2:]: v for key, v in params.items() if key.startswith("b_") and key[2:] in B_FIELDS and v}
    b: dict[str, Any] = {}
    b_errors: list[str] = []
    for read in (read_texts, read_numbers, read_choices, read_method):
        read(own, b, b_errors)
    if own.get("top_k") in NO_TOP_K[1:]:  # an override to "no truncation" is a value, not an absence
        b["top_k"] = None
    errors.extend(f"b_{error}" for error in b_errors)
    if b:
        updates["b"] = b


def to_query(state: DashboardState) -> str:
    """The query string ('?' included) that parse_query reads back into the same state."""
    values = asdict(state)
    values["reward"] = format_reward(state.reward)
    values["top_k"] = "" if state.top_k is None else str(state.top_k)
    values["sample_seed"] = "" if state.sample_seed is None else str(state.sample_seed)
    del values["b"], values["compare"]
    if state.compare:
        values["compare"] = state.compare
    for key in B_FIELDS:  # only B's overrides: a link states how B differs from A
        if key in state.b:
            value = state.b[key]
            values[f"b_{key}"] = "off" if key == "top_k" and value is None else value
    return "?" + urlencode(
        {key: str(value) if not isinstance(value, str) else value for key, value in values.items()}
    )


def to_request(state: DashboardState) -> dict[str, Any]:
    """The body of POST /api/v1/analyses (docs/contract.md, AnalysisCreate) for this state."""
    sampled = state.sample_seed is not None
    return {
        "model": state.model,
        "prefix": state.prefix,
        "continuation": None if sampled else state.continuation or None,
        "continuation_sample": {"seed": state.sample_seed, "max_tokens": state.sample_tokens}
        if sampled
        else None,
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
