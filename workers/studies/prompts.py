"""The prompt file of a study: JSON Lines, one ``{"prompt": ..., "target": ...}`` object per line.

Why strict: a study runs for minutes to hours, so every mistake in the file is found before the model
loads, and reported as one line that names the line number and what to write instead.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

FIELDS = ("prompt", "target")
EXAMPLE = '{"prompt": "Q: 2+3=? A:", "target": " 5"}'


class PromptFileError(ValueError):
    """Bad content in the prompt file; the message is one line naming the line and the fix."""


@dataclass(frozen=True)
class StudyPrompt:
    index: int  # 0-based among the prompts (blank lines are skipped)
    line: int  # 1-based line in the file
    text: str
    target: str | None


@dataclass(frozen=True)
class EncodedPrompt:
    index: int
    line: int
    input_ids: list[int]
    target: str | None
    target_ids: list[int] | None  # the target as a continuation of the prompt


def read_prompts(path: Path) -> list[StudyPrompt]:
    """Every prompt of ``path``; raises PromptFileError for an empty file or a bad line."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as error:
        raise PromptFileError(f"cannot read the prompt file {path}: {error}") from None
    prompts: list[StudyPrompt] = []
    for number, line in enumerate(lines, start=1):
        if line.strip():
            prompts.append(_parse_line(path, number, line, len(prompts)))
    if not prompts:
        raise PromptFileError(f"{path} has no prompts; write one JSON object per line, e.g. {EXAMPLE}")
    return prompts


def _parse_line(path: Path, number: int, line: str, index: int) -> StudyPrompt:
    where = f"{path} line {number}"
    try:
        item = json.loads(line)
    except json.JSONDecodeError as error:
        raise PromptFileError(f"{where} is not JSON ({error.msg}); write an object like {EXAMPLE}") from None
    if not isinstance(item, dict):
        raise PromptFileError(f"{where} is a JSON {type(item).__name__}, not an object like {EXAMPLE}")
    unknown = sorted(set(item) - set(FIELDS))
    if unknown:
        raise PromptFileError(
            f"{where} has unknown field {unknown[0]!r}; the fields are 'prompt' (required) and 'target'"
        )
    text = item.get("prompt")
    if not isinstance(text, str) or not text.strip():
        raise PromptFileError(f"{where} needs a non-empty string 'prompt', e.g. {EXAMPLE}")
    target = item.get("target")
    if target is not None and not isinstance(target, str):
        raise PromptFileError(f"{where}: 'target' must be a string (the expected response), e.g. {EXAMPLE}")
    return StudyPrompt(index, number, text, target)


def require_targets(path: Path, prompts: Sequence[StudyPrompt], why: str) -> None:
    """Every prompt has a non-empty target (a reward compares responses with it)."""
    for prompt in prompts:
        if not prompt.target:
            raise PromptFileError(f"{path} line {prompt.line} has no 'target'; {why}")


def encode_prompts(
    path: Path,
    prompts: Sequence[StudyPrompt],
    encode_prompt: Callable[[str], list[int]],
    encode_target: Callable[[str], list[int]],
    max_prompt_tokens: int,
) -> list[EncodedPrompt]:
    """Token ids of every prompt (and target), refusing a prompt over ``max_prompt_tokens``."""
    encoded = []
    for prompt in prompts:
        ids = encode_prompt(prompt.text)
        where = f"{path} line {prompt.line}"
        if not ids:
            raise PromptFileError(f"{where}: the prompt encodes to no tokens; write some text")
        if len(ids) > max_prompt_tokens:
            raise PromptFileError(
                f"{where}: the prompt is {len(ids)} tokens, over the limit of {max_prompt_tokens}; shorten it"
            )
        target_ids = encode_target(prompt.target) if prompt.target else None
        if prompt.target and not target_ids:
            raise PromptFileError(f"{where}: the target encodes to no tokens; write its text or drop it")
        encoded.append(EncodedPrompt(prompt.index, prompt.line, ids, prompt.target, target_ids))
    return encoded
