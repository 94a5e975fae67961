"""The engine's process keeps freed memory (glibc's thresholds), once, and says where it cannot."""

from __future__ import annotations

import ctypes
import ctypes.util
import platform

import pytest

from workers import process_memory


@pytest.mark.skipif(platform.system() != "Linux" or not platform.libc_ver()[0], reason="glibc only")
def test_glibc_takes_the_thresholds_once(monkeypatch):
    monkeypatch.setattr(process_memory, "_applied", None)
    calls = []
    real = process_memory._apply
    monkeypatch.setattr(process_memory, "_apply", lambda: calls.append(1) or real())
    assert process_memory.retain_freed_memory() is True
    assert process_memory.retain_freed_memory() is True
    assert calls == [1]


def test_a_c_library_without_mallopt_is_left_alone(monkeypatch):
    monkeypatch.setattr(process_memory, "_applied", None)
    monkeypatch.setattr(ctypes.util, "find_library", lambda name: None)
    assert process_memory.retain_freed_memory() is False


def test_a_c_library_whose_mallopt_is_missing_is_left_alone(monkeypatch):
    monkeypatch.setattr(process_memory, "_applied", None)
    monkeypatch.setattr(ctypes, "CDLL", lambda name: object())  # a libc without mallopt (musl, macOS)
    assert process_memory.retain_freed_memory() is False


@pytest.mark.skipif(platform.system() != "Linux" or not platform.libc_ver()[0], reason="glibc only")
def test_a_stage_returns_freed_memory_and_the_last_one_out_retains_it_again(monkeypatch):
    set_now: list[tuple[tuple[int, int], ...]] = []
    real = process_memory._set
    monkeypatch.setattr(process_memory, "_applied", None)
    monkeypatch.setattr(process_memory, "_set", lambda settings: set_now.append(settings) or real(settings))
    with process_memory.returning_freed_memory():
        assert set_now[-1] == process_memory.RETURNING
        with process_memory.returning_freed_memory():  # another summary in another thread
            pass
        assert set_now[-1] == process_memory.RETURNING
    assert set_now[-1] == process_memory._retaining()
    assert process_memory._returning == 0
