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
        with self.lock:
            free = self.free.get((dtype, torch.device(device)), [])
            buffer = free.pop() if free else None
        if buffer is None or buffer.numel() < numel:
            buffer = torch.empty(numel, dtype=dtype, device=device)
        return buffer

    def give(self, buffer: torch.Tensor) -> None:
        with self.lock:
            self.free.setdefault((buffer.dtype, buffer.device), []).append(buffer)


summary_scratch = ScratchPool()
