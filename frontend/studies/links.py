"""Where a study's prompt opens in the single-prefix dashboard: its URL, written by `frontend.state`.

Why through the dashboard's own URL writer: the dashboard's URL is its whole state, so the link states
the study's model, sampler and method as the dashboard reads them, and nothing here repeats its format.
"""

from __future__ import annotations

from typing import Any

from frontend.state import DashboardState, to_query

DASHBOARD_PATH = "/"


def dashboard_link(request: dict[str, Any], prompt: str | None) -> str | None:
    """The dashboard's analysis of ``prompt`` as a prefix under the study's model and sampler."""
    if not prompt:
        return None
    sampler = request.get("sampler") or {}
    state = DashboardState(
        model=request["model"],
        prefix=prompt,
        temperature=float(sampler.get("temperature", 1.0)),
        top_k=sampler.get("top_k"),
        top_p=float(sampler.get("top_p", 1.0)),
        engine=sampler.get("engine") or "model",
        sampler=sampler.get("kind") or "model",
        method=request.get("method") or "exact",
    )
    return DASHBOARD_PATH + to_query(state)
