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
    if not path.is_file():
        # a folder, or a device such as /dev/zero or a pipe: nothing to read, or no end to reading
        what = "no such file" if not path.exists() else "not a regular file"
        raise PromptFileError(f"cannot read the prompt file {path}: {what}; lines like {EXAMPLE}")
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


def unicode_problem(text: str) -> str | None:
    """Why ``text`` is not valid Unicode text, or None: a lone surrogate (JSON's ``"\\udc80"``, or bytes
    of a command line that are not UTF-8) has no UTF-8 form, so no tokenizer or regex can take it."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        return f"not valid Unicode text (a lone surrogate {text[error.start]!r} at character {error.start})"
    return None


def _parse_line(path: Path, number: int, line: str, index: int) -> StudyPrompt:
    where = f"{path} line {number}"
    item = _json_object(where, line)
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
    for field, value in (("prompt", text), ("target", target)):
        problem = unicode_problem(value) if value is not None else None
        if problem:
            raise PromptFileError(f"{where}: '{field}' is {problem}; write the text itself")
    return StudyPrompt(index, number, text, target)


def _json_object(where: str, line: str) -> dict:
    """The line's JSON object; a field given twice is refused rather than the last one silently kept."""
    try:
        item = json.loads(line, object_pairs_hook=_without_repeats)
    except _RepeatedField as repeated:
        raise PromptFileError(f"{where} gives the field {repeated.args[0]!r} twice; keep one") from None
    except RecursionError:
        raise PromptFileError(f"{where} nests too deeply; write an object like {EXAMPLE}") from None
    except ValueError as error:  # JSONDecodeError, or an integer too long to convert
        reason = error.msg if isinstance(error, json.JSONDecodeError) else str(error).partition(":")[0]
        raise PromptFileError(f"{where} is not JSON ({reason}); write an object like {EXAMPLE}") from None
    if not isinstance(item, dict):
        raise PromptFileError(f"{where} is a JSON {type(item).__name__}, not an object like {EXAMPLE}")
    return item


class _RepeatedField(Exception):
    """A key given twice in one JSON object (json keeps the last without a word)."""


def _without_repeats(pairs: list[tuple[str, object]]) -> dict:
    item: dict = {}
    for key, value in pairs:
        if key in item:
            raise _RepeatedField(key)
        item[key] = value
    return item


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
