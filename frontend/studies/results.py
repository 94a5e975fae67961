"""Drawing a finished study: responses, where the mask lands, the estimators, the paper's statistics.

Why from the status only: the browser's `status` store says which study is done; the summary is read by
id from this process (`StudyClient`, one GET per finished study), so redrawing for another mask density
or another sort order asks the API nothing.
"""

from __future__ import annotations

from typing import Any

import dash
from dash import ALL, Input, Output, State, ctx, html
from dash.exceptions import PreventUpdate

from backend.study_schemas import StudyPublic
from backend.study_summary import Estimators, StudySummary
from frontend.api_client import ApiError
from frontend.plots import message_figure
from frontend.studies.client import StudyClient
from frontend.studies.figures import (
    ESTIMATOR_NAMES,
    estimator,
    estimator_overlap_figure,
    mask_groups_figure,
    mask_heatmap_figure,
    response_fisher_figure,
)
from frontend.studies.form import density_label, parse_prompts, study_id_in
from frontend.studies.links import dashboard_link
from frontend.studies.panels import overview, paper_panel
from frontend.studies.tables import (
    DEFAULT_SORT,
    MAX_RESPONSES,
    comparison_table,
    estimator_table,
    num,
    prompts_table,
    responses_table,
    tensor_table,
)

PROMPTS_NOTE = (
    "Per prompt: F of its K responses (summed); and F at the prompt (its responses' first position) under "
    "the model's p and under the uniform sampler, whose ratio summed over the prompts is the paper's "
    "model-vs-uniform statistic below. Prompt text is the form's, shown where it tokenizes to the study's."
)
HIDDEN, SHOWN = {"display": "none"}, {"display": "block"}
HEATMAP_ROWS, HEATMAP_COLS = 96, 96  # blocks of a mask heatmap at most
PAPER_Q = "0.01"
DRAWN = [
    "overview",
    "response-figure",
    "prompts-section",
    "responses-section",
    "estimator-figure",
    "estimator-notes",
    "estimator-section",
    "paper-section",
]
DRAWN_PROPS = {"response-figure": "figure", "estimator-figure": "figure"}


def register(app: dash.Dash, client: StudyClient) -> None:
    register_study(app, client)
    register_masks(app, client)
    register_heatmap(app, client)
    register_compare(app, client)
    register_sort(app)


def finished(client: StudyClient, status: dict[str, Any] | None) -> tuple[StudyPublic, StudySummary] | None:
    """The finished study the status names and its summary, or None while it is not done (or no longer
    readable)."""
    if not status or status.get("status") != "done":
        return None
    try:
        return client.finished(status["id"])
    except ApiError:
        return None


def register_study(app: dash.Dash, client: StudyClient) -> None:
    @app.callback(
        Output("results", "style"),
        [Output(key, DRAWN_PROPS.get(key, "children")) for key in DRAWN],
        Output("view-q", "options"),
        Output("view-q", "value", allow_duplicate=True),
        Output("mask-tensor", "options"),
        Output("mask-tensor", "value"),
        Input("status", "data"),
        State("prompts", "value"),
        State("view-q", "value"),
        State("mask-tensor", "value"),
        State("link-tensor", "data"),
        prevent_initial_call=True,
    )
    def draw_study(
        status: dict[str, Any] | None,
        prompts: str | None,
        view_q: str | None,
        tensor: str | None,
        link_tensor: str | None,
    ):
        found = finished(client, status)
        if found is None:
            return [HIDDEN] + [dash.no_update] * (len(DRAWN) + 4)
        study, summary = found
        texts = client.prompt_texts(study, parse_prompts(prompts or "")[0])
        rewarded = summary.spec.reward is not None
        on_policy = summary.spec.sampler.on_policy
        keys = list(summary.masks.by_q)
        options = [{"label": density_label(float(key)), "value": key} for key in keys]
        chosen = view_q if view_q in keys else (PAPER_Q if PAPER_Q in keys else keys[0])
        tensors = summary.masks.by_q[chosen].tensors
        names = [row.name for row in tensors]
        densest = max(tensors, key=lambda row: row.count).name if tensors else None
        drawn = next((name for name in (tensor, link_tensor) if name in names), densest)
        return [
            SHOWN,
            overview(summary, client.masks_url(study.id)),
            response_fisher_figure(summary.responses[:MAX_RESPONSES], rewarded),
            [
                prompts_table(summary, texts, [dashboard_link(study.request, text) for text in texts]),
                html.Div(PROMPTS_NOTE, className="control-hint"),
            ],
            responses_table(summary.responses, texts),
            estimator_overlap_figure(summary.estimators),
            estimator_notes(summary.estimators),
            estimator_table(summary.estimators, on_policy),
            paper_panel(summary),
            options,
            chosen,
            names,
            drawn,
        ]


def estimator_notes(estimators: Estimators) -> list[Any]:
    """What the estimators are and how they are scored."""
    notes: list[Any] = [
        html.P(
            "Relative L2 error = ||F_est - F|| / ||F|| over all parameters, each an average over the "
            "study's responses (the empirical Fisher over the prompts' targets). Overlap = |A ∩ B| / |A| "
            "of the top-q sets; unrelated sets of density q overlap by q (chance), Jaccard by q / (2 - q)."
        )
    ]
    for key, name in ESTIMATOR_NAMES.items():
        definition = estimator(estimators, key).definition
        if definition:
            notes.append(html.P([html.B(name), ": ", definition.split(": ", 1)[-1]]))
    return notes


def register_masks(app: dash.Dash, client: StudyClient) -> None:
    @app.callback(
        Output("layers-figure", "figure"),
        Output("kinds-figure", "figure"),
        Output("mask-caption", "children"),
        Output("tensor-section", "children"),
        Input("view-q", "value"),
        Input("tensor-sort", "data"),
        Input("status", "data"),
    )
    def draw_masks(view_q: str | None, sort: dict[str, Any] | None, status: dict[str, Any] | None):
        found = finished(client, status)
        if found is None or not view_q or view_q not in found[1].masks.by_q:
            raise PreventUpdate
        summary = found[1]
        shares = summary.masks.by_q[view_q]
        q, n_params = shares.q, summary.counts.n_params
        caption = (
            f"The top {density_label(q)} mask holds {shares.count:,} of the {n_params:,} coordinates (F ≥ "
            f"{num(shares.threshold)}). Red: its share per group; grey: the group's share of all "
            "parameters, where a random mask of the same density would put it. Per tensor below: a column "
            "heading sorts; density / q above 1 means the mask is denser there than overall."
        )
        return (
            mask_groups_figure(shares.layers, n_params, q, "layer"),
            mask_groups_figure(shares.kinds, n_params, q, "module kind"),
            caption,
            tensor_table(shares, q, sort or DEFAULT_SORT),
        )


def register_heatmap(app: dash.Dash, client: StudyClient) -> None:
    @app.callback(
        Output("mask-heatmap", "figure"),
        Input("mask-tensor", "value"),
        Input("view-q", "value"),
        Input("status", "data"),
    )
    def draw_heatmap(tensor: str | None, view_q: str | None, status: dict[str, Any] | None):
        found = finished(client, status)
        if found is None or not tensor or not view_q:
            raise PreventUpdate
        try:
            view = client.mask_view(found[0].id, tensor, float(view_q), HEATMAP_ROWS, HEATMAP_COLS)
        except ApiError as error:
            return message_figure(f"The mask of {tensor} cannot be drawn: {error}")
        return mask_heatmap_figure(view)


def register_compare(app: dash.Dash, client: StudyClient) -> None:
    @app.callback(
        Output("compare-section", "children"),
        Input("compare-id", "value"),
        Input("status", "data"),
    )
    def draw_comparison(text: str | None, status: dict[str, Any] | None):
        found = finished(client, status)
        if found is None:
            raise PreventUpdate
        study_id = found[0].id
        if not (text or "").strip():
            return []
        other = study_id_in(text)
        if other is None:
            return html.Div(
                "That is neither a study id (64 hex characters) nor a share link naming one.",
                className="message",
            )
        try:
            compared = client.compare(study_id, other)
        except ApiError as error:
            return html.Div(f"These two studies cannot be compared: {error}", className="message")
        return [
            comparison_table(compared, study_id, other),
            html.Div(
                f"Both of {compared.model}; the masks are cut at the densities both studies chose.",
                className="control-hint",
            ),
        ]


def register_sort(app: dash.Dash) -> None:
    @app.callback(
        Output("tensor-sort", "data"),
        Input({"type": "tensor-sort", "column": ALL}, "n_clicks"),
        State("tensor-sort", "data"),
        prevent_initial_call=True,
    )
    def sort_by(clicks: list[int | None], sort: dict[str, Any] | None):
        if not isinstance(ctx.triggered_id, dict) or not any(clicks):
            raise PreventUpdate
        column = ctx.triggered_id["column"]
        sort = sort or DEFAULT_SORT
        if sort.get("column") == column:
            return {"column": column, "descending": not sort.get("descending", True)}
        return {"column": column, "descending": column != "name"}
