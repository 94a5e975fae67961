"""ASGI guard on request bodies: size, UTF-8 and JSON nesting depth, checked before parsing.

Why: Python's JSON parser recurses, so a deeply nested body would raise RecursionError inside the
framework (a 500) instead of a 400 that says what is wrong.
"""

from __future__ import annotations

import json
from typing import Any

MAX_BODY_BYTES = 256 * 1024
MAX_DEPTH = 32


def body_problem(body: bytes) -> tuple[int, str] | None:
    """(status, message) when the body must be refused before JSON parsing, else None."""
    if len(body) > MAX_BODY_BYTES:
        return 413, f"request body is over {MAX_BODY_BYTES} bytes; send a smaller JSON object"
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as error:
        return 400, f"request body is not valid UTF-8 (byte {error.start}); send UTF-8 JSON"
    depth = 0
    in_string = escaped = False
    for char in text:
        if in_string:
            if escaped:
                escaped = False
            elif char == "\\":
                escaped = True
            elif char == '"':
                in_string = False
        elif char == '"':
            in_string = True
        elif char in "[{":
            depth += 1
            if depth > MAX_DEPTH:
                return 400, f"JSON is nested more than {MAX_DEPTH} levels deep; send a flat request"
        elif char in "]}":
            depth -= 1
    return None


class BodyGuard:
    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["method"] not in ("POST", "PUT", "PATCH"):
            await self.app(scope, receive, send)
            return
        chunks: list[bytes] = []
        size = 0
        more = True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size <= MAX_BODY_BYTES:
                chunks.append(chunk)
            more = message.get("more_body", False)
        body = b"".join(chunks) if size <= MAX_BODY_BYTES else b"\0" * (MAX_BODY_BYTES + 1)
        problem = body_problem(body)
        if problem is not None:
            await _send_json(send, problem[0], {"detail": problem[1]})
            return
        replayed = False

        async def replay() -> dict:
            nonlocal replayed
            if replayed:
                return await receive()
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}

        await self.app(scope, replay, send)


async def _send_json(send: Any, status: int, payload: dict) -> None:
    data = json.dumps(payload).encode("utf-8")
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": data})
