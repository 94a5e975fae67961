"""A study's reward over whole responses: exact match with the prompt's target, or a regex built from it.

Why a pattern with ``{target}`` rather than a regex per prompt: the target stays the literal expected
response, which the empirical Fisher scores as text; the pattern says how a response must contain it
(``^\\s*{target}\\b``: the answer first). The target is inserted escaped, so "2+3" matches literally.

Why RE2 (google-re2) and not Python's ``re``: a pattern comes from whoever can reach the service, and
``re`` backtracks, so ``([\\s\\S]|[\\s\\S])*(?!)`` held a worker for minutes and, holding the GIL, froze
the embedded process. RE2 matches in time linear in the response and refuses what it cannot match so
(look-arounds, backreferences, repetition counts over 1000) when the pattern is compiled, which is at
POST, once per prompt with that prompt's target in place.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

import re2

TARGET_SLOT = "{target}"
RE2_SYNTAX = "https://github.com/google/re2/wiki/Syntax"
# RE2's own bound on the memory of one compiled pattern (its default); a pattern over it is refused
MAX_PATTERN_MEMORY = 8 << 20


class RewardKind(StrEnum):
    exact = "exact"  # 1 when the decoded response equals the target (outer whitespace ignored)
    regex = "regex"  # 1 when the pattern, with the target inserted, matches somewhere in the response


def _options() -> re2.Options:
    options = re2.Options()
    options.log_errors = False  # a refused pattern is the person's error, answered to them, not logged
    options.max_mem = MAX_PATTERN_MEMORY
    return options


def _problem(error: re2.error) -> str:
    message = error.args[0] if error.args else error
    return message.decode("utf-8", "replace") if isinstance(message, bytes) else str(message)


def compile_pattern(pattern: str) -> re2._Regexp:
    """``pattern`` compiled by RE2; ValueError naming what RE2 refused (its syntax: RE2_SYNTAX)."""
    try:
        return re2.compile(pattern, _options())
    except re2.error as error:
        raise ValueError(
            f"the reward pattern {pattern!r} is not a regex RE2 can run: {_problem(error)} "
            f"(no look-arounds or backreferences; syntax: {RE2_SYNTAX})"
        ) from None
    except (TypeError, UnicodeError) as error:
        raise ValueError(f"the reward pattern {pattern!r} cannot be used: {error}") from None


@dataclass(frozen=True)
class RewardRule:
    kind: RewardKind
    pattern: str | None = None  # regex only

    def __post_init__(self) -> None:
        if self.kind == RewardKind.regex:
            if not self.pattern:
                raise ValueError("a regex reward needs a pattern, e.g. '^\\s*{target}\\b'")
            compile_pattern(self.pattern.replace(TARGET_SLOT, "x"))

    def check_target(self, target: str) -> None:
        """ValueError when the pattern cannot be used with this target in place (``(?P<{target}>.)``):
        checked for every prompt when the study is submitted, so no part fails after sampling."""
        if self.kind == RewardKind.regex:
            self._compiled(target)

    def _compiled(self, target: str) -> re2._Regexp:
        assert self.pattern is not None
        return compile_pattern(self.pattern.replace(TARGET_SLOT, re2.escape(target.strip())))

    def score(self, response_text: str, target: str) -> float:
        """1.0 or 0.0 for one decoded response."""
        if self.kind == RewardKind.exact:
            return float(response_text.strip() == target.strip())
        # a decoded response can hold a lone surrogate, which has no UTF-8 form for RE2
        text = response_text.encode("utf-8", "replace").decode("utf-8")
        return float(self._compiled(target).search(text) is not None)

    def describe(self) -> str:
        if self.kind == RewardKind.exact:
            return "1 if the response equals the prompt's target (outer whitespace ignored), else 0"
        return (
            f"1 if the RE2 regex {self.pattern!r} matches in the response, {TARGET_SLOT} = the target, else 0"
        )

    def to_dict(self) -> dict:
        return {"kind": self.kind.value, "pattern": self.pattern, "rule": self.describe()}
