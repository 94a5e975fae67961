"""The Dash app: one instance, every callback registered on it with `@app.callback`.

The URL query string is the whole state (frontend.state); the API is reached only through
`frontend.api_client`; figures and slides are pure functions of the summary JSON, so the centering toggle
and slide steps never ask the API for anything.
"""

from __future__ import annotations

import time
from dataclasses import asdict
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

import dash
from dash import ALL, Input, Output, State, ctx, html
from dash.exceptions import PreventUpdate

from frontend import figures, layout
from frontend.api_client import ApiClient, ApiError
from frontend.slides import SLIDES
from frontend.state import (
    N_SLIDES,
    DashboardState,
    format_reward,
    parse_query,
    parse_reward,
    to_query,
    to_request,
)

CONTROL_IDS = [
    "model",
    "prefix",
    "continuation",
    "temperature",
    "top_k",
    "top_p",
    "engine",
    "sampler",
    "data_token",
    "reward",
    "method",
    "centering",
]
ASSETS = Path(__file__).parent / "assets"


def state_from_controls(values: list[Any], slide: int) -> tuple[DashboardState, list[str]]:
    """Validate the controls by writing them as a query and parsing it: one validation path for both."""
    raw = dict(zip(CONTROL_IDS, values, strict=True))
    reward = raw.pop("reward") or ""
    query_state = {key: "" if value is None else str(value) for key, value in raw.items()}
    query = urlencode({**query_state, "reward": reward, "slide": str(slide or 1)})
    return parse_query(query)


def controls_from_state(state: DashboardState) -> list[Any]:
    values = asdict(state)
    values["reward"] = format_reward(state.reward)
    return [values[key] for key in CONTROL_IDS]


def model_ids(api: ApiClient) -> list[str]:
    """The model ids the API serves (the default alone when the API cannot say)."""
    try:
        return [model["id"] for model in api.models() if model.get("available", True)]
    except (ApiError, KeyError, TypeError):
        return [DashboardState().model]


def message_block(errors: list[str]) -> list[Any]:
    return [html.Div(error) for error in errors]


def create_dash_app(
    api_base_url: str, requests_pathname_prefix: str = "/", public_api_url: str | None = None
) -> dash.Dash:
    """The dashboard, calling the API at `api_base_url`; browsers download from `public_api_url`."""
    api = ApiClient(api_base_url)
    public = ApiClient(public_api_url) if public_api_url else api
    app = dash.Dash(
        __name__,
        requests_pathname_prefix=requests_pathname_prefix,
        assets_folder=str(ASSETS),
        title="fisherscope",
        suppress_callback_exceptions=True,
    )
    app.layout = layout.page()
    register_state_callbacks(app, api)
    register_run_callbacks(app, api)
    register_view_callbacks(app, api, public)
    return app


def register_state_callbacks(app: dash.Dash, api: ApiClient) -> None:
    """URL -> controls on load; controls -> URL on every change; token chips; candidate clicks."""

    @app.callback(
        [Output(key, "value") for key in CONTROL_IDS]
        + [Output("slide", "data"), Output("message", "children"), Output("autorun", "data")]
        + [Output("model", "options"), Output("restored", "data")],
        Input("url", "pathname"),
        State("url", "search"),
        State("restored", "data"),
    )
    def restore(_pathname: str, search: str | None, restored: bool | None):
        if restored:
            raise PreventUpdate  # Location re-fires on every URL write; the URL is read once per page load
        state, errors = parse_query(search or "")
        models = model_ids(api)
        if state.model not in models:
            errors.append(f"model {state.model!r} is not served here; choose one of {', '.join(models)}")
        autorun = time.time() if state.prefix and not errors else None
        return [*controls_from_state(state), state.slide, message_block(errors), autorun, models, True]

    @app.callback(
        Output("url-out", "search"),
        [Input(key, "value") for key in CONTROL_IDS],
        Input("slide", "data"),
        prevent_initial_call=True,
    )
    def write_url(*values):
        state, errors = state_from_controls(list(values[:-1]), values[-1])
        if errors:
            raise PreventUpdate
        return to_query(state)

    app.clientside_callback(
        "function(search) { return window.location.origin + window.location.pathname + (search || ''); }",
        Output("share-link", "value"),
        Input("url-out", "search"),
    )

    @app.callback(Output("token-chips", "children"), Input("prefix", "value"), Input("model", "value"))
    def token_chips(prefix: str | None, model: str | None):
        if not prefix or not model:
            return []
        try:
            tokens = api.tokenize(model, prefix)
        except ApiError as error:
            return [html.Span(str(error), className="chip-error")]
        return [
            html.Span(figures.token_label(token["text"]), title=f"id {token['id']}", className="chip")
            for token in tokens
        ]

    @app.callback(
        Output("reward", "value", allow_duplicate=True),
        Input({"type": "candidate", "token": ALL}, "n_clicks"),
        State("reward", "value"),
        prevent_initial_call=True,
    )
    def toggle_reward(clicks: list[int | None], reward_text: str | None):
        if not ctx.triggered_id or not any(clicks):
            raise PreventUpdate
        token = ctx.triggered_id["token"]
        reward, _ = parse_reward(reward_text or "")
        if token in reward:
            del reward[token]
        else:
            reward[token] = 1.0
        return format_reward(reward)


def register_run_callbacks(app: dash.Dash, api: ApiClient) -> None:
    """Run posts the analysis; a cached one arrives at once, otherwise the status is polled."""

    @app.callback(
        Output("analysis-id", "data"),
        Output("summary", "data"),
        Output("poll", "disabled"),
        Output("message", "children", allow_duplicate=True),
        Output("progress-bar", "style"),
        Output("progress-stage", "children"),
        Input("run", "n_clicks"),
        Input("autorun", "data"),
        [State(key, "value") for key in CONTROL_IDS],
        State("slide", "data"),
        prevent_initial_call=True,
    )
    def submit(_clicks, autorun, *values):
        if ctx.triggered_id == "autorun" and not autorun:
            raise PreventUpdate  # a link without a prefix, or with a bad value, does not run anything
        state, errors = state_from_controls(list(values[:-1]), values[-1])
        if not state.prefix:
            errors.append("type a prefix, e.g. 'She drank a cup of'")
        if errors:
            return dash.no_update, dash.no_update, True, message_block(errors), dash.no_update, ""
        try:
            body = api.submit(to_request(state))
        except ApiError as error:
            return dash.no_update, dash.no_update, True, [html.Div(str(error))], {"width": "0%"}, ""
        if body.get("status") == "done" and body.get("result"):
            return body["id"], body["result"], True, [], {"width": "100%"}, "cached"
        return body["id"], dash.no_update, False, [], progress_style(body.get("progress", 0.0)), "queued"

    @app.callback(
        Output("summary", "data", allow_duplicate=True),
        Output("poll", "disabled", allow_duplicate=True),
        Output("message", "children", allow_duplicate=True),
        Output("progress-bar", "style", allow_duplicate=True),
        Output("progress-stage", "children", allow_duplicate=True),
        Input("poll", "n_intervals"),
        State("analysis-id", "data"),
        prevent_initial_call=True,
    )
    def poll(_n: int, analysis_id: str | None):
        if not analysis_id:
            raise PreventUpdate
        try:
            body = api.analysis(analysis_id)
        except ApiError as error:
            return dash.no_update, True, [html.Div(str(error))], dash.no_update, ""
        status = body.get("status")
        if status == "done":
            return body["result"], True, [], progress_style(1.0), "done"
        if status == "failed":
            return (
                dash.no_update,
                True,
                [html.Div(f"the analysis failed: {body.get('error', 'no reason given')}")],
                progress_style(0.0),
                "failed",
            )
        stage = body.get("stage") or status or ""
        return dash.no_update, False, dash.no_update, progress_style(body.get("progress", 0.0)), stage


def progress_style(progress: float) -> dict[str, str]:
    return {"width": f"{100 * max(0.0, min(1.0, float(progress or 0.0))):.0f}%"}


def register_view_callbacks(app: dash.Dash, api: ApiClient, public: ApiClient) -> None:
    """Slides, explorer and exports: all drawn from the summary already in the browser."""

    # Stepping runs in the browser, so held arrow keys never wait for a server round trip.
    app.clientside_callback(
        """function(prev, next, slide) {
            const trigger = (dash_clientside.callback_context.triggered[0] || {}).prop_id || "";
            const step = trigger.startsWith("prev-slide") ? -1 : 1;
            return Math.min(N_SLIDES, Math.max(1, (slide || 1) + step));
        }""".replace("N_SLIDES", str(N_SLIDES)),
        Output("slide", "data", allow_duplicate=True),
        Input("prev-slide", "n_clicks"),
        Input("next-slide", "n_clicks"),
        State("slide", "data"),
        prevent_initial_call=True,
    )

    @app.callback(
        Output("slide-counter", "children"),
        Output("slide-title", "children"),
        Output("slide-claim", "children"),
        Output("slide-formula", "children"),
        Output("slide-graph", "figure"),
        Output("slide-reading", "children"),
        Input("summary", "data"),
        Input("slide", "data"),
        Input("centering", "value"),
    )
    def render_slide(summary: dict | None, slide: int | None, centering: str | None):
        module = SLIDES[max(1, min(N_SLIDES, slide or 1)) - 1]
        centering = centering or "on"
        counter = f"{slide or 1} / {N_SLIDES}"
        if not summary:
            return (
                counter,
                module.TITLE,
                module.CLAIM,
                module.FORMULA,
                figures.message_figure("Type a prefix and press Run."),
                "",
            )
        return (
            counter,
            module.TITLE,
            module.CLAIM,
            module.FORMULA,
            module.figure(summary, centering),
            module.reading(summary, centering),
        )

    @app.callback(
        Output("layer-graph", "figure"),
        Output("kind-graph", "figure"),
        Output("top-coordinates", "children"),
        Output("response-graph", "figure"),
        Output("candidate-chips", "children"),
        Output("explorer-position", "options"),
        Output("explorer-position", "value"),
        Input("summary", "data"),
        Input("centering", "value"),
        State("explorer-position", "value"),
    )
    def render_explorer(summary: dict | None, centering: str | None, position: int | None):
        if not summary:
            empty = figures.message_figure("No analysis yet.")
            return empty, empty, [], empty, [], [], 0
        centering = centering or "on"
        positions = position_options(summary)
        keep = position if isinstance(position, int) and 0 <= position < len(positions) else 0
        return (
            figures.layer_mass(summary, centering),
            figures.kind_mass(summary, centering),
            top_coordinates_table(summary, figures.stat_for_centering(centering)),
            figures.response_view(summary, centering),
            candidate_chips(summary),
            positions,
            keep,
        )

    @app.callback(
        Output("next-token-graph", "figure"),
        Output("spectrum-graph", "figure"),
        Input("summary", "data"),
        Input("explorer-position", "value"),
    )
    def render_position(summary: dict | None, position: int | None):
        if not summary:
            empty = figures.message_figure("No analysis yet.")
            return empty, empty
        index = position if isinstance(position, int) and 0 <= position < len(summary["positions"]) else 0
        return figures.next_token(summary, index), figures.spectrum(summary, index)

    @app.callback(
        Output("heatmap-tensor", "options"),
        Output("heatmap-tensor", "value"),
        Output("heatmap-scope", "children"),
        Input("summary", "data"),
        Input("layer-graph", "clickData"),
        Input("slide-graph", "clickData"),
        State("centering", "value"),
    )
    def choose_matrix(summary: dict | None, layer_click: dict | None, slide_click: dict | None, centering):
        if not summary:
            return [], None, ""
        stat = figures.stat_for_centering(centering or "on")
        everything = [tensor["name"] for tensor in summary["tensors"]]
        if ctx.triggered_id == "layer-graph" and layer_click:
            layer = str(layer_click["points"][0]["customdata"][0])
            names = figures.tensors_of_layer(summary, layer, stat)
            scope = f"layer {figures.layer_label(int(layer) if layer.isdigit() else layer)}: "
            count = "1 tensor" if len(names) == 1 else f"{len(names)} tensors, largest {stat} first"
            return names, names[0] if names else None, scope + count
        if ctx.triggered_id == "slide-graph" and slide_click:
            name = slide_click["points"][0].get("customdata")
            if isinstance(name, str) and name in everything:
                layer = next(str(t["layer"]) for t in summary["tensors"] if t["name"] == name)
                names = figures.tensors_of_layer(summary, layer, stat)
                return names, name, f"opened from slide 3: {name}"
        largest = max(summary["tensors"], key=lambda tensor: tensor["totals"].get(stat, 0.0))["name"]
        return everything, largest, f"all {len(everything)} tensors; opened: the largest {stat}, {largest}"

    @app.callback(
        Output("heatmap-graph", "figure"),
        Input("heatmap-tensor", "value"),
        Input("centering", "value"),
        State("analysis-id", "data"),
    )
    def render_heatmap(tensor: str | None, centering: str | None, analysis_id: str | None):
        if not tensor or not analysis_id:
            return figures.message_figure("Pick a matrix, or click a layer bar, to see where its mass sits.")
        stat = figures.stat_for_centering(centering or "on")
        try:
            return figures.heatmap(api.pooled(analysis_id, tensor, stat), tensor, stat)
        except ApiError as error:
            return figures.message_figure(str(error))

    @app.callback(
        Output("csv-download", "data"),
        Input("csv-button", "n_clicks"),
        State("summary", "data"),
        prevent_initial_call=True,
    )
    def export_csv(_clicks: int, summary: dict | None):
        if not summary:
            raise PreventUpdate
        return {"content": figures.tensor_totals_csv(summary), "filename": "fisherscope_tensor_totals.csv"}

    @app.callback(
        Output("arrays-status", "children"),
        Output("arrays-link", "href"),
        Output("arrays-link", "style"),
        Output("arrays-poll", "disabled"),
        Output("arrays-started", "data"),
        Input("arrays-prepare", "n_clicks"),
        Input("arrays-poll", "n_intervals"),
        Input("analysis-id", "data"),
        State("arrays-started", "data"),
        State("summary", "data"),
    )
    def prepare_arrays(_clicks, _ticks, analysis_id: str | None, started: float | None, summary: dict | None):
        hidden = {"display": "none"}
        if ctx.triggered_id in (None, "analysis-id") or not analysis_id:
            return "", "", hidden, True, None
        if not summary:
            return "run an analysis first", "", hidden, True, None
        started = started or time.time()
        try:
            answer = api.arrays_status(analysis_id)
        except ApiError as error:
            return f"could not prepare the arrays: {error}", "", hidden, True, None
        if answer["ready"]:
            size = f" ({answer['bytes'] / 1e6:.1f} MB)" if answer.get("bytes") else ""
            return f"ready{size}", public.arrays_url(analysis_id), {}, True, None
        return f"preparing the arrays… {time.time() - started:.0f} s", "", hidden, False, started


def position_options(summary: dict) -> list[dict[str, Any]]:
    """One option per analysed position: the prefix's next token, then each response token."""
    continuation = summary["tokens"].get("continuation") or []
    options = []
    for index, position in enumerate(summary["positions"]):
        target = position.get("target") or (continuation[index] if index < len(continuation) else None)
        what = f"predicting {figures.token_label(target['text'])}" if target else "the next token"
        options.append(
            {"label": f"{index + 1}: after {position['context_length']} tokens, {what}", "value": index}
        )
    return options


def candidate_chips(summary: dict) -> list[Any]:
    """The likeliest next tokens as buttons that toggle their reward; `#id` where the text is ambiguous."""
    top = summary["positions"][0]["p"]["top"][:12]
    labels = figures.unique_token_labels(top)
    chips = []
    for token, label in zip(top, labels, strict=True):
        key = token["text"] if label == figures.token_label(token["text"]) else f"#{token['id']}"
        chips.append(
            html.Button(
                label,
                id={"type": "candidate", "token": key},
                className="chip candidate",
                title=f"p = {token['p']:.3g}: click to reward",
            )
        )
    return chips


def top_coordinates_table(summary: dict, stat: str, limit: int = 15) -> html.Table | html.Div:
    """The largest single coordinates of the toggle's statistic, with their share of the model total."""
    rows = summary["top_coordinates"].get(stat, [])[:limit]
    # the engine lists only non-zero coordinates: an empty list with a zero total means all are zero
    if not any(row["value"] for row in rows) and not summary["totals"].get(stat):
        return html.Div(f"the {figures.STAT_LABEL.get(stat, stat)} is 0 at every coordinate here")
    if not rows:
        return html.Div(f"no top coordinates stored for {stat}")
    total = summary["totals"].get(stat) or 0.0
    header = html.Tr(
        [html.Th("tensor"), html.Th("index [row, col]"), html.Th(stat), html.Th("share of total")]
    )
    body = [
        html.Tr(
            [
                html.Td(row["tensor"]),
                html.Td(str(row["index"])),
                html.Td(f"{row['value']:.4g}"),
                html.Td(f"{100 * row['value'] / total:.2g}%" if total > 0 else "–"),
            ]
        )
        for row in rows
    ]
    return html.Table([header, *body], className="top-table")
