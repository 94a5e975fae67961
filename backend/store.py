"""Where analyses live between the API and the worker: status, summary JSON, pooled float32 views.

Why two stores behind one interface: with REDIS_URL the API and any number of workers share Redis;
embedded, one process keeps them in memory and persists finished analyses to a folder so links survive
a restart. Nothing is pickled: metadata and summaries are JSON, pooled views are raw little-endian
float32 bytes plus a JSON header. Full per-parameter arrays never enter a store.
"""

from __future__ import annotations

import json
import time
from abc import ABC, abstractmethod
from typing import Any, NamedTuple

import numpy as np

from backend.fastjson import dumps, loads

# A running job refreshes its lease this often; a lease older than LEASE_TTL_S means the worker died.
LEASE_REFRESH_S = 2.0
LEASE_TTL_S = 10.0
# Recent-item lists (the studies people find again) keep this many ids; older ones drop off the end.
RECENT_LIMIT = 50
# a model's published worker rates outlive a quiet week; a worker that is gone is skipped by name
RATES_TTL_S = 7 * 24 * 3600
RECENT_STUDIES = "studies"
# counters (``Store.count``): analyses the engine computed whole, and those answered from another
# reward's analysis (workers.reward_reuse); a cache hit adds to neither
ENGINE_RUNS = "engine_runs"
REWARD_REUSES = "reward_reuses"
WORKER_DIED = (
    "the worker stopped (crashed, was killed or lost its connection) while running this analysis; "
    "POST the same request again to retry"
)


def _encode_pooled(pooled: dict[str, dict[str, dict]]) -> tuple[dict, dict[str, bytes]]:
    """Split `{stat: {tensor: PooledView}}` into a JSON header and float32 blobs keyed `stat/tensor`."""
    header: dict[str, dict[str, dict]] = {}
    blobs: dict[str, bytes] = {}
    for stat, views in pooled.items():
        header[stat] = {}
        for tensor, view in views.items():
            values = np.asarray(view["values"], dtype="<f4")
            header[stat][tensor] = {
                "shape": [int(n) for n in values.shape],
                "row_edges": [int(e) for e in view["row_edges"]],
                "col_edges": [int(e) for e in view["col_edges"]],
            }
            blobs[f"{stat}/{tensor}"] = values.tobytes()
    return header, blobs


def decode_view(entry: dict, blob: bytes) -> dict:
    values = np.frombuffer(blob, dtype="<f4").reshape(entry["shape"])
    return {**entry, "values": values}


class StoredAnalysis(NamedTuple):
    """What one read of an analysis returns: its meta and, when done, the summary as stored JSON bytes."""

    meta: dict | None
    summary_json: bytes | None


class Store(ABC):
    """Status records (`meta`), summaries and pooled views of analyses, keyed by analysis id.

    A worker refreshes a running job's lease every `lease_refresh_s`; a lease older than `LEASE_TTL_S`
    means the worker died.
    """

    lease_refresh_s = LEASE_REFRESH_S

    @staticmethod
    def encoded_size(pooled: dict[str, dict[str, dict]]) -> int:
        """Bytes the pooled views `{stat: {tensor: view}}` take in a store (float32 values)."""
        return sum(
            4 * np.asarray(view["values"]).size for views in pooled.values() for view in views.values()
        )

    def save_result(self, analysis_id: str, summary: dict, pooled: dict[str, dict[str, dict]]) -> None:
        """Store the summary and pooled views `{stat: {tensor: view}}`, then mark the analysis done."""
        header, blobs = _encode_pooled(pooled)
        self._save_encoded(analysis_id, summary, header, blobs)

    @abstractmethod
    def ping(self) -> None: ...

    @abstractmethod
    def get_meta(self, analysis_id: str) -> dict | None: ...

    @abstractmethod
    def claim(self, analysis_id: str, meta: dict) -> bool:
        """Write `meta` unless a live (non-failed) record exists; True when the caller must enqueue."""

    @abstractmethod
    def update_meta(self, analysis_id: str, **fields: Any) -> None: ...

    @abstractmethod
    def _save_encoded(self, analysis_id: str, summary: dict, header: dict, blobs: dict[str, bytes]) -> None:
        """Store the summary and the encoded pooled views, then mark the analysis done."""

    @abstractmethod
    def get_pooled_header(self, analysis_id: str) -> dict | None: ...

    @abstractmethod
    def get_pooled_blob(self, analysis_id: str, stat: str, tensor: str) -> bytes | None: ...

    def get_pooled(self, analysis_id: str) -> dict[str, dict[str, dict]] | None:
        """Every pooled view of a done analysis, as ``save_result`` took them; None when any is gone."""
        header = self.get_pooled_header(analysis_id)
        blobs = self._pooled_blobs(analysis_id) if header is not None else None
        if header is None or blobs is None:
            return None
        out: dict[str, dict[str, dict]] = {}
        for stat, views in header.items():
            out[stat] = {}
            for tensor, entry in views.items():
                blob = blobs.get(f"{stat}/{tensor}")
                if blob is None:
                    return None
                out[stat][tensor] = decode_view(entry, blob)
        return out

    @abstractmethod
    def _pooled_blobs(self, analysis_id: str) -> dict[str, bytes] | None:
        """Every blob of an analysis's pooled views, keyed ``stat/tensor``, in one read."""

    @abstractmethod
    def save_partial(self, analysis_id: str, partial: dict) -> None:
        """The latest partial result of a running analysis (replaced by the next, dropped when done)."""

    @abstractmethod
    def get_partial_json(self, analysis_id: str) -> bytes | None: ...

    @abstractmethod
    def touch_lease(self, analysis_id: str) -> None: ...

    @abstractmethod
    def lease_alive(self, analysis_id: str) -> bool: ...

    @abstractmethod
    def count(self, counter: str) -> int:
        """Increment and return a named counter (e.g. engine runs, which the cache tests read)."""

    @abstractmethod
    def read_counter(self, counter: str) -> int: ...

    def set_progress(self, analysis_id: str, stage: str, progress: float) -> None:
        self.update_meta(analysis_id, status="running", stage=stage, progress=min(max(progress, 0.0), 1.0))
        self.touch_lease(analysis_id)

    def fail(self, analysis_id: str, error: str, permanent: bool = False) -> None:
        """Mark a job failed. ``permanent``: the request itself cannot succeed (a reward pattern that
        fails on a response), so submitting it again queues nothing and the error says what to change."""
        self.update_meta(analysis_id, status="failed", error=error, permanent=permanent)
        self._drop_partial(analysis_id)

    @abstractmethod
    def _drop_partial(self, analysis_id: str) -> None: ...

    def checked_meta(self, analysis_id: str) -> dict | None:
        """The meta, with a running job whose worker died turned into failed (never running forever)."""
        meta = self.get_meta(analysis_id)
        if meta and meta["status"] == "running" and not self.lease_alive(analysis_id):
            self.fail(analysis_id, WORKER_DIED)
            meta = self.get_meta(analysis_id)
        return meta

    def read(self, analysis_id: str) -> StoredAnalysis:
        """Meta (checked as in `checked_meta`) and, when done, the summary's JSON bytes, unparsed.

        Why bytes: a cache hit answers with the stored summary spliced into the response body, so the
        hot path never parses, validates and re-serializes hundreds of kB of JSON.
        """
        meta = self.checked_meta(analysis_id)
        done = meta is not None and meta["status"] == "done"
        return StoredAnalysis(meta, self.get_summary_json(analysis_id) if done else None)

    @abstractmethod
    def get_summary_json(self, analysis_id: str) -> bytes | None: ...

    @abstractmethod
    def remember_recent(self, index: str, item_id: str, limit: int = RECENT_LIMIT) -> None:
        """Put ``item_id`` first in the bounded list ``index`` (once: an id already there moves up)."""

    @abstractmethod
    def request_cancel(self, analysis_id: str, cancel: bool = True) -> None:
        """Ask whoever runs (or will run) an analysis to stop at its next chunk of work; ``cancel=False``
        withdraws the request (the same request POSTed again)."""

    @abstractmethod
    def cancel_requested(self, analysis_id: str) -> bool:
        """Why a flag of its own rather than a field of the meta: the worker rewrites the meta at every
        progress step and would overwrite a field the API set in between."""

    @abstractmethod
    def publish_rate(self, worker: str, model_id: str, flops_per_second: float) -> None:
        """A worker's measured float32 matmul rate for a model, by worker name (its last one)."""

    @abstractmethod
    def rates(self, model_id: str) -> dict[str, float]:
        """The rates workers have published for a model, by worker name (live or not)."""

    @abstractmethod
    def recent(self, index: str, limit: int = RECENT_LIMIT) -> list[str]:
        """The ids of ``index``, most recently remembered first; some may name records since expired."""


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


class RedisStore(Store):
    """Redis keys `fs:meta:<id>` (JSON), `fs:summary:<id>` (JSON), `fs:pooled:<id>` (hash of bytes)."""

    def __init__(self, redis: Any, ttl_s: int, prefix: str = "fs") -> None:
        self.redis = redis
        self.ttl_s = ttl_s
        self.prefix = prefix

    def _key(self, kind: str, analysis_id: str) -> str:
        return f"{self.prefix}:{kind}:{analysis_id}"

    def ping(self) -> None:
        self.redis.ping()

    def get_meta(self, analysis_id: str) -> dict | None:
        raw = self.redis.get(self._key("meta", analysis_id))
        return loads(raw) if raw else None

    def read(self, analysis_id: str) -> StoredAnalysis:
        """One round trip (MGET of meta, summary and lease) for the common case."""
        keys = [self._key(kind, analysis_id) for kind in ("meta", "summary", "lease")]
        raw_meta, summary_json, lease = self.redis.mget(keys)
        meta = loads(raw_meta) if raw_meta else None
        if meta is None:
            return StoredAnalysis(None, None)
        if meta["status"] == "running" and lease is None:
            return super().read(analysis_id)  # the worker died: the slow path marks it failed
        return StoredAnalysis(meta, summary_json if meta["status"] == "done" and summary_json else None)

    def claim(self, analysis_id: str, meta: dict) -> bool:
        key = self._key("meta", analysis_id)
        if self.redis.set(key, json.dumps(meta), nx=True, ex=self.ttl_s):
            return True
        existing = self.get_meta(analysis_id)
        if existing is None or existing["status"] != "failed":
            return False
        # A failed analysis is retried by whoever wins this short lock.
        if not self.redis.set(self._key("retry", analysis_id), "1", nx=True, ex=5):
            return False
        self.redis.set(key, json.dumps(meta), ex=self.ttl_s)
        return True

    def update_meta(self, analysis_id: str, **fields: Any) -> None:
        key = self._key("meta", analysis_id)
        meta = self.get_meta(analysis_id) or {}
        meta.update(fields, updated=time.time())
        self.redis.set(key, json.dumps(meta), ex=self.ttl_s)

    def _save_encoded(self, analysis_id: str, summary: dict, header: dict, blobs: dict[str, bytes]) -> None:
        pooled_key = self._key("pooled", analysis_id)
        pipe = self.redis.pipeline(transaction=True)
        pipe.set(self._key("summary", analysis_id), dumps(summary), ex=self.ttl_s)
        pipe.delete(pooled_key)
        pipe.hset(pooled_key, mapping={"__header__": json.dumps(header), **blobs})
        pipe.expire(pooled_key, self.ttl_s)
        pipe.delete(self._key("partial", analysis_id))
        pipe.execute()
        self.update_meta(analysis_id, status="done", stage="done", progress=1.0, error=None)

    def get_summary_json(self, analysis_id: str) -> bytes | None:
        return self.redis.get(self._key("summary", analysis_id))

    def get_pooled_header(self, analysis_id: str) -> dict | None:
        raw = self.redis.hget(self._key("pooled", analysis_id), "__header__")
        return loads(raw) if raw else None

    def get_pooled_blob(self, analysis_id: str, stat: str, tensor: str) -> bytes | None:
        return self.redis.hget(self._key("pooled", analysis_id), f"{stat}/{tensor}")

    def _pooled_blobs(self, analysis_id: str) -> dict[str, bytes] | None:
        raw = self.redis.hgetall(self._key("pooled", analysis_id))
        return {key.decode(): value for key, value in raw.items() if key != b"__header__"} if raw else None

    def save_partial(self, analysis_id: str, partial: dict) -> None:
        self.redis.set(self._key("partial", analysis_id), dumps(partial), ex=self.ttl_s)

    def get_partial_json(self, analysis_id: str) -> bytes | None:
        return self.redis.get(self._key("partial", analysis_id))

    def _drop_partial(self, analysis_id: str) -> None:
        self.redis.delete(self._key("partial", analysis_id))

    def touch_lease(self, analysis_id: str) -> None:
        self.redis.set(self._key("lease", analysis_id), "1", px=int(LEASE_TTL_S * 1000))

    def lease_alive(self, analysis_id: str) -> bool:
        return bool(self.redis.exists(self._key("lease", analysis_id)))

    def remember_recent(self, index: str, item_id: str, limit: int = RECENT_LIMIT) -> None:
        key = f"{self.prefix}:recent:{index}"
        pipe = self.redis.pipeline(transaction=True)
        pipe.lrem(key, 0, item_id)
        pipe.lpush(key, item_id)
        pipe.ltrim(key, 0, limit - 1)
        pipe.execute()

    def recent(self, index: str, limit: int = RECENT_LIMIT) -> list[str]:
        raw = self.redis.lrange(f"{self.prefix}:recent:{index}", 0, limit - 1)
        return [item.decode() if isinstance(item, bytes) else str(item) for item in raw]

    def request_cancel(self, analysis_id: str, cancel: bool = True) -> None:
        if cancel:
            self.redis.set(self._key("cancel", analysis_id), "1", ex=self.ttl_s)
        else:
            self.redis.delete(self._key("cancel", analysis_id))

    def cancel_requested(self, analysis_id: str) -> bool:
        return bool(self.redis.exists(self._key("cancel", analysis_id)))

    def publish_rate(self, worker: str, model_id: str, flops_per_second: float) -> None:
        key = f"{self.prefix}:rates:{model_id}"
        pipe = self.redis.pipeline(transaction=True)
        pipe.hset(key, worker, repr(float(flops_per_second)))
        pipe.expire(key, RATES_TTL_S)
        pipe.execute()

    def rates(self, model_id: str) -> dict[str, float]:
        found = self.redis.hgetall(f"{self.prefix}:rates:{model_id}")
        return {_text(name): float(_text(rate)) for name, rate in found.items()}

    def count(self, counter: str) -> int:
        return int(self.redis.incr(f"{self.prefix}:count:{counter}"))

    def read_counter(self, counter: str) -> int:
        return int(self.redis.get(f"{self.prefix}:count:{counter}") or 0)
