"""Service settings, read from the environment (pydantic-settings).

Why one object: the same API runs embedded on a laptop (no REDIS_URL) and against a fleet of workers;
every limit a person can hit (token limits, cost budget, TTL, memory per analysis) is stated here.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from pydantic import AliasChoices, Field
from pydantic_settings import BaseSettings, SettingsConfigDict


@dataclass(frozen=True)
class RequestLimits:
    """Limits that concern the content of a request (used by backend.normalize)."""

    max_prefix_tokens: int = 256
    max_continuation_tokens: int = 64


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="FISHERSCOPE_", extra="ignore")

    redis_url: str | None = Field(
        default=None,
        validation_alias=AliasChoices("REDIS_URL", "FISHERSCOPE_REDIS_URL"),
        description="Redis for queue and cache; unset = embedded mode",
    )
    results_dir: Path = Field(
        default=Path.home() / ".cache" / "fisherscope" / "results",
        description="embedded mode: folder the result cache persists to",
    )
    exports_dir: Path = Field(
        default=Path.home() / ".cache" / "fisherscope" / "exports",
        description="safetensors downloads, written by the worker (a volume shared with the API)",
    )
    studies_dir: Path = Field(
        default=Path.home() / ".cache" / "fisherscope" / "studies",
        description="study parts and masks, written by the workers (a volume shared with the API); "
        "outside the exports budget, so a running study's parts are never evicted",
    )
    exports_budget_bytes: int = Field(
        default=20 * 2**30, description="disk the exports folder may use; the least recently used go first"
    )
    allowed_models: list[str] | None = Field(
        default=None, description="ids the API accepts; unset = every built-in and registered id"
    )
    max_prefix_tokens: int = 256
    max_continuation_tokens: int = 64
    cost_budget_tflop: float = Field(default=50.0, description="refuse analyses estimated above this")
    flops_per_second: float = Field(default=5e10, description="throughput used to turn flops into seconds")
    allow_tf32: bool = Field(
        default=False,
        description="CUDA float32 matmuls in TF32 (faster, ~1e-3 relative; the certificate measures it)",
    )
    landing_analysis: bool = Field(
        default=True,
        description="`fisherscope serve` queues the first page's example analysis once its model is loaded",
    )
    engine_memory_bytes: int = Field(
        default=1 << 30, description="memory one direction chunk of the engine may use (bytes)"
    )
    result_ttl_s: int = Field(default=7 * 24 * 3600, description="how long results stay in Redis")
    max_result_bytes: int = Field(default=64 * 2**20, description="memory budget per analysis in Redis")
    job_timeout_s: int = Field(default=3600, description="a job running longer fails")
    queue_name: str = "fisherscope"
    pooled_rows: int = 128
    pooled_cols: int = 128

    def export_path(self, analysis_id: str) -> Path:
        """Where the safetensors file of an analysis is written (by a worker) and read (by the API)."""
        return self.exports_dir / f"{analysis_id}.safetensors"

    def levels_path(self, analysis_id: str) -> Path:
        """The analysis's top-q Fisher sets, one byte per coordinate (workers.fisher.masks), for compares."""
        return self.exports_dir / "levels" / f"{analysis_id}.u8"

    def study_dir(self, study_id: str) -> Path:
        """A study's parts (one file per prompt until they are reduced) and its masks file."""
        return self.studies_dir / study_id

    def limits(self) -> RequestLimits:
        return RequestLimits(self.max_prefix_tokens, self.max_continuation_tokens)

    @property
    def budget_flops(self) -> float:
        return self.cost_budget_tflop * 1e12


@lru_cache(maxsize=1)
def get_settings() -> Settings:
    return Settings()
