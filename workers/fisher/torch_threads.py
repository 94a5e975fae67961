"""Torch's intra-op threads inside the math core's own threads (``cpu_kernels.each_in_threads``).

Why: a torch op run in a thread other than the one torch started on gets an OpenMP team of its own.
From then on, libgomp manages more threads than the machine has cores, and it stops spinning between
parallel regions: every later parallel op of the process waits for its team to wake. On a 2-core Xeon,
once the service's pooled views had formed rho in a helper thread, SmolLM2's C_mu took 0.36-0.38 s
instead of 0.24-0.25, in every analysis after. Inside ``one_torch_thread`` a thread runs torch's ops
on itself: no second team is started, and a reduction's order does not depend on which thread took
the item.
"""

from __future__ import annotations

import ctypes
import glob
import os
from collections.abc import Iterator
from contextlib import contextmanager
from functools import cache

import torch


@cache
def _openmp() -> ctypes.CDLL | None:
    """The OpenMP runtime torch's ops run on (the one in torch's wheel), or None without one."""
    if not torch.backends.openmp.is_available():
        return None
    for path in sorted(glob.glob(os.path.join(os.path.dirname(torch.__file__), "lib", "lib*omp*.so*"))):
        library = ctypes.CDLL(path)  # the copy the process has loaded already: the same runtime
        if hasattr(library, "omp_set_num_threads"):
            return library
    library = ctypes.CDLL(None)  # a build that links the system's runtime into the process
    return library if hasattr(library, "omp_set_num_threads") else None


@contextmanager
def one_torch_thread() -> Iterator[None]:
    """This thread's torch ops on this thread alone, until the block ends (other threads unchanged:
    OpenMP's thread count is a setting of each thread)."""
    library = _openmp()
    if library is None:
        yield
        return
    torch.get_num_threads()  # torch sets a new thread's count on its first op: done first, not after
    before = library.omp_get_max_threads()
    library.omp_set_num_threads(1)
    try:
        yield
    finally:
        library.omp_set_num_threads(before)
