"""Slide 6, Part 2 section 1: in the output layer a row learns only if the sampler hesitates."""

from __future__ import annotations

from frontend import figures
from frontend.slides.common import Summary, first_position, pct, quoted

TITLE = "6. Output layer: a row learns only if the sampler hesitates"
CLAIM = (
    "In the output layer the Fisher is exactly sparse: row c gets a gradient only if the sampler is "
    "unsure about token c."
)
FORMULA = (
    r"$$f_{(c,k)}=h_k^2\,\mu(c)\big(1-\mu(c)\big),\qquad "
    r"\sum_{c,k}f_{(c,k)}=\|h\|^2\Big(1-\sum_c\mu(c)^2\Big)$$"
)


def figure(summary: Summary, centering: str):
    return figures.output_rows(summary)


def reading(summary: Summary, centering: str) -> str:
    output = first_position(summary)["output_layer"]
    rows = sorted(output["rows"], key=lambda row: -row["share"])
    top_two = rows[:2]
    names = " and ".join(quoted(row["text"]) for row in top_two)
    outside = next((b for b in output["concentration_bound"] if b["top_tokens"] == 20), None)
    sentence = (
        f"The rows of {names} hold {pct(sum(row['share'] for row in top_two))} of the output-layer "
        f"Fisher (total ‖h‖²(1−Σμ²) = {output['total']:.3g}); the 20 rows shown hold "
        f"{pct(sum(row['share'] for row in rows))}."
    )
    if outside:
        sentence += (
            f" The other {figures_vocab(summary) - 20:,} rows share {pct(outside['share_outside'])}, "
            f"under the bound {pct(outside['bound'])}."
        )
    return sentence


def figures_vocab(summary: Summary) -> int:
    return int(summary["model"]["vocab_size"])
