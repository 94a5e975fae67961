"""The study summary as typed wire models: what a finished study's JSON file holds and the API sends.

docs/studies.md says what each part means, docs/design.md §7 how the sums are defined. The worker (and
the CLI) validate every summary against ``StudySummary`` once, before it is stored or written
(``checked_study_summary``), so an extra or missing field fails the study with the field named instead
of changing the contract in silence. Fields that one kind of study lacks (an estimator without targets,
the paper's comparisons without a reward or references) are null.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from backend.study_cost import StudyCostEstimate
from backend.summary import Finite, SamplerSettings


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StudyModel(_Strict):
    id: str
    digest: str
    n_params: int
    d_model: int
    vocab_size: int
    architecture: str
    dtype: str


class StudyRewardRule(_Strict):
    kind: str
    pattern: str | None
    rule: str = Field(..., description="the rule in a sentence")


class StudySpecSummary(_Strict):
    sampler: SamplerSettings
    samples: int = Field(..., description="K responses per prompt")
    max_tokens: int = Field(..., description="L: at most this many tokens each")
    seed: int
    method: str = Field(..., description="exact | truncated:F | mc:S")
    reward: StudyRewardRule | None
    fractions: list[float] = Field(..., description="the mask densities q")
    compare_at: str = Field(..., description="prompts | responses | none")
    chat_template: bool


class StudyCounts(_Strict):
    prompts: int
    responses: int
    positions: int
    distinct_contexts: int
    targets: int
    directions: int
    direction_tokens: int
    n_params: int


class StudyTotals(_Strict):
    fisher: float = Field(..., description="sum of F over all coordinates (per response)")
    uncentered: float
    mean_shift_norm_sq: float = Field(..., description="||M||^2, M averaged over the responses")


class PromptRecord(_Strict):
    prompt_index: int
    line: int = Field(..., description="the prompt's line in the file (1-based)")
    n_tokens: int
    target: str | None
    rewards: list[float] | None = Field(..., description="the K responses' rewards; null without a rule")
    totals: dict[str, float] = Field(..., description="fisher and uncentered over the K responses")
    compared: dict[str, float] = Field(
        ..., description="Fisher totals under the sampler and the references, where compared"
    )
    contexts: int
    directions: int


class ResponseRecord(_Strict):
    prompt_index: int
    response_index: int
    seed: int
    input_ids: list[int]
    continuation_ids: list[int]
    text: str
    reward: float | None
    totals: dict[str, float] = Field(..., description="fisher and uncentered over the response's positions")


class TopSetComparison(_Strict):
    """Two top-q sets, density by density, each figure beside its chance value."""

    q: list[float]
    overlap: list[float]
    jaccard: list[float]
    chance_overlap: list[float]
    chance_jaccard: list[float]


class EstimatorComparison(_Strict):
    """An estimator against the exact F; only ``definition``, ``available`` and ``reason`` when it has no
    data (no prompt has a target)."""

    definition: str
    available: bool
    reason: str | None = None
    count: int | None = None
    relative_l2_vs_fisher: Finite = None
    relative_l2_vs_uncentered: Finite = None
    top_q_vs_fisher: TopSetComparison | None = None


class Estimators(_Strict):
    mc_fisher: EstimatorComparison
    empirical_fisher: EstimatorComparison
    mc_vs_empirical: TopSetComparison | None = None


class MaskShare(_Strict):
    count: int = Field(..., description="coordinates of the group in the mask")
    size: int = Field(..., description="coordinates of the group")
    share_of_mask: float
    density: float


class TensorMaskShare(MaskShare):
    name: str


class GroupMaskShare(MaskShare):
    group: str


class MaskAtDensity(_Strict):
    q: float
    count: int = Field(..., description="coordinates in the mask")
    threshold: Finite = Field(..., description="the smallest F in the mask")
    tensors: list[TensorMaskShare]
    layers: list[GroupMaskShare]
    kinds: list[GroupMaskShare]


class StudyMasks(_Strict):
    statistic: str
    q: list[float]
    by_q: dict[str, MaskAtDensity] = Field(..., description="'%g' of q -> the mask's shares")


class FisherVsPolicyGradient(_Strict):
    q: float
    label: str
    paper_value: str
    mean_reward: Finite
    prompts_with_reward_variance: int
    policy_gradient: str
    overlap: Finite
    reason: str | None = None
    chance_overlap: float | None = None
    jaccard: float | None = None
    chance_jaccard: float | None = None


class ModelVsUniform(_Strict):
    label: str
    paper_value: str
    at: str
    fisher_model: float
    fisher_sampler: float
    fisher_uniform: float
    ratio_model_to_uniform: Finite
    ratio_sampler_to_uniform: Finite


class PaperStatistics(_Strict):
    fisher_vs_policy_gradient: FisherVsPolicyGradient | None
    model_vs_uniform: ModelVsUniform | None


class StudySummary(_Strict):
    kind: str = Field(..., description="'fisherscope.study'")
    version: int
    model: StudyModel
    spec: StudySpecSummary
    normalization: str = Field(..., description="how F, U and M are averaged")
    counts: StudyCounts
    totals: StudyTotals
    prompts: list[PromptRecord]
    responses: list[ResponseRecord]
    estimators: Estimators
    masks: StudyMasks
    paper: PaperStatistics
    cost: StudyCostEstimate | None
    timing: dict[str, float] = Field(..., description="seconds per stage")


def checked_study_summary(summary: dict[str, Any]) -> dict[str, Any]:
    """``summary`` itself once it validates against ``StudySummary``; pydantic's error names the field."""
    StudySummary.model_validate(summary)
    return summary
