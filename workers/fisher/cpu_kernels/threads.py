"""Where the compiled loops run: ``compiled_for`` (the one test of which path a tensor's values take),
``torch_ops_only`` (CPU tensors down the GPU's torch path, for tests), and the threads a loop's parts
(``_in_parts``) or a pass over many tensors (``each_in_threads``) run in.

A large array is cut into one part per torch thread, each compiled loop running without the GIL in a
thread of its own. A pass over many arrays (the summary's tensors) runs whole tensors in threads instead:
cut per call, tensors of about a million values spent more time handing parts to an idle thread than
the part saved. Torch's ops in that work run on the thread that calls them (``torch_threads``): a second
OpenMP team slows every later op of the process.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import TypeVar

import torch

from workers.fisher.torch_threads import one_torch_thread

PART_MIN_VALUES = 1 << 18  # below this a part costs more to hand to a thread than it saves
_Part = TypeVar("_Part")
_Item = TypeVar("_Item")
_pool: ThreadPoolExecutor | None = None
_pool_threads = 0
_pool_lock = threading.Lock()
_thread_state = threading.local()  # busy: this thread runs items of ``each_in_threads``
_torch_only = 0  # > 0 inside ``torch_ops_only``: process-wide, since summaries run in threads


def compiled_for(where: torch.Tensor | torch.device) -> bool:
    """Whether these loops read a tensor (``where``, or one on that device): those in the CPU's memory.
    The one test every caller makes, so that ``torch_ops_only`` reaches all of them."""
    device = where.device if isinstance(where, torch.Tensor) else torch.device(where)
    return device.type == "cpu" and not _torch_only


@contextmanager
def torch_ops_only() -> Iterator[None]:
    """CPU tensors through the callers' torch ops, as a GPU's are: the GPU's code path, run and tested
    on a machine without one. Not for concurrent use with code that should take the compiled loops."""
    global _torch_only
    _torch_only += 1
    try:
        yield
    finally:
        _torch_only -= 1


def _busy() -> bool:
    return getattr(_thread_state, "busy", False)


def _in_parts(size: int, work: Callable[[int, int], _Part]) -> list[_Part]:
    """``work(lo, hi)`` over [0, size) cut into parts, one per torch thread, this thread doing the first;
    one part inside ``each_in_threads``, whose threads are all busy already."""
    count = 1 if _busy() else max(1, min(torch.get_num_threads(), size // PART_MIN_VALUES))
    if count == 1:
        return [work(0, size)]
    bounds = [size * k // count for k in range(count + 1)]
    pool = _thread_pool(count - 1)
    others = [pool.submit(work, lo, hi) for lo, hi in zip(bounds[1:-1], bounds[2:], strict=True)]
    return [work(bounds[0], bounds[1]), *(future.result() for future in others)]


def each_in_threads(
    work: Callable[[_Item], _Part], items: Sequence[_Item], sizes: Sequence[int]
) -> list[_Part]:
    """``[work(item) for item in items]``, the items shared among torch's threads (this one included),
    largest ``sizes`` first so that no thread is left with a large one at the end.

    Why: the summary's passes call these loops once per tensor and stat; a thread that takes whole
    tensors from a queue stays busy, where cutting each call in parts woke an idle thread for every
    call (two threads were 1.2x one on SmolLM2's 272 tensors). ``work`` must not depend on the order
    in which items run: callers combine the results in the items' order. Nested calls run in order.
    """
    threads = min(torch.get_num_threads(), len(items))
    if threads <= 1 or _busy():
        return [work(item) for item in items]
    order = iter(sorted(range(len(items)), key=lambda i: -sizes[i]))
    results: list[_Part | None] = [None] * len(items)
    taking = threading.Lock()
    failed = threading.Event()

    def run() -> None:
        _thread_state.busy = True
        try:
            with one_torch_thread():  # torch's ops in the work: no second OpenMP team (torch_threads)
                take()
        except BaseException:
            failed.set()  # the other threads stop taking items; the error reaches the caller
            raise
        finally:
            _thread_state.busy = False

    def take() -> None:
        while not failed.is_set():
            with taking:
                i = next(order, None)
            if i is None:
                return
            results[i] = work(items[i])

    helpers = [_thread_pool(threads - 1).submit(run) for _ in range(threads - 1)]
    try:
        run()
    finally:
        for helper in helpers:  # every helper is done before the caller goes on (or sees an error)
            helper.exception()
    for helper in helpers:
        helper.result()
    return results  # type: ignore[return-value]  # every slot is filled when no thread failed


def _thread_pool(threads: int) -> ThreadPoolExecutor:
    """The pool, grown when torch's thread count is raised. A replaced pool is not shut down: a caller
    may still be submitting to it; its threads exit once it is collected."""
    global _pool, _pool_threads
    with _pool_lock:
        if _pool is None or _pool_threads < threads:
            _pool, _pool_threads = ThreadPoolExecutor(threads, thread_name_prefix="fisher-kernels"), threads
        return _pool
