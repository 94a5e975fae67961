"""The math core's threads run torch's ops on themselves: no thread but torch's own starts an OpenMP
team (``workers.fisher.torch_threads``)."""

from __future__ import annotations

import os
import threading

import pytest
import torch

from workers.fisher import cpu_kernels
from workers.fisher.torch_threads import _openmp, one_torch_thread

pytestmark = pytest.mark.skipif(_openmp() is None, reason="this torch runs its ops without OpenMP")

LARGE = 1 << 22  # values: above torch's grain size, so that its ops would run in parallel


def _threads() -> set[int]:
    return {int(tid) for tid in os.listdir("/proc/self/task")}


def _runtime_threads(started: set[int]) -> set[int]:
    """Of the threads ``started``, those Python did not start: OpenMP's (a pool may add a worker)."""
    return started - {thread.native_id for thread in threading.enumerate()}


def test_one_torch_thread_sets_this_thread_alone_and_restores_it():
    before = torch.get_num_threads()
    with one_torch_thread():
        assert torch.get_num_threads() == 1
    assert torch.get_num_threads() == before


def test_work_in_threads_starts_no_openmp_team():
    """Torch ops in ``each_in_threads``' work run on one thread in every thread that takes items, and
    the helpers start no threads of their own: before, a helper's first parallel op started a team and
    every later parallel op of the process waited longer for its own (libgomp spins no more once it
    manages more threads than there are cores)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(2)  # two threads take items, whatever the machine
    try:
        _check_no_team()
    finally:
        torch.set_num_threads(threads)


def _check_no_team() -> None:
    values = torch.rand(LARGE)
    (values * 2).sum()  # this thread's team exists before the threads are counted
    values[:4096].view(64, 64) @ values[:4096].view(64, 64)
    cpu_kernels.each_in_threads(lambda item: item, [0, 1, 2, 3], [1, 1, 1, 1])  # the pool's threads
    seen: list[int] = []

    square = values[: 512 * 512].view(512, 512)

    def work(item: int) -> float:
        seen.append(torch.get_num_threads())
        return float((values * item).sum()) + float((square @ square).sum())  # MKL's product too

    before = _threads()
    found = cpu_kernels.each_in_threads(work, [1, 2, 3, 4], [4, 3, 2, 1])
    assert not _runtime_threads(_threads() - before)
    assert seen == [1, 1, 1, 1]
    # a sum's order no longer depends on which thread took the item
    assert cpu_kernels.each_in_threads(work, [1, 2, 3, 4], [1, 2, 3, 4]) == found
