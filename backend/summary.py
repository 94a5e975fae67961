"""The analysis summary as typed wire models: what the engine writes, the store keeps and the API sends.

docs/contract.md says what each field means, docs/design.md §2 how each number is defined. The worker
validates every summary against ``AnalysisSummary`` once, before storing it (``workers.jobs``), so the
API, the OpenAPI document and the dashboard read one checked shape; an extra or missing field is a
failed analysis with the field named, never a silent change of the contract.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class CostEstimate(BaseModel):
    """What an analysis is estimated to cost (``backend.cost``)."""

    flops: float = Field(..., description="estimated floating-point operations")
    seconds: float = Field(
        ...,
        description="the direction pass at its measured efficiency plus per-position and summary work, at "
        "the configured (or measured) throughput",
    )
    directions: int = Field(..., description="backward directions per analysed position")
    peak_bytes: int | None = Field(
        None, description="estimated peak resident memory of the analysis (weights, sums, workspace)"
    )
    upper_bound: bool = Field(False, description="true when the estimate is an upper bound (truncated)")


class TopCoordinate(BaseModel):
    tensor: str
    index: list[int]
    value: float


# Non-finite floats (chi^2 where a response token has p = 0) travel as null (backend/fastjson.py).
Finite = float | None


class TokenText(_Strict):
    id: int
    text: str


class ModelSummary(_Strict):
    id: str
    digest: str
    n_params: int
    d_model: int
    vocab_size: int
    n_layers: int
    tied_embeddings: bool
    architecture: str
    dtype: str


class TokensSummary(_Strict):
    prefix: list[TokenText]
    continuation: list[TokenText]


class SamplerSettings(_Strict):
    """The sampler mu as a result records it."""

    kind: str
    temperature: float
    top_k: int | None
    top_p: float
    engine: str
    data_token_id: int | None
    on_policy: bool


class SamplerSummary(SamplerSettings):
    data_token_text: str | None


class RewardEntry(_Strict):
    id: int
    text: str
    value: float


class MethodSummary(_Strict):
    name: str
    fraction: float | None
    samples: int | None
    directions: int = Field(..., description="backward directions at the first position")
    kept_share: float = Field(..., description="the smallest share of trace(C_mu) kept over positions")
    missing_estimate: float


# fisher, uncentered, raw, mean_shift_sq, common_sq, rho_mean[, policy_grad_sq, bound]; non-finite: null
Totals = dict[str, float | None]
NamedShares = dict[str, float]  # "0.001", "0.01", "0.05", "0.1" -> a share


class TensorTotals(_Strict):
    name: str
    layer: int | str
    kind: str
    shape: list[int]
    numel: int
    totals: Totals
    concentration: dict[str, NamedShares] | None = Field(
        ..., description="the Fisher's exact named shares within the tensor (a full summary's)"
    )


class LayerTotals(_Strict):
    layer: int | str
    numel: int
    totals: Totals


class KindTotals(_Strict):
    kind: str
    numel: int
    totals: Totals


class ConcentrationCurve(_Strict):
    q: list[float]
    share: list[float]
    at: NamedShares
    thresholds: NamedShares = Field(..., description="the value of the k-th largest coordinate per named q")


class Overlap(_Strict):
    q: list[float]
    fisher_vs_policy_grad: list[float]
    baseline: list[float]


class TargetToken(_Strict):
    id: int
    text: str
    p: float
    mu: float


class CandidateRow(_Strict):
    """A likely next token and its LM-head row's closed forms (docs/contract.md)."""

    id: int
    text: str
    p: float
    mu: float
    reward: float
    row_fisher: float
    row_fisher_p: float
    row_shift_sq: float
    row_policy_grad: float | None = Field(..., description="with a reward: |mu_c (r_c - rbar)| g'(l_c) ||h||")
    row_bound: float | None = Field(..., description="with a reward: std(r) sqrt(row_fisher)")


class DistributionSummary(_Strict):
    entropy: float
    support: int
    sum_sq: float


class NextTokens(DistributionSummary):
    top: list[CandidateRow]


class Spectrum(_Strict):
    eigenvalues: list[float]
    trace: float
    numerical_rank: int
    effective_rank: float
    participation_ratio: float
    rank_bound: int
    uncentered_eigenvalues: list[float]


class OutputRow(_Strict):
    id: int
    text: str
    mu: float
    fisher: float
    share: float


class ConcentrationBound(_Strict):
    top_tokens: int
    share_outside: float
    bound: float | None


class OutputLayer(_Strict):
    h_norm_sq: float
    total: float
    logit_map: bool
    rows: list[OutputRow]
    concentration_bound: list[ConcentrationBound]


class RewardMoments(_Strict):
    mean: float
    std: float


class PositionSummary(_Strict):
    index: int
    context_length: int
    target: TargetToken | None
    p: NextTokens
    mu: DistributionSummary
    spectrum: Spectrum | None = Field(
        ...,
        description="C_mu's spectrum; null in a response's first partial result where mu draws more tokens "
        "than its first pass reads (its Fisher is then a lower bound from C_mu's part over mu's most "
        "probable tokens), until the refining round or the position's exact result",
    )
    output_layer: OutputLayer
    totals: Totals
    reward: RewardMoments | None
    chi2: Finite
    directions: int
    kept_share: float


class ShiftGrowth(_Strict):
    accumulated_shift_sq: list[float]
    sum_shift_sq: list[float]
    sum_variances: list[float]


class SftIdentity(_Strict):
    max_abs_error: float
    max_abs_gradient: float
    relative_error: float


class ResponseSummary(_Strict):
    T: int
    targets: list[TokenText]
    p_target: list[float]
    chi2: list[Finite]
    log_one_plus_chi2_cum: list[Finite]
    fisher_total: list[float]
    fisher_running: list[float]
    uncentered_total: list[float]
    uncentered_running: list[float]
    log_one_plus_chi2_floor: list[Finite]
    mean_shift_sq_total: list[float]
    shift_growth: ShiftGrowth
    sft_identity: SftIdentity | None


class Timing(_Strict):
    seconds: float
    fisher_reused: bool = Field(..., description="answered from the same analysis under another reward")


class AnalysisSummary(_Strict):
    """The summary of an analysis (a partial one has no concentration, top coordinates or overlap)."""

    model: ModelSummary
    tokens: TokensSummary
    sampler: SamplerSummary
    reward: list[RewardEntry]
    method: MethodSummary
    rho_available: bool = Field(
        ...,
        description="rho was computed: on the policy always; off it only when asked (request field rho), "
        "else every rho_mean is null and no rho arrays exist. A response's partial results have no rho "
        "(false) until the exact result",
    )
    processes: int = Field(..., description="processes the directions were split over (torchrun); 1 alone")
    directions_per_process: list[int] = Field(
        ...,
        description="backward directions each process ran over all positions: they add up to what one "
        "process alone runs",
    )
    positions: list[PositionSummary]
    totals: Totals
    tensors: list[TensorTotals]
    layers: list[LayerTotals]
    kinds: list[KindTotals]
    concentration: dict[str, ConcentrationCurve] | None
    top_coordinates: dict[str, list[TopCoordinate]] | None
    overlap: Overlap | None
    response: ResponseSummary | None
    cost: CostEstimate | None = Field(
        ..., description="the estimate the request was given; null in a partial"
    )
    timing: Timing | None = Field(..., description="null in a partial result")


class PositionEntry(BaseModel):
    """One analysed position, in brief (its whole summary: GET .../positions/{index})."""

    index: int
    context_length: int
    target: TargetToken | None = Field(default=None, description="the response token it predicts")


class AnalysisOverview(AnalysisSummary):
    """GET .../overview: the summary with its first position whole and every position in brief."""

    position_index: list[PositionEntry]
    vocabulary: dict[str, str] = Field(
        ..., description="the token of every vocabulary row among the top coordinates, by row"
    )


def checked_summary(summary: dict[str, Any]) -> dict[str, Any]:
    """``summary`` unchanged when it has the contract's shape; a ValueError naming the field if not."""
    AnalysisSummary.model_validate(summary)
    return summary
