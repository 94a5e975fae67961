"""What the browser holds of an analysis: a handle of a few fields, never its summary.

A handle is written when the analysis is posted and rewritten by each poll: which request it answers
(`request`, the id that was posted or opened), the analysis that answers it (`id`: a sampled response's
request follows, once drawn, to the analysis of the concrete response), its status, progress and
stage, the kept share of a partial result, the error of a failed one, and the query of the controls
that asked for it (`query`: what the analysis is, for the banner and the share link, which must
describe what is drawn rather than what the controls now say). Its size does not depend on the
analysis, so no callback body grows with a long response. Pure functions, tested without a browser.

Off the policy the per-parameter rho needs the Fisher under p (d_model directions more per position),
which the API computes only when asked, so a first answer comes sooner. A finished analysis without it
gets a second stage (`rho`: the id, status, progress and error of the same request with rho): the first
analysis stays drawn, and neither greyed nor stale, while the poll follows the stage; once it is done
the handle moves to that analysis, a superset of the first, and everything redraws from it. A failed
stage leaves the first analysis drawn, its reason on the stage line.
"""

from __future__ import annotations

from typing import Any

from backend.vocabulary import CANCELLING
from frontend.summaries import View

Handle = dict[str, Any]
DONE, FAILED, RUNNING = "done", "failed", "running"
WANTED = "wanted"  # a rho stage not yet asked of the API
RHO_WORDS = "the Fisher under p (second stage)"
ERROR_SHOWN = 160  # characters of a failed rho stage's reason on the stage line


def handle_from(
    body: dict[str, Any],
    request_id: str | None,
    cached: bool = False,
    sample: dict[str, int] | None = None,
    query: str | None = None,
    wants_rho: bool = True,
) -> Handle:
    """The handle for one answer of the API (POST or GET: `AnalysisPublic`) to the request `request_id`.

    `cached`: the answer came straight from the POST, nothing computed; `sample`: the seed and length
    the response was drawn with (the concrete analysis's own request no longer says); `query`: the
    controls that asked for it, as a URL query (`frontend.state.to_query`); `wants_rho`: a finished
    analysis without rho gets a rho stage (the compare panel's B never draws rho: none).
    """
    status = body.get("status")
    partial = body.get("partial") if status == RUNNING else None
    kept_share = float(partial["kept_share"]) if partial else None
    if status == DONE:
        stage = "cached" if cached else "done"
    elif status == FAILED:
        stage = "failed"
    elif body.get("stage") == CANCELLING:
        stage = CANCELLING
    elif kept_share is not None:
        stage = f"partial: {kept_share:.0%} of the C_mu trace"
    else:
        stage = body.get("stage") or status or ""
    if status not in (DONE, FAILED) and stage != CANCELLING:
        stage += expected_words((body.get("cost") or {}).get("seconds"))
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
        "wants_rho": wants_rho,
        "rho": rho_entry(WANTED) if wants_rho and status == DONE and lacks_rho(body) else None,
    }


def expected_words(seconds: float | None) -> str:
    """' · about 1 min 35 s in all': the API's estimate of the whole analysis, at the slowest live
    worker's measured rate (nothing when the API gave none)."""
    if seconds is None:
        return ""
    whole = max(1, round(float(seconds)))
    minutes, rest = divmod(whole, 60)
    return f" · about {f'{minutes} min {rest} s' if minutes else f'{rest} s'} in all"


def is_cancellable(handle: Handle | None) -> bool:
    """Whether the page offers to cancel the analysis: it has an id, and is queued or running."""
    return bool(handle and handle.get("id") and handle.get("status") not in (DONE, FAILED))


def lacks_rho(body: dict[str, Any]) -> bool:
    """A finished analysis whose summary says rho was not computed (off the policy, not asked)."""
    result = body.get("result")
    return isinstance(result, dict) and result.get("rho_available") is False


def rho_entry(
    status: str, analysis_id: str | None = None, progress: float = 0.0, error: str | None = None
) -> dict[str, Any]:
    return {"id": analysis_id, "status": status, "progress": progress, "error": error}


def rho_pending(handle: Handle | None) -> bool:
    """A rho stage is to be asked for, or computing: the handle is not settled."""
    rho = handle.get("rho") if handle else None
    return rho is not None and rho["status"] not in (DONE, FAILED)


def rho_answered(handle: Handle, body: dict[str, Any]) -> Handle:
    """The handle after the API's answer about its rho stage: the POST of `/rho` (the stage's id not
    known yet) or a GET of the stage's analysis. An answer naming the handle's own analysis means it has
    rho already, or cannot have it: no stage. A finished stage moves the handle to its analysis."""
    rho = handle["rho"]
    if body.get("id") == handle["id"]:
        return {**handle, "progress": 1.0, "rho": None}
    status = body.get("status")
    if status == FAILED:
        return rho_failed(handle, body.get("error") or "no reason given")
    if status == DONE:
        # "cached" only where nothing was computed: the first analysis, nor the stage (the POST's answer)
        cached = handle.get("stage") == "cached" and rho["id"] is None
        return {
            **handle,
            "id": body["id"],
            "progress": 1.0,
            "stage": "cached" if cached else DONE,
            "rho": rho_entry(DONE, body["id"], 1.0),
        }
    progress = float(body.get("progress") or 0.0)
    return {**handle, "progress": progress, "rho": rho_entry(status or RUNNING, body["id"], progress)}


def rho_failed(handle: Handle, reason: str) -> Handle:
    """The rho stage failed: the first analysis stays drawn, the stage line says why."""
    return {**handle, "progress": 1.0, "rho": rho_entry(FAILED, handle["rho"]["id"], error=reason)}


def stage_line(handle: Handle) -> str:
    """The stage the page shows: the analysis's own, or its rho stage's while that is asked for, queued
    or computing, or why it failed."""
    rho = handle.get("rho")
    stage = handle.get("stage") or ""
    if not rho or rho["status"] == DONE:
        return stage
    if rho["status"] == FAILED:
        reason = rho["error"] or "no reason given"
        short = reason if len(reason) <= ERROR_SHOWN else reason[: ERROR_SHOWN - 1] + "…"
        return f"{stage}; rho failed, drawn without it: {short}"
    if rho["status"] == WANTED:
        return f"rho: asking for {RHO_WORDS}"
    if rho["status"] == RUNNING:
        return f"rho: computing {RHO_WORDS}, {rho['progress']:.0%}"
    return f"rho: {rho['status']}, {RHO_WORDS}"


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
    """Done or failed, and no rho stage to ask for or wait for: nothing more to poll for."""
    return not handle or (handle.get("status") in (DONE, FAILED) and not rho_pending(handle))


def progress_style(progress: float | None) -> dict[str, str]:
    """The progress bar's width for a progress in [0, 1] (clamped; missing counts as 0)."""
    return {"width": f"{100 * max(0.0, min(1.0, float(progress or 0.0))):.0f}%"}
