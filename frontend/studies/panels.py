"""The study's headline panels: what was run, its progress, and the paper's statistics on this model.

Why the paper's numbers are labelled at every turn: the statistics are the paper's (top-1% Fisher vs
top-1% |policy gradient| overlap; total Fisher under the model over under the uniform sampler), but the
values are this model's, on these prompts, responses and sampler; the paper's own values are quoted
beside them as what they are, never as a target this page reproduces.
"""

from __future__ import annotations

from typing import Any

from dash import html

from backend.study_summary import StudySummary
from frontend.studies.tables import num, pct

RUNNING_NOTE = (
    "Each prompt is one job, run by whichever worker is free (one at a time in `fisherscope serve`); "
    "the results appear here when every prompt is done. Closing the page does not stop the study: "
    "its link (the address bar) opens it later."
)


STAGES = {"sampling": "sampling", "fisher": "exact Fisher", "scores": "scores (MC, empirical, gradient)"}


def duration(seconds: float) -> str:
    return f"{seconds:.1f} s" if seconds < 120 else f"{seconds / 60:.1f} min"


def describe_request(summary: StudySummary) -> str:
    """One line: model, prompts x K responses of at most L tokens, sampler, method, reward."""
    spec, counts, model = summary.spec, summary.counts, summary.model
    sampler = spec.sampler
    parts = [f"T = {sampler.temperature:g}"]
    if sampler.top_k:
        parts.append(f"top-k {sampler.top_k}")
    if sampler.top_p < 1.0:
        parts.append(f"top-p {sampler.top_p:g}")
    if sampler.engine != "model":
        parts.append(f"{sampler.engine} engine")
    on_policy = "on policy" if sampler.on_policy else "off policy"
    reward = spec.reward
    if reward is None:
        rewarded = "no reward"
    elif reward.kind == "regex":
        rewarded = (
            f"reward: 1 where the regex {reward.pattern} matches the response ({{target}} = the target)"
        )
    else:
        rewarded = "reward: 1 where the response equals the target"
    return (
        f"{model.id} ({model.n_params:,} parameters) · {counts.prompts} prompts × K = "
        f"{spec.samples} responses of at most L = {spec.max_tokens} tokens, seed {spec.seed} · "
        f"sampler {sampler.kind} ({', '.join(parts)}; {on_policy}) · method {spec.method} · {rewarded}"
    )


def overview(summary: StudySummary, masks_url: str) -> list[Any]:
    """The finished study's request, totals, time, and the masks download."""
    counts, totals, timing = summary.counts, summary.totals, summary.timing
    spent = ", ".join(f"{STAGES.get(stage, stage)} {duration(s)}" for stage, s in timing.items())
    return [
        html.Div(describe_request(summary), className="request-line"),
        html.Div(
            [
                "Total Fisher F = ",
                html.B(num(totals.fisher), id="total-fisher"),
                f" per response: the sum over its positions and all {counts.n_params:,} parameters, "
                f"averaged over the {counts.responses} responses ({counts.positions} positions, "
                f"{counts.distinct_contexts} distinct contexts)"
                + (f" · time spent: {spent}." if spent else "."),
            ],
            className="totals-line",
        ),
        html.Div(
            [
                html.A(
                    "Download the masks (safetensors)",
                    href=masks_url,
                    id="masks-link",
                    className="download",
                    download="",
                ),
                html.Span(
                    " one uint8 tensor per parameter for each density, named q<q>/<parameter name>; 1 = in "
                    "the mask (the top q of all coordinates by F: train it), 0 = freeze it",
                    className="control-hint",
                ),
            ]
        ),
    ]


def progress_panel(status: dict[str, Any] | None) -> list[Any]:
    """While a study runs: a bar per prompt (status, stage, progress); a failure's reason."""
    if not status:
        return []
    state = status.get("status")
    head = f"Study {status['id'][:12]}… {state}"
    if state in ("queued", "running"):
        done = sum(1 for p in status["parts"] if p["status"] == "done")
        head += f": {done} of {len(status['parts'])} prompts done"
    children: list[Any] = [html.Div(head, id="study-state", className=f"study-state state-{state}")]
    if status.get("error"):
        children.append(html.Div(status["error"], className="message-line"))
    if state != "done":
        children.append(html.Div([part_bar(part) for part in status["parts"]], className="parts"))
    if state in ("queued", "running"):
        children.append(html.Div(RUNNING_NOTE, className="control-hint"))
    return children


def part_bar(part: dict[str, Any]) -> html.Div:
    progress = float(part.get("progress") or 0.0)
    stage = part.get("stage") or part.get("status")
    label = f"P{part['prompt_index'] + 1}: {part['status']}" + (
        f" · {stage}" if stage != part["status"] else ""
    )
    return html.Div(
        [
            html.Span(label, className="part-label"),
            html.Div(
                html.Div(className="part-fill", style={"width": f"{100 * progress:.0f}%"}),
                className="part-track",
            ),
            html.Span(f"{100 * progress:.0f}%", className="part-percent"),
        ],
        className=f"part part-{part['status']}",
        title=part.get("error") or "",
    )


def paper_panel(summary: StudySummary) -> list[Any]:
    """The paper's two statistics, as this model's values."""
    paper, model = summary.paper, summary.model.id
    labelled = paper.fisher_vs_policy_gradient or paper.model_vs_uniform
    label = labelled.label if labelled else None
    return [
        html.P(
            f"Same statistics as the paper, computed on THIS model ({model}) with these prompts, responses "
            "and sampler: this model's values, not a reproduction of the paper's.",
            className="paper-label",
            title=label or "",
        ),
        html.Div([gradient_card(summary), uniform_card(summary)], className="cards"),
    ]


def card(title: str, value: str, value_id: str, lines: list[Any]) -> html.Div:
    return html.Div(
        [html.H4(title), html.Div(value, id=value_id, className="card-value"), *[html.P(x) for x in lines]],
        className="card",
    )


def gradient_card(summary: StudySummary) -> html.Div:
    title = "Top 1% by Fisher vs top 1% by |policy gradient|"
    stat = summary.paper.fisher_vs_policy_gradient
    if stat is None:
        return card(
            title,
            "—",
            "paper-overlap",
            ["This study has no reward: choose exact or regex (every prompt with a target) to compute it."],
        )
    n = summary.counts.prompts
    lines: list[Any] = [
        f"mean reward {num(stat.mean_reward)}; {stat.prompts_with_reward_variance} of {n} prompts "
        "have responses that differ in reward (only those contribute to the gradient)."
    ]
    if stat.overlap is None:
        lines.insert(0, f"Not defined here: {stat.reason or 'no gradient'}.")
        value = "—"
    else:
        value = pct(stat.overlap)
        lines.insert(
            0,
            f"overlap of the two top-1% sets, this model; chance {pct(stat.chance_overlap)}; Jaccard "
            f"{pct(stat.jaccard)} (chance {pct(stat.chance_jaccard)}).",
        )
    lines.append(
        html.Span(f"The paper: {stat.paper_value} (another model and setup).", className="paper-value")
    )
    return card(title, value, "paper-overlap", lines)


def uniform_card(summary: StudySummary) -> html.Div:
    title = "Total Fisher under the model / under the uniform sampler"
    stat = summary.paper.model_vs_uniform
    if stat is None:
        return card(title, "—", "paper-ratio", ["Not computed for this study."])
    lines: list[Any] = [
        f"F under the model {num(stat.fisher_model)}, under the uniform sampler "
        f"{num(stat.fisher_uniform)}, summed at the {summary.counts.prompts} prompts (the first "
        "position of their responses), this model."
    ]
    if not summary.spec.sampler.on_policy:
        lines.append(
            f"Under this study's sampler / uniform: {num(stat.ratio_sampler_to_uniform)} "
            f"(F = {num(stat.fisher_sampler)})."
        )
    lines.append(
        html.Span(f"The paper: {stat.paper_value} (another model and setup).", className="paper-value")
    )
    return card(title, num(stat.ratio_model_to_uniform), "paper-ratio", lines)
