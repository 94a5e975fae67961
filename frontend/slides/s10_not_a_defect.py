"""Slide 10, Part 2 section 5: sparsity is not a defect (training-inference mismatch)."""

from __future__ import annotations

from frontend import figures
from frontend.slides.common import Summary, first_position, quoted

TITLE = "10. Sparsity is not a defect"
CLAIM = "Under training–inference mismatch, centering is what keeps numerical noise out of the update."
FORMULA = r"$$m_{(c,k)}=\big(\mu(c)-p(c)\big)\,h_k,\qquad f^{p}_{(c,k)}=h_k^2\,p(c)\big(1-p(c)\big)$$"


def figure(summary: Summary, centering: str):
    return figures.engine_shift_rows(summary)


def reading(summary: Summary, centering: str) -> str:
    position = first_position(summary)
    top = position["p"]["top"]
    engine = summary["sampler"]["engine"]
    ratios = [((tok["mu"] - tok["p"]) ** 2 / max(tok["p"] * (1 - tok["p"]), 1e-30), tok) for tok in top]
    worst_ratio, worst = max(ratios, key=lambda pair: pair[0])
    if worst_ratio == 0:
        return (
            "Here μ = p exactly (engine model, no temperature or truncation), so there is no shift; "
            "switch the engine to bf16 to see the mismatch."
        )
    rarest = min(top, key=lambda tok: tok["p"])
    rare_ratio = (rarest["mu"] - rarest["p"]) ** 2 / max(rarest["p"] * (1 - rarest["p"]), 1e-30)
    sampler = summary["sampler"]
    why = f"engine {engine}, temperature {sampler.get('temperature', 1.0):g}"
    if sampler.get("top_k"):
        why += f", top-k {sampler['top_k']}"
    if sampler.get("top_p", 1.0) < 1.0:
        why += f", top-p {sampler['top_p']:g}"
    return (
        f"Sampler ({why}): relative to its on-policy Fisher, the shift is largest on the row of "
        f"{quoted(worst['text'])} (shift²/Fisher = {worst_ratio:.2g}); the rarest shown token "
        f"{quoted(rarest['text'])} (p = {rarest['p']:.2g}) has {rare_ratio:.2g}. Centering removes all of it."
    )
