"""The store and queue of one process without Redis: a folder-backed store and a worker thread.

Why here: the API of the embedded mode needs both, but the worker itself (torch) is supplied by the
composition that runs the process (``workers.serve``): the API never imports the workers. Finished
analyses persist to a local folder (`FISHERSCOPE_RESULTS_DIR`), so a copied link still opens after a
restart. Without a runner (the API alone, no Redis) every job fails at once with a reason.
"""

from __future__ import annotations

from collections.abc import Callable

from backend.local_store import LocalStore
from backend.queue import JobQueue, ThreadQueue
from backend.settings import Settings
from backend.store import Store

Runner = Callable[[str, dict, Store], None]  # (job function, payload, store)
NO_WORKER = (
    "no worker runs in this process and no REDIS_URL is set: start the service with `fisherscope serve` "
    "(embedded) or point it and `fisherscope worker` processes at one Redis"
)


def local_backend(settings: Settings, runner: Runner | None = None) -> tuple[Store, JobQueue]:
    """A folder-backed store and a thread that runs each queued job with ``runner``."""
    store = LocalStore(settings.results_dir)

    def run(function: str, payload: dict, analysis_id: str) -> None:
        if runner is None:
            store.fail(analysis_id, NO_WORKER)
            return
        runner(function, payload, store)

    return store, ThreadQueue(run)
