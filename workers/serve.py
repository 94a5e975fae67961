"""`fisherscope serve`: the embedded mode, the one place that composes API, dashboard and worker.

Why here: the API (``backend``) never imports the workers, the dashboard (``frontend``) talks to the
API over HTTP only; one process that runs all three is a composition of the three, made here. Jobs run
in a thread of this process (``workers.jobs``, torch imported on the first job), finished analyses
persist to a folder, and the dashboard is mounted under `/` beside the API.
"""

from __future__ import annotations

import logging
from typing import Any

from backend.embedded import local_backend
from backend.main import create_app
from backend.queue import ANALYSIS_FUNCTION, EXPORT_FUNCTION
from backend.schemas import AnalysisJob
from backend.settings import Settings, get_settings
from backend.store import Store

log = logging.getLogger(__name__)


def embedded_api(settings: Settings) -> Any:
    """The API with a folder store and an in-process worker thread (no Redis)."""
    settings = settings.model_copy(update={"redis_url": None})
    store, queue = local_backend(
        settings, lambda function, payload, store: _run(function, payload, store, settings)
    )
    return create_app(settings, store, queue)


def _run(function: str, payload: dict, store: Store, settings: Settings) -> None:
    from workers import jobs

    job = AnalysisJob.model_validate(payload)
    if function == ANALYSIS_FUNCTION:
        jobs.execute_analysis(job, store, settings)
    elif function == EXPORT_FUNCTION:
        jobs.execute_export(job, store, settings)
    else:
        raise ValueError(f"unknown job function {function}")


def with_dashboard(api: Any, api_base_url: str) -> Any:
    """Mount the Dash dashboard under `/` (the API keeps /api, /healthz, /readyz, /docs)."""
    from a2wsgi import WSGIMiddleware

    from frontend.app import create_dash_app

    api.mount("/", WSGIMiddleware(create_dash_app(api_base_url).server))
    return api


def build_app(settings: Settings, host: str, port: int) -> Any:
    return with_dashboard(embedded_api(settings), f"http://{host}:{port}")


def serve(host: str = "127.0.0.1", port: int = 8000) -> None:
    import uvicorn

    logging.basicConfig(level=logging.INFO)
    app = build_app(get_settings(), host, port)
    print(f"fisherscope: dashboard and API on http://{host}:{port}/  (API docs: /docs)", flush=True)
    uvicorn.run(app, host=host, port=port, log_level="warning")
