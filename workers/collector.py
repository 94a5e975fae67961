"""Python's cycle collector during the engine's stages: the objects that were there before a stage began
are left out of its collections (``gc.freeze``), and put back when it ends.

Why: a loaded model, torch and transformers make about 480k objects the collector tracks (SmolLM2-135M
in a worker), and a full collection walks all of them: 0.2 s each on this project's 2-core VMs. An
analysis makes enough short-lived objects (a first moment's terms, a chunk's views) to set off such
collections while it runs, and none of them can free what the model holds. Measured on SmolLM2, a
16-token response at top-k 50, job start to the first partial result, this freeze on and off alternated
in one process (six responses): 4.08-4.81 s on (mean 4.36), 4.24-4.84 s off (mean 4.58). What a stage
makes is collected as before; garbage from before it waits until it ends.
"""

from __future__ import annotations

import contextlib
import gc
import threading
from collections.abc import Iterator

_lock = threading.Lock()
_stages = 0  # such stages running now, in any thread
_ours = False  # whether the first stage in froze (not where the process had frozen objects already)


@contextlib.contextmanager
def earlier_objects_frozen() -> Iterator[None]:
    """Process-wide: the first stage in freezes what is tracked, the last one out unfreezes it (so a
    model dropped from a worker's cache afterwards is collected as usual). A process that froze
    objects of its own (a server preloading before it forks) keeps them frozen: nothing is done."""
    global _stages, _ours
    with _lock:
        _stages += 1
        if _stages == 1:
            _ours = gc.get_freeze_count() == 0
            if _ours:
                gc.freeze()
    try:
        yield
    finally:
        with _lock:
            _stages -= 1
            if _stages == 0 and _ours:
                gc.unfreeze()
