"""The functions the queue runs: one analysis into the store, or one safetensors export to a file.

Why separate from the engine: the engine computes an ``AnalysisRequest``; this module is the glue
around it (a wire ``AnalysisJob`` into a request, the model pool, progress and a lease in the store,
the cost estimate, the memory budget of pooled views), shared by the RQ worker process and the
embedded in-process worker thread. It talks to the store through ``backend.store.Store`` only.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from backend.cost import estimate_cost
from backend.schemas import AnalysisJob
from backend.settings import Settings, get_settings
from backend.store import RedisStore, Store
from workers.engine import Analysis, AnalysisRequest, ProgressCallback, run_analysis
from workers.fisher.methods import Method
from workers.fisher.sampler import SamplerConfig
from workers.models.loading import LoadedModel, ModelPool

ENGINE_RUNS = "engine_runs"

_pool: ModelPool | None = None
_pool_lock = threading.Lock()


def model_pool() -> ModelPool:
    """The process's models, each loaded once (on the GPU when there is one)."""
    global _pool
    with _pool_lock:
        if _pool is None:
            import torch

            _pool = ModelPool(device="cuda" if torch.cuda.is_available() else "cpu")
        return _pool


def request_from_job(job: AnalysisJob) -> AnalysisRequest:
    """The engine's request for a normalized job; Monte Carlo draws are seeded by the job's key."""
    s = job.sampler
    return AnalysisRequest(
        input_ids=list(job.input_ids),
        continuation_ids=list(job.continuation_ids),
        sampler=SamplerConfig(
            s.kind, float(s.temperature), s.top_k, float(s.top_p), s.engine, s.data_token_id
        ),
        method=Method.parse(job.method, seed=int(job.key()[:8], 16)),
        reward={int(token): float(value) for token, value in job.reward.items()},
    )


def analyze_job(
    loaded: LoadedModel,
    job: AnalysisJob,
    settings: Settings,
    progress: ProgressCallback | None = None,
    flops_per_second: float | None = None,
) -> Analysis:
    """Run ``job``; its summary gets the cost estimate at ``flops_per_second`` (else the configured rate)."""
    analysis = run_analysis(loaded, request_from_job(job), settings.engine_memory_bytes, progress)
    rate = flops_per_second or settings.flops_per_second
    analysis.summary["cost"] = estimate_cost(loaded.info, job, rate).model_dump(mode="json")
    return analysis


@contextmanager
def leased(store: Store, analysis_id: str) -> Iterator[None]:
    """Refresh the job's lease while it runs, so a dead worker shows as failed, not running forever."""
    stop = threading.Event()

    def beat() -> None:
        while not stop.wait(store.lease_refresh_s):
            with contextlib.suppress(Exception):  # Redis briefly away: the next beat retries
                store.touch_lease(analysis_id)

    store.touch_lease(analysis_id)
    thread = threading.Thread(target=beat, name=f"lease-{analysis_id[:8]}", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(timeout=5)


def load_for(job: AnalysisJob, pool: ModelPool) -> LoadedModel:
    """The job's model as the job saw it (weights digest and dtype); a re-registered id is reloaded."""
    loaded = pool.get(job.model)
    if (loaded.info.digest, loaded.info.dtype) != (job.weights_digest, job.dtype):
        pool.forget(job.model)  # the registry changed under this worker: load what it holds now
        loaded = pool.get(job.model)
    if (loaded.info.digest, loaded.info.dtype) != (job.weights_digest, job.dtype):
        raise RuntimeError(
            f"the weights of {job.model} changed since this request was made "
            f"({loaded.info.digest[:19]} {loaded.info.dtype} != {job.weights_digest[:19]} {job.dtype}); "
            "POST it again"
        )
    return loaded


def pooled_within_budget(analysis: Analysis, store: Store, settings: Settings) -> dict:
    """Pooled views at the configured grid, halved until they fit the per-analysis memory budget."""
    rows, cols = settings.pooled_rows, settings.pooled_cols
    while True:
        pooled = analysis.pooled(max_rows=rows, max_cols=cols)
        if store.encoded_size(pooled) <= settings.max_result_bytes or rows * cols <= 4:
            return pooled
        rows, cols = max(1, rows // 2), max(1, cols // 2)


def execute_analysis(
    job: AnalysisJob, store: Store, settings: Settings, pool: ModelPool | None = None
) -> None:
    """Run `job` and store its summary and pooled views; any failure is stored as a readable error."""
    analysis_id = job.key()
    store.update_meta(analysis_id, status="running", stage="load", progress=0.0, error=None)
    with leased(store, analysis_id):
        try:
            loaded = load_for(job, pool or model_pool())
            store.count(ENGINE_RUNS)
            analysis = analyze_job(
                loaded, job, settings, lambda stage, p: store.set_progress(analysis_id, stage, p)
            )
            store.save_result(analysis_id, analysis.summary, pooled_within_budget(analysis, store, settings))
        except BaseException as error:  # includes RQ's timeout; the job must end failed, never running
            store.fail(analysis_id, _reason(error))
            if not isinstance(error, Exception):
                raise


def execute_export(
    job: AnalysisJob, store: Store, settings: Settings, pool: ModelPool | None = None
) -> Path | None:
    """Recompute the analysis and write every per-parameter array to `<exports_dir>/<id>.safetensors`."""
    analysis_id = job.key()
    target = settings.export_path(analysis_id)
    try:
        analysis = analyze_job(load_for(job, pool or model_pool()), job, settings)
        target.parent.mkdir(parents=True, exist_ok=True)
        partial = target.with_name(f".{target.name}.{os.getpid()}.part")
        analysis.save(partial, metadata={"job": job.canonical_json()})
        partial.replace(target)
        store.update_meta(analysis_id, export_status="done", export_error=None)
        return target
    except Exception as error:
        store.update_meta(analysis_id, export_status="failed", export_error=_reason(error))
        return None


def _reason(error: BaseException) -> str:
    if type(error).__name__ == "JobTimeoutException":
        return "the analysis ran past the job timeout (FISHERSCOPE_JOB_TIMEOUT_S); try a cheaper method"
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else 'no message'}"


def _redis_store(settings: Settings) -> RedisStore:
    from rq import get_current_job

    current = get_current_job()
    if current is None:
        raise RuntimeError("run_analysis_job runs inside an RQ worker")
    return RedisStore(current.connection, settings.result_ttl_s)


def run_analysis_job(payload: dict) -> None:
    """RQ entry point (JSON payload, see backend.queue)."""
    settings = get_settings()
    execute_analysis(AnalysisJob.model_validate(payload), _redis_store(settings), settings)


def run_export_job(payload: dict) -> None:
    settings = get_settings()
    execute_export(AnalysisJob.model_validate(payload), _redis_store(settings), settings)
