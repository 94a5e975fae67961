"""How a request presents the server's API token, read and written once for the API and the dashboard.

Why a module of its own, free of FastAPI: the API (``backend.access``) checks the token on the routes
that compute, and the dashboard's server (``frontend.server_guard``) checks the same token when a
browser opens it; both accept it as a Bearer token or as the password of HTTP Basic (what a browser
sends after its prompt), and compare in constant time.
"""

from __future__ import annotations

import base64
import binascii
import hmac


def presented_token(authorization: str | None) -> str | None:
    """The token of a Bearer header, or the password of a Basic one (what a browser sends)."""
    if not authorization:
        return None
    scheme, _, value = authorization.partition(" ")
    if scheme.lower() == "bearer":
        return value.strip()
    if scheme.lower() == "basic":
        try:
            decoded = base64.b64decode(value.strip(), validate=True).decode("utf-8")
        except (binascii.Error, UnicodeDecodeError):
            return None
        return decoded.partition(":")[2]
    return None


def token_matches(presented: str | None, expected: str) -> bool:
    return presented is not None and hmac.compare_digest(presented.encode(), expected.encode())


def basic_header(token: str, user: str = "fisherscope") -> str:
    """The Authorization header a browser sends after the prompt (for clients and tests)."""
    return "Basic " + base64.b64encode(f"{user}:{token}".encode()).decode()
