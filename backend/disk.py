"""The exports folder within its budget: files used least recently are removed first.

Why: one SmolLM2 safetensors export is ~4.3 GB and the per-analysis top-q sets 134 MB; without a
budget the folder only grows. Readers mark a file used (its modification time) when they serve it,
writers evict after each write, never the file just written.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path


def mark_used(path: Path) -> None:
    with contextlib.suppress(OSError):  # gone already: nothing to mark
        os.utime(path)


def evict_to_budget(folder: Path, budget_bytes: int, keep: Path) -> list[Path]:
    """Remove the least recently used files under ``folder`` until it fits ``budget_bytes``."""
    files = []
    for path in folder.rglob("*"):
        with contextlib.suppress(OSError):
            if path.is_file() and not path.name.startswith(".") and path != keep:
                stat = path.stat()
                files.append((stat.st_mtime, stat.st_size, path))
    used = sum(size for _, size, _ in files) + (keep.stat().st_size if keep.is_file() else 0)
    removed = []
    for _, size, path in sorted(files):
        if used <= budget_bytes:
            break
        with contextlib.suppress(OSError):
            path.unlink()
            used -= size
            removed.append(path)
    return removed
