"""Who may drive the service: the hosts it answers to, the token on routes that cost, per-client limits.

Why three checks: a service on loopback is still reachable from a web page whose host name a DNS
rebinding points at 127.0.0.1 (the Host header gives it away: ``HostGuard``); a shared server must let
only its users start compute or write to disk (``require_token`` on those routes, reads of finished
results by id stay open, as share links need); and one client must not queue the others out
(``rate_limited``: a moving window per client address, in Redis when the service has one so every
API process counts together).
"""

from __future__ import annotations

import json
import math
import time
from typing import Any

from fastapi import HTTPException, Request
from limits import parse_many, storage, strategies

from backend.credentials import presented_token, token_matches
from backend.settings import Settings

TOKEN_HELP = "send `Authorization: Bearer <FISHERSCOPE_API_TOKEN>` (the operator of this server has it)"


def _host_name(host_header: str) -> str:
    """The host of a Host header, without port or IPv6 brackets, lower case."""
    host = host_header.strip().lower()
    if host.startswith("["):
        return host[1 : host.find("]")] if "]" in host else host
    return host.rsplit(":", 1)[0] if host.count(":") == 1 else host


def host_allowed(host_header: str | None, allowed: list[str]) -> bool:
    if "*" in allowed:
        return True
    return host_header is not None and _host_name(host_header) in allowed


class HostGuard:
    """ASGI middleware: 400 (JSON, saying what to set) for a Host header outside ``allowed``."""

    def __init__(self, app: Any, allowed: list[str]) -> None:
        self.app = app
        self.allowed = allowed

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or [])
        raw = headers.get(b"host")
        host = raw.decode("latin-1") if raw is not None else None
        if host_allowed(host, self.allowed):
            await self.app(scope, receive, send)
            return
        detail = (
            f"this server does not answer to the host {host!r}; its operator adds the name people use "
            "to FISHERSCOPE_ALLOWED_HOSTS"
        )
        body = json.dumps({"detail": detail}).encode()
        if scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1008})
            return
        head = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
        await send({"type": "http.response.start", "status": 400, "headers": head})
        await send({"type": "http.response.body", "body": body})


def _settings(request: Request) -> Settings:
    return request.app.state.service.settings


def require_token(request: Request) -> None:
    """401 unless the request carries the server's token; nothing to check when none is set."""
    token = _settings(request).api_token
    if token is None:
        return
    presented = presented_token(request.headers.get("authorization"))
    if not token_matches(presented, token.get_secret_value()):
        problem = "no API token" if presented is None else "a wrong API token"
        raise HTTPException(
            401,
            f"this route starts compute or writes to disk and the request has {problem}; {TOKEN_HELP}",
            headers={"WWW-Authenticate": 'Bearer realm="fisherscope"'},
        )


class RateLimiter:
    """The per-client limits of ``settings.rate_limit`` over the compute routes, one window for all."""

    def __init__(self, settings: Settings) -> None:
        self.limits = parse_many(settings.rate_limit)
        uri = settings.redis_url or "memory://"
        self.limiter = strategies.MovingWindowRateLimiter(storage.storage_from_string(uri))

    def retry_after_s(self, client: str) -> int | None:
        """None when ``client`` may go on (the hit is counted), else the seconds until it may."""
        for limit in self.limits:
            if not self.limiter.hit(limit, "fisherscope-compute", client):
                reset = self.limiter.get_window_stats(limit, "fisherscope-compute", client).reset_time
                return max(1, math.ceil(reset - time.time()))
        return None


def rate_limited(request: Request) -> None:
    """429 with Retry-After once a client is over a limit (its address; behind a trusted proxy, the
    forwarded one, which uvicorn puts in the scope)."""
    limiter: RateLimiter = request.app.state.rate_limiter
    client = request.client.host if request.client else "unknown"
    wait = limiter.retry_after_s(client)
    if wait is not None:
        raise HTTPException(
            429,
            f"too many requests that start compute from {client} (limit {_settings(request).rate_limit}); "
            f"retry in {wait} s",
            headers={"Retry-After": str(wait)},
        )
