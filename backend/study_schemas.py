"""Wire schemas of studies: what a person sends (`StudyCreate`), what the workers run (`StudyJob`).

Why a job of its own: a study is many analyses' worth of work split over workers, prompt by prompt;
`StudyJob` is tokenized and canonical, so its hash is the study's id and cache key, and every part a
worker runs reads the same object.
"""

from __future__ import annotations

import hashlib
import json

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from backend.rewards import RewardKind
from backend.schemas import ENGINE_VERSION, JobStatus, MethodField, PooledView, SamplerSpec
from backend.study_summary import StudySummary
from backend.vocabulary import Method, Sampler

DEFAULT_MASK_FRACTIONS = (0.001, 0.01, 0.05)


class StudyPrompt(BaseModel):
    model_config = ConfigDict(extra="forbid")

    prompt: str = Field(..., min_length=1, max_length=20_000)
    target: str | None = Field(default=None, max_length=20_000, description="what a reward compares with")


class StudyReward(BaseModel):
    """1 for a response that matches its prompt's target, else 0."""

    model_config = ConfigDict(extra="forbid")

    kind: RewardKind
    pattern: str | None = Field(
        default=None,
        max_length=1_000,
        description="regex only: searched in the response, '{target}' stands for the escaped target",
    )


class StudyCreate(BaseModel):
    """Body of POST /api/v1/studies."""

    model_config = ConfigDict(extra="forbid")

    name: str | None = Field(
        default=None,
        min_length=1,
        max_length=120,
        description="a label to find the study again (GET /api/v1/studies); not part of its id: the "
        "same study POSTed again keeps the name it was first given",
    )
    model: str = Field(..., min_length=1, max_length=128)
    prompts: list[StudyPrompt] = Field(..., min_length=1, max_length=256)
    samples: int = Field(default=2, ge=1, le=64, description="K responses per prompt")
    max_tokens: int = Field(default=16, ge=1, le=256, description="L: at most this many tokens each")
    seed: int = Field(default=0, ge=0, le=2**63 - 1, description="same seed, same responses")
    sampler: SamplerSpec = Field(default_factory=lambda: SamplerSpec())
    method: MethodField = Field(default=Method())
    reward: StudyReward | None = None
    q: list[float] = Field(
        default_factory=lambda: list(DEFAULT_MASK_FRACTIONS),
        min_length=1,
        max_length=8,
        description="mask densities, each in (0, 1)",
    )

    @field_validator("name")
    @classmethod
    def _name_is_one_line(cls, name: str | None) -> str | None:
        if name is None:
            return None
        name = name.strip()
        if not name or not name.isprintable():
            raise ValueError("a name is one line of printable text; leave it out for none")
        return name

    @field_validator("q")
    @classmethod
    def _densities(cls, q: list[float]) -> list[float]:
        if any(not 0 < value < 1 for value in q):
            raise ValueError(f"every mask density must be in (0, 1); got {q}")
        return sorted(set(q))


class StudyJobPrompt(BaseModel):
    model_config = ConfigDict(extra="forbid")

    input_ids: list[int]
    target: str | None = None
    target_ids: list[int] | None = None


class StudyJob(BaseModel):
    """The normalized study; its canonical JSON's hash is the study id."""

    model_config = ConfigDict(extra="forbid")

    model: str
    weights_digest: str
    dtype: str = "float32"
    prompts: list[StudyJobPrompt]
    samples: int
    max_tokens: int
    seed: int
    sampler: Sampler
    method: MethodField
    reward: StudyReward | None = None
    q: list[float]
    engine_version: str = ENGINE_VERSION

    @model_validator(mode="after")
    def _reward_has_targets(self) -> StudyJob:
        if self.reward is not None and any(not p.target for p in self.prompts):
            raise ValueError("a reward compares each response with its prompt's target; give every target")
        return self

    def canonical_json(self) -> str:
        return json.dumps(self.model_dump(mode="json"), sort_keys=True, separators=(",", ":"))

    def key(self) -> str:
        return hashlib.sha256(("study:" + self.canonical_json()).encode("utf-8")).hexdigest()


class StudyPartPublic(BaseModel):
    prompt_index: int
    status: JobStatus
    progress: float = Field(0.0, ge=0.0, le=1.0)
    stage: str | None = None
    error: str | None = None
    permanent: bool = Field(False, description="failed for a reason that submitting it again cannot fix")


class StudyCost(BaseModel):
    flops: float
    seconds: float
    upper_bound: bool = True


class StudyPublic(BaseModel):
    """GET /api/v1/studies/{id} and the answers of POST."""

    id: str
    name: str | None = Field(None, description="the label the study was first POSTed with")
    created: float | None = Field(None, description="when it was first queued (seconds since the epoch)")
    prompt_texts: list[str] | None = Field(None, description="the prompts as they were POSTed, in order")
    status: JobStatus
    progress: float = Field(0.0, ge=0.0, le=1.0, description="mean of the parts' progress")
    parts: list[StudyPartPublic] = Field(default_factory=list, description="one per prompt")
    request: StudyJob
    cost: StudyCost | None = None
    error: str | None = None
    summary: StudySummary | None = Field(default=None, description="the study summary when done")


class StudyListItem(BaseModel):
    """One line of GET /api/v1/studies: enough to recognise a study and open it."""

    id: str
    name: str | None
    model: str
    status: JobStatus
    created: float | None = Field(None, description="seconds since the epoch")
    prompts: int = Field(..., description="how many prompts it has")


class StudyMaskView(BaseModel):
    """One parameter's Fisher mask at one density, for a heatmap: coordinates in the mask per block."""

    tensor: str
    q: float
    shape: list[int] = Field(..., description="the parameter's shape")
    count: int = Field(..., description="coordinates of this parameter in the mask")
    size: int = Field(..., description="coordinates of this parameter")
    view: PooledView = Field(
        ...,
        description="values[i][j]: coordinates in the mask in rows row_edges[i]..row_edges[i+1] and "
        "columns col_edges[j]..col_edges[j+1] (a vector is one row; experts are stacked as rows)",
    )


class StudyMaskComparison(BaseModel):
    """The masks of two studies of one model, density by density, each figure beside its chance value."""

    a: str
    b: str
    model: str | None
    q: list[float] = Field(..., description="the densities both studies cut")
    overlap: list[float] = Field(..., description="|A ∩ B| / |A|")
    jaccard: list[float] = Field(..., description="|A ∩ B| / |A ∪ B|")
    chance_overlap: list[float] = Field(..., description="q: two independent random masks")
    chance_jaccard: list[float] = Field(..., description="q / (2 - q)")
