"""Cost of a study before it runs (torch-free, like ``backend.cost``), an upper bound: every response
is counted at its longest, L tokens.

Why not ``backend.cost.estimate_flops`` per response: it prices an analysis, which off the policy also
forms the Fisher under p (d more directions per position); a study's exact pass needs the directions of
C_mu and one for the mean shift, computes a context shared by several responses once (the prompt
itself always), and adds the score backward passes of its estimators and the reference Fisher at the
prompts. Each part is about 2 P flop per context token and direction, as in docs/design.md §3.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from pydantic import BaseModel, ConfigDict

from backend.vocabulary import Method, SamplerKind

CHEAPER_METHODS = ("truncated:0.5", "truncated:0.25", "truncated:0.1", "mc:64", "mc:16")


@dataclass(frozen=True)
class StudyShape:
    """Sizes the cost depends on."""

    n_params: int
    d_model: int
    prompt_lengths: Sequence[int]
    target_tokens: Sequence[int]  # prompt plus target length, for each prompt with a target
    samples: int
    max_tokens: int
    sampler_kind: str
    top_k: int | None
    on_policy: bool
    references: int  # reference distributions compared (0 or 2: model and uniform)
    references_everywhere: bool

    @classmethod
    def of_prompts(cls, prompts: Sequence[TokenizedPrompt], **sizes: Any) -> StudyShape:
        """The shape of a study over ``prompts`` (ids, and target ids where given); ``sizes`` the rest."""
        return cls(
            prompt_lengths=[len(p.input_ids) for p in prompts],
            target_tokens=[len(p.input_ids) + len(p.target_ids) for p in prompts if p.target_ids],
            **sizes,
        )


class TokenizedPrompt(Protocol):
    @property
    def input_ids(self) -> Sequence[int]: ...

    @property
    def target_ids(self) -> Sequence[int] | None: ...


class StudyCostEstimate(BaseModel):
    """What a study is estimated to cost, in all (``flops``, ``seconds``) and by part; the summary
    records it."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    flops: float
    seconds: float
    exact_flops: float
    reference_flops: float
    score_flops: float
    sampling_flops: float
    directions_per_position: int
    upper_bound: bool = True


def estimate_study_cost(shape: StudyShape, method: Method, flops_per_second: float) -> StudyCostEstimate:
    p, d = shape.n_params, shape.d_model
    k, length = shape.samples, shape.max_tokens
    top_k = shape.top_k if shape.sampler_kind == SamplerKind.model else None
    rank = max(1, min(d, top_k - 1)) if top_k is not None else d
    per_position = method.direction_bound(rank) + (0 if shape.on_policy else 1)
    reference_directions = method.direction_bound(d) * shape.references
    exact = reference = score = sampling = 0.0
    for x in shape.prompt_lengths:
        # the prompt once, then K responses' later positions: contexts of x + 1 .. x + L - 1 tokens
        contexts = [x] + [x + t for t in range(1, length)] * k
        exact += sum(2.0 * p * tokens * (per_position + 1) for tokens in contexts)
        reference_tokens = sum(contexts) if shape.references_everywhere else x
        reference += 2.0 * p * reference_tokens * reference_directions
        score += k * 6.0 * p * (x + length)  # one forward and backward per response's score
        sampling += k * 2.0 * p * (x + length)  # one cached forward per drawn token
    score += sum(6.0 * p * tokens for tokens in shape.target_tokens)  # the empirical Fisher's scores
    flops = exact + reference + score + sampling
    return StudyCostEstimate(
        flops=flops,
        seconds=flops / max(flops_per_second, 1.0),
        exact_flops=exact,
        reference_flops=reference,
        score_flops=score,
        sampling_flops=sampling,
        directions_per_position=per_position,
    )


def cheaper_study_methods(shape: StudyShape, budget_flops: float) -> list[str]:
    """Methods whose study would fit the budget, cheapest last."""
    return [
        method
        for method in CHEAPER_METHODS
        if estimate_study_cost(shape, Method.parse(method), 1.0).flops <= budget_flops
    ]
