"""The study page's tables and number panels: pure functions of a finished study's typed summary.

Why tables beside the figures: a reader quotes numbers (an overlap, a relative error), so every number
a figure draws is also written out, in the same format the figures' hovers use.
"""

from __future__ import annotations

import unicodedata
from collections.abc import Sequence
from typing import Any

from dash import html

from backend.study_schemas import StudyMaskComparison
from backend.study_summary import Estimators, MaskAtDensity, ResponseRecord, StudySummary, TopSetComparison
from frontend.numbers import percent
from frontend.studies.figures import ESTIMATOR_NAMES, estimator
from frontend.studies.form import density_label

TENSOR_COLUMNS = (  # key, heading, how a cell reads
    ("name", "tensor"),
    ("size", "parameters"),
    ("count", "in the mask"),
    ("share_of_mask", "share of the mask"),
    ("density", "density in the tensor"),
    ("enrichment", "density / q"),
)
MAX_RESPONSES = 256  # rows of the responses table (and bars of its figure); the summary holds them all
DEFAULT_SORT = {"column": "count", "descending": True}


def pct(value: float | None) -> str:
    """A fraction as a percent with 3 significant figures (``frontend.numbers.percent``), "—" for none."""
    return "—" if value is None else percent(value, 3)


def num(value: float | None) -> str:
    """A Fisher total or a ratio: 4 significant digits, whole numbers with thousands separators from
    1,000 on (23,250 rather than 2.325e+04)."""
    if value is None:
        return "—"
    if 1e3 <= abs(value) < 1e12:
        return f"{value:,.0f}"
    return f"{value:.4g}"


def visible(text: str) -> str:
    """A decoded response as it can be read: newlines, tabs and control characters spelt out."""
    out = []
    for char in text:
        if char == "\n":
            out.append("⏎")
        elif char == "\t":
            out.append("⇥")
        elif unicodedata.category(char) in ("Cc", "Cf"):
            out.append(f"\\x{ord(char):02x}" if ord(char) < 256 else f"\\u{ord(char):04x}")
        else:
            out.append(char)
    return "".join(out)


def table(
    headings: Sequence[Any], rows: Sequence[Sequence[Any]], id: str, class_name: str = ""
) -> html.Table:
    return html.Table(
        [html.Thead(html.Tr([html.Th(h) for h in headings])), html.Tbody([html.Tr(list(r)) for r in rows])],
        id=id,
        className=f"study-table {class_name}".strip(),
    )


def prompt_cell(index: int, texts: Sequence[str | None], links: Sequence[str | None] = ()) -> html.Td:
    text = texts[index] if index < len(texts) else None
    link = links[index] if index < len(links) else None
    opens = [html.A("open in dashboard", href=link, className="prompt-link", target="_blank")] if link else []
    return html.Td(
        [html.Span(f"P{index + 1}", className="prompt-number"), f" {text} " if text else "", *opens],
        className="prompt-cell",
    )


def prompts_table(
    summary: StudySummary, texts: Sequence[str | None], links: Sequence[str | None] = ()
) -> html.Table:
    """Per prompt: its target, tokens, rewards, its responses' Fisher, and F under model and uniform;
    ``links`` open each prompt's own analysis in the dashboard."""
    rows = []
    for p in summary.prompts:
        compared = p.compared
        ratio = compared["model"] / compared["uniform"] if compared.get("uniform") else None
        rewards = p.rewards
        rows.append(
            [
                prompt_cell(p.prompt_index, texts, links),
                html.Td(html.Span(visible(p.target), className="text") if p.target else "—"),
                html.Td(p.n_tokens, className="n"),
                html.Td("—" if rewards is None else ", ".join(f"{r:g}" for r in rewards), className="n"),
                html.Td(num(p.totals["fisher"]), className="n"),
                html.Td(num(compared.get("model")), className="n"),
                html.Td(num(compared.get("uniform")), className="n"),
                html.Td(num(ratio), className="n"),
            ]
        )
    headings = [
        "prompt",
        "target",
        "tokens",
        "rewards",
        "F of its responses (sum)",
        "F at the prompt: model",
        "uniform",
        "model / uniform",
    ]
    return table(headings, rows, "prompts-table")


def responses_table(responses: list[ResponseRecord], texts: Sequence[str | None]) -> html.Table | html.Div:
    """The sampled responses (the first MAX_RESPONSES): text, length, reward, Fisher total (sum over its
    positions)."""
    shown_responses = responses[:MAX_RESPONSES]
    off_policy = any(abs(r.totals["uncentered"] - r.totals["fisher"]) > 1e-9 for r in shown_responses)
    rows = []
    for r in shown_responses:
        cells = [
            prompt_cell(r.prompt_index, texts),
            html.Td(f"R{r.response_index + 1}", className="n"),
            html.Td(html.Span(visible(r.text), className="text", title=f"token ids {r.continuation_ids}")),
            html.Td(len(r.continuation_ids), className="n"),
            html.Td("—" if r.reward is None else f"{r.reward:g}", className="n"),
            html.Td(num(r.totals["fisher"]), className="n fisher-total"),
        ]
        if off_policy:
            cells.append(html.Td(num(r.totals["uncentered"]), className="n"))
        rows.append(cells)
    headings = ["prompt", "response", "text (decoded)", "tokens", "reward", "F (sum over positions)"]
    shown = table(headings + (["U (uncentered)"] if off_policy else []), rows, "responses-table")
    if len(responses) <= MAX_RESPONSES:
        return shown
    more = f"the first {MAX_RESPONSES} of {len(responses)} responses; all are in the API's summary"
    return html.Div([shown, html.Div(more, className="control-hint")])


def tensor_rows(shares: MaskAtDensity, q: float, sort: dict[str, Any]) -> list[dict[str, Any]]:
    rows = [{**row.model_dump(), "enrichment": row.density / q} for row in shares.tensors]
    asked = str(sort.get("column"))
    column = asked if asked in dict(TENSOR_COLUMNS) else str(DEFAULT_SORT["column"])
    return sorted(rows, key=lambda row: row[column], reverse=bool(sort.get("descending", True)))


def tensor_table(shares: MaskAtDensity, q: float, sort: dict[str, Any]) -> html.Table:
    """The mask per tensor, sortable by any column (a click on a heading sorts; a second reverses)."""
    column = sort.get("column", DEFAULT_SORT["column"])
    arrow = " ▼" if sort.get("descending", True) else " ▲"
    headings = [
        html.Button(
            heading + (arrow if key == column else ""),
            id={"type": "tensor-sort", "column": key},
            className="sort-button",
            title=f"sort by {heading}",
        )
        for key, heading in TENSOR_COLUMNS
    ]
    rows = [
        [
            html.Td(row["name"], className="tensor-name"),
            html.Td(f"{row['size']:,}", className="n"),
            html.Td(f"{row['count']:,}", className="n"),
            html.Td(pct(row["share_of_mask"]), className="n"),
            html.Td(pct(row["density"]), className="n"),
            html.Td(f"{row['enrichment']:.3g}×", className="n"),
        ]
        for row in tensor_rows(shares, q, sort)
    ]
    return table(headings, rows, "tensor-table", "sortable")


def estimator_table(estimators: Estimators, on_policy: bool) -> html.Table:
    """MC and empirical Fisher against the exact F: relative L2 error, top-q overlap and Jaccard (each
    beside chance); and the two estimators' sets against each other."""
    entries = {key: estimator(estimators, key) for key in ESTIMATOR_NAMES}
    fractions: list[float] = next(
        (e.top_q_vs_fisher.q for e in entries.values() if e.available and e.top_q_vs_fisher), []
    )
    rows = []
    for key, name in ESTIMATOR_NAMES.items():
        entry = entries[key]
        if not entry.available or entry.top_q_vs_fisher is None:
            reason = entry.reason or "not computed"
            rows.append([html.Td(name), html.Td(f"not available: {reason}", colSpan=3 + len(fractions))])
            continue
        unit = "responses" if key == "mc_fisher" else "targets"
        cells = [html.Td(name, title=entry.definition), html.Td(f"{entry.count} {unit}", className="n")]
        cells.append(html.Td(num(entry.relative_l2_vs_fisher), className="n rel-l2"))
        if not on_policy:
            cells.append(html.Td(num(entry.relative_l2_vs_uncentered), className="n"))
        cells += overlap_cells(entry.top_q_vs_fisher)
        rows.append(cells)
    between = estimators.mc_vs_empirical
    if between:
        blank = [html.Td("—", className="n")] * (1 if on_policy else 2)
        rows.append(
            [html.Td("Monte Carlo vs empirical"), html.Td("", className="n"), *blank, *overlap_cells(between)]
        )
    headings = ["estimator", "from", "relative L2 error vs F"]
    headings += [] if on_policy else ["vs U (off policy)"]
    headings += [f"top {density_label(q)} sets" for q in fractions]
    return table(headings, rows, "estimator-table")


def overlap_cells(compared: TopSetComparison) -> list[html.Td]:
    """Per density: 'overlap (chance) · Jaccard (chance)'."""
    return [
        html.Td(
            [
                html.Span(pct(o), className="overlap"),
                html.Span(f" overlap (chance {pct(co)})", className="chance"),
                html.Br(),
                html.Span(pct(j), className="jaccard"),
                html.Span(f" Jaccard (chance {pct(cj)})", className="chance"),
            ],
            className="n",
        )
        for o, co, j, cj in zip(
            compared.overlap, compared.chance_overlap, compared.jaccard, compared.chance_jaccard, strict=True
        )
    ]


def comparison_table(compared: StudyMaskComparison, a: str, b: str) -> html.Table:
    """Two studies' masks per density: overlap and Jaccard beside chance, and how many times chance."""
    rows = [
        [
            html.Td(density_label(q), className="n"),
            html.Td(pct(o), className="n compare-overlap"),
            html.Td(pct(co), className="n chance"),
            html.Td(f"{o / co:.3g}×" if co else "—", className="n"),
            html.Td(pct(j), className="n compare-jaccard"),
            html.Td(pct(cj), className="n chance"),
        ]
        for q, o, co, j, cj in zip(
            compared.q,
            compared.overlap,
            compared.chance_overlap,
            compared.jaccard,
            compared.chance_jaccard,
            strict=True,
        )
    ]
    headings = ["mask q", f"overlap of {a[:8]}… with {b[:8]}…", "chance", "× chance", "Jaccard", "chance"]
    return table(headings, rows, "compare-table")
