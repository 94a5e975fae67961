"""The cycle collector during an engine stage (``workers.collector``)."""

from __future__ import annotations

import gc
import threading
import weakref

from workers.collector import earlier_objects_frozen


class _Cycle:
    def __init__(self) -> None:
        self.me = self


def test_a_stage_leaves_out_what_was_there_and_collects_what_it_makes() -> None:
    gc.disable()  # no collection but the test's own: the garbage from before must still be there
    try:
        _collected_only_when_asked()
    finally:
        gc.enable()


def _collected_only_when_asked() -> None:
    kept, dropped = _Cycle(), weakref.ref(_Cycle())  # a live object and cyclic garbage from before
    with earlier_objects_frozen():
        assert not any(o is kept for o in gc.get_objects())  # out of every generation
        made = weakref.ref(_Cycle())
        gc.collect()
        assert made() is None  # what the stage makes is collected as before
        assert dropped() is not None  # garbage from before waits for the stage to end
    assert any(o is kept for o in gc.get_objects())  # back in the oldest generation
    gc.collect()
    assert dropped() is None


def test_the_last_stage_out_unfreezes() -> None:
    entered, leave = threading.Event(), threading.Event()

    def other_stage() -> None:
        with earlier_objects_frozen():
            entered.set()
            leave.wait(10)

    thread = threading.Thread(target=other_stage)
    thread.start()
    entered.wait(10)
    with earlier_objects_frozen():
        pass
    assert gc.get_freeze_count() > 0  # the other stage still runs
    leave.set()
    thread.join(10)
    assert gc.get_freeze_count() == 0


def test_an_error_in_a_stage_unfreezes() -> None:
    try:
        with earlier_objects_frozen():
            raise RuntimeError("stage failed")
    except RuntimeError:
        pass
    assert gc.get_freeze_count() == 0


def test_objects_the_process_froze_itself_stay_frozen() -> None:
    gc.freeze()
    try:
        frozen = gc.get_freeze_count()
        with earlier_objects_frozen():
            pass
        assert gc.get_freeze_count() == frozen
    finally:
        gc.unfreeze()
