"""What a study is: sampler, K responses of at most L tokens, seed, method, reward, mask densities.

Why one frozen object: every part of a study (one per worker, any split of the prompts) must run with
the same spec, and the summary records it, so the same spec and seed give the same responses and sums.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from enum import StrEnum

from backend.rewards import RewardRule
from backend.vocabulary import Method, Sampler, SamplerKind
from workers.fisher.study import Reference, derived_seed

DEFAULT_FRACTIONS: tuple[float, ...] = (0.001, 0.01, 0.05)
PAPER_FRACTION = 0.01  # the paper compares the top 1% by Fisher and by |gradient|


class CompareAt(StrEnum):
    """Where the Fisher under the model and under the uniform sampler is computed (d directions each)."""

    prompts = "prompts"  # at each prompt (the first position of its responses)
    responses = "responses"  # at every sampled position (as costly again as an on-policy study)
    none = "none"


@dataclass(frozen=True)
class StudySpec:
    sampler: Sampler
    samples: int = 4  # K responses per prompt
    max_tokens: int = 16  # L
    seed: int = 0
    method: Method = Method()
    reward: RewardRule | None = None
    fractions: tuple[float, ...] = DEFAULT_FRACTIONS
    compare_at: CompareAt = CompareAt.prompts
    chat_template: bool = False

    def __post_init__(self) -> None:
        if self.sampler.kind == SamplerKind.data:
            raise ValueError("a study samples its responses: use the model or uniform sampler, not data")
        if self.samples < 1:
            raise ValueError(f"samples must be >= 1, got {self.samples}")
        if self.max_tokens < 1:
            raise ValueError(f"max tokens must be >= 1, got {self.max_tokens}")
        if not self.fractions or any(not 0 < q < 1 for q in self.fractions):
            raise ValueError(f"mask densities q must be in (0, 1), got {list(self.fractions)}")
        if list(self.fractions) != sorted(set(self.fractions)):
            raise ValueError(f"mask densities must be distinct and ascending, got {list(self.fractions)}")

    def method_config(self) -> Method:
        return self.method.with_seed(self.seed)

    def response_seed(self, prompt_index: int, response_index: int) -> int:
        """The draw of response k of prompt n depends on (seed, n, k) only, not on order or workers."""
        return derived_seed(self.seed, prompt_index, response_index)

    @property
    def references(self) -> tuple[str, ...]:
        """Distributions compared with the sampler's Fisher (the paper's model-vs-uniform ratio)."""
        return () if self.compare_at == CompareAt.none else (Reference.model, Reference.uniform)

    @property
    def level_fractions(self) -> tuple[float, ...]:
        """The mask densities plus the paper's 1%, ascending (one level map holds them all)."""
        return tuple(sorted(set(self.fractions) | {PAPER_FRACTION}))

    def to_dict(self) -> dict:
        sampler = {
            key: str(value) if isinstance(value, str) else value
            for key, value in asdict(self.sampler).items()
        }
        return {
            "sampler": {**sampler, "on_policy": self.sampler.is_on_policy},
            "samples": self.samples,
            "max_tokens": self.max_tokens,
            "seed": self.seed,
            "method": str(self.method_config()),
            "reward": None if self.reward is None else self.reward.to_dict(),
            "fractions": list(self.fractions),
            "compare_at": self.compare_at.value,
            "chat_template": self.chat_template,
        }
