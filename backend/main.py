"""The FastAPI app: `uvicorn backend.main:app` (with REDIS_URL: the queue of `fisherscope worker`s).

Why a factory: tests and the embedded mode (`workers.serve`, which brings the in-process worker) build
apps with their own settings, store and queue. Importing this module builds nothing and never imports
torch; `app` is made on first access, for uvicorn.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from redis import Redis
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError
from redis.retry import Retry

from backend.access import HostGuard, RateLimiter
from backend.guards import BodyGuard
from backend.normalize import RequestError
from backend.queue import JobQueue, RedisQueue
from backend.routes import api, health
from backend.service import AnalysisService
from backend.service_error import ServiceError
from backend.settings import Settings, get_settings
from backend.store import RedisStore, Store
from backend.studies import StudyService
from backend.study_routes import studies
from backend.unrouted import unrouted_router
from backend.update_routes import updates
from backend.updates import UpdatesService

REDIS_DOWN = "Redis is unreachable; the service recovers by itself when it is back, retry in a few seconds"


def redis_client(url: str) -> Redis:
    """A client that fails fast while Redis is down (answered as 503) and reconnects on its own."""
    return Redis.from_url(
        url,
        socket_connect_timeout=1.0,
        socket_timeout=5.0,
        retry=Retry(NoBackoff(), 1),
        health_check_interval=10,
    )


def default_backend(settings: Settings) -> tuple[Store, JobQueue]:
    if settings.redis_url:
        redis = redis_client(settings.redis_url)
        return (
            RedisStore(redis, settings.result_ttl_s),
            RedisQueue(redis, settings.queue_name, settings.job_timeout_s),
        )
    from backend.embedded import local_backend

    return local_backend(settings)  # no worker here: jobs fail at once, saying how to start one


def create_app(
    settings: Settings | None = None, store: Store | None = None, queue: JobQueue | None = None
) -> FastAPI:
    settings = settings or get_settings()
    if store is None or queue is None:
        store, queue = default_backend(settings)
    app = FastAPI(
        title="fisherscope",
        version="1",
        description="The token Fisher of a causal LM on your own prefix: analyses, pooled views, downloads.",
    )
    app.state.service = AnalysisService(settings, store, queue)
    app.state.studies = StudyService(app.state.service)
    app.state.updates = UpdatesService(app.state.studies)
    app.state.rate_limiter = RateLimiter(settings)
    app.include_router(api)
    app.include_router(studies)
    app.include_router(updates)
    app.include_router(health)
    app.include_router(unrouted_router(api, studies, updates))  # last: what no route above serves under /api
    _add_error_handlers(app)
    app.add_middleware(BodyGuard)
    app.add_middleware(HostGuard, allowed=settings.allowed_hosts)  # outermost: before any body is read
    return app


def _error(status: int, detail: str, **extra: Any) -> JSONResponse:
    body = {"detail": detail, **{key: value for key, value in extra.items() if value is not None}}
    return JSONResponse(body, status_code=status)


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(RequestValidationError)
    async def invalid(_: Request, error: RequestValidationError) -> JSONResponse:
        raw = error.errors()
        if raw and raw[0].get("type") == "json_invalid":
            position = raw[0].get("loc", ("body", "?"))[-1]
            return _error(400, f"request body is not valid JSON (near character {position}); send JSON")
        errors = [
            {
                "loc": [str(part) for part in e.get("loc", ())],
                "msg": str(e.get("msg", "")),
                "type": e.get("type"),
            }
            for e in raw
        ]
        detail = "; ".join(f"{'.'.join(e['loc'][1:] or e['loc'])}: {e['msg']}" for e in errors[:5])
        return _error(422, detail or "invalid request", errors=errors)

    @app.exception_handler(RequestError)
    async def refused(_: Request, error: RequestError) -> JSONResponse:
        estimate = error.estimate.model_dump() if error.estimate is not None else None  # type: ignore[attr-defined]
        return _error(error.status, str(error), estimate=estimate, cheaper_methods=error.cheaper_methods)

    @app.exception_handler(ServiceError)
    async def unavailable(_: Request, error: ServiceError) -> JSONResponse:
        return _error(error.status, error.detail)

    @app.exception_handler(RedisConnectionError)
    @app.exception_handler(RedisTimeoutError)
    async def redis_down(_: Request, error: Exception) -> JSONResponse:
        return _error(503, REDIS_DOWN)


def __getattr__(name: str) -> Any:
    """`backend.main:app` for uvicorn, built from the environment on first access."""
    if name == "app":
        return create_app()
    raise AttributeError(name)
