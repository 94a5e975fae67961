"""Keep freed memory in the engine's process instead of handing it back to the OS at every free.

Why: the engine allocates and frees arrays of 1-30 MB thousands of times per analysis (a chunk's
per-direction gradients, the summary's per-tensor bins). glibc returns such memory to the kernel (above
128 kB it maps each one afresh, and it trims the heap's free top), so every reuse page-faults again,
and on the VMs this project runs on a fault costs microseconds per 4 kB page. Measured on SmolLM2 in
separate processes (two each, analyses after a warm-up): 5-token exact 5.35-5.49 s with glibc's
defaults, 4.98-5.17 s with these; 32 tokens 28.9-29.5 s and 27.7-29.1 s; peak memory the same (4.1-4.2
GB; keeping up to 1 GB at the heap's top instead of 256 MB added a gigabyte to it and no speed).
Arrays above 32 MB (glibc's ceiling for this setting) are still mapped per allocation; the largest
the engine forms, the embedding table's sums, are recycled instead (``workers.fisher.recycled``).

A summary and a certificate are the exceptions (``returning_freed_memory``): they read each array once,
and what they free in threads, kept, grew with the model.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import threading
from collections.abc import Callable, Iterator

_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_THRESHOLD = -1, -2, -3  # glibc's mallopt parameters
MMAP_THRESHOLD_BYTES = 32 << 20  # glibc refuses more
TRIM_THRESHOLD_BYTES = 256 << 20  # free memory at the heap's top kept up to this
TOP_PAD_BYTES = 64 << 20
# while a summary or a certificate runs: arrays above 1 MB mapped per allocation, the heap's free top
# above 8 MB trimmed (Qwen3-1.7B's first answer, T 0.7 top-k 50: peak 16.9 GB with the retaining
# thresholds, 15.5 with these; SmolLM2-135M's whole analysis with these everywhere was 15-40% slower,
# its summary is 8% of it)
RETURNING = ((_M_MMAP_THRESHOLD, 1 << 20), (_M_TRIM_THRESHOLD, 8 << 20), (_M_TOP_PAD, 0))

_lock = threading.Lock()
_applied: bool | None = None
_returning = 0  # such stages running now, in any thread


def retain_freed_memory() -> bool:
    """Set glibc's thresholds once per process; False where the C library is not glibc (nothing set)."""
    global _applied
    with _lock:
        if _applied is None:
            _applied = _apply()
        return _applied


@contextlib.contextmanager
def returning_freed_memory() -> Iterator[None]:
    """A stage whose freed memory goes back to the kernel (``RETURNING``), where the process retains it
    otherwise. Process-wide: stages in several threads count themselves, and the last one out sets the
    retaining thresholds (``retain_freed_memory``), whether or not they were set before."""
    global _returning
    retain_freed_memory()
    with _lock:
        _returning += 1
        if _returning == 1 and _applied:
            _set(RETURNING)
    try:
        yield
    finally:
        with _lock:
            _returning -= 1
            if _returning == 0 and _applied:
                _set(_retaining())


def _retaining() -> tuple[tuple[int, int], ...]:
    return (
        (_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES),
        (_M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES),
        (_M_TOP_PAD, TOP_PAD_BYTES),
    )


def _mallopt() -> Callable[[int, int], int] | None:
    name = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(name).mallopt if name else None
    except (OSError, AttributeError):
        return None


def _set(settings: tuple[tuple[int, int], ...]) -> bool:
    mallopt = _mallopt()
    return mallopt is not None and all(mallopt(parameter, value) == 1 for parameter, value in settings)


def _apply() -> bool:
    return _set(_retaining())
