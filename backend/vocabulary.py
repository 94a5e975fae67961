"""The words every side shares, defined once: statistics, sampler kinds, engines, methods, module kinds.

Why a module of its own, free of pydantic and torch: the engine's math (``workers/fisher``), the wire
schemas (``backend.schemas``), the service and the dashboard all name the same things, and each name,
and each rule over them (when is mu == p, how is a method written), must have exactly one definition.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, replace
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
# rho's denominator E_p[kappa^2] needs the Fisher under p: free on the policy, d_model directions per
# position off it, so an off-policy analysis computes it only when asked
RHO_NOT_ASKED = (
    "rho needs the Fisher under p, which this off-policy analysis did not compute (it is computed only "
    "when asked: request field rho, fisherscope analyze --rho, notebook analyze(..., rho=True))"
)
# the error of an analysis a DELETE stopped (the API stores it, the dashboard recognizes it)
CANCELLED = "cancelled (DELETE /api/v1/analyses/{id}); POST the same request again to run it"
CANCELLING = "cancelling"  # the stage of a running analysis a DELETE asked to stop
# A pass over the parameters (a summary, the certificate) reads a tensor of more than this many values
# in blocks of whole rows, so that what it forms of a tensor is a block's: Qwen3-1.7B's embedding table
# is 1.2 GB per float32 array, and a summary formed three of them at once. SmolLM2-135M's largest tensor
# (28M values) stays whole. The engine's blocks and the API's memory estimate read this one number.
PIECE_VALUES = 1 << 25
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


@dataclass(frozen=True)
class Sampler:
    """The sampler mu, resolved: what a job carries, the engine draws from and a cache key hashes.

    A request names a data token as text (``backend.schemas.SamplerSpec``); once tokenized it is this
    value, which travels unchanged from the normalized job to the engine.
    """

    kind: SamplerKind = SamplerKind.model
    temperature: float = 1.0
    top_k: int | None = None
    top_p: float = 1.0
    engine: EngineKind = EngineKind.model
    data_token_id: int | None = None

    def __post_init__(self) -> None:
        if not self.temperature > 0:
            raise ValueError(f"temperature must be > 0, got {self.temperature}")
        if self.top_k is not None and self.top_k < 1:
            raise ValueError(f"top_k must be >= 1, got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")

    @property
    def is_on_policy(self) -> bool:
        """mu == p exactly: the model sampler at temperature 1, no truncation, the model's own logits."""
        return (
            self.kind == SamplerKind.model
            and self.temperature == 1.0
            and self.top_k is None
            and self.top_p == 1.0
            and self.engine == EngineKind.model
        )


METHOD_MAX_LENGTH = 64
METHOD_USAGE = "method must be 'exact', 'truncated:F' with 0 < F <= 1, or 'mc:S' with an integer S >= 2"


@dataclass(frozen=True)
class Method:
    """How second moments are formed, written ``exact`` | ``truncated:F`` | ``mc:S``.

    ``Method.parse`` reads the written form once, where a request enters (schemas, CLI, links); the value
    then travels as it is. ``str`` gives the canonical spelling, so ``truncated:.5`` and
    ``truncated:0.5`` share a cache key.
    """

    name: MethodName = MethodName.exact
    fraction: float | None = None  # truncated: share of trace(C_q) to keep
    samples: int | None = None  # mc: tokens drawn
    # mc: the draws' seed; not part of the written form (a job derives it from its own key)
    seed: int = 0

    def __post_init__(self) -> None:
        if self.name == MethodName.truncated and not (
            self.fraction is not None and 0.0 < self.fraction <= 1.0
        ):
            raise ValueError(f"{METHOD_USAGE}; got fraction {self.fraction!r}")
        if self.name == MethodName.mc and not (self.samples is not None and self.samples >= 2):
            raise ValueError(f"{METHOD_USAGE}; got {self.samples} samples")

    @classmethod
    def parse(cls, text: object, seed: int = 0) -> Method:
        """Raises ValueError with a message that says which forms are accepted."""
        if isinstance(text, Method):
            return replace(text, seed=seed) if seed else text
        if not isinstance(text, str) or len(text) > METHOD_MAX_LENGTH:
            raise ValueError(METHOD_USAGE)
        name, sep, arg = text.strip().partition(":")
        if name == MethodName.exact and not sep:
            return cls(seed=seed)
        if name in (MethodName.truncated, MethodName.mc) and sep:
            truncated = name == MethodName.truncated
            try:
                number = float(arg) if truncated else int(arg)
            except ValueError:
                raise ValueError(f"{METHOD_USAGE}; got {text!r}") from None
            if truncated:
                return cls(MethodName.truncated, fraction=number, seed=seed)
            return cls(MethodName.mc, samples=int(number), seed=seed)
        raise ValueError(f"{METHOD_USAGE}; got {text!r}")

    def with_seed(self, seed: int) -> Method:
        return replace(self, seed=seed)

    def direction_bound(self, rank_bound: int) -> int:
        """Directions of a second moment of rank <= ``rank_bound`` (``truncated:F``: an upper bound)."""
        if rank_bound <= 0:
            return 0
        if self.name == MethodName.truncated:
            assert self.fraction is not None
            return max(1, math.ceil(self.fraction * rank_bound))
        if self.name == MethodName.mc:
            assert self.samples is not None
            return self.samples
        return rank_bound

    def __str__(self) -> str:
        if self.name == MethodName.truncated:
            return f"truncated:{float(self.fraction or 0.0)!r}"
        if self.name == MethodName.mc:
            return f"mc:{int(self.samples or 0)}"
        return MethodName.exact.value


def takes_a_first_pass(method: Method, sampler: Sampler, positions: int) -> bool:
    """Whether an analysis asked for partial results starts with a first pass over every position
    (``workers.fisher.response._FirstPass``): a response, by the exact method, whose positions take
    hundreds of directions each (a truncated or sampled plan is a few dozen, which the first pass would
    half repeat), and not under the data sampler, whose exact pass is its first moments alone."""
    return positions > 1 and method.name == MethodName.exact and sampler.kind != SamplerKind.data
