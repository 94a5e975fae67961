"""HTTP routes of /api/v1/updates: thin handlers over `UpdatesService`."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Request, Response
from fastapi import Path as PathParam
from fastapi.responses import JSONResponse

from backend.routes import ERRORS, queued_or_cached
from backend.update_schemas import UpdatesCreate, UpdatesPublic
from backend.updates import UpdatesService


def get_updates(request: Request) -> UpdatesService:
    return request.app.state.updates


Updates = Annotated[UpdatesService, Depends(get_updates)]
UpdatesId = Annotated[
    str, PathParam(pattern=r"^[0-9a-f]{64}$", description="comparison id, 64 hex characters")
]

updates = APIRouter(prefix="/api/v1", responses=ERRORS)


@updates.post("/updates", **queued_or_cached(UpdatesPublic, "finished (served from the cache)"))
def create_updates(create: UpdatesCreate, service: Updates) -> Response:
    """Compare two checkpoints of one model (and lay a study's Fisher masks over what changed): queued
    (202), or answered from the cache."""
    public, status = service.submit(create)
    return JSONResponse(public.model_dump(mode="json"), status_code=status)


@updates.get("/updates/{updates_id}", response_model=UpdatesPublic)
def read_updates(updates_id: UpdatesId, service: Updates) -> UpdatesPublic:
    """Where the run changed the weights: per tensor, layer and kind, top-|delta| sets, mask overlaps."""
    return service.get(updates_id)
