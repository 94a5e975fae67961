"""The study page's comparison with a fine-tuned checkpoint: POST /api/v1/updates with the study's model as
the start, poll it, and draw where the run changed the weights beside where the mask lands."""

from __future__ import annotations

from typing import Any

import dash
from dash import Input, Output, State
from dash.exceptions import PreventUpdate

from backend.schemas import JobStatus
from backend.update_schemas import UpdatesPublic
from frontend.api_client import ApiError
from frontend.numbers import percent
from frontend.studies.client import StudyClient
from frontend.studies.figures import updates_groups_figure
from frontend.studies.form import density_label
from frontend.studies.results import PAPER_Q, finished

HIDDEN, SHOWN = {"display": "none"}, {"display": "block"}
SETTLED = (JobStatus.done.value, JobStatus.failed.value)


def register_updates(app: dash.Dash, client: StudyClient) -> None:
    @app.callback(
        Output("updates-after", "options"),
        Input("status", "data"),
    )
    def offer_checkpoints(status: dict[str, Any] | None):
        """Every other model of the server: a checkpoint trained from this study's model is one of them."""
        found = finished(client, status)
        if found is None:
            raise PreventUpdate
        start = found[0].request.model
        try:
            models = client.models()
        except ApiError:
            return []
        return [{"label": m["id"], "value": m["id"]} for m in models if m["id"] != start]

    @app.callback(
        Output("updates-job", "data"),
        Output("updates-poll", "disabled"),
        Input("updates-run", "n_clicks"),
        Input("updates-poll", "n_intervals"),
        State("updates-after", "value"),
        State("updates-job", "data"),
        State("status", "data"),
        prevent_initial_call=True,
    )
    def run_or_poll(clicks: int, ticks: int, after: str | None, job: dict | None, status: dict | None):
        found = finished(client, status)
        if found is None:
            raise PreventUpdate
        try:
            if dash.ctx.triggered_id == "updates-run":
                if not after:
                    return {"status": "failed", "error": "choose the fine-tuned checkpoint first"}, True
                public = client.submit_updates(found[0].request.model, after, found[0].id)
            elif job and job.get("id"):
                public = client.updates(job["id"])
            else:
                raise PreventUpdate
        except ApiError as error:
            return {"status": "failed", "error": str(error)}, True
        settled = public.status.value in SETTLED
        return {"id": public.id, "status": public.status.value, "error": public.error}, settled

    @app.callback(
        Output("updates-caption", "children"),
        Output("updates-layers", "figure"),
        Output("updates-kinds", "figure"),
        Output("updates-layers", "style"),
        Output("updates-kinds", "style"),
        Input("updates-job", "data"),
        Input("view-q", "value"),
        State("status", "data"),
    )
    def draw_updates(job: dict | None, view_q: str | None, status: dict | None):
        found = finished(client, status)
        if found is None or not job:
            raise PreventUpdate
        if job.get("status") == JobStatus.failed.value:
            return f"The comparison failed: {job.get('error')}", {}, {}, HIDDEN, HIDDEN
        if job.get("status") != JobStatus.done.value:
            return f"Comparing the two checkpoints ({job.get('status')})…", {}, {}, HIDDEN, HIDDEN
        try:
            public = client.updates(job["id"])
        except ApiError as error:
            return f"The comparison cannot be read: {error}", {}, {}, HIDDEN, HIDDEN
        summary = found[1]
        key = view_q if view_q in summary.masks.by_q else (PAPER_Q if PAPER_Q in summary.masks.by_q else None)
        if public.summary is None or key is None:
            raise PreventUpdate
        shares = summary.masks.by_q[key]
        n_params = summary.counts.n_params
        return (
            caption(public, shares.q),
            updates_groups_figure(public.summary.layers, shares.layers, n_params, shares.q, "layer"),
            updates_groups_figure(public.summary.kinds, shares.kinds, n_params, shares.q, "module kind"),
            SHOWN,
            SHOWN,
        )


def caption(public: UpdatesPublic, q: float) -> str:
    """The run's totals, and its top-q |delta| set inside the top-q mask beside chance."""
    summary = public.summary
    assert summary is not None
    total = summary.total
    text = (
        f"{public.request.after} against {public.request.before}: {percent(total.changed_share, 3)} of the "
        f"{total.params:,} parameters changed, {percent(total.changed_bf16_share, 3)} visibly in bf16."
    )
    masks = summary.masks
    if masks is None or q not in masks.q:
        return text
    column = masks.q.index(q)
    top = next((row for row in masks.sets if row.set == f"top {q:g} |delta|"), None)
    if top is not None:
        inside, chance = percent(top.overlap[column], 3), percent(top.chance_overlap[column], 3)
        text += (
            f" Of the run's top {density_label(q)} updates by |delta|, {inside} lie inside the "
            f"top-{density_label(q)} Fisher mask (chance: {chance})."
        )
    return text
