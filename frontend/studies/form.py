"""The study form as values: read from and written to the URL, and turned into the API's `StudyCreate`.

Why plain values: the URL holds the form's controls (and the study id), so a share link restores the
form exactly as it was; only Run turns the values into a request, and every value that cannot become
one is a sentence saying what to write instead. Pure functions, tested without a browser.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qsl, urlencode, urlsplit

from backend.rewards import TARGET_SLOT
from backend.vocabulary import EngineKind, Method, SamplerKind

STUDY_ID = re.compile(r"[0-9a-f]{64}")
MAX_TENSOR_NAME = 300
TARGET_SEPARATORS = ("\t", " =>")  # the last one on a line splits prompt from target
DEFAULT_PATTERN = r"^\s*{target}\b"
DEFAULT_PROMPTS = "\n".join(
    (
        "The capital of France is => Paris",
        "Two plus three equals => five",
        "The opposite of hot is => cold",
    )
)
PROMPT_SYNTAX = (
    "One prompt per line; blank lines are skipped. An optional target (the response a reward and the "
    "empirical Fisher compare with) follows a tab or ' =>', e.g. 'The capital of France is => Paris'. "
    "The target is the text after the separator as written, so ' Paris' keeps its leading space."
)
REWARDS = ("none", "exact", "regex")
SAMPLER_KINDS = (SamplerKind.model.value, SamplerKind.uniform.value)
ENGINES = tuple(kind.value for kind in EngineKind)
MAX_SEED = 2**63 - 1


@dataclass(frozen=True)
class Field:
    """One control of the form: its component id (also its URL key), default, and how a value reads."""

    id: str
    default: Any
    kind: type = str
    choices: tuple[str, ...] | None = None
    valid: Callable[[Any], bool] | None = None
    expected: str = ""


FIELDS: tuple[Field, ...] = (
    Field("name", ""),
    Field("model", "smollm2-135m"),
    Field("prompts", DEFAULT_PROMPTS),
    Field("samples", 2, int, valid=lambda v: 1 <= v <= 64, expected="an integer from 1 to 64"),
    Field("max_tokens", 4, int, valid=lambda v: 1 <= v <= 256, expected="an integer from 1 to 256"),
    Field("seed", 0, int, valid=lambda v: 0 <= v <= MAX_SEED, expected="an integer >= 0"),
    Field("sampler", "model", choices=SAMPLER_KINDS),
    Field("temperature", 1.0, float, valid=lambda v: v > 0, expected="a number > 0"),
    Field("top_k", None, int, valid=lambda v: v >= 1, expected="an integer >= 1, or empty for off"),
    Field("top_p", 1.0, float, valid=lambda v: 0 < v <= 1, expected="a number in (0, 1]"),
    Field("engine", "model", choices=ENGINES),
    Field("method", "exact"),
    Field("reward", "regex", choices=REWARDS),
    Field("pattern", DEFAULT_PATTERN),
    Field("densities", "0.1, 1, 5"),
)
FIELD_IDS = tuple(field.id for field in FIELDS)
DEFAULTS: dict[str, Any] = {field.id: field.default for field in FIELDS}
Values = dict[str, Any]


@dataclass(frozen=True)
class Link:
    """What a URL says: the form's values, the study it shows, the mask density, the matrix whose mask
    is drawn, and the study it is compared with."""

    values: Values
    study: str | None = None
    view_q: str | None = None
    tensor: str | None = None
    compare: str | None = None


def parse_query(query: str) -> tuple[Link, list[str]]:
    """A URL query string (with or without '?') as a `Link`, and a sentence per value it cannot use."""
    params = dict(parse_qsl(query.lstrip("?"), keep_blank_values=True))
    values, errors = dict(DEFAULTS), []
    for field in FIELDS:
        if field.id in params:
            value, error = read_value(field, params[field.id])
            if error:
                errors.append(error)
            else:
                values[field.id] = value
    study = _study_id(params.get("study"), "study", errors)
    compare = _study_id(params.get("compare"), "compared study", errors)
    tensor = params.get("tensor") or None
    if tensor is not None and len(tensor) > MAX_TENSOR_NAME:
        errors.append(f"the link's tensor name is {len(tensor)} characters; no parameter's is that long")
        tensor = None
    return Link(values, study, params.get("q") or None, tensor, compare), errors


def _study_id(value: str | None, what: str, errors: list[str]) -> str | None:
    if value is None or STUDY_ID.fullmatch(value):
        return value
    shown = value if len(value) <= 80 else value[:80] + "…"
    errors.append(
        f"the link's {what} id {shown!r} is not a study id (64 hex characters); check the link, or "
        "press Run to compute the study in the form"
    )
    return None


def study_id_in(text: str | None) -> str | None:
    """A study id typed or pasted: the id itself, or the study a share link names."""
    text = (text or "").strip()
    if STUDY_ID.fullmatch(text):
        return text
    study = dict(parse_qsl(urlsplit(text).query)).get("study", "")
    return study if STUDY_ID.fullmatch(study) else None


def read_value(field: Field, text: str) -> tuple[Any, str | None]:
    """One URL value as the control holds it: (value, None), or (None, what is wrong)."""
    if field.choices is not None:
        if text in field.choices:
            return text, None
        return None, f"{field.id} must be one of {', '.join(field.choices)}, got {text!r}"
    if field.kind is str:
        return text, None
    if text.strip() in ("", "off", "none") and field.default is None:
        return None, None
    try:
        number = field.kind(text)
    except ValueError:
        return None, f"{field.id} must be {field.expected}, got {text!r}"
    if (field.kind is float and not math.isfinite(number)) or (field.valid and not field.valid(number)):
        return None, f"{field.id} must be {field.expected}, got {text!r}"
    return number, None


def to_query(
    values: Mapping[str, Any],
    study: str | None = None,
    view_q: str | None = None,
    tensor: str | None = None,
    compare: str | None = None,
) -> str:
    """The URL query of the form: the values that differ from the defaults, the study, the view."""
    params = {
        key: "" if value is None else str(value)
        for key, value in values.items()
        if key in DEFAULTS and value != DEFAULTS[key] and not (value in (None, "") and DEFAULTS[key] is None)
    }
    if study:
        params["study"] = study
    if view_q:
        params["q"] = view_q
    if tensor:
        params["tensor"] = tensor
    if compare:
        params["compare"] = compare
    return "?" + urlencode(params) if params else ""


@dataclass(frozen=True)
class PromptLine:
    line: int  # 1-based line of the text box
    prompt: str
    target: str | None


def parse_prompts(text: str) -> tuple[list[PromptLine], list[str]]:
    """The prompts of the text box (one a line, target after a tab or ' =>'), and what is wrong."""
    prompts, errors = [], []
    for number, raw in enumerate((text or "").splitlines(), start=1):
        if not raw.strip():
            continue
        prompt, target = split_target(raw)
        if not prompt.strip():
            errors.append(f"line {number} has a target but no prompt before the separator")
            continue
        prompts.append(PromptLine(number, prompt, target))
    if not prompts and not errors:
        errors.append("write at least one prompt (one per line)")
    return prompts, errors


def split_target(line: str) -> tuple[str, str | None]:
    """(prompt, target) of one line: split at the last tab, else at the last ' =>'; no target: None."""
    for separator in TARGET_SEPARATORS:
        prompt, found, target = line.rpartition(separator)
        if found:
            return prompt, target if target.strip() else None
    return line, None


def request_body(values: Mapping[str, Any]) -> tuple[dict[str, Any] | None, list[str]]:
    """The POST /api/v1/studies body of the form's values, or None and a sentence per problem."""
    errors: list[str] = []
    prompts, prompt_errors = parse_prompts(values.get("prompts") or "")
    errors += prompt_errors
    numbers: dict[str, Any] = {}
    for field in FIELDS:
        if field.kind is str:
            continue
        value = values.get(field.id)
        if value is None and field.default is not None:
            errors.append(f"{field.id} must be {field.expected}")
            continue
        _, error = read_value(field, "" if value is None else str(value))
        errors += [error] if error else []
        numbers[field.id] = value
    method = (values.get("method") or "exact").strip()
    try:
        Method.parse(method)
    except ValueError as error:
        errors.append(str(error))
    reward, reward_errors = reward_spec(values, prompts)
    errors += reward_errors
    q, q_errors = parse_densities(values.get("densities") or "")
    errors += q_errors
    if errors:
        return None, errors
    sampler = {
        "kind": values.get("sampler") or "model",
        "temperature": float(numbers["temperature"]),
        "top_k": None if numbers["top_k"] is None else int(numbers["top_k"]),
        "top_p": float(numbers["top_p"]),
        "engine": values.get("engine") or "model",
    }
    name = (values.get("name") or "").strip()
    body = {
        **({"name": name} if name else {}),  # a label to find it again; not part of the study's id
        "model": values.get("model"),
        "prompts": [{"prompt": p.prompt, **({"target": p.target} if p.target else {})} for p in prompts],
        "samples": int(numbers["samples"]),
        "max_tokens": int(numbers["max_tokens"]),
        "seed": int(numbers["seed"]),
        "sampler": sampler,
        "method": method,
        "reward": reward,
        "q": q,
    }
    return body, []


def reward_spec(values: Mapping[str, Any], prompts: list[PromptLine]) -> tuple[dict | None, list[str]]:
    """The reward of the form (None for none) and what is missing for it."""
    kind = values.get("reward") or "none"
    if kind == "none":
        return None, []
    missing = [str(p.line) for p in prompts if not p.target]
    errors = []
    if missing:
        errors.append(
            f"a reward compares each response with its prompt's target; line(s) {', '.join(missing)} "
            "have none (write 'prompt => target'), or choose reward: none"
        )
    if kind == "exact":
        return {"kind": "exact"}, errors
    pattern = values.get("pattern") or ""
    if not pattern:
        errors.append(f"a regex reward needs a pattern, e.g. {DEFAULT_PATTERN} ({TARGET_SLOT} = the target)")
    return {"kind": "regex", "pattern": pattern}, errors


def parse_densities(text: str) -> tuple[list[float], list[str]]:
    """Mask densities typed in percent ('0.1, 1, 5') as fractions of all parameters."""
    q, errors = [], []
    for item in re.split(r"[,\s]+", text.strip().replace("%", "")):
        if not item:
            continue
        try:
            percent = float(item)
        except ValueError:
            errors.append(f"mask density {item!r} is not a number; write percents, e.g. 0.1, 1, 5")
            continue
        if not 0 < percent < 100:
            errors.append(f"mask density {item}% must be between 0 and 100 (exclusive)")
            continue
        q.append(round(percent / 100, 12))
    if not q and not errors:
        errors.append("give at least one mask density in percent, e.g. 1")
    if len(set(q)) > 8:
        errors.append("at most 8 mask densities")
    return sorted(set(q)), errors


def density_label(q: float) -> str:
    """A density as the form writes it: 0.001 -> '0.1%'."""
    return f"{q * 100:g}%"
