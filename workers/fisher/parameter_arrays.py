"""Arrays over every parameter of a model as views of one flat array, in memory or in a mapped file.

Why a file: sums kept over positions or contexts are parameter-sized each (an off-policy response keeps
five: 12 GB on Qwen3-0.6B beside its 2.4 GB of float32 weights). The pages of a shared file mapping are
the kernel's to write out and drop under memory pressure; anonymous memory without swap is not. The file
is unlinked as soon as it is mapped: the mapping keeps its pages, and nothing is left behind when the
process dies.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from workers.fisher.shards import current_shard, first_failure


class NoRoomForSums(OSError):
    """The folder of the mapped sums cannot take one more: no disk left (a mapped page written to a disk
    with no room would kill the process with SIGBUS, so the blocks are reserved first), or the folder
    cannot be written."""


def parameter_arrays(
    names: list[str],
    shapes: dict[str, tuple[int, ...]],
    dtype: torch.dtype,
    device: torch.device,
    backing: Path | None,
    stat: str,
) -> dict[str, torch.Tensor]:
    """Zeros for every tensor of ``names``, views of one array: a file of zeros mapped from ``backing``
    (on the CPU), else in memory."""
    n_values = sum(math.prod(shapes[name]) for name in names)
    if backing is not None and device.type == "cpu":
        # a name of this process's (the processes of a worker, or of torchrun, share the folder)
        path = backing / f".{stat}.{os.getpid()}.sums"
        _reserve_with_the_others(path, n_values * dtype.itemsize)
        try:
            flat = torch.from_file(str(path), shared=True, size=n_values, dtype=dtype)
        finally:
            path.unlink()  # the mapping keeps the pages
    else:
        flat = torch.zeros(n_values, dtype=dtype, device=device)
    table, start = {}, 0
    for name in names:
        size = math.prod(shapes[name])
        table[name] = flat[start : start + size].view(shapes[name])
        start += size
    return table


def _reserve_with_the_others(path: Path, nbytes: int) -> None:
    """``_reserve`` (no file left where it raises). Where the analysis is split over processes
    (``shards``), which make the same tables at the same step, every process fails when one has no room,
    with that one's message."""
    shard = current_shard()
    if shard is None:
        _reserve(path, nbytes)
        return
    try:
        _reserve(path, nbytes)
    except NoRoomForSums as error:
        first_failure(str(error))
        raise
    failed = first_failure(None)
    if failed is not None:
        path.unlink()
        rank, message = failed
        raise NoRoomForSums(f"process {rank} of {shard.world}: {message}")


def _reserve(path: Path, nbytes: int) -> None:
    """A new file of ``nbytes`` zeros, its blocks allocated now where the system can (``posix_fallocate``,
    no zeros written; elsewhere, macOS, a sparse file as ``from_file`` makes)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.unlink(missing_ok=True)  # from_file maps what is there
        descriptor = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            allocate = getattr(os, "posix_fallocate", None)
            if allocate is not None:
                allocate(descriptor, 0, nbytes)
        except OSError:
            path.unlink()
            raise
        finally:
            os.close(descriptor)
    except OSError as error:
        raise NoRoomForSums(
            f"no room for {nbytes / 1e9:.1f} GB of sums in {path.parent} ({error.strerror}): free disk "
            "there, or point the folder at a larger disk (FISHERSCOPE_SUMS_DIR for a response's sums; a "
            "study's are in its own folder)"
        ) from error


@dataclass
class SumsStorage:
    """Where a response's sums over positions live (``stats.MomentSums``): each statistic's sums in
    memory while those counted stay within ``memory_bytes``, the rest mapped from files in ``folder``
    (on the CPU; on a GPU all in its memory). Why a budget rather than files always: a mapped page the
    kernel has written out faults again at the next position's add, and on SmolLM2 every sum fits in
    memory beside the weights."""

    folder: Path
    memory_bytes: int
    in_memory: int = 0  # bytes of the tables handed out in memory
    mapped: int = 0  # bytes of those mapped from files

    def table(
        self,
        stat: str,
        names: list[str],
        shapes: dict[str, tuple[int, ...]],
        dtype: torch.dtype,
        device: torch.device,
    ) -> dict[str, torch.Tensor] | None:
        """Zeros for statistic ``stat`` of every tensor, mapped from a file (``parameter_arrays``); None
        where it stays in memory (each tensor's sum an array of its own, as without a storage: arrays
        below glibc's mapping threshold reuse freed memory, where one flat array would fault afresh)."""
        nbytes = sum(math.prod(shapes[name]) for name in names) * dtype.itemsize
        if device.type != "cpu" or self.in_memory + nbytes <= self.memory_bytes:
            self.in_memory += nbytes
            return None
        self.mapped += nbytes
        return parameter_arrays(names, shapes, dtype, device, self.folder, stat)
