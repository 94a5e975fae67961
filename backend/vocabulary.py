"""The words every side shares, defined once: statistics, sampler kinds, engines, methods, module kinds.

Why a module of its own, free of pydantic and torch: the engine's math (``workers/fisher``), the wire
schemas (``backend.schemas``), the service and the dashboard all name the same things, and each name,
and each rule over them (when is mu == p, how is a method written), must have exactly one definition.
"""

from __future__ import annotations

import re
from enum import StrEnum

# A model id: what the HTTP API accepts in place of a path (built-in and registered ids alike). It is a
# folder name in the cache and a path segment in URLs: no '..', no leading or trailing punctuation, so
# that every id that can be added can also be used and removed.
MODEL_ID = re.compile(r"[a-z0-9](?:[a-z0-9._-]{0,62}[a-z0-9])?")
MODEL_ID_RULE = (
    "1-64 characters of a-z, 0-9, '.', '_', '-', starting and ending with a letter or digit, without '..'"
)


def is_model_id(model_id: str) -> bool:
    """Whether ``model_id`` may name a model (MODEL_ID_RULE): never a path, never '..'."""
    return MODEL_ID.fullmatch(model_id) is not None and ".." not in model_id


def model_id_problem(model_id: str) -> str | None:
    """What is wrong with ``model_id`` as a new id, in a sentence, or None."""
    return None if is_model_id(model_id) else f"model id {model_id!r} must be {MODEL_ID_RULE}"


# Per-parameter statistics (docs/design.md §2), in the order summaries and files list them.
STATS: tuple[str, ...] = (
    "fisher",
    "uncentered",
    "raw",
    "mean_shift",
    "common",
    "rho",
    "policy_grad",
    "bound",
)
SIGNED_STATS: tuple[str, ...] = ("mean_shift", "common", "policy_grad")
# The densities q of the named top-q sets: concentration shares, overlaps, compares and masks.
TOP_FRACTIONS: tuple[float, ...] = (0.001, 0.01, 0.05, 0.1)
# The essays' running example: what a first visit shows, computed once by `fisherscope serve` at start.
# It carries what every slide reads: a short response (slides 4, 8, 9; each position costs seconds on a
# CPU), a reward over next tokens (slide 2: ' tea' rewarded, its likely rival ' coffee' not), and an
# off-policy sampler, the temperature and truncation RL samples with (slides 5, 7, 8, 10: mu != p).
LANDING_PREFIX = "She drank a cup of"
LANDING_CONTINUATION = " tea with her"
LANDING_REWARD: dict[str, float] = {" tea": 1.0, " coffee": 0.0}
LANDING_TEMPERATURE = 0.7
LANDING_TOP_K = 50

# Module kinds a parameter is grouped by, in the order figures show them.
MODULE_KINDS: tuple[str, ...] = (
    "embedding",
    "position",
    "qkv",
    "q",
    "k",
    "v",
    "o",
    "router",
    "gate_up",
    "gate",
    "up",
    "down",
    "norm",
    "head",
    "other",
)


class SamplerKind(StrEnum):
    model = "model"  # the model's (tempered, truncated) next-token distribution
    data = "data"  # one-hot on a data token (SFT)
    uniform = "uniform"


class EngineKind(StrEnum):
    model = "model"  # logits as the model computes them
    bf16 = "bf16"  # the same weights run in bfloat16 (the training-inference mismatch)


class MethodName(StrEnum):
    exact = "exact"
    truncated = "truncated"
    mc = "mc"


def is_on_policy(kind: str, temperature: float, top_k: int | None, top_p: float, engine: str) -> bool:
    """mu == p exactly: the model sampler at temperature 1, no truncation, the model's own logits."""
    return (
        kind == SamplerKind.model
        and temperature == 1.0
        and top_k is None
        and top_p == 1.0
        and engine == EngineKind.model
    )


METHOD_USAGE = "method must be 'exact', 'truncated:F' with 0 < F <= 1, or 'mc:S' with an integer S >= 2"


def parse_method(method: object) -> tuple[MethodName, float | None, int | None]:
    """Split ``exact`` | ``truncated:F`` | ``mc:S`` into (name, fraction, samples).

    Raises ValueError with a message that says which forms are accepted.
    """
    if not isinstance(method, str):
        raise ValueError(METHOD_USAGE)
    name, sep, arg = method.strip().partition(":")
    if name == MethodName.exact and not sep:
        return MethodName.exact, None, None
    if name == MethodName.truncated and sep:
        try:
            fraction = float(arg)
        except ValueError:
            raise ValueError(f"{METHOD_USAGE}; got {method!r}") from None
        if not 0.0 < fraction <= 1.0:
            raise ValueError(f"{METHOD_USAGE}; got fraction {arg!r}")
        return MethodName.truncated, fraction, None
    if name == MethodName.mc and sep:
        try:
            samples = int(arg)
        except ValueError:
            raise ValueError(f"{METHOD_USAGE}; got {method!r}") from None
        if samples < 2:
            raise ValueError(f"{METHOD_USAGE}; got {samples} samples")
        return MethodName.mc, None, samples
    raise ValueError(f"{METHOD_USAGE}; got {method!r}")


def format_method(name: str, fraction: float | None, samples: int | None) -> str:
    """Canonical spelling of a parsed method (so ``truncated:.5`` and ``truncated:0.5`` share a key)."""
    if name == MethodName.truncated:
        return f"truncated:{float(fraction or 0.0)!r}"
    if name == MethodName.mc:
        return f"mc:{int(samples or 0)}"
    return MethodName.exact.value
