"""The store of embedded mode: everything in this process, finished analyses persisted to a folder so
that share links survive a restart (the ``Store`` interface: ``backend/store.py``)."""

from __future__ import annotations

import json
import os
import shutil
import threading
import time
from collections import OrderedDict
from pathlib import Path
from typing import Any

from backend.fastjson import dumps
from backend.store import LEASE_TTL_S, RECENT_LIMIT, Store


class LocalStore(Store):
    """In-process store for embedded mode; finished analyses persist to `folder/<id>/`.

    The summaries last read are kept as bytes in memory (`SUMMARY_CACHE_SIZE` of them), so a cache
    hit reads no file.
    """

    SUMMARY_CACHE_SIZE = 32

    def __init__(self, folder: Path) -> None:
        self.folder = Path(folder)
        self._lock = threading.RLock()
        self._meta: dict[str, dict] = {}
        self._leases: dict[str, float] = {}
        self._counters: dict[str, int] = {}
        self._summaries: OrderedDict[str, bytes] = OrderedDict()
        self._partials: dict[str, bytes] = {}
        self._rates: dict[str, dict[str, float]] = {}
        self._cancelled: set[str] = set()

    def ping(self) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)

    def _dir(self, analysis_id: str) -> Path:
        if not analysis_id.isalnum():  # ids are sha256 hex; anything else never names a folder
            raise KeyError(analysis_id)
        return self.folder / analysis_id

    def get_meta(self, analysis_id: str) -> dict | None:
        with self._lock:
            if analysis_id in self._meta:
                return dict(self._meta[analysis_id])
        try:
            path = self._dir(analysis_id) / "meta.json"
        except KeyError:
            return None
        if not path.is_file():
            return None
        meta = json.loads(path.read_text())
        with self._lock:
            self._meta.setdefault(analysis_id, meta)
        return dict(meta)

    def claim(self, analysis_id: str, meta: dict) -> bool:
        with self._lock:
            existing = self.get_meta(analysis_id)
            if existing is not None and existing["status"] != "failed":
                return False
            self._meta[analysis_id] = dict(meta)
            return True

    def update_meta(self, analysis_id: str, **fields: Any) -> None:
        with self._lock:
            meta = self._meta.setdefault(analysis_id, {})
            meta.update(fields, updated=time.time())

    def _save_encoded(self, analysis_id: str, summary: dict, header: dict, blobs: dict[str, bytes]) -> None:
        target = self._dir(analysis_id)
        staging = target.with_name(target.name + f".tmp{os.getpid()}-{threading.get_ident()}")
        shutil.rmtree(staging, ignore_errors=True)
        (staging / "pooled").mkdir(parents=True)
        (staging / "summary.json").write_bytes(dumps(summary))
        (staging / "pooled.json").write_text(json.dumps(header))
        names = {}
        for index, (name, blob) in enumerate(blobs.items()):
            (staging / "pooled" / f"{index}.f32").write_bytes(blob)
            names[name] = f"{index}.f32"
        (staging / "pooled" / "index.json").write_text(json.dumps(names))
        with self._lock:
            self.update_meta(analysis_id, status="done", stage="done", progress=1.0, error=None)
            (staging / "meta.json").write_text(json.dumps(self._meta[analysis_id]))
            shutil.rmtree(target, ignore_errors=True)
            staging.rename(target)
            self._summaries.pop(analysis_id, None)
            self._partials.pop(analysis_id, None)

    def _read_json(self, analysis_id: str, name: str) -> Any:
        try:
            path = self._dir(analysis_id) / name
        except KeyError:
            return None
        return json.loads(path.read_text()) if path.is_file() else None

    def get_summary_json(self, analysis_id: str) -> bytes | None:
        with self._lock:
            raw = self._summaries.get(analysis_id)
            if raw is not None:
                self._summaries.move_to_end(analysis_id)
                return raw
        try:
            path = self._dir(analysis_id) / "summary.json"
            raw = path.read_bytes()
        except (KeyError, FileNotFoundError):
            return None
        with self._lock:
            self._summaries[analysis_id] = raw
            while len(self._summaries) > self.SUMMARY_CACHE_SIZE:
                self._summaries.popitem(last=False)
        return raw

    def get_pooled_header(self, analysis_id: str) -> dict | None:
        return self._read_json(analysis_id, "pooled.json")

    def get_pooled_blob(self, analysis_id: str, stat: str, tensor: str) -> bytes | None:
        names = self._read_json(analysis_id, "pooled/index.json") or {}
        name = names.get(f"{stat}/{tensor}")
        return (self._dir(analysis_id) / "pooled" / name).read_bytes() if name else None

    def _pooled_blobs(self, analysis_id: str) -> dict[str, bytes] | None:
        names = self._read_json(analysis_id, "pooled/index.json")
        if names is None:
            return None
        folder = self._dir(analysis_id) / "pooled"
        try:
            return {key: (folder / name).read_bytes() for key, name in names.items()}
        except FileNotFoundError:  # evicted while read
            return None

    def save_partial(self, analysis_id: str, partial: dict) -> None:
        with self._lock:
            self._partials[analysis_id] = dumps(partial)

    def get_partial_json(self, analysis_id: str) -> bytes | None:
        with self._lock:
            return self._partials.get(analysis_id)

    def _drop_partial(self, analysis_id: str) -> None:
        with self._lock:
            self._partials.pop(analysis_id, None)

    def touch_lease(self, analysis_id: str) -> None:
        with self._lock:
            self._leases[analysis_id] = time.monotonic()

    def lease_alive(self, analysis_id: str) -> bool:
        with self._lock:
            touched = self._leases.get(analysis_id)
        return touched is not None and time.monotonic() - touched < LEASE_TTL_S

    def _recent_path(self, index: str) -> Path:
        if not index.isalnum():
            raise KeyError(index)
        return self.folder / f"recent-{index}.json"  # never an analysis folder: those are hex ids

    def remember_recent(self, index: str, item_id: str, limit: int = RECENT_LIMIT) -> None:
        path = self._recent_path(index)
        with self._lock:
            ids = [item_id, *(other for other in self.recent(index, limit) if other != item_id)][:limit]
            self.folder.mkdir(parents=True, exist_ok=True)
            staging = path.with_name(f".{path.name}.{os.getpid()}-{threading.get_ident()}")
            staging.write_text(json.dumps(ids))
            staging.replace(path)  # a restart finds the list whole, never half-written

    def recent(self, index: str, limit: int = RECENT_LIMIT) -> list[str]:
        path = self._recent_path(index)
        with self._lock:
            try:
                ids = json.loads(path.read_text())
            except (FileNotFoundError, ValueError):
                return []
        return [str(item) for item in ids if isinstance(item, str)][:limit]

    def request_cancel(self, analysis_id: str, cancel: bool = True) -> None:
        with self._lock:
            if cancel:
                self._cancelled.add(analysis_id)
            else:
                self._cancelled.discard(analysis_id)

    def cancel_requested(self, analysis_id: str) -> bool:
        with self._lock:
            return analysis_id in self._cancelled

    def publish_rate(self, worker: str, model_id: str, flops_per_second: float) -> None:
        with self._lock:
            self._rates.setdefault(model_id, {})[worker] = float(flops_per_second)

    def rates(self, model_id: str) -> dict[str, float]:
        with self._lock:
            return dict(self._rates.get(model_id, {}))

    def count(self, counter: str) -> int:
        with self._lock:
            self._counters[counter] = self._counters.get(counter, 0) + 1
            return self._counters[counter]

    def read_counter(self, counter: str) -> int:
        with self._lock:
            return self._counters.get(counter, 0)
