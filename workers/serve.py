"""`fisherscope serve`: the embedded mode, the one place that composes API, dashboard and worker.

Why here: the API (``backend``) never imports the workers, the dashboard (``frontend``) talks to the
API over HTTP only; one process that runs all three is a composition of the three, made here. Jobs run
in a thread of this process (``workers.jobs``, torch imported on the first job), finished analyses
persist to a folder, and the dashboard is mounted under `/` beside the API.
"""

from __future__ import annotations

import ipaddress
import logging
import threading
from collections.abc import Callable
from typing import Any

from backend.embedded import local_backend
from backend.main import create_app
from backend.queue import ANALYSIS_FUNCTION, EXPORT_FUNCTION, STUDY_PART_FUNCTION, UPDATES_FUNCTION
from backend.registry import DEFAULT_MODEL, is_available
from backend.schemas import AnalysisCreate, AnalysisJob, SamplerSpec
from backend.settings import Settings, get_settings
from backend.store import Store
from backend.study_schemas import StudyJob
from backend.update_schemas import UpdatesJob
from backend.vocabulary import (
    LANDING_CONTINUATION,
    LANDING_PREFIX,
    LANDING_REWARD,
    LANDING_TEMPERATURE,
    LANDING_TOP_K,
)

log = logging.getLogger(__name__)


def embedded_api(settings: Settings, preload: str | None = None) -> Any:
    """The API with a folder store and an in-process worker thread (no Redis).

    ``preload``: a model id loaded in the background at once, so that the first analysis finds it
    warm (`/readyz` answers 503 with what is loading until it is in), and whose landing analysis (the
    essays' example) is then queued, so that a first visit finds it in the cache.
    """
    settings = settings.model_copy(update={"redis_url": None})
    store, queue = local_backend(
        settings, lambda function, payload, store: _run(function, payload, store, settings)
    )
    api = create_app(settings, store, queue)
    if preload is not None:
        service = api.state.service

        def then() -> None:
            if settings.landing_analysis:
                _submit_landing(service, preload)

        service.warming = _Preload(preload, then).status
    return api


def landing_request(model_id: str) -> AnalysisCreate:
    """The essays' example on ``model_id``: the request a first visit's page sends (frontend.state)."""
    return AnalysisCreate(
        model=model_id,
        prefix=LANDING_PREFIX,
        continuation=LANDING_CONTINUATION,
        sampler=SamplerSpec(temperature=LANDING_TEMPERATURE, top_k=LANDING_TOP_K),
        reward=dict(LANDING_REWARD),
    )


def _submit_landing(service: Any, model_id: str) -> None:
    """Queue the landing view's analysis and then its rho stage (what the page asks next); a cached one
    costs nothing."""
    public, _ = service.submit(landing_request(model_id))
    service.with_rho_json(public.id)


class _Preload:
    """Loads one model into this process's pool on a thread; says what it is doing until done."""

    def __init__(self, model_id: str, then: Callable[[], None]) -> None:
        self.model_id = model_id
        self.then = then
        self.failed: str | None = None
        self.done = threading.Event()
        threading.Thread(target=self._load, name=f"preload-{model_id}", daemon=True).start()

    def _load(self) -> None:
        try:
            from workers import jobs

            jobs.model_pool().get(self.model_id)
            self.then()
        except Exception as error:  # the first job for it will say why again; the service still serves
            self.failed = f"{type(error).__name__}: {error}"
            log.warning("preloading %s failed: %s", self.model_id, self.failed)
        finally:
            self.done.set()

    def status(self) -> str | None:
        if not self.done.is_set():
            return f"loading the model {self.model_id} (the first analysis waits for it)"
        return None


def _run(function: str, payload: dict, store: Store, settings: Settings) -> None:
    from workers import jobs, study_jobs, update_jobs

    if function == ANALYSIS_FUNCTION:
        jobs.execute_analysis(AnalysisJob.model_validate(payload), store, settings)
    elif function == EXPORT_FUNCTION:
        jobs.execute_export(AnalysisJob.model_validate(payload), store, settings)
    elif function == STUDY_PART_FUNCTION:
        study = StudyJob.model_validate(payload["study"])
        study_jobs.execute_study_part(study, int(payload["prompt_index"]), store, settings)
    elif function == UPDATES_FUNCTION:
        update_jobs.execute_updates(UpdatesJob.model_validate(payload), store, settings)
    else:
        raise ValueError(f"unknown job function {function}")


def with_dashboard(api: Any, api_base_url: str, api_token: str | None = None) -> Any:
    """Mount the study page under `/studies` and the Dash dashboard under `/` (the API keeps /api,
    /healthz, /readyz, /docs). Starlette matches mounts in order: `/studies` goes first."""
    from a2wsgi import WSGIMiddleware

    from frontend.app import create_dash_app
    from frontend.studies.app import create_study_app

    api.mount("/studies", WSGIMiddleware(create_study_app(api_base_url, api_token=api_token).server))
    api.mount("/", WSGIMiddleware(create_dash_app(api_base_url, api_token=api_token).server))
    return api


def is_loopback(host: str) -> bool:
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def _every_address(host: str) -> bool:
    """A bind to every interface: no name a browser would use."""
    return host.strip("[]") in ("0.0.0.0", "::", "")


def _own_url(host: str, port: int) -> str:
    """Where the dashboard reaches the API of its own process: loopback when bound to every address."""
    if _every_address(host):
        host = "127.0.0.1"
    elif ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"http://{host}:{port}"


def served_settings(settings: Settings, host: str) -> Settings:
    """The settings with the bound address among the allowed hosts (a browser may use it as the name)."""
    name = host.strip("[]").lower()
    if _every_address(host) or name in settings.allowed_hosts:
        return settings
    return settings.model_copy(update={"allowed_hosts": [*settings.allowed_hosts, name]})


def exposure_problem(host: str, settings: Settings, open_without_token: bool) -> str | None:
    """Why serving on ``host`` is refused: beyond loopback, anyone who reaches it could start compute."""
    if is_loopback(host) or settings.api_token is not None or open_without_token:
        return None
    return (
        f"serving on {host} lets anyone who reaches it start computations: set FISHERSCOPE_API_TOKEN "
        "(and FISHERSCOPE_ALLOWED_HOSTS, the names people use), or pass --open-without-token"
    )


def build_app(settings: Settings, host: str, port: int, preload: str | None = None) -> Any:
    settings = served_settings(settings, host)
    token = settings.api_token.get_secret_value() if settings.api_token else None
    return with_dashboard(embedded_api(settings, preload), _own_url(host, port), token)


def serve(host: str = "127.0.0.1", port: int = 8000, open_without_token: bool = False) -> None:
    """Run the embedded service; UsageError (before anything starts) when it would be open to others."""
    import uvicorn
    from pydantic import ValidationError

    from workers.commands.common import UsageError

    try:
        settings = get_settings()
    except ValidationError as error:
        first = error.errors()[0]
        raise UsageError(f"FISHERSCOPE_{str(first['loc'][0]).upper()}: {first['msg']}") from None
    problem = exposure_problem(host, settings, open_without_token)
    if problem is not None:
        raise UsageError(problem)
    logging.basicConfig(level=logging.INFO)
    app = build_app(settings, host, port, preload=DEFAULT_MODEL if is_available(DEFAULT_MODEL) else None)
    guarded = "token required for compute" if settings.api_token else "no token: open to this machine"
    print(
        f"fisherscope: dashboard and API on {_own_url(host, port)}/  (API docs: /docs; {guarded})", flush=True
    )
    uvicorn.run(app, host=host, port=port, log_level="warning")
