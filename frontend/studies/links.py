"""Where a study's prompt opens in the single-prefix dashboard: its URL, written by `frontend.state`.

Why through the dashboard's own URL writer: the dashboard's URL is its whole state, so the link states
the study's model, sampler and method as the dashboard reads them, and nothing here repeats its format.
"""

from __future__ import annotations

from backend.study_schemas import StudyJob
from frontend.state import DashboardState, to_query

DASHBOARD_PATH = "/"


def dashboard_link(request: StudyJob, prompt: str | None) -> str | None:
    """The dashboard's analysis of ``prompt`` as a prefix under the study's model and sampler."""
    if not prompt:
        return None
    sampler = request.sampler
    state = DashboardState(
        model=request.model,
        prefix=prompt,
        temperature=sampler.temperature,
        top_k=sampler.top_k,
        top_p=sampler.top_p,
        engine=sampler.engine.value,
        sampler=sampler.kind.value,
        method=str(request.method),
    )
    return DASHBOARD_PATH + to_query(state)
