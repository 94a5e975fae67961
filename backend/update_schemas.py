"""Where a fine-tuning run changed the weights, through the API: the request, the job, the typed summary
(what ``workers.weight_updates`` computes; docs/design.md §7a)."""

from __future__ import annotations

import hashlib
import json

from pydantic import BaseModel, ConfigDict, Field, field_validator

from backend.schemas import JobStatus

ModelId = Field(min_length=1, max_length=200, description="a model id of GET /api/v1/models")


class UpdatesCreate(BaseModel):
    model_config = ConfigDict(extra="forbid")

    before: str = ModelId
    after: str = ModelId
    study: str | None = Field(
        default=None,
        pattern=r"^[0-9a-f]{64}$",
        description="a finished study of either model: its Fisher masks are laid over what changed",
    )
    q: list[float] | None = Field(
        default=None,
        min_length=1,
        max_length=8,
        description="densities of the top-|delta| sets (default: the study's mask densities, else "
        "0.001, 0.01, 0.05)",
    )

    @field_validator("q")
    @classmethod
    def _densities(cls, q: list[float] | None) -> list[float] | None:
        if q is not None and any(not 0 < value <= 1 for value in q):
            raise ValueError("every density q must lie in (0, 1]")
        return None if q is None else sorted(set(q))


class UpdatesJob(BaseModel):
    """What a worker compares: two models by id and digest, and the mask file of a study."""

    before: str
    after: str
    before_digest: str
    after_digest: str
    study: str | None = None  # its mask file (the worker finds it in the studies folder)
    q: list[float] | None = None

    def key(self) -> str:
        identity = {
            "kind": "updates",
            "before": self.before_digest,
            "after": self.after_digest,
            "study": self.study,
            "q": self.q,
        }
        return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()


class UpdateCounts(BaseModel):
    params: int
    changed: int = Field(description="coordinates whose stored value changed")
    changed_bf16: int = Field(description="coordinates that differ once both values are rounded to bf16")
    changed_share: float
    changed_bf16_share: float


class UpdateGroup(UpdateCounts):
    group: str = Field(description="a layer index ('embed', 'final') or a module kind")


class CheckpointRef(BaseModel):
    model: str
    digest: str


class TopDelta(BaseModel):
    q: float
    k: int = Field(description="ceil(q P) coordinates")
    threshold: float = Field(description="the k-th largest |delta| (float32)")


class SetInMasks(BaseModel):
    set: str = Field(description="'changed', 'changed_bf16' or 'top <q> |delta|'")
    size: int
    in_mask: list[int] = Field(description="|S ∩ M| per mask density")
    overlap: list[float] = Field(description="|S ∩ M| / |S| per mask density")
    chance_overlap: list[float] = Field(description="|M| / P: an independent random set's overlap")
    jaccard: list[float]
    chance_jaccard: list[float] = Field(description="ab / (a + b - ab) for densities a, b")


class MaskOverlaps(BaseModel):
    file: str
    model_id: str | None
    digest: str | None
    polarity: str | None
    q: list[float]
    mask_sizes: list[int]
    sets: list[SetInMasks]


class UpdatesSummary(BaseModel):
    kind: str = "fisherscope.updates"
    before: CheckpointRef
    after: CheckpointRef
    tolerance: dict[str, str]
    total: UpdateCounts
    tensors: dict[str, UpdateCounts]
    layers: list[UpdateGroup]
    kinds: list[UpdateGroup]
    top_q: list[TopDelta]
    masks: MaskOverlaps | None


class UpdatesPublic(BaseModel):
    id: str
    status: JobStatus
    progress: float = 0.0
    stage: str | None = None
    error: str | None = None
    request: UpdatesJob
    summary: UpdatesSummary | None = None
