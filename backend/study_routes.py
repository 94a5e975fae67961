"""HTTP routes of /api/v1/studies: thin handlers over `StudyService`."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Query, Request, Response
from fastapi import Path as PathParam
from fastapi.responses import FileResponse, JSONResponse

from backend.routes import ERRORS, queued_or_cached
from backend.store import RECENT_LIMIT
from backend.studies import StudyService
from backend.study_schemas import (
    StudyCreate,
    StudyListItem,
    StudyMaskComparison,
    StudyMaskView,
    StudyPublic,
)


def get_studies(request: Request) -> StudyService:
    return request.app.state.studies


Studies = Annotated[StudyService, Depends(get_studies)]
StudyId = Annotated[str, PathParam(pattern=r"^[0-9a-f]{64}$", description="study id, 64 hex characters")]

studies = APIRouter(prefix="/api/v1", responses=ERRORS)


@studies.post("/studies", **queued_or_cached(StudyPublic, "finished (served from the cache)"))
def create_study(create: StudyCreate, service: Studies) -> Response:
    """Queue a study, one job per prompt over every running worker (202), or answer it from the cache."""
    public, status = service.submit(create)
    return JSONResponse(public.model_dump(mode="json"), status_code=status)


@studies.get("/studies", response_model=list[StudyListItem])
def list_studies(
    service: Studies, limit: Annotated[int, Query(ge=1, le=RECENT_LIMIT)] = RECENT_LIMIT
) -> list[StudyListItem]:
    """The studies last POSTed on this server, newest first (a study POSTed again moves up)."""
    return service.recent(limit)


@studies.get("/studies/compare", response_model=StudyMaskComparison)
def compare_studies(
    service: Studies,
    a: Annotated[str, Query(pattern=r"^[0-9a-f]{64}$", description="a finished study's id")],
    b: Annotated[str, Query(pattern=r"^[0-9a-f]{64}$", description="another, of the same model")],
) -> StudyMaskComparison:
    """Overlap and Jaccard of two studies' Fisher masks at every density both cut, beside chance (two
    samplers, two prompt sets, exact against an estimator's study)."""
    return service.compare(a, b)


@studies.get("/studies/{study_id}", response_model=StudyPublic)
def read_study(study_id: StudyId, service: Studies) -> StudyPublic:
    """Status, progress per prompt, and when done the summary (estimators, masks, the paper's statistics)."""
    return service.get(study_id)


@studies.get(
    "/studies/{study_id}/masks",
    responses={200: {"content": {"application/octet-stream": {}}, "description": "the masks file"}},
)
def download_masks(study_id: StudyId, service: Studies) -> FileResponse:
    """Every mask density in one safetensors file: `q<q>/<param name>`, uint8, 1 = trainable."""
    path = service.masks(study_id)
    return FileResponse(
        path, media_type="application/octet-stream", filename=f"fisher-masks-{study_id[:12]}.safetensors"
    )


@studies.get("/studies/{study_id}/masks/{tensor}", response_model=StudyMaskView)
def read_mask(
    study_id: StudyId,
    tensor: str,
    service: Studies,
    q: Annotated[float, Query(gt=0, lt=1, description="one of the study's mask densities")] = 0.01,
    rows: Annotated[int, Query(ge=1, le=512)] = 64,
    cols: Annotated[int, Query(ge=1, le=512)] = 64,
) -> StudyMaskView:
    """Where one parameter's mask lies: coordinates in the mask per block (for a heatmap)."""
    return service.mask_view(study_id, tensor, q, rows, cols)
