"""The job behind ``POST /api/v1/updates``: two registered models compared (``workers.weight_updates``),
with the Fisher masks of a study when one is named."""

from __future__ import annotations

import logging

from backend.settings import Settings, get_settings
from backend.store import Store
from backend.studies import masks_path
from backend.update_schemas import UpdatesJob, UpdatesSummary
from workers.jobs import _reason, _redis_store, leased

_log = logging.getLogger(__name__)


def execute_updates(job: UpdatesJob, store: Store, settings: Settings) -> None:
    from workers.weight_updates import compare_checkpoints

    updates_id = job.key()
    with leased(store, updates_id):
        store.set_progress(updates_id, "changed", 0.0)
        try:
            masks = None if job.study is None else masks_path(settings.study_dir(job.study))
            summary = compare_checkpoints(
                job.before,
                job.after,
                job.q,
                masks,
                lambda stage, fraction: store.set_progress(updates_id, stage, fraction),
            )
            if summary["masks"] is not None:  # the study, not the server's folder, names the masks
                summary["masks"]["file"] = f"study {job.study}"
            UpdatesSummary.model_validate(summary)
        except Exception as error:
            _log.warning("comparison %s failed: %s", updates_id[:12], _reason(error))
            store.fail(updates_id, _reason(error))
            return
        store.save_result(updates_id, summary, {})


def run_updates_job(payload: dict) -> None:
    """RQ entry point (JSON payload: an UpdatesJob)."""
    settings = get_settings()
    execute_updates(UpdatesJob.model_validate(payload), _redis_store(settings), settings)
