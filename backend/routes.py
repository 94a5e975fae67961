"""HTTP routes of /api/v1: thin handlers over `AnalysisService`."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Query, Request, Response
from fastapi import Path as PathParam
from fastapi.responses import FileResponse, JSONResponse
from pydantic import BaseModel

from backend.access import rate_limited, require_token
from backend.export_choice import parse_export_choice
from backend.fastjson import dumps
from backend.schemas import (
    AnalysisCreate,
    AnalysisPublic,
    ComparePublic,
    ErrorBody,
    ExportChoice,
    Health,
    ModelPublic,
    TensorView,
    TokenizeResponse,
    TopCoordinates,
)
from backend.service import AnalysisService
from backend.service_error import ServiceError
from backend.store import ENGINE_RUNS, REWARD_REUSES
from backend.summary import AnalysisOverview, PositionSummary

ERRORS: dict[int | str, dict[str, Any]] = {
    400: {"model": ErrorBody, "description": "malformed body, or a Host this server does not answer to"},
    404: {"model": ErrorBody, "description": "unknown analysis, tensor or stat"},
    409: {"model": ErrorBody, "description": "the analysis is not done yet"},
    413: {"model": ErrorBody, "description": "body too large"},
    422: {"model": ErrorBody, "description": "bad request content; `detail` says what to fix"},
    503: {"model": ErrorBody, "description": "Redis or the model cache is unavailable"},
}
# routes that start compute or write to disk: the server's token when it has one, and a per-client limit
COMPUTE: dict[str, Any] = {
    "dependencies": [Depends(require_token), Depends(rate_limited)],
    "responses": {
        401: {"model": ErrorBody, "description": "the server has an API token and the request lacks it"},
        429: {"model": ErrorBody, "description": "over the client's rate limit; see Retry-After"},
    },
}


def queued_or_cached(model: type, cached: str) -> dict[str, Any]:
    """A compute route's decorator arguments: queued (202) or answered from the cache (200, ``cached``
    says what), behind the token and the rate limit."""
    return {
        "response_model": model,
        "status_code": 202,
        "dependencies": COMPUTE["dependencies"],
        "responses": {200: {"model": model, "description": cached}, **COMPUTE["responses"]},
    }


class JsonBytes(Response):
    """A body already serialized to the declared schema (the service splices cached summaries in)."""

    media_type = "application/json"


def get_service(request: Request) -> AnalysisService:
    return request.app.state.service


Service = Annotated[AnalysisService, Depends(get_service)]
AnalysisId = Annotated[
    str, PathParam(pattern=r"^[0-9a-f]{64}$", description="analysis id: the cache key, 64 hex characters")
]

api = APIRouter(prefix="/api/v1", responses=ERRORS)
health = APIRouter()


@api.post("/analyses", **queued_or_cached(AnalysisPublic, "finished (served from the cache)"))
def create_analysis(create: AnalysisCreate, service: Service) -> Response:
    """Queue an analysis (202) or answer it from the cache (200); the id is the cache key."""
    body, status = service.submit_json(create)
    return JsonBytes(body, status_code=status)


@api.post(
    "/analyses/{analysis_id}/rho",
    **queued_or_cached(AnalysisPublic, "finished (from the cache), or the analysis itself"),
)
def request_rho(analysis_id: AnalysisId, service: Service) -> Response:
    """The same analysis with rho: off the policy the Fisher under p is computed only when asked (d_model
    directions more per position), so a first answer comes sooner; this asks for it. Answers the analysis
    itself where it already has rho (on the policy, or asked with `rho`), else queues (202) or answers
    from the cache (200) the request with `rho: true`, whose id differs."""
    body, status = service.with_rho_json(analysis_id)
    return JsonBytes(body, status_code=status)


@api.get("/analyses/{analysis_id}", response_model=AnalysisPublic)
def read_analysis(analysis_id: AnalysisId, service: Service) -> Response:
    return JsonBytes(service.get_json(analysis_id))


@api.delete(
    "/analyses/{analysis_id}",
    response_model=AnalysisPublic,
    # the token, but no rate limit: a client over its limit can still stop what it started
    dependencies=[Depends(require_token)],
    responses={
        202: {"model": AnalysisPublic, "description": "running: its worker stops at its next chunk of work"},
        401: COMPUTE["responses"][401],
    },
)
def cancel_analysis(analysis_id: AnalysisId, service: Service) -> Response:
    """Cancel a queued or running analysis (a sampled response's id: the analysis it follows). Queued: failed
    at once with the error `cancelled` (200). Running: asked to stop (202, stage `cancelling`); its worker
    fails it at its next chunk of directions and takes the next job. Failed: answered as it is. Done: 409,
    the result stays cached. POSTing the same request again runs it anew."""
    body, status = service.cancel_json(analysis_id)
    return JsonBytes(body, status_code=status)


@api.get("/analyses/{analysis_id}/overview", response_model=AnalysisOverview)
def read_overview(analysis_id: AnalysisId, service: Service) -> Response:
    """The finished summary with its first position whole and `position_index` listing every position
    in brief: what the slides draw, as small for a 64-token response as for a prefix. (The summary was
    checked against its model when it was stored; it is sent as stored.)"""
    return JsonBytes(dumps(service.overview(analysis_id)))


@api.get("/analyses/{analysis_id}/positions/{index}", response_model=PositionSummary)
def read_position(
    analysis_id: AnalysisId, index: Annotated[int, PathParam(ge=0, le=100_000)], service: Service
) -> Response:
    """One analysed position's whole summary (p and mu, spectrum, output layer, totals)."""
    return JsonBytes(dumps(service.position(analysis_id, index)))


@api.get("/compare", response_model=ComparePublic)
def compare(
    service: Service,
    a: Annotated[str, Query(pattern=r"^[0-9a-f]{64}$", description="an analysis id")],
    b: Annotated[str, Query(pattern=r"^[0-9a-f]{64}$", description="another, of the same parameters")],
) -> ComparePublic:
    """Two finished analyses side by side: overlap and Jaccard of their top-q Fisher sets against
    chance, and both analyses' totals per tensor."""
    return service.compare(a, b)


@api.get("/analyses/{analysis_id}/tensors", response_model=list[str])
def list_tensors(analysis_id: AnalysisId, service: Service) -> list[str]:
    return service.tensor_names(analysis_id)


@api.get("/analyses/{analysis_id}/tensors/{tensor}", response_model=TensorView)
def read_tensor(
    analysis_id: AnalysisId,
    tensor: str,
    service: Service,
    stat: Annotated[str, Query(max_length=32)] = "fisher",
    rows: Annotated[int, Query(ge=1, le=512)] = 64,
    cols: Annotated[int, Query(ge=1, le=512)] = 64,
) -> TensorView:
    """Block sums of one statistic over one tensor, on at most rows x cols blocks (for heatmaps)."""
    return service.tensor_view(analysis_id, tensor, stat, rows, cols)


@api.get("/analyses/{analysis_id}/top", response_model=TopCoordinates)
def read_top(
    analysis_id: AnalysisId,
    service: Service,
    stat: Annotated[str, Query(max_length=32)] = "fisher",
    limit: Annotated[int, Query(ge=1, le=1000)] = 50,
) -> TopCoordinates:
    return service.top(analysis_id, stat, limit)


def export_choice(
    stats: Annotated[
        str | None,
        Query(max_length=200, description="comma list of statistics; default fisher,mean_shift"),
    ] = None,
    tensors: Annotated[
        str | None,
        Query(
            max_length=4000,
            description="comma list of parameter names, dotted prefixes (model.layers.0) or globs "
            "(*.mlp.*); default every parameter",
        ),
    ] = None,
    dtype: Annotated[
        str | None,
        Query(max_length=16, description="float16 (default; refused if a value overflows) | float32"),
    ] = None,
) -> ExportChoice:
    return parse_export_choice(stats, tensors, dtype)


Choice = Annotated[ExportChoice, Depends(export_choice)]
SAFETENSORS = "/analyses/{analysis_id}/safetensors"


@api.get(
    SAFETENSORS,
    response_model=AnalysisPublic,
    status_code=202,
    dependencies=COMPUTE["dependencies"],
    responses={
        200: {"content": {"application/octet-stream": {}}, "description": "the safetensors file"},
        **COMPUTE["responses"],
    },
)
def download_safetensors(analysis_id: AnalysisId, choice: Choice, service: Service) -> Response:
    """The chosen per-parameter arrays (`<stat>/<param>`), computed on demand: 202 until the file is
    written. Each choice of stats, tensors and dtype is a file of its own; its metadata says what it
    holds and what float16 rounding did."""
    answer = service.export(analysis_id, choice)
    if isinstance(answer, Path):
        return FileResponse(answer, media_type="application/octet-stream", filename=answer.name)
    return JSONResponse(answer.model_dump(mode="json"), status_code=202)


@api.head(
    SAFETENSORS,
    status_code=200,
    dependencies=COMPUTE["dependencies"],
    responses={
        200: {"description": "the file is written: its headers (Content-Length), no body"},
        202: {"description": "the file is being written"},
        404: {"description": "nobody asked for this choice yet (GET starts it), or no such analysis"},
        **COMPUTE["responses"],
    },
)
def head_safetensors(analysis_id: AnalysisId, choice: Choice, service: Service) -> Response:
    """Whether a choice's file is ready, never starting one: a poll that costs the worker nothing."""
    answer = service.export_state(analysis_id, choice)
    if isinstance(answer, Path):
        return FileResponse(answer, media_type="application/octet-stream", filename=answer.name)
    return Response(status_code=404 if answer is None else 202)


class Stats(BaseModel):
    """Service counters: `engine_runs` counts analyses the engine computed whole, `reward_reuses` those
    answered from the same analysis under another reward (cache hits add to neither)."""

    engine_runs: int
    reward_reuses: int


@api.get("/stats", response_model=Stats)
def read_stats(service: Service) -> Stats:
    """How often the engine ran, so a client can check that a cached answer computed nothing new."""
    store = service.store
    return Stats(engine_runs=store.read_counter(ENGINE_RUNS), reward_reuses=store.read_counter(REWARD_REUSES))


@api.get("/models", response_model=list[ModelPublic])
def list_models(service: Service) -> list[ModelPublic]:
    return service.models()


@api.get("/tokenize", response_model=TokenizeResponse)
def tokenize(
    service: Service,
    model: Annotated[str, Query(min_length=1, max_length=128)],
    text: Annotated[str, Query(max_length=20_000)],
    special_tokens: bool = False,
) -> TokenizeResponse:
    """How a text splits into tokens (continuation rules unless special_tokens), to pick reward tokens."""
    return service.tokenize(model, text, special_tokens)


@health.get("/healthz", response_model=Health)
def healthz() -> Health:
    return Health(status="ok")


@health.get(
    "/readyz",
    response_model=Health,
    responses={503: {"model": ErrorBody, "description": "the store is down, or a model is still loading"}},
)
def readyz(service: Service) -> Health:
    try:
        service.store.ping()
    except Exception as error:
        raise ServiceError(503, f"store unavailable: {type(error).__name__}") from None
    warming = service.warming()
    if warming is not None:
        raise ServiceError(503, warming)
    return Health(status="ready")
