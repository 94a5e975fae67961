"""A study's parts on the workers: one prompt per job, the last one to finish reduces them.

Why the reducer is whichever worker finishes last: no coordinator process is needed, any number of
workers can run the parts, and a part whose worker died is retried by RQ on another one. Parts are
files (the running sums of one prompt) in the study's folder, a volume every worker and the API share;
the reduction adds them in prompt order, so the result does not depend on how many workers ran them
or in which order they finished.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
from collections.abc import Callable
from pathlib import Path

from backend.rewards import RewardRule
from backend.schemas import JobStatus
from backend.settings import Settings, get_settings
from backend.store import Store
from backend.studies import STUDY_KIND, masks_path, part_id
from backend.study_schemas import StudyJob
from workers import jobs
from workers.commands.processes import together
from workers.jobs import ModelPool, _reason, _redis_store, leased
from workers.models.loading import LoadedModel
from workers.studies.prompts import EncodedPrompt
from workers.studies.spec import StudySpec

PART_PATTERN = "part-{index:05d}.safetensors"
STUDY_RUNS = "study_parts_run"


def study_spec(job: StudyJob) -> StudySpec:
    return StudySpec(
        sampler=job.sampler,
        samples=job.samples,
        max_tokens=job.max_tokens,
        seed=job.seed,
        method=job.method,
        reward=None if job.reward is None else RewardRule(job.reward.kind, job.reward.pattern),
        fractions=tuple(job.q),
    )


def encoded_prompt(job: StudyJob, index: int) -> EncodedPrompt:
    prompt = job.prompts[index]
    return EncodedPrompt(index, index + 1, list(prompt.input_ids), prompt.target, prompt.target_ids)


def _load(job: StudyJob, pool: ModelPool) -> LoadedModel:
    loaded = pool.get(job.model)
    if (loaded.info.digest, loaded.info.dtype) != (job.weights_digest, job.dtype):
        raise RuntimeError(f"the weights of {job.model} changed since this study was made; POST it again")
    return loaded


def part_path(settings: Settings, study_id: str, index: int) -> Path:
    return settings.study_dir(study_id) / PART_PATTERN.format(index=index)


def execute_study_part(
    job: StudyJob, index: int, store: Store, settings: Settings, pool: ModelPool | None = None
) -> None:
    """Run prompt ``index`` of ``job`` into its part file; reduce the study when it was the last part."""
    from workers.studies.files import write_part
    from workers.studies.runner import run_study_part, study_model_of

    study_id = job.key()
    record = part_id(study_id, index)
    target = part_path(settings, study_id, index)
    with leased(store, record):  # the lease first: running without one reads as a dead worker
        store.update_meta(record, status="running", stage="load", progress=0.0, error=None)
        try:
            if not target.is_file():  # a retried part that had written its file is done already
                loaded = _load(job, pool or jobs.model_pool())
                jobs.published_rate(store, loaded)  # for the API's estimates of what comes next
                spec = study_spec(job)
                study_model = study_model_of(loaded, spec)
                store.count(STUDY_RUNS)
                with together(repeat_study_part, job, index):
                    part = run_study_part(
                        study_model,
                        spec,
                        [encoded_prompt(job, index)],
                        memory_budget_bytes=settings.engine_memory_bytes,
                        progress=lambda stage, fraction: store.set_progress(record, stage, fraction),
                        sums_folder=settings.study_dir(study_id),
                    )
                target.parent.mkdir(parents=True, exist_ok=True)
                partial = target.with_name(f".{target.name}.{os.getpid()}.part")
                write_part(partial, part)
                partial.replace(target)
            store.update_meta(record, status=JobStatus.done.value, stage="done", progress=1.0)
        except BaseException as error:  # RQ's timeout included: the part ends failed, never running
            # the study reads its parts: it shows failed too. A ValueError is the request's content
            # (a reward that cannot score a response): running it again would fail the same way
            store.fail(record, _reason(error), permanent=isinstance(error, ValueError))
            if not isinstance(error, Exception):
                raise
            return
    # every part's file written and its status done: a part that reduced as soon as the other parts'
    # files were there could finish the study while one of them still read as running (its file
    # written, its status not yet). Each part marks itself done before it looks, so the last to do so
    # sees them all; the claim is atomic: of two parts finishing together, one reduces (once per
    # submission)
    if all(_part_done(store, settings, study_id, i) for i in range(len(job.prompts))):
        attempt = reduce_id(study_id, (store.get_meta(study_id) or {}).get("created"))
        if store.claim(attempt, {"status": JobStatus.running.value, "kind": STUDY_KIND}):
            reduce_study(job, store, settings, pool)


def repeat_study_part(job: StudyJob, index: int) -> Callable[[], object]:
    """Prompt ``index``'s engine run as the other processes of a worker repeat it (``together``): the
    same responses (the seeds fix them) and directions, split; the part file is rank 0's."""
    from workers.studies.runner import run_study_part, study_model_of

    spec = study_spec(job)
    study_model = study_model_of(_load(job, jobs.model_pool()), spec)
    settings = get_settings()
    return lambda: run_study_part(
        study_model,
        spec,
        [encoded_prompt(job, index)],
        memory_budget_bytes=settings.engine_memory_bytes,
    )


def _part_done(store: Store, settings: Settings, study_id: str, index: int) -> bool:
    meta = store.get_meta(part_id(study_id, index)) or {}
    return meta.get("status") == JobStatus.done.value and part_path(settings, study_id, index).is_file()


def reduce_id(study_id: str, submitted: object) -> str:
    return hashlib.sha256(f"{study_id}:reduce:{submitted}".encode()).hexdigest()


def reduce_study(job: StudyJob, store: Store, settings: Settings, pool: ModelPool | None = None) -> None:
    """Add the parts in prompt order, cut the masks, store the summary, remove the parts."""
    study_id = job.key()
    folder = settings.study_dir(study_id)
    with leased(store, study_id):  # the lease first: a running study without one reads as dead
        store.update_meta(study_id, status="running", stage="reduce")
        _reduce(job, store, settings, pool, folder)


def _reduce(job: StudyJob, store: Store, settings: Settings, pool: ModelPool | None, folder: Path) -> None:
    from workers.studies.files import read_part, write_masks
    from workers.studies.runner import merge_parts, model_meta
    from workers.studies.summary import finish_study

    study_id = job.key()
    try:
        parts = [part_path(settings, study_id, i) for i in range(len(job.prompts))]
        merged = read_part(parts[0])
        for path in parts[1:]:  # two parts in memory at most, whatever the number of prompts
            merged = merge_parts([merged, read_part(path)])
        loaded = _load(job, pool or jobs.model_pool())
        meta = store.get_meta(study_id) or {}
        finished = finish_study(merged, study_spec(job), model_meta(loaded), meta.get("cost"))
        target = masks_path(folder)
        partial = target.with_name(f".{target.name}.{os.getpid()}.part")
        write_masks(partial, finished, merged, study_spec(job))
        partial.replace(target)
        store.save_result(study_id, finished.summary, {})
        for path in parts:
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
    except BaseException as error:
        store.fail(study_id, f"reducing the parts failed: {_reason(error)}; POST the study again")
        if not isinstance(error, Exception):
            raise


def run_study_part_job(payload: dict) -> None:
    """RQ entry point (JSON payload: {"study": StudyJob, "prompt_index": int})."""
    settings = get_settings()
    job = StudyJob.model_validate(payload["study"])
    execute_study_part(job, int(payload["prompt_index"]), _redis_store(settings), settings)
