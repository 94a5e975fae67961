"""The service's answers other than 2xx that are not about the request's content (those are
``normalize.RequestError``): shared by the analysis and study services."""

from __future__ import annotations


class ServiceError(Exception):
    """An answer other than 2xx that is not about the request's content (404, 409, 503)."""

    def __init__(self, status: int, detail: str) -> None:
        super().__init__(detail)
        self.status = status
        self.detail = detail
