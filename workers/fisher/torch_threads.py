"""Torch's intra-op threads inside the math core's own threads (``cpu_kernels.each_in_threads``).

Why: a torch op run in a thread other than the one torch started on gets an OpenMP team of its own.
From then on, libgomp manages more threads than the machine has cores, and it stops spinning between
parallel regions: every later parallel op of the process waits for its team to wake (once the service's
pooled views had formed rho in a helper thread, C_mu took half as long again in every analysis after).
Inside ``one_torch_thread`` a thread runs torch's ops
on itself: no second team is started, and a reduction's order does not depend on which thread took
the item.
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Iterator
from contextlib import contextmanager
from functools import cache

import torch

# GNU's, Intel's and LLVM's OpenMP runtimes, by the names a process loads them under
_OPENMP_RUNTIMES = ("libgomp.so.1", "libiomp5.so", "libomp.so")
# where torch's MKL is: linked into torch's CPU library (the wheels), or a library of its own
_MKL_LIBRARIES = (os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so"), "libmkl_rt.so.2")


def _loaded(names: tuple[str, ...], symbol: str) -> ctypes.CDLL | None:
    """The first of ``names`` that the process has loaded already (never a new one) and that has
    ``symbol``."""
    for name in names:
        try:
            library = ctypes.CDLL(name, mode=os.RTLD_NOLOAD)
        except OSError:
            continue
        if hasattr(library, symbol):
            return library
    return None


@cache
def _openmp() -> ctypes.CDLL | None:
    """The OpenMP runtime torch's ops run on, or None without one."""
    return _loaded(_OPENMP_RUNTIMES, "omp_set_num_threads") if torch.backends.openmp.is_available() else None


@cache
def _mkl() -> ctypes.CDLL | None:
    """torch's MKL, whose thread count torch sets per thread as well, or None without it."""
    return _loaded(_MKL_LIBRARIES, "MKL_Set_Num_Threads_Local") if torch.backends.mkl.is_available() else None


@contextmanager
def one_torch_thread() -> Iterator[None]:
    """This thread's torch ops, MKL's products included, on this thread alone until the block ends
    (other threads unchanged: both thread counts are settings of each thread)."""
    openmp = _openmp()
    if openmp is None:
        yield
        return
    torch.get_num_threads()  # torch sets a new thread's counts on its first op: done first, not after
    before = openmp.omp_get_max_threads()
    openmp.omp_set_num_threads(1)
    mkl = _mkl()
    # MKL's C function (the lowercase name is Fortran's, which takes a pointer); 0: MKL's global count
    mkl_before = mkl.MKL_Set_Num_Threads_Local(1) if mkl is not None else 0
    try:
        yield
    finally:
        if mkl is not None:
            mkl.MKL_Set_Num_Threads_Local(mkl_before)
        openmp.omp_set_num_threads(before)
