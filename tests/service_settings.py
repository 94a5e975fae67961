"""Service settings for a test: every folder under the test's tmp_path, no Redis unless asked, no
landing analysis queued at start (a test asks for what it needs)."""

from __future__ import annotations

from pathlib import Path

from backend.settings import Settings


def folder_settings(tmp_path: Path, **fields) -> Settings:
    folders = {
        name: tmp_path / name.removesuffix("_dir") for name in ("results_dir", "exports_dir", "studies_dir")
    }
    return Settings(**{"redis_url": None, "landing_analysis": False, **folders, **fields})
