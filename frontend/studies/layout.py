"""The study page: the form on the left; the study's progress, then its results, on the right.

Only components and their ids live here; what they do is in `frontend.studies.callbacks`. The stores
hold a study's id and status (a few fields per prompt), never its summary.
"""

from __future__ import annotations

from typing import Any

from dash import dcc, html

from frontend.studies.form import DEFAULTS, ENGINES, PROMPT_SYNTAX, REWARDS, SAMPLER_KINDS
from frontend.studies.tables import DEFAULT_SORT

GRAPH_CONFIG: dcc.Graph.Config = {"displaylogo": False, "toImageButtonOptions": {"format": "png", "scale": 2}}
POLL_MS = 700
RECENT_POLL_MS = 5000  # the recent-studies list: statuses change over seconds, not frames
HEATMAP_NOTE = (
    "Inside one parameter: the share of each block's coordinates that the mask holds (rows are outputs, "
    "columns inputs; a vector is one row). A random mask would colour every block q."
)
UPDATES_NOTE = (
    "A checkpoint trained from this study's model (register it with fisherscope models add): where the "
    "run changed the weights, visibly in bf16, per layer and module kind beside where the mask lands "
    "and where a random set would (the group's share of all parameters); and how much of the run's "
    "largest updates lies inside the mask, beside chance."
)
COMPARE_NOTE = (
    "Paste another study's id or share link (same model): the overlap |A ∩ B| / |A| and Jaccard |A ∩ B| / "
    "|A ∪ B| of the two Fisher masks at every density both cut, beside chance (q and q / (2 - q)). Two "
    "samplers, two prompt sets, or K and L against more of them."
)


def labelled(label: str, component: Any, hint: str | None = None) -> html.Div:
    children = [html.Label(label, className="control-label"), component]
    if hint:
        children.append(html.Div(hint, className="control-hint"))
    return html.Div(children, className="control")


def number(id: str, **options: Any) -> dcc.Input:
    return dcc.Input(id=id, type="number", value=DEFAULTS[id], className="num-input", **options)


def page() -> html.Div:
    return html.Div(
        [
            dcc.Location(id="url"),
            dcc.Location(id="url-out", refresh=False),
            dcc.Store(id="restored", data=False),
            dcc.Store(id="study"),  # {"id", "asked"}: the study on the page, and when it was asked for
            dcc.Store(id="status"),  # `client.status_of`: status and parts, no summary
            dcc.Store(id="tensor-sort", data=DEFAULT_SORT),
            dcc.Store(id="link-tensor"),  # the parameter a link names, drawn once its study is
            dcc.Interval(id="poll", interval=POLL_MS, disabled=True),
            html.Div(
                [
                    html.H1("fisherscope · studies"),
                    html.Span(
                        "the exact Fisher over a prompt set, its masks, and the estimators people use",
                        className="tagline",
                    ),
                    html.A("single-prefix dashboard", href="/", className="header-link"),
                ],
                className="header",
            ),
            html.Div(id="message", className="message"),
            html.Div(
                [form(), html.Div([html.Div(id="progress"), results()], className="content")],
                className="main",
            ),
        ]
    )


def form() -> html.Div:
    return html.Div(
        [
            labelled(
                "Name",
                dcc.Input(
                    id="name", type="text", value=DEFAULTS["name"], className="text-input", maxLength=120
                ),
                "optional: a label to find the study again in the list below",
            ),
            labelled(
                "Model",
                dcc.Dropdown(
                    id="model", options=[DEFAULTS["model"]], value=DEFAULTS["model"], clearable=False
                ),
            ),
            labelled(
                "Prompts",
                dcc.Textarea(
                    id="prompts", value=DEFAULTS["prompts"], className="prompts-input", spellCheck=False
                ),
                PROMPT_SYNTAX,
            ),
            *_sampling_controls(),
            *_reward_controls(),
            html.Button("Run", id="run", n_clicks=0, className="run-button"),
            html.H3("Recent studies"),
            html.Div(id="recent-studies", className="recent-studies"),
            dcc.Interval(id="recent-poll", interval=RECENT_POLL_MS),
        ],
        className="controls",
    )


def _sampling_controls() -> list[Any]:
    """How the responses are drawn: K, L, the seed, the sampler and the method."""
    return [
        html.Div(
            [
                labelled("K responses", number("samples", min=1, max=64, step=1)),
                labelled("L max tokens", number("max_tokens", min=1, max=256, step=1)),
                labelled("seed", number("seed", min=0, step=1)),
            ],
            className="row",
        ),
        labelled(
            "Sampler",
            dcc.RadioItems(id="sampler", options=list(SAMPLER_KINDS), value=DEFAULTS["sampler"], inline=True),
        ),
        html.Div(
            [
                labelled("temperature", number("temperature", min=0, step=0.1)),
                labelled("top-k", number("top_k", min=1, step=1, placeholder="off")),
                labelled("top-p", number("top_p", min=0, max=1, step=0.05)),
            ],
            className="row",
        ),
        labelled(
            "engine",
            dcc.RadioItems(id="engine", options=list(ENGINES), value=DEFAULTS["engine"], inline=True),
        ),
        labelled(
            "Method",
            dcc.Input(id="method", type="text", value=DEFAULTS["method"], className="text-input"),
            "exact | truncated:F (the top F of the mass, exactly) | mc:S (S sampled directions)",
        ),
    ]


def _reward_controls() -> list[Any]:
    """The reward over responses and the mask densities."""
    return [
        labelled(
            "Reward",
            dcc.RadioItems(id="reward", options=list(REWARDS), value=DEFAULTS["reward"], inline=True),
            "1 or 0 per response: exact = equals the target; regex = the pattern matches the response",
        ),
        labelled(
            "Regex pattern",
            dcc.Input(id="pattern", type="text", value=DEFAULTS["pattern"], className="text-input"),
            "{target} stands for the prompt's target (escaped, outer spaces stripped)",
        ),
        labelled(
            "Mask densities (%)",
            dcc.Input(id="densities", type="text", value=DEFAULTS["densities"], className="text-input"),
            "the top q of all parameters by F; 1 = the top 1% (the paper's 1% is always computed)",
        ),
    ]


def section(title: str, children: list[Any], id: str) -> html.Div:
    return html.Div([html.H3(title), *children], id=id, className="section")


def results() -> html.Div:
    """Everything a finished study shows; hidden until one is done."""
    share = html.Div(
        [
            html.Label("Share link", className="control-label"),
            dcc.Input(id="share-link", type="text", readOnly=True, className="share-link"),
        ],
        className="share",
    )
    return html.Div(
        [
            html.Div(id="overview", className="section overview"),
            share,
            _responses_section(),
            _masks_section(),
            _compare_section(),
            _updates_section(),
            _estimators_section(),
            section("The paper's statistics, on this model", [html.Div(id="paper-section")], "paper"),
        ],
        id="results",
        style={"display": "none"},
    )


def _responses_section() -> html.Div:
    children = [
        dcc.Graph(id="response-figure", config=GRAPH_CONFIG),
        html.Div(id="prompts-section", className="scroll"),
        html.Div(id="responses-section", className="scroll"),
    ]
    return section("Responses", children, "responses")


def _masks_section() -> html.Div:
    density = html.Div(
        [
            html.Span("mask density q: ", className="control-label inline"),
            dcc.RadioItems(id="view-q", options=[], inline=True),
        ],
        className="row view-q",
    )
    groups = html.Div(
        [
            dcc.Graph(id="layers-figure", config=GRAPH_CONFIG),
            dcc.Graph(id="kinds-figure", config=GRAPH_CONFIG),
        ],
        className="grid-2",
    )
    children = [
        density,
        groups,
        html.Div(id="mask-caption", className="control-hint"),
        html.Div(id="tensor-section", className="scroll tall"),
        labelled(
            "Mask inside one parameter",
            dcc.Dropdown(id="mask-tensor", options=[], clearable=False),
            HEATMAP_NOTE,
        ),
        dcc.Graph(id="mask-heatmap", config=GRAPH_CONFIG),
    ]
    return section("Where the mask lands", children, "masks")


def _compare_section() -> html.Div:
    other = dcc.Input(
        id="compare-id",
        type="text",
        debounce=True,
        placeholder="a study id or a share link",
        className="text-input",
    )
    children = [labelled("Other study", other, COMPARE_NOTE), html.Div(id="compare-section")]
    return section("Compare with another study's masks", children, "compare")


def _updates_section() -> html.Div:
    choose = html.Div(
        [
            dcc.Dropdown(
                id="updates-after", options=[], placeholder="a fine-tuned checkpoint", className="grow"
            ),
            html.Button("Compare", id="updates-run", n_clicks=0),
        ],
        className="row",
    )
    groups = html.Div(
        [
            dcc.Graph(id="updates-layers", config=GRAPH_CONFIG, style={"display": "none"}),
            dcc.Graph(id="updates-kinds", config=GRAPH_CONFIG, style={"display": "none"}),
        ],
        className="grid-2",
    )
    children = [
        labelled("Fine-tuned checkpoint", choose, UPDATES_NOTE),
        dcc.Store(id="updates-job"),  # {"id", "status", "error"} of the comparison on the page
        dcc.Interval(id="updates-poll", interval=POLL_MS, disabled=True),
        html.Div(id="updates-caption", className="control-hint"),
        groups,
    ]
    return section("Compare with a fine-tuned checkpoint", children, "updates")


def _estimators_section() -> html.Div:
    figure = html.Div(
        [dcc.Graph(id="estimator-figure", config=GRAPH_CONFIG), html.Div(id="estimator-notes")],
        className="grid-2",
    )
    children = [figure, html.Div(id="estimator-section", className="scroll")]
    return section("Estimators against the exact Fisher", children, "estimators")
