"""What every ``fisherscope`` command shares: the one-line error for bad input, quiet HF libraries."""

from __future__ import annotations

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
