"""Embedded mode, `fisherscope serve`: API, dashboard and an in-process worker in one process.

Why: the first command a person runs needs no Redis and no second process. Finished analyses persist
to a local folder (`FISHERSCOPE_RESULTS_DIR`), so a copied link still opens after a restart.
"""

from __future__ import annotations

import logging
from typing import Any

from backend.queue import ANALYSIS_FUNCTION, EXPORT_FUNCTION, JobQueue, ThreadQueue
from backend.schemas import AnalysisJob
from backend.settings import Settings, get_settings
from backend.store import LocalStore, Store

log = logging.getLogger(__name__)


def local_backend(settings: Settings) -> tuple[Store, JobQueue]:
    """A folder-backed store and a worker thread that imports the engine on its first job."""
    store = LocalStore(settings.results_dir)

    def run(function: str, payload: dict) -> None:
        from workers import jobs  # torch is imported here, in the worker thread, not at app import

        job = AnalysisJob.model_validate(payload)
        if function == ANALYSIS_FUNCTION:
            jobs.execute_analysis(job, store, settings)
        elif function == EXPORT_FUNCTION:
            jobs.execute_export(job, store, settings)
        else:
            raise ValueError(f"unknown job function {function}")

    return store, ThreadQueue(run)


def with_dashboard(api: Any, api_base_url: str) -> Any:
    """Mount the Dash dashboard under `/` (the API keeps /api, /healthz, /readyz, /docs)."""
    try:
        from a2wsgi import WSGIMiddleware  # type: ignore[import-not-found]
    except ImportError:
        from starlette.middleware.wsgi import WSGIMiddleware  # type: ignore[no-redef]
    try:
        from frontend.app import create_dash_app  # type: ignore[import-not-found]
    except ImportError as error:
        log.warning("dashboard not available (%s); serving the API alone", error)
        return api
    dash_app = create_dash_app(api_base_url)
    api.mount("/", WSGIMiddleware(dash_app.server))
    return api


def build_app(settings: Settings, host: str, port: int) -> Any:
    from backend.main import create_app

    settings = settings.model_copy(update={"redis_url": None})
    api = create_app(settings)
    return with_dashboard(api, f"http://{host}:{port}")


def serve(host: str = "127.0.0.1", port: int = 8000) -> None:
    import uvicorn

    logging.basicConfig(level=logging.INFO)
    app = build_app(get_settings(), host, port)
    print(f"fisherscope: dashboard and API on http://{host}:{port}/  (API docs: /docs)", flush=True)
    uvicorn.run(app, host=host, port=port, log_level="warning")
