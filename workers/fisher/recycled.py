"""Large CPU arrays recycled between analyses: memory the process has touched before.

Why: an analysis of a tied model forms the embedding table's sums as dense arrays of the table's size
(SmolLM2: 49152 x 576 float32, 113 MB, two per analysis). Above glibc's 32 MB ceiling for keeping freed
memory (``workers.process_memory``) each is mapped afresh, and on this project's VMs its first touch
cost 27.6k page faults and 0.16-0.34 s of system time, per array and analysis.

An array is lent as a tensor over memory kept here; it comes back once that tensor's storage is freed
(the tensor and every view of it gone), and is lent again, zeroed or overwritten, for the same size.
"""

from __future__ import annotations

import math
import threading
import weakref

import torch

RECYCLED_MIN_BYTES = 32 << 20  # below glibc's ceiling, its heap keeps freed memory already
# asked for a size none of the free arrays has, the free ones are let go beyond this much (the largest
# kept); until then they stay, as a worker that analyses one model wants
KEPT_FREE_BYTES = 1 << 30


class _Slot:
    """Memory kept in the process, and a weak reference to the array that lends it out now."""

    def __init__(self, nbytes: int) -> None:
        # torch's allocation seen as numpy (whose views can be watched with a weak reference), not
        # numpy's own: numpy advises huge pages for large arrays, and where the kernel compacts memory
        # for them at the fault (transparent_hugepage/defrag "madvise", a common default) the first
        # touch stalled: zeroing Qwen3-0.6B's 0.62 GB table took 0.43-0.98 s, against 0.12-0.16 s
        self.memory = torch.empty(nbytes, dtype=torch.uint8).numpy()
        self.lent: weakref.ref | None = None

    @property
    def free(self) -> bool:
        return self.lent is None or self.lent() is None


_slots: list[_Slot] = []
_lock = threading.Lock()


def zeros(shape: tuple[int, ...] | torch.Size, like: torch.Tensor) -> torch.Tensor:
    """``like.new_zeros(shape)``, recycled on the CPU from a freed array of the same size when large."""
    return _lent(shape, like).zero_()


def empty(shape: tuple[int, ...] | torch.Size, like: torch.Tensor) -> torch.Tensor:
    """``like.new_empty(shape)``, recycled like ``zeros`` (its values whatever the last loan left)."""
    return _lent(shape, like)


def copy(value: torch.Tensor) -> torch.Tensor:
    """A contiguous copy of ``value`` (``value.clone()``), recycled like ``zeros``: a partial result's
    snapshot copies a running sum it adds into, the table's 113 MB on SmolLM2."""
    return _lent(value.shape, value).copy_(value)


def _lent(shape: tuple[int, ...] | torch.Size, like: torch.Tensor) -> torch.Tensor:
    """An uninitialized contiguous tensor of ``shape`` and ``like``'s dtype and device: lent when large
    and on the CPU."""
    nbytes = math.prod(shape) * like.element_size()
    if like.device.type != "cpu" or nbytes < RECYCLED_MIN_BYTES:
        return like.new_empty(shape)
    with _lock:
        slot = next((s for s in _slots if s.free and s.memory.nbytes == nbytes), None)
        if slot is None:
            _let_go(nbytes)
            slot = _Slot(nbytes)
            _slots.append(slot)
        # a view of its own: the tensor's storage holds it, and frees it (ending the loan) when it goes
        lent = slot.memory[:]
        slot.lent = weakref.ref(lent)
    return torch.from_numpy(lent).view(like.dtype).view(shape)


def _let_go(coming: int) -> None:
    """Drop free slots, the largest kept first, so that with the one about to be taken at most
    ``KEPT_FREE_BYTES`` are free."""
    kept = coming
    for slot in sorted(_slots, key=lambda s: -s.memory.nbytes):
        if not slot.free:
            continue
        if kept + slot.memory.nbytes > KEPT_FREE_BYTES:
            _slots.remove(slot)
        else:
            kept += slot.memory.nbytes


def kept_bytes() -> tuple[int, int]:
    """(bytes lent out now, bytes kept free): for tests and for a look at the process."""
    with _lock:
        lent = sum(s.memory.nbytes for s in _slots if not s.free)
        return lent, sum(s.memory.nbytes for s in _slots) - lent
