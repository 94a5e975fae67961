"""Service settings, read from the environment (pydantic-settings).

Why one object: the same API runs embedded on a laptop (no REDIS_URL) and against a fleet of workers;
every limit a person can hit (token limits, cost budget, TTL, memory per analysis) is stated here.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Annotated

from limits import parse_many
from pydantic import AliasChoices, Field, SecretStr, field_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "::1")
MIN_TOKEN_CHARS = 16


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
    flops_per_second: float = Field(
        default=5e10,
        description="throughput that turns flops into seconds when no live worker has published its measured "
        "rate for the model",
    )
    allow_tf32: bool = Field(
        default=False,
        description="CUDA float32 matmuls in TF32 (faster, ~1e-3 relative; the certificate measures it)",
    )
    landing_analysis: bool = Field(
        default=True,
        description="`fisherscope serve` queues the first page's example analysis once its model is loaded",
    )
    engine_memory_bytes: int = Field(
        default=2 << 30,
        description="the engine's workspace (bytes): half for a chunk of directions' gradients, half for "
        "what it holds between chunks and passes (ghost moments, a response's kept plans)",
    )
    sums_memory_bytes: int = Field(
        default=4 << 30,
        description="memory a response's sums over positions may use (each parameter-sized); the rest are "
        "memory-mapped files in sums_dir, whose pages the kernel can write out (on the CPU)",
    )
    sums_dir: Path = Field(
        default=Path.home() / ".cache" / "fisherscope" / "sums",
        description="where the sums beyond sums_memory_bytes are mapped from (a file unlinked once mapped)",
    )
    memory_limit_bytes: int | None = Field(
        default=None,
        description="an analysis whose estimated peak memory is above this is refused (unset: the memory "
        "of the machine that checks: the API's, or the CLI's)",
    )
    api_token: SecretStr | None = Field(
        default=None,
        description="when set, routes that compute or write to disk (and the dashboard) need it: "
        "`Authorization: Bearer TOKEN` (or HTTP Basic with it as password); unset = open, for loopback only",
    )
    allowed_hosts: Annotated[list[str], NoDecode] = Field(
        default=list(LOOPBACK_HOSTS),
        description="Host header values served (comma-separated; '*' = any): a DNS-rebinding page "
        "reaches a local service under its own host name, which is refused",
    )
    rate_limit: str = Field(
        default="60/minute;600/hour",
        description="per client, over the routes that start compute (`limits` notation, ';' between)",
    )
    result_ttl_s: int = Field(default=7 * 24 * 3600, description="how long results stay in Redis")
    max_result_bytes: int = Field(default=64 * 2**20, description="memory budget per analysis in Redis")
    job_timeout_s: int = Field(default=3600, description="a job running longer fails")
    queue_name: str = "fisherscope"
    pooled_rows: int = 128
    pooled_cols: int = 128

    @field_validator("api_token")
    @classmethod
    def _token_is_long_enough(cls, token: SecretStr | None) -> SecretStr | None:
        if token is not None and len(token.get_secret_value()) < MIN_TOKEN_CHARS:
            raise ValueError(
                f"FISHERSCOPE_API_TOKEN must be at least {MIN_TOKEN_CHARS} characters; make one with "
                "python -c 'import secrets; print(secrets.token_urlsafe(32))'"
            )
        return token

    @field_validator("allowed_hosts", mode="before")
    @classmethod
    def _split_hosts(cls, hosts: object) -> object:
        if isinstance(hosts, str):
            return [host.strip().lower() for host in hosts.split(",") if host.strip()]
        return hosts

    @field_validator("rate_limit")
    @classmethod
    def _rate_limit_parses(cls, rate_limit: str) -> str:
        parse_many(rate_limit)  # ValueError naming the bad part
        return rate_limit

    def export_path(self, analysis_id: str, choice: str) -> Path:
        """Where one choice (``ExportChoice.slug``) of an analysis's arrays is written (by a worker) and
        read (by the API): one file per choice, all under the exports budget."""
        return self.exports_dir / f"{analysis_id}-{choice}.safetensors"

    def levels_path(self, analysis_id: str) -> Path:
        """The analysis's top-q Fisher sets, one byte per coordinate (workers.fisher.masks), for compares."""
        return self.exports_dir / "levels" / f"{analysis_id}.u8"

    def fisher_roots_path(self, family: str) -> Path:
        """What an analysis keeps for a later reward on it (workers.reward_reuse), named by the key of its
        request without the reward: every request that differs from it in the reward only finds it."""
        return self.exports_dir / "rewards" / f"{family}.safetensors"

    def study_dir(self, study_id: str) -> Path:
        """A study's parts (one file per prompt until they are reduced) and its masks file."""
        return self.studies_dir / study_id

    def sums_memory_on(self, device: str) -> int | None:
        """``sums_memory_bytes`` for an analysis on ``device``: the CPU maps what is beyond it from files;
        None elsewhere (on a GPU every sum is in its memory)."""
        return self.sums_memory_bytes if device == "cpu" else None

    def limits(self) -> RequestLimits:
        return RequestLimits(self.max_prefix_tokens, self.max_continuation_tokens)

    @property
    def budget_flops(self) -> float:
        return self.cost_budget_tflop * 1e12


@lru_cache(maxsize=1)
def get_settings() -> Settings:
    return Settings()
