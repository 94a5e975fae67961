"""The functions the queue runs: one analysis into the store, or one safetensors export to a file.

Why separate from the engine: the engine computes an ``AnalysisRequest``; this module is the glue
around it (a wire ``AnalysisJob`` into a request, the model pool, progress and a lease in the store,
the cost estimate, the memory budget of pooled views), shared by the RQ worker process and the
embedded in-process worker thread. It talks to the store through ``backend.store.Store`` only.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from backend.analysis_records import queued_meta
from backend.cost import estimate_cost
from backend.disk import evict_to_budget
from backend.export_choice import EXPORT_FIELD_PREFIX, export_record
from backend.queue import IN_PROCESS_WORKER
from backend.schemas import AnalysisJob, ExportChoice, JobStatus
from backend.settings import Settings, get_settings
from backend.store import ENGINE_RUNS, REWARD_REUSES, RedisStore, Store
from backend.summary import checked_summary
from backend.vocabulary import CANCELLED, STATS, EngineKind
from workers.commands.processes import launched_by_torchrun, together
from workers.engine import (
    Analysis,
    AnalysisRequest,
    PartialCallback,
    ProgressCallback,
    run_analysis,
    sums_storage,
)
from workers.exports import Float16Overflow, write_export
from workers.fisher.concentration import NAMED_FRACTIONS
from workers.fisher.masks import top_q_levels
from workers.fisher.pooling import pooled_grid
from workers.fisher.sampling import sample_continuation, stop_ids
from workers.models.loading import LoadedModel, ModelPool
from workers.reward_reuse import (
    answer_from_kept,
    copy_levels,
    keep_for_rewards,
    parameter_shapes,
)

_log = logging.getLogger(__name__)
_pool: ModelPool | None = None
_pool_lock = threading.Lock()


def model_pool() -> ModelPool:
    """The process's models, each loaded once (on the GPU when there is one)."""
    global _pool
    with _pool_lock:
        if _pool is None:
            import torch

            # float32 matmuls at full precision unless the operator asks for TF32
            torch.backends.cuda.matmul.allow_tf32 = get_settings().allow_tf32
            _pool = ModelPool(device="cuda" if torch.cuda.is_available() else "cpu")
        return _pool


def request_from_job(job: AnalysisJob) -> AnalysisRequest:
    """The engine's request for a normalized job; Monte Carlo draws are seeded by the job's key."""
    return AnalysisRequest(
        input_ids=list(job.input_ids),
        continuation_ids=list(job.continuation_ids),
        sampler=job.sampler,
        # the draws follow the request, not whether rho is asked: a rho stage's other numbers are the same
        method=job.method.with_seed(int(job.model_copy(update={"rho": False}).key()[:8], 16)),
        rho=job.rho,
        reward={int(token): float(value) for token, value in job.reward.items()},
    )


def analyze_job(
    loaded: LoadedModel,
    job: AnalysisJob,
    settings: Settings,
    progress: ProgressCallback | None = None,
    flops_per_second: float | None = None,
    on_partial: PartialCallback | None = None,
    keep_fisher_roots: tuple[int, int] | None = None,
) -> Analysis:
    """Run ``job``; its summary gets the cost estimate at ``flops_per_second`` (else the configured rate)."""
    analysis = run_analysis(
        loaded,
        request_from_job(job),
        settings.engine_memory_bytes,
        progress,
        on_partial,
        keep_fisher_roots=keep_fisher_roots,
        sums_storage=sums_storage(settings),
    )
    analysis.summary["cost"] = _cost(loaded, job, settings, flops_per_second, partials=on_partial is not None)
    return analysis


def published_rate(store: Store, loaded: LoadedModel) -> float | None:
    """This worker's float32 matmul rate at the model's width (measured once per device and width and
    remembered: ``workers.throughput``), published under its RQ name for the API, whose estimates use
    the slowest live worker's rate (a configured guess was 4x slow on a 2-core machine). None where it
    could not be measured or published: an aid to estimates, the job runs regardless."""
    from rq import get_current_job

    from workers.throughput import matmul_rate

    try:
        rate = matmul_rate(_device(loaded), loaded.info.d_model)
        current = get_current_job()
        worker = current.worker_name if current is not None and current.worker_name else IN_PROCESS_WORKER
        store.publish_rate(worker, loaded.info.id, rate)
    except Exception as error:
        _log.warning("published no matmul rate for %s: %s", loaded.info.id, _reason(error))
        return None
    return rate


def judge_rate(loaded: LoadedModel, analysis: Analysis) -> None:
    """Forget the remembered rate when the run missed its estimate at that rate by more than
    ``MISS_FACTOR`` (measured while the machine was busy): the next job measures and publishes again."""
    from workers.throughput import check_estimate

    cost = analysis.summary.get("cost") or {}
    if cost.get("upper_bound") or not cost.get("seconds") or launched_by_torchrun():
        return  # an upper bound, or a run split over processes, says nothing of the rate
    check_estimate(
        _device(loaded),
        loaded.info.d_model,
        float(cost["seconds"]),
        float(analysis.summary["timing"]["seconds"]),
    )


def _device(loaded: LoadedModel) -> str:
    """Where the model's weights are: the device whose rate is measured and remembered."""
    return str(next(loaded.model.parameters()).device)


def _cost(
    loaded: LoadedModel,
    job: AnalysisJob,
    settings: Settings,
    flops_per_second: float | None = None,
    partials: bool = False,
):
    rate = flops_per_second or settings.flops_per_second
    estimate = estimate_cost(
        loaded.info,
        job,
        rate,
        settings.engine_memory_bytes,
        partials,
        settings.sums_memory_on(_device(loaded)),
    )
    return estimate.model_dump(mode="json")


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


def write_levels(analysis: Analysis, target: Path, settings: Settings) -> None:
    """The analysis's top-q Fisher sets (one byte per coordinate) beside the exports, for compares."""
    sums = analysis.sequence.sums
    total = sum(math.prod(shape) for shape in sums.shapes.values())
    known = analysis.summary["concentration"]["fisher"]["thresholds"]
    levels, _ = top_q_levels(
        lambda: (value for _, value in sums.iter_stat("fisher")),
        total,
        NAMED_FRACTIONS,
        [known[f"{q:g}"] for q in NAMED_FRACTIONS],
    )
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(f".{target.name}.{os.getpid()}.part")
    levels.numpy().tofile(partial)
    partial.replace(target)
    evict_to_budget(settings.exports_dir, settings.exports_budget_bytes, keep=target)


def draw_response(job: AnalysisJob, store: Store, settings: Settings, pool: ModelPool) -> AnalysisJob | None:
    """For a job whose response is to be sampled: draw it, link the request to the concrete job.

    Returns the concrete job when this worker should run it (nobody has, or its last try failed).
    """
    request_id = job.key()
    with leased(store, request_id):  # the lease first: running without one reads as a dead worker
        store.update_meta(request_id, status="running", stage="sampling", progress=0.0, error=None)
        try:
            loaded = load_for(job, pool)
            ids = sample_response(loaded, job)
        except Exception as error:
            store.fail(request_id, _reason(error))
            return None
    concrete = job.model_copy(update={"continuation_ids": ids, "continuation_sample": None})
    concrete_id = concrete.key()
    rate = published_rate(store, loaded) or settings.flops_per_second
    estimate = estimate_cost(
        loaded.info,
        concrete,
        rate,
        settings.engine_memory_bytes,
        True,
        settings.sums_memory_on(_device(loaded)),
    )
    claimed = store.claim(concrete_id, queued_meta(concrete, estimate))
    store.update_meta(request_id, status="done", stage="sampled", progress=1.0, follows=concrete_id)
    return concrete if claimed else None


def sample_response(loaded: LoadedModel, job: AnalysisJob) -> list[int]:
    """The job's response, drawn from its own sampler with its seed (stops at the model's EOS)."""
    import torch

    spec = job.continuation_sample
    assert spec is not None
    request = request_from_job(job)
    model = loaded.model
    device = next(model.parameters()).device
    engine = loaded.bf16() if request.sampler.engine == EngineKind.bf16 else None
    prefix = torch.tensor(job.input_ids, dtype=torch.long, device=device)
    return sample_continuation(
        model, prefix, request.sampler, spec.seed, spec.max_tokens, stop_ids(model), engine
    )


class AnalysisCancelled(Exception):
    """A DELETE asked for this analysis to stop (``Store.request_cancel``)."""


def watched_progress(store: Store, analysis_id: str, *requested: str) -> ProgressCallback:
    """The job's progress into its record, stopping the job (``AnalysisCancelled``) at the first report
    after a cancel of it, or of the request it answers (a sampled response's): the engine reports after
    every chunk of directions, so a cancelled analysis stops within a chunk. Not a run split over
    processes (torchrun): the others would wait in their next collective for good, so it finishes."""
    watched = () if launched_by_torchrun() else (analysis_id, *requested)

    def progress(stage: str, fraction: float) -> None:
        if any(store.cancel_requested(key) for key in watched):
            raise AnalysisCancelled(CANCELLED)
        store.set_progress(analysis_id, stage, fraction)

    return progress


def _taken_elsewhere(store: Store, analysis_id: str) -> bool:
    """Whether this queued job is no longer this worker's to run: cancelled while queued (failed), or
    another copy of it (the same request POSTed again after a cancel) runs or ran it. A record that
    expired is run."""
    meta = store.get_meta(analysis_id)
    if meta is None or meta.get("status") == JobStatus.queued:
        return False
    if meta.get("status") == JobStatus.failed:
        store.request_cancel(analysis_id, cancel=False)  # failed by the DELETE already
    return True


def execute_analysis(
    job: AnalysisJob, store: Store, settings: Settings, pool: ModelPool | None = None
) -> None:
    """Run `job` and store its summary and pooled views; any failure is stored as a readable error.

    A job with a response to sample draws it first; the analysis then runs under the concrete job's id.
    A job cancelled while queued, or run by another copy of it, is skipped; one cancelled while running
    fails as cancelled.
    """
    requested = job.key()
    if _taken_elsewhere(store, requested):
        return
    if job.continuation_sample is not None:
        concrete = draw_response(job, store, settings, pool or model_pool())
        if concrete is None:
            return
        job = concrete
    analysis_id = job.key()
    progress = watched_progress(store, analysis_id, requested)

    def withdraw_cancel() -> None:
        """A cancel asked of this run no longer stands: before its record says it ended, so that whoever
        reads the end reads no cancel pending."""
        for key in {analysis_id, requested}:
            store.request_cancel(key, cancel=False)

    with leased(store, analysis_id):  # the lease first: running without one reads as a dead worker
        store.update_meta(analysis_id, status="running", stage="load", progress=0.0, error=None)
        try:
            loaded = load_for(job, pool or model_pool())
            if _answered_from_kept(loaded, job, store, settings):
                return
            rate = published_rate(store, loaded)
            store.count(ENGINE_RUNS)
            shapes = list(parameter_shapes(loaded).values())
            grid = pooled_grid(
                shapes, settings.pooled_rows, settings.pooled_cols, settings.max_result_bytes, len(STATS)
            )
            with together(repeat_analysis, job):
                analysis = analyze_job(
                    loaded,
                    job,
                    settings,
                    progress,
                    flops_per_second=rate,
                    on_partial=lambda summary, kept: store.save_partial(
                        analysis_id, {"kept_share": kept, "result": checked_summary(summary)}
                    ),
                    keep_fisher_roots=grid,
                )
            if rate is not None:
                judge_rate(loaded, analysis)
            # the top-q sets first: an analysis that reads as done can be compared at once
            write_levels(analysis, settings.levels_path(analysis_id), settings)
            try:
                keep_for_rewards(analysis, job, settings)
            except Exception as error:  # a cache for later rewards: without it they run whole
                _log.warning("kept no Fisher roots for %s: %s", analysis_id[:12], _reason(error))
            summary = checked_summary(analysis.summary)
            withdraw_cancel()
            store.save_result(analysis_id, summary, analysis.pooled(*grid))
        except BaseException as error:  # includes RQ's timeout; the job must end failed, never running
            withdraw_cancel()
            store.fail(analysis_id, _reason(error))
            if not isinstance(error, Exception):
                raise
        finally:
            withdraw_cancel()


def repeat_analysis(job: AnalysisJob) -> Callable[[], object]:
    """The engine run of ``job`` as the other processes of a worker repeat it (``together``): the
    same directions, split; the progress, partial results and kept roots are rank 0's."""
    loaded = load_for(job, model_pool())
    return lambda: analyze_job(loaded, job, get_settings())


def _answered_from_kept(loaded: LoadedModel, job: AnalysisJob, store: Store, settings: Settings) -> bool:
    """Answer ``job`` from a kept analysis of it under another reward (``workers.reward_reuse``); False
    when there is none, or when answering from it failed: the job then runs whole, with the same result."""
    analysis_id = job.key()
    try:
        reused = answer_from_kept(loaded, job, request_from_job(job), store, settings)
        if reused is None:
            return False
        summary, pooled, kept_id = reused
        summary["cost"] = _cost(loaded, job, settings)
        copy_levels(kept_id, analysis_id, settings)
        checked_summary(summary)
    except Exception as error:
        _log.warning(
            "answering %s from a kept analysis failed, running it whole: %s", analysis_id[:12], _reason(error)
        )
        return False
    store.count(REWARD_REUSES)
    store.save_result(analysis_id, summary, pooled)
    return True


def execute_export(
    job: AnalysisJob, store: Store, settings: Settings, pool: ModelPool | None = None
) -> list[Path]:
    """Recompute the analysis once and write every download choice queued in its record
    (``backend.export_requests.ExportRequests.export``), each to its own file; the files written."""
    analysis_id = job.key()
    meta = store.get_meta(analysis_id) or {}
    queued = {
        key: ExportChoice.model_validate(record["choice"])
        for key, record in meta.items()
        if key.startswith(EXPORT_FIELD_PREFIX)
        and isinstance(record, dict)
        and record.get("status") == "queued"
    }
    if not queued:  # another job took them (one job is queued per choice, the first writes them all)
        return []
    for key, choice in queued.items():
        store.update_meta(analysis_id, **{key: export_record(choice, "running")})
    try:
        loaded = load_for(job, pool or model_pool())
        with together(repeat_analysis, job):
            analysis = analyze_job(loaded, job, settings)
    except Exception as error:
        for key, choice in queued.items():
            store.update_meta(analysis_id, **{key: export_record(choice, "failed", _reason(error))})
        return []
    return [
        path
        for key, choice in queued.items()
        if (path := _write_choice(analysis, job, choice, key, store, settings))
    ]


def _write_choice(
    analysis: Analysis, job: AnalysisJob, choice: ExportChoice, key: str, store: Store, settings: Settings
) -> Path | None:
    analysis_id = job.key()
    target = settings.export_path(analysis_id, choice.slug())
    partial = target.with_name(f".{target.name}.{os.getpid()}.part")
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        request = analysis.request
        sums = analysis.sequence.sums
        write_export(sums, request.input_ids, request.continuation_ids, choice, partial, job.canonical_json())
        partial.replace(target)
        evict_to_budget(settings.exports_dir, settings.exports_budget_bytes, keep=target)
    except Float16Overflow as error:  # permanent: the API answers it as a 422 asking for float32
        store.update_meta(analysis_id, **{key: export_record(choice, "failed", str(error), overflow=True)})
        return None
    except Exception as error:
        partial.unlink(missing_ok=True)
        store.update_meta(analysis_id, **{key: export_record(choice, "failed", _reason(error))})
        return None
    store.update_meta(analysis_id, **{key: export_record(choice, "done")})
    return target


def _reason(error: BaseException) -> str:
    if isinstance(error, AnalysisCancelled):
        return CANCELLED
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
