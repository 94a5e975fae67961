"""What every ``fisherscope`` command shares: the one-line error for bad input, quiet HF libraries."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager

EXIT_USAGE = 2


class UsageError(Exception):
    """Bad input the user can fix; reported as one line with exit code 2."""


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
