"""JSON to and from bytes: orjson, with the standard library for what orjson refuses, same output rules.

Why: summaries of real models are hundreds of kB and are written once but served often; orjson is
several times faster and writes NaN and infinities as `null`, so stored summaries are always strict
JSON that can be spliced into a response body unparsed (`is_strict_json_object`).
"""

from __future__ import annotations

import json
import math
from typing import Any

import orjson

# Tokens the standard library writes for non-finite floats; strict JSON (and the API) has none.
_NON_JSON_NUMBERS = (b"NaN", b"Infinity")


def loads(raw: bytes | str) -> Any:
    """Parse JSON; NaN/Infinity written by older versions (which orjson refuses) still parse."""
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError:
        return json.loads(raw)


def _finite_or_none(value: Any) -> Any:
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {key: _finite_or_none(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite_or_none(item) for item in value]
    return value


def dumps(value: Any) -> bytes:
    """Compact UTF-8 JSON; non-finite floats become null (as pydantic writes them in responses)."""
    try:
        return orjson.dumps(value)
    except TypeError:  # e.g. non-str keys or a lone surrogate: the standard library copes
        return json.dumps(_finite_or_none(value), separators=(",", ":")).encode("utf-8")


def is_strict_json_object(raw: bytes) -> bool:
    """True when stored JSON is an object without NaN/Infinity (false positives only cost speed).

    Summaries stored by older versions may hold `NaN`; those are served through the slow path, which
    parses them and writes null as before.
    """
    return raw[:1] == b"{" and not any(token in raw for token in _NON_JSON_NUMBERS)
