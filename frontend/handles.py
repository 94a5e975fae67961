"""What the browser holds of an analysis: a handle of a few fields, never its summary.

A handle is written when the analysis is posted and rewritten by each poll: which request it answers
(`request`, the id that was posted or opened), the analysis that answers it (`id`: a sampled response's
request follows, once drawn, to the analysis of the concrete response), its status, progress and
stage, the kept share of a partial result, the error of a failed one, and the query of the controls
that asked for it (`query`: what the analysis is, for the banner and the share link, which must
describe what is drawn rather than what the controls now say). Its size does not depend on the
analysis, so no callback body grows with a long response. Pure functions, tested without a browser.
"""

from __future__ import annotations

from typing import Any

from frontend.summaries import View

Handle = dict[str, Any]
DONE, FAILED, RUNNING = "done", "failed", "running"


def handle_from(
    body: dict[str, Any],
    request_id: str | None,
    cached: bool = False,
    sample: dict[str, int] | None = None,
    query: str | None = None,
) -> Handle:
    """The handle for one answer of the API (POST or GET: `AnalysisPublic`) to the request `request_id`.

    `cached`: the answer came straight from the POST, nothing computed; `sample`: the seed and length
    the response was drawn with (the concrete analysis's own request no longer says); `query`: the
    controls that asked for it, as a URL query (`frontend.state.to_query`).
    """
    status = body.get("status")
    partial = body.get("partial") if status == RUNNING else None
    kept_share = float(partial["kept_share"]) if partial else None
    if status == DONE:
        stage = "cached" if cached else "done"
    elif status == FAILED:
        stage = "failed"
    elif kept_share is not None:
        stage = f"partial: {kept_share:.0%} of the C_mu trace"
    else:
        stage = body.get("stage") or status or ""
    return {
        "request": request_id,
        "id": body["id"],
        "status": status,
        "progress": 1.0 if status == DONE else float(body.get("progress") or 0.0),
        "stage": stage,
        "kept_share": kept_share,
        "error": (body.get("error") or "no reason given") if status == FAILED else None,
        "sample": sample,
        "query": query,
    }


def refused(error: str, query: str | None = None) -> Handle:
    """The handle of a request the API refused before any analysis existed: failed, with no id."""
    return handle_from({"id": None, "status": FAILED, "error": error}, None, query=query)


def view_of(handle: Handle | None) -> View | None:
    """What there is to draw for a handle: the finished analysis, or its partial result; else None."""
    if not handle:
        return None
    if handle.get("status") == DONE:
        return {"id": handle["id"], "kept_share": None, "query": handle.get("query")}
    if handle.get("kept_share") is not None:
        return {"id": handle["id"], "kept_share": handle["kept_share"], "query": handle.get("query")}
    return None


def is_stale(handle: Handle | None, view: View | None) -> bool:
    """The drawing is of an earlier analysis than the one asked for: a new one is computing (nothing
    of it drawn yet), or the last one failed. A partial result of the current one is not stale."""
    if not handle or not view:
        return False
    return handle.get("status") == FAILED or handle.get("id") != view["id"]


def is_settled(handle: Handle | None) -> bool:
    """Done or failed: nothing more to poll for."""
    return not handle or handle.get("status") in (DONE, FAILED)


def progress_style(progress: float | None) -> dict[str, str]:
    """The progress bar's width for a progress in [0, 1] (clamped; missing counts as 0)."""
    return {"width": f"{100 * max(0.0, min(1.0, float(progress or 0.0))):.0f}%"}
