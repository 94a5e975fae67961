"""Wire schemas shared by the API, the worker and the dashboard (pydantic v2, torch-free).

`AnalysisCreate` is what a person sends; `AnalysisJob` is the normalized, tokenized request: the one
object the worker runs and the only source of the cache key (`AnalysisJob.key()`).
"""

from __future__ import annotations

import fnmatch
import hashlib
import json
from enum import StrEnum
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, PlainSerializer, PlainValidator, WithJsonSchema

from backend.summary import AnalysisSummary, CostEstimate, TopCoordinate
from backend.vocabulary import METHOD_MAX_LENGTH, EngineKind, Method, Sampler, SamplerKind

# Bumped whenever the engine's numbers or the summary's shape (backend/summary.py) change, so old cache
# entries (and certificates) stop matching.
ENGINE_VERSION = "7"


class JobStatus(StrEnum):
    queued = "queued"
    running = "running"
    done = "done"
    failed = "failed"


FiniteFloat = Annotated[float, Field(allow_inf_nan=False)]
RewardValue = Annotated[float, Field(strict=True, allow_inf_nan=False)]
# A method on the wire is its written form; in Python it is the parsed value (one parse, at the edge).
MethodField = Annotated[
    Method,
    PlainValidator(Method.parse),
    PlainSerializer(str, return_type=str),
    WithJsonSchema(
        {"type": "string", "description": "exact | truncated:F | mc:S", "maxLength": METHOD_MAX_LENGTH}
    ),
    # the schema's default in its written form, not the dataclass's fields
    Field(json_schema_extra={"default": str(Method())}),
]


class SamplerSpec(BaseModel):
    """The sampler mu as a person writes it (docs/contract.md, docs/design.md §2)."""

    model_config = ConfigDict(extra="forbid")

    kind: SamplerKind = SamplerKind.model
    temperature: FiniteFloat = Field(default=1.0, gt=0.0, description="T > 0; 1 = none")
    top_k: int | None = Field(default=None, ge=1, description="keep the k most probable tokens; null = off")
    top_p: FiniteFloat = Field(default=1.0, gt=0.0, le=1.0, description="nucleus mass in (0, 1]; 1 = off")
    engine: EngineKind = EngineKind.model
    data_token: str | None = Field(
        default=None, max_length=256, description="text that encodes to exactly one token, or '#ID'"
    )


class SampleSpec(BaseModel):
    """Draw the continuation y ~ mu from the request's own sampler instead of typing it."""

    model_config = ConfigDict(extra="forbid")

    seed: int = Field(default=0, ge=0, le=2**63 - 1, description="same seed, same response")
    max_tokens: int = Field(default=16, ge=1, le=1024, description="at most this many tokens; stops at EOS")


class AnalysisCreate(BaseModel):
    """Body of POST /api/v1/analyses."""

    model_config = ConfigDict(extra="forbid")

    model: str = Field(..., min_length=1, max_length=128, description="an allowed model id")
    prefix: str = Field(..., min_length=1, max_length=20_000)
    continuation: str | None = Field(default=None, max_length=20_000)
    continuation_sample: SampleSpec | None = Field(
        default=None, description="instead of `continuation`: a response sampled from the sampler mu"
    )
    sampler: SamplerSpec = Field(default_factory=lambda: SamplerSpec())
    reward: dict[Annotated[str, Field(max_length=256)], RewardValue] = Field(
        default_factory=dict, max_length=1024, description="token (text or '#ID') -> reward; others 0"
    )
    method: MethodField = Field(default=Method())
    rho: bool = Field(
        default=False,
        description="off the policy (mu != p), also the Fisher under p: d_model directions more per "
        "position, which only the stat rho needs; on the policy rho is free and always given",
    )


class AnalysisJob(BaseModel):
    """The normalized request: what the worker runs and what the cache key hashes."""

    model_config = ConfigDict(extra="forbid")

    model: str
    weights_digest: str
    dtype: str = Field("float32", description="what the engine computes in (the model's registered dtype)")
    input_ids: list[int]
    continuation_ids: list[int] = Field(default_factory=list)
    continuation_sample: SampleSpec | None = Field(
        default=None,
        description="a response still to be drawn: the worker samples it, then runs the job of the concrete "
        "response, whose id this one's answers follow",
    )
    sampler: Sampler = Field(default_factory=Sampler, description="the data token, if any, is an id")
    reward: dict[str, float] = Field(default_factory=dict, description="token id (decimal) -> reward")
    method: MethodField = Field(default=Method())
    rho: bool = Field(default=False, description="the Fisher under p off the policy (on the policy: false)")
    engine_version: str = ENGINE_VERSION

    def canonical_json(self) -> str:
        return json.dumps(self.model_dump(mode="json"), sort_keys=True, separators=(",", ":"))

    def key(self) -> str:
        """sha256 hex of the canonical JSON: the analysis id and cache key."""
        return hashlib.sha256(self.canonical_json().encode("utf-8")).hexdigest()


class PartialResult(BaseModel):
    """What a running exact analysis has so far: the directions done carry `kept_share` of trace(C_mu)."""

    kept_share: float = Field(
        ...,
        ge=0.0,
        le=1.0,
        description="share of the C_mu trace the result covers (a response's: of the positions' summed "
        "traces; each position states its own)",
    )
    result: AnalysisSummary = Field(
        ...,
        description="the summary schema from the directions done: the Fisher of C_mu truncated to them, a "
        "lower bound but on the rows of a tied table that the context reads (their cross term has either "
        "sign); concentration, top_coordinates and overlap are null until the analysis is done. A "
        "response's has every position from the first: first moments, mean shift and chi^2 whole, each "
        "position's Fisher from its directions so far (the next partial: 90% of its trace without a "
        "reward; exact once the exact pass has finished it); its model totals are the first pass's and "
        "that round's until the analysis is done",
    )


class AnalysisPublic(BaseModel):
    """GET /api/v1/analyses/{id} and the answers of POST."""

    id: str
    status: JobStatus
    progress: float = Field(0.0, ge=0.0, le=1.0)
    stage: str | None = None
    request: AnalysisJob
    cost: CostEstimate | None = None
    error: str | None = None
    partial: PartialResult | None = Field(default=None, description="while running: the result so far")
    result: AnalysisSummary | None = Field(
        default=None, description="the summary when done (docs/contract.md)"
    )


class ErrorBody(BaseModel):
    """Every 4xx/5xx answer: `detail` says what to fix."""

    detail: str
    errors: list[dict[str, Any]] | None = None
    estimate: CostEstimate | None = None
    cheaper_methods: list[str] | None = None


class PooledView(BaseModel):
    shape: list[int]
    row_edges: list[int]
    col_edges: list[int]
    values: list[list[float]]


class TensorView(BaseModel):
    tensor: str
    stat: str
    view: PooledView
    row_tokens: list[str] | None = Field(
        None,
        description="for a tensor whose rows are the vocabulary (embedding, LM head): the token of the "
        "first row of each block of rows; null otherwise, or when the model's tokenizer is gone",
    )


class TopCoordinates(BaseModel):
    stat: str
    coordinates: list[TopCoordinate]


class CertificatePublic(BaseModel):
    """docs/design.md §3a: the engine against plain autograd on this model (the engine's own fields)."""

    passed: bool
    dtype: str
    tolerance: float = Field(..., description="max relative error allowed per tensor")
    logits_error: float | None = Field(
        default=None, description="recorded forward against the model's logits"
    )
    first_moment_error: float | None = Field(default=None, description="d(u^T z)/dtheta against autograd")
    square_error: float | None = Field(default=None, description="(d(v^T h)/dtheta)^2 against autograd")
    worst_parameter: str | None = None
    failing_module: str | None = None
    reason: str | None = None
    routes: dict[str, int] = Field(default_factory=dict, description="tensors per path: matrix, expert, ...")
    autograd_matrices: list[str] = Field(default_factory=list, description="matrices without a fast form")
    seconds: float = 0.0


class SetComparison(BaseModel):
    q: list[float]
    overlap: list[float] = Field(..., description="|A ∩ B| / |A| of the two top-q sets")
    jaccard: list[float] = Field(..., description="|A ∩ B| / |A ∪ B|")
    chance_overlap: list[float] = Field(..., description="for independent random sets: q")
    chance_jaccard: list[float] = Field(..., description="for independent random sets: q / (2 - q)")


class TensorPair(BaseModel):
    name: str
    layer: int | str
    kind: str
    a: dict[str, float]
    b: dict[str, float]


class ComparePublic(BaseModel):
    """Two analyses of models with the same parameter names, side by side (docs/design.md §8)."""

    a: str
    b: str
    sets: SetComparison = Field(..., description="the top-q sets by the centered Fisher")
    tensors: list[TensorPair]


class ModelPublic(BaseModel):
    id: str
    available: bool
    n_params: int | None = None
    size_bytes: int | None = None
    vocab_size: int | None = None
    n_layers: int | None = None
    d_model: int | None = None
    digest: str | None = None
    architecture: str | None = None
    dtype: str | None = Field(default=None, description="what the engine computes in")
    description: str | None = None
    registered: bool = Field(default=False, description="added by the operator (fisherscope models add)")
    certificate: CertificatePublic | None = Field(
        default=None, description="null until a worker first loads it"
    )


class TokenPiece(BaseModel):
    id: int
    text: str


class TokenizeResponse(BaseModel):
    model: str
    text: str
    special_tokens: bool
    tokens: list[TokenPiece]


class Health(BaseModel):
    status: str
    detail: str | None = None


class ExportDtype(StrEnum):
    float16 = "float16"  # half the bytes; ~3 significant digits, magnitudes up to 65504
    float32 = "float32"  # the engine's sums as computed


DEFAULT_EXPORT_STATS = ("fisher", "mean_shift")


class ExportChoice(BaseModel):
    """What one safetensors download holds: which statistics, of which parameters, in which precision.

    Each choice is its own file and its own job; `slug` names the file, so two choices never share one.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    stats: tuple[str, ...] = Field(DEFAULT_EXPORT_STATS, description="statistics, in STATS order")
    tensors: tuple[str, ...] | None = Field(
        None,
        description="parameter selectors, sorted: a name, a dotted prefix of names, or a glob; null = all",
    )
    dtype: ExportDtype = ExportDtype.float16

    def slug(self) -> str:
        """`fisher+mean_shift-float16`, plus a digest of the tensor selection when there is one."""
        slug = f"{'+'.join(self.stats)}-{self.dtype.value}"
        if self.tensors is not None:
            slug += "-" + hashlib.sha256(",".join(self.tensors).encode("utf-8")).hexdigest()[:12]
        return slug

    def selects(self, name: str) -> bool:
        """Whether parameter ``name`` is in the file: every parameter unless `tensors` narrows it."""
        if self.tensors is None:
            return True
        return any(_selects(selector, name) for selector in self.tensors)


def _selects(selector: str, name: str) -> bool:
    # a dotted prefix stops at a dot: "model.layers.1" holds layer 1, never layer 10
    return name == selector or name.startswith(selector + ".") or fnmatch.fnmatchcase(name, selector)
