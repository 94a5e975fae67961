"""Slide 2, Part 1 section 2: the gradient is a covariance, the Fisher a variance."""

from __future__ import annotations

from frontend import figures
from frontend.slides.common import Summary, first_position, pct, quoted

TITLE = "2. The gradient is a covariance, the Fisher a variance"
CLAIM = (
    "On the model's own samples the score averages to zero, so the expected gradient is a covariance "
    "and the Fisher is a variance."
)
FORMULA = (
    r"$$G_i=\mathbb{E}\big[A\cdot\mathrm{score}_i\big]=\operatorname{Cov}(A,\mathrm{score}_i),\qquad "
    r"F_i=\operatorname{Var}(\mathrm{score}_i),\qquad |G_i|\le\operatorname{std}(A)\sqrt{F_i}$$"
)


def figure(summary: Summary, centering: str):
    return figures.gradient_vs_bound(summary)


def reading(summary: Summary, centering: str) -> str:
    position = first_position(summary)
    rewarded = [row for row in figures.reward_rows(position) if row["reward"] != 0]
    if not rewarded or not position.get("reward") or position["reward"]["std"] == 0:
        return (
            "No reward varies over the likely next tokens, so the gradient is zero everywhere; click "
            "candidate tokens to give them a reward and see the bound at work."
        )
    total = position["output_layer"]["total"]
    share = sum(float(row["fisher"]) for row in rewarded) / total
    grad = sum(float(row["grad"]) for row in rewarded)
    bound = sum(float(row["bound"]) for row in rewarded)
    names = " and ".join(quoted(str(row["text"])) for row in rewarded[:3])
    ratio = grad / bound if bound else 0.0
    verdict = (
        "the reward barely tells the rewarded tokens apart"
        if ratio < 0.25
        else "the reward separates the rewarded tokens from the rest"
    )
    one = len(rewarded) == 1
    sentence = (
        f"The rewarded row{'' if one else 's'} {names} hold{'s' if one else ''} {pct(share)} of the "
        f"output-layer Fisher; {'its' if one else 'their'} gradient is {pct(ratio)} of the bound "
        f"std(r)·√F: {verdict}."
    )
    overlap = summary.get("overlap")
    if overlap and 0.01 in overlap["q"]:
        k = overlap["q"].index(0.01)
        sentence += (
            f" The top 1% of coordinates by Fisher hold {pct(overlap['fisher_vs_policy_grad'][k])} of "
            f"the top 1% by |gradient|, against {pct(overlap['baseline'][k])} at random."
        )
    return sentence
