"""The exports folder stays within its budget, least recently used first, never the file just written."""

from __future__ import annotations

import os
from pathlib import Path

from backend.disk import evict_to_budget, mark_used


def _file(folder: Path, name: str, size: int, mtime: float) -> Path:
    path = folder / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"x" * size)
    os.utime(path, (mtime, mtime))
    return path


def test_least_recently_used_files_go_first_until_the_folder_fits(tmp_path: Path) -> None:
    old = _file(tmp_path, "a.safetensors", 400, 1_000)
    middle = _file(tmp_path, "levels/b.u8", 300, 2_000)
    recent = _file(tmp_path, "c.safetensors", 200, 3_000)
    written = _file(tmp_path, "d.safetensors", 500, 500)  # oldest mtime, but just written: kept
    hidden = _file(tmp_path, ".e.safetensors.123.part", 900, 100)  # a write in progress: not counted

    removed = evict_to_budget(tmp_path, budget_bytes=900, keep=written)

    assert removed == [old, middle]  # 1400 -> 1000 -> 700 bytes <= 900
    assert recent.is_file() and written.is_file() and hidden.is_file()


def test_serving_a_file_marks_it_used_and_protects_it(tmp_path: Path) -> None:
    first = _file(tmp_path, "a.safetensors", 400, 1_000)
    second = _file(tmp_path, "b.safetensors", 400, 2_000)
    mark_used(first)  # the older file was just downloaded
    removed = evict_to_budget(tmp_path, budget_bytes=500, keep=tmp_path / "none")
    assert removed == [second] and first.is_file()
    mark_used(tmp_path / "gone.safetensors")  # a file removed meanwhile is not an error


def test_a_folder_within_its_budget_is_left_alone(tmp_path: Path) -> None:
    files = [_file(tmp_path, f"{i}.safetensors", 100, 1_000 + i) for i in range(3)]
    assert evict_to_budget(tmp_path, budget_bytes=300, keep=files[0]) == []
    assert all(path.is_file() for path in files)
