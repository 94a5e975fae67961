"""Every path under /api that no route serves: a JSON 404, or 405 with Allow, never the dashboard; and
HEAD wherever GET is served.

Why: the embedded mode mounts the dashboard under `/`, which answers any path with its page, so a
mistyped API path or a name with an encoded '/' would get 200 text/html. This router goes last.
FastAPI's GET routes do not answer HEAD; here a HEAD that no route of its own serves runs the GET
route's handler (its dependencies included) and sends the headers without the body. A route whose GET
has effects (the safetensors export) declares its own HEAD, which is matched before this one.
"""

from __future__ import annotations

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse
from fastapi.routing import APIRoute
from starlette.routing import Match
from starlette.types import Message, Receive, Scope, Send

ANY_METHOD = ["GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"]


class HeadOfGet(Response):
    """The answer of ``route`` to GET, as headers only: the handler runs with method HEAD (so a file
    response reads no file) and every body message is replaced by one empty final one."""

    def __init__(self, route: APIRoute, child_scope: Scope) -> None:
        super().__init__()
        self.route = route
        self.child_scope = child_scope

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        ended = False

        async def headers_only(message: Message) -> None:
            nonlocal ended
            if message["type"] != "http.response.body":
                await send(message)
            elif not ended and not message.get("more_body", False):
                ended = True
                await send({"type": "http.response.body", "body": b"", "more_body": False})

        await self.route.app({**scope, **self.child_scope, "method": "HEAD"}, receive, headers_only)


def unrouted_router(*served: APIRouter) -> APIRouter:
    """The catch-all for /api, telling a known path's other methods (those of ``served``) from none."""
    routes = [route for router in served for route in router.routes if isinstance(route, APIRoute)]
    router = APIRouter()

    def get_route(request: Request) -> tuple[APIRoute, Scope] | None:
        get_scope = {**request.scope, "method": "GET"}
        for route in routes:
            match, child_scope = route.matches(get_scope)
            if match == Match.FULL:
                return route, child_scope
        return None

    @router.api_route("/api/{rest:path}", methods=ANY_METHOD, include_in_schema=False)
    def no_such_route(request: Request) -> Response:
        if request.method == "HEAD" and (found := get_route(request)) is not None:
            return HeadOfGet(*found)
        allowed = {
            method
            for route in routes
            if route.matches(request.scope)[0] == Match.PARTIAL
            for method in route.methods or ()
        }
        if "GET" in allowed:
            allowed.add("HEAD")
        path = request.url.path
        if allowed:
            methods = ", ".join(sorted(allowed))
            detail = f"{request.method} is not served on {path}; use {methods}"
            return JSONResponse({"detail": detail}, status_code=405, headers={"Allow": methods})
        detail = f"no API route {request.method} {path} (names never contain '/'); the routes are at /docs"
        return JSONResponse({"detail": detail}, status_code=404)

    return router
