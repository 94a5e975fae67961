"""A study's reward over whole responses: exact match with the prompt's target, or a regex built from it.

Why a pattern with ``{target}`` rather than a regex per prompt: the target stays the literal expected
response, which the empirical Fisher scores as text; the pattern says how a response must contain it
(``^\\s*{target}\\b``: the answer first). The target is inserted escaped, so "2+3" matches literally.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import StrEnum

TARGET_SLOT = "{target}"


class RewardKind(StrEnum):
    exact = "exact"  # 1 when the decoded response equals the target (outer whitespace ignored)
    regex = "regex"  # 1 when the pattern, with the target inserted, matches somewhere in the response


@dataclass(frozen=True)
class RewardRule:
    kind: RewardKind
    pattern: str | None = None  # regex only

    def __post_init__(self) -> None:
        if self.kind == RewardKind.regex:
            if not self.pattern:
                raise ValueError("a regex reward needs a pattern, e.g. '^\\s*{target}\\b'")
            try:
                re.compile(self.pattern.replace(TARGET_SLOT, "x"))
            except re.error as error:
                raise ValueError(f"the reward pattern {self.pattern!r} is not a regex: {error}") from None

    def score(self, response_text: str, target: str) -> float:
        """1.0 or 0.0 for one decoded response."""
        if self.kind == RewardKind.exact:
            return float(response_text.strip() == target.strip())
        assert self.pattern is not None
        pattern = self.pattern.replace(TARGET_SLOT, re.escape(target.strip()))
        return float(re.search(pattern, response_text) is not None)

    def describe(self) -> str:
        if self.kind == RewardKind.exact:
            return "1 if the response equals the prompt's target (outer whitespace ignored), else 0"
        return f"1 if re.search({self.pattern!r}) matches the response, {TARGET_SLOT} = the target, else 0"

    def to_dict(self) -> dict:
        return {"kind": self.kind.value, "pattern": self.pattern, "rule": self.describe()}
