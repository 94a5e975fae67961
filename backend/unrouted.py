"""Every path under /api that no route serves: a JSON 404, or 405 with Allow, never the dashboard.

Why: the embedded mode mounts the dashboard under `/`, which answers any path with its page, so a
mistyped API path or a name with an encoded '/' would get 200 text/html. This router goes last.
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from fastapi.routing import APIRoute
from starlette.routing import Match

ANY_METHOD = ["GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"]


def unrouted_router(*served: APIRouter) -> APIRouter:
    """The catch-all for /api, telling a known path's other methods (those of ``served``) from none."""
    routes = [route for router in served for route in router.routes if isinstance(route, APIRoute)]
    router = APIRouter()

    @router.api_route("/api/{rest:path}", methods=ANY_METHOD, include_in_schema=False)
    def no_such_route(request: Request) -> JSONResponse:
        allowed = sorted(
            {
                method
                for route in routes
                if route.matches(request.scope)[0] == Match.PARTIAL
                for method in route.methods or ()
            }
        )
        path = request.url.path
        if allowed:
            detail = f"{request.method} is not served on {path}; use {', '.join(allowed)}"
            return JSONResponse({"detail": detail}, status_code=405, headers={"Allow": ", ".join(allowed)})
        detail = f"no API route {request.method} {path} (names never contain '/'); the routes are at /docs"
        return JSONResponse({"detail": detail}, status_code=404)

    return router
