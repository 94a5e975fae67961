"""The dashboard's only view of the HTTP API: every URL the frontend uses is built here.

Errors come back as `ApiError` with the API's own message (its 4xx `detail`), so the dashboard can show
what to fix instead of a stack trace. What the figures draw comes back as the API's own wire models
(`backend.summary`, `backend.schemas`), checked once here: an answer off the contract is an error with
the field named, not a KeyError deep in a figure. The server's API token, when it has one, stays in
this process: it is sent from here, never to a browser and never in a link.
"""

from __future__ import annotations

import os
from typing import Any, TypeVar
from urllib.parse import quote, urlencode

import flask
import httpx
from pydantic import BaseModel, ValidationError

from backend.schemas import ComparePublic, PartialResult, TensorView, TokenizeResponse, TokenPiece
from backend.summary import AnalysisOverview, PositionSummary

API_PREFIX = "/api/v1"
Answer = TypeVar("Answer", bound=BaseModel)


class ApiError(Exception):
    """A request the API refused or could not answer; `str()` is a sentence for the person.

    `status`: the HTTP status of a refusal (None when the API did not answer), so a caller can tell "not
    ready yet, ask again" (409) from "wrong" (4xx) without reading the sentence.
    """

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


def readable_detail(response: httpx.Response) -> str:
    """The API's error message: FastAPI's `detail` (a string, or a list of pydantic errors)."""
    try:
        body = response.json()
    except ValueError:
        return response.text[:300] or f"HTTP {response.status_code}"
    detail = body.get("detail", body) if isinstance(body, dict) else body
    if isinstance(detail, list):
        parts = []
        for item in detail:
            if isinstance(item, dict):
                where = ".".join(str(p) for p in item.get("loc", []) if p != "body")
                parts.append(f"{where}: {item.get('msg', item)}" if where else str(item.get("msg", item)))
            else:
                parts.append(str(item))
        return "; ".join(parts)
    return str(detail)


def parsed(model: type[Answer], body: bytes | dict[str, Any], what: str) -> Answer:
    """`body` as `model`: the one place an answer of the API becomes a typed object for the dashboard.
    An answer off the contract is an ApiError naming the field, so a callback shows a sentence."""
    try:
        if isinstance(body, dict):
            return model.model_validate(body)
        return model.model_validate_json(body)
    except ValidationError as error:
        problem = error.errors()[0]
        where = ".".join(str(part) for part in problem["loc"])
        more = f" (and {error.error_count() - 1} more)" if error.error_count() > 1 else ""
        raise ApiError(
            f"the API's {what} does not match the contract: {where}: {problem['msg']}{more}"
        ) from None


def partial_result(body: dict[str, Any]) -> PartialResult | None:
    """The result so far that a running analysis's answer carries (None when it carries none), checked
    once here: the figures draw it as the `AnalysisSummary` it is."""
    if body.get("status") != "running" or not body.get("partial"):
        return None
    return parsed(PartialResult, body["partial"], "partial result")


TOKEN_VARIABLE = "FISHERSCOPE_API_TOKEN"


def _forwarded_for() -> dict[str, str]:
    """The browser's address, inside a dashboard request: the API limits each person, not the
    dashboard (uvicorn takes X-Forwarded-For from a loopback peer, which the embedded dashboard is)."""
    if flask.has_request_context() and flask.request.remote_addr:
        return {"X-Forwarded-For": flask.request.remote_addr}
    return {}


class ApiClient:
    """Synchronous client for the fisherscope API at `base_url` (e.g. http://127.0.0.1:8000)."""

    def __init__(self, base_url: str, timeout_s: float = 30.0, token: str | None = None) -> None:
        self.base_url = base_url.rstrip("/")
        token = token if token is not None else os.environ.get(TOKEN_VARIABLE) or None
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.http = httpx.Client(base_url=self.base_url, timeout=timeout_s, headers=headers)

    def request(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        kwargs["headers"] = {**kwargs.get("headers", {}), **_forwarded_for()}
        try:
            response = self.http.request(method, API_PREFIX + path, **kwargs)
        except httpx.HTTPError as error:
            raise ApiError(f"the API at {self.base_url} did not answer ({type(error).__name__})") from error
        if response.status_code >= 400:
            raise ApiError(readable_detail(response), response.status_code)
        return response

    def submit(self, body: dict[str, Any]) -> dict[str, Any]:
        """POST an analysis: the finished analysis when cached (200), else {id, status, progress} (202)."""
        return self.request("POST", "/analyses", json=body).json()

    def rho(self, analysis_id: str) -> dict[str, Any]:
        """The same analysis with rho (off the policy the Fisher under p is computed only when asked):
        the analysis itself where it has rho, else the rho request's answer, as `submit` gives it."""
        return self.request("POST", f"/analyses/{quote(analysis_id, safe='')}/rho").json()

    def cancel(self, analysis_id: str) -> dict[str, Any]:
        """DELETE: a queued analysis fails as cancelled at once, a running one at its next chunk of work;
        the analysis's record as GET gives it (409, ``ApiError``, when it is already done)."""
        return self.request("DELETE", f"/analyses/{quote(analysis_id, safe='')}").json()

    def analysis(self, analysis_id: str) -> dict[str, Any]:
        """Status, progress, stage, request, while running the `partial` result so far (read it with
        `partial_result`) and when done the summary as `result` (the figures draw the overview instead)."""
        return self.request("GET", f"/analyses/{quote(analysis_id, safe='')}").json()

    def overview(self, analysis_id: str) -> AnalysisOverview:
        """A finished summary with only `positions[0]` whole, and `position_index` listing every position:
        what the slides draw, no larger for a long response than for a prefix."""
        response = self.request("GET", f"/analyses/{quote(analysis_id, safe='')}/overview")
        return parsed(AnalysisOverview, response.content, "overview")

    def position(self, analysis_id: str, index: int) -> PositionSummary:
        """One analysed position's whole summary (p and mu, spectrum, output layer, totals)."""
        response = self.request("GET", f"/analyses/{quote(analysis_id, safe='')}/positions/{int(index)}")
        return parsed(PositionSummary, response.content, f"position {int(index)}")

    def compare(self, a: str, b: str) -> ComparePublic:
        """Two finished analyses side by side: overlap and Jaccard of their top-q sets, per-tensor totals."""
        response = self.request("GET", "/compare", params={"a": a, "b": b})
        return parsed(ComparePublic, response.content, "compare")

    def pooled(self, analysis_id: str, tensor: str, stat: str, rows: int = 64, cols: int = 64) -> TensorView:
        """Block sums of one tensor's statistic (`view`), with `row_tokens`: the first token of each
        block of vocabulary rows, or None."""
        path = f"/analyses/{quote(analysis_id, safe='')}/tensors/{quote(tensor, safe='')}"
        response = self.request("GET", path, params={"stat": stat, "rows": rows, "cols": cols})
        return parsed(TensorView, response.content, f"view of {tensor}")

    def models(self) -> list[dict[str, Any]]:
        body = self.request("GET", "/models").json()
        return body["models"] if isinstance(body, dict) and "models" in body else body

    def tokenize(self, model: str, text: str) -> list[TokenPiece]:
        """How a text splits into tokens."""
        response = self.request("GET", "/tokenize", params={"model": model, "text": text})
        return parsed(TokenizeResponse, response.content, "tokenization").tokens

    def arrays_status(self, analysis_id: str, choice: dict[str, str] | None = None) -> dict[str, Any]:
        """Ask for the safetensors file without downloading it: {"ready": bool, "bytes": n | None, ...}.

        The first ask starts the export on the worker; the API answers 202 (JSON) until the file exists,
        then streams it; the stream is closed unread here, the browser downloads it from `arrays_url`.
        """
        path = API_PREFIX + f"/analyses/{quote(analysis_id, safe='')}/safetensors"
        try:
            with self.http.stream("GET", path, params=choice or {}, headers=_forwarded_for()) as response:
                if response.status_code >= 400:
                    response.read()
                    raise ApiError(readable_detail(response))
                if response.status_code == 200:
                    size = response.headers.get("content-length")
                    return {"ready": True, "bytes": int(size) if size and size.isdigit() else None}
                response.read()
                body = response.json()
        except httpx.HTTPError as error:
            raise ApiError(f"the API at {self.base_url} did not answer ({type(error).__name__})") from error
        return {"ready": False, "bytes": None, "status": body.get("status"), "stage": body.get("stage")}

    def arrays_url(self, analysis_id: str, choice: dict[str, str] | None = None) -> str:
        """Where the browser downloads the chosen per-parameter arrays (safetensors; 202 JSON until
        written); ``choice`` is the query (`stats`, `dtype`, `tensors`), so each choice is its own link."""
        query = f"?{urlencode(choice)}" if choice else ""
        return f"{self.base_url}{API_PREFIX}/analyses/{quote(analysis_id, safe='')}/safetensors{query}"
