"""Scratch buffers of the model summary, kept between summaries."""

from __future__ import annotations

import threading

import torch


class ScratchPool:
    """The summary's buffer, kept between summaries: one buffer the size of the largest tensor costs
    as much in first-touch page faults as the summary's arithmetic on some machines. A buffer is taken
    out while a summary uses it, so concurrent summaries never share one."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.free: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}

    def take(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """The smallest free buffer of at least ``numel`` values, else a new one (a larger buffer kept
        for the thread that will summarize the largest tensor)."""
        with self.lock:
            free = self.free.get((dtype, torch.device(device)), [])
            fits = [i for i, b in enumerate(free) if b.numel() >= numel]
            at = min(fits, key=lambda i: free[i].numel()) if fits else None
            buffer = None if at is None else free.pop(at)
        return buffer if buffer is not None else torch.empty(numel, dtype=dtype, device=device)

    def give(self, buffer: torch.Tensor) -> None:
        with self.lock:
            self.free.setdefault((buffer.dtype, buffer.device), []).append(buffer)


summary_scratch = ScratchPool()
