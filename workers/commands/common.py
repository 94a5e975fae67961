"""What every ``fisherscope`` command shares: the one-line error for bad input, output paths checked
before any compute, quiet HF libraries."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

EXIT_USAGE = 2


class UsageError(Exception):
    """Bad input the user can fix; reported as one line with exit code 2."""


def check_outputs(outputs: Mapping[str, Path | None]) -> list[Path]:
    """The given output paths (option -> path; None = not asked for), each a distinct file that can be
    written: checked before the model loads, so a run of minutes never ends unable to write its result."""
    given = {flag: path for flag, path in outputs.items() if path is not None}
    if len({path.resolve() for path in given.values()}) != len(given):
        raise UsageError(f"{', '.join(given)} must name different files")
    for flag, path in given.items():
        _check_writable(flag, path)
    return list(given.values())


def _check_writable(flag: str, path: Path) -> None:
    folder = path.parent
    if path.is_dir():
        raise UsageError(f"{flag} {path} is a folder; name a file, e.g. {path / 'out'}")
    if not folder.is_dir():
        raise UsageError(f"{flag}: cannot write {path}: {folder} is not an existing folder; create it first")
    # a new file needs the folder writable; an existing one is replaced or rewritten in place
    if not os.access(folder, os.W_OK | os.X_OK) or (path.exists() and not os.access(path, os.W_OK)):
        raise UsageError(f"{flag}: cannot write {path}: no write permission there; choose another folder")


def quiet_transformers() -> None:
    """The CLI speaks in its own lines: no progress bars or retry warnings from the HF libraries."""
    from huggingface_hub.utils import logging as hub_logging
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    hub_logging.set_verbosity_error()


@contextmanager
def progress_bar(name: str) -> Iterator[Callable[[str, float], None]]:
    """A tqdm bar on stderr, fed by the engine's (stage, fraction) callback; full when the block ends."""
    from tqdm import tqdm

    with tqdm(
        total=100,
        desc=name,
        unit="%",
        file=sys.stderr,
        bar_format="{desc}: {percentage:3.0f}%|{bar}| {elapsed}",
    ) as bar:

        def progress(stage: str, fraction: float) -> None:
            bar.set_description_str(f"{name} [{stage}]", refresh=False)
            bar.update(max(0, round(100 * min(max(fraction, 0.0), 1.0)) - bar.n))

        yield progress
        bar.update(100 - bar.n)
