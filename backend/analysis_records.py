"""The analyses themselves: validate, key, look up the cache, enqueue, and read the status records and
finished summaries back."""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable

from backend import registry
from backend.cost import cheaper_methods, estimate_cost, slowest_live_rate
from backend.fastjson import dumps, is_strict_json_object, loads
from backend.memory_estimate import refuse_over_memory
from backend.model_catalog import ModelCatalog
from backend.normalize import RequestError, normalize
from backend.queue import ANALYSIS_FUNCTION, JobQueue
from backend.schemas import AnalysisCreate, AnalysisJob, AnalysisPublic, CostEstimate, JobStatus
from backend.service_error import ServiceError
from backend.settings import Settings
from backend.store import Store, StoredAnalysis
from backend.summary import AnalysisSummary
from backend.vocabulary import CANCELLED, CANCELLING

# `AnalysisPublic` serializes `result` last; a cache hit replaces this tail with the stored summary.
_NULL_RESULT_TAIL = b',"result":null}'
# ... and a running analysis's latest partial result is spliced in the same way, before it.
_NULL_PARTIAL_TAIL = b',"partial":null,"result":null}'
SUMMARIES_KEPT = 16  # parsed finished summaries kept for the per-position and compare views


class AnalysisRecords(ModelCatalog):
    """Submit an analysis (cached, or queued once however often asked) and read its record back."""

    def __init__(self, settings: Settings, store: Store, queue: JobQueue) -> None:
        super().__init__(settings)
        self.store = store
        self.queue = queue
        self._summaries: OrderedDict[str, dict] = OrderedDict()
        # what keeps the service from answering at full speed yet (a model loading), or None; the
        # composition that runs a worker in this process sets it
        self.warming: Callable[[], str | None] = lambda: None

    def flops_per_second(self, model_id: str) -> float:
        """The slowest live worker's measured rate for the model, else the configured one."""
        rate = slowest_live_rate(self.store.rates(model_id), self.queue.live_workers())
        return self.settings.flops_per_second if rate is None else rate

    def submit(self, create: AnalysisCreate) -> tuple[AnalysisPublic, int]:
        """200 with the finished analysis when cached, else 202 (queued once however often asked)."""
        analysis_id, (meta, summary_json) = self.submit_id(create)
        public = self._public(analysis_id, meta, loads(summary_json) if summary_json else None)
        return public, 200 if public.status == JobStatus.done else 202

    def submit_json(self, create: AnalysisCreate) -> tuple[bytes, int]:
        """As `submit`, answering the response body as JSON bytes (the cached summary spliced in)."""
        body, status = self._public_json(*self.submit_id(create))
        return body, 200 if status == JobStatus.done else 202

    def submit_id(self, create: AnalysisCreate) -> tuple[str, StoredAnalysis]:
        """Validate, key and (unless cached or in flight) enqueue `create`: the id and what is stored."""
        info, codec = self.resolve_model(create.model)
        return self.submit_job(info, normalize(create, codec, info, self.settings.limits()))

    def submit_job(self, info: registry.ModelInfo, job: AnalysisJob) -> tuple[str, StoredAnalysis]:
        """Key and (unless cached, in flight or over the budget) enqueue a normalized job."""
        settings = self.settings
        estimate = estimate_cost(
            info,
            job,
            self.flops_per_second(info.id),
            settings.engine_memory_bytes,
            partials=True,
            sums_memory_bytes=settings.sums_memory_bytes,
        )
        refuse_over_memory(info, job, settings)
        if estimate.flops > self.settings.budget_flops:
            raise RequestError(
                f"this analysis is estimated at {estimate.flops / 1e12:.1f} TFLOP "
                f"(~{estimate.seconds:.0f} s), over the budget of {self.settings.cost_budget_tflop:g} TFLOP; "
                "shorten the prefix or continuation, or pick a cheaper method",
                status=422,
                field="method",
            ).with_estimate(estimate, cheaper_methods(info, job, self.settings.budget_flops))
        analysis_id = job.key()
        stored = self.store.read(analysis_id)
        meta = stored.meta
        if meta and meta.get("follows"):  # a sampled response already drawn: its own analysis
            followed = self.store.get_meta(meta["follows"])
            if followed is not None and followed["status"] == JobStatus.failed and "request" in followed:
                # asked again after it failed (or was cancelled): the drawn response's analysis runs again
                return self.submit_job(info, AnalysisJob.model_validate(followed["request"]))
            return self._resolve(analysis_id)
        if meta and meta["status"] != JobStatus.done:
            # asked again after a cancel, or while cancelling: it runs (or goes on)
            self.store.request_cancel(analysis_id, cancel=False)
        if meta and meta["status"] == JobStatus.done:
            if stored.summary_json is not None:
                return analysis_id, stored  # the cache hit: one store read in all
            self.store.fail(analysis_id, "the cached result expired")
            meta = self.store.get_meta(analysis_id)
        retry = meta is None or meta["status"] == JobStatus.failed
        if retry and self.store.claim(analysis_id, queued_meta(job, estimate)):
            self.queue.enqueue(ANALYSIS_FUNCTION, job.model_dump(mode="json"), analysis_id)
        return self._resolve(analysis_id)

    def with_rho_json(self, analysis_id: str) -> tuple[bytes, int]:
        """The analysis ``analysis_id`` with rho: itself where it has rho (on the policy it is free),
        else the same request with the Fisher under p, answered or queued like a POST."""
        analysis_id, stored = self._resolve(analysis_id)
        assert stored.meta is not None  # _resolve answers 404 for an id with no analysis
        job = AnalysisJob.model_validate(stored.meta["request"])
        if job.rho or job.sampler.is_on_policy:
            body, status = self._public_json(analysis_id, stored)
        else:
            info, _ = self.resolve_model(job.model)
            body, status = self._public_json(*self.submit_job(info, job.model_copy(update={"rho": True})))
        return body, 200 if status == JobStatus.done else 202

    def cancel_json(self, analysis_id: str) -> tuple[bytes, int]:
        """Stop an analysis: a queued one fails at once as cancelled (200); a running one is asked to
        stop and its worker fails it at its next report (202, stage ``cancelling``); a failed one
        is answered as it is (200). A finished one is refused (409): its result is the cache's.
        A sampled response's id cancels the analysis it follows, or its sampling."""
        analysis_id, stored = self._resolve(analysis_id)
        assert stored.meta is not None  # _resolve answers 404 for an id with no analysis
        status = stored.meta["status"]
        if status == JobStatus.done:
            raise ServiceError(
                409, f"analysis {analysis_id} is done: there is nothing to cancel (its result stays cached)"
            )
        if status != JobStatus.failed:
            self.store.request_cancel(analysis_id)
            if status == JobStatus.queued:
                self.store.fail(analysis_id, CANCELLED)
            # a running one's record is the worker's to write (the API writing it too could undo the
            # worker's last write): its stage reads `cancelling` while the request stands (`_public`)
        body, status = self._public_json(*self._resolve(analysis_id))
        return body, 202 if status == JobStatus.running else 200

    def _resolve(self, analysis_id: str) -> tuple[str, StoredAnalysis]:
        """The analysis an id answers for, and what is stored of it.

        A request whose response was to be sampled follows, once the response is drawn, the analysis
        of that concrete response (`meta.follows`), so a link with a seed finds the cached result.
        """
        stored = self.store.read(analysis_id)
        if stored.meta is not None and stored.meta.get("follows"):
            analysis_id = stored.meta["follows"]
            stored = self.store.read(analysis_id)
        if stored.meta is not None and stored.meta.get("kind") is not None:  # a study's records
            raise ServiceError(404, f"{analysis_id!r} is not an analysis (a study's? GET /api/v1/studies/ID)")
        if stored.meta is None or "request" not in stored.meta:
            raise ServiceError(404, f"no analysis with id {analysis_id!r}; POST /api/v1/analyses first")
        return analysis_id, stored

    def _public(self, analysis_id: str, meta: dict | None, result: dict | None) -> AnalysisPublic:
        if meta is None:  # _resolve and submit_id answer 404 before this
            raise ServiceError(404, f"no analysis with id {analysis_id!r}; POST /api/v1/analyses first")
        stage = meta.get("stage")
        if meta["status"] == JobStatus.running and self.store.cancel_requested(analysis_id):
            stage = CANCELLING
        return AnalysisPublic(
            id=analysis_id,
            status=meta["status"],
            progress=meta.get("progress") or 0.0,
            stage=stage,
            request=AnalysisJob.model_validate(meta["request"]),
            cost=meta.get("cost"),
            error=meta.get("error"),
            result=None if result is None else AnalysisSummary.model_validate(result),
        )

    def get(self, analysis_id: str) -> AnalysisPublic:
        analysis_id, (meta, summary_json) = self._resolve(analysis_id)
        return self._public(analysis_id, meta, loads(_strict(summary_json)) if summary_json else None)

    def get_json(self, analysis_id: str) -> bytes:
        """The body of GET /api/v1/analyses/{id} as JSON bytes (same schema as `get`)."""
        return self._public_json(*self._resolve(analysis_id))[0]

    def _public_json(self, analysis_id: str, stored: StoredAnalysis) -> tuple[bytes, JobStatus]:
        """Everything but the summary goes through `AnalysisPublic` (so the schema is the pinned one);
        the stored summary bytes are spliced in as `result`, never parsed on this path."""
        meta, summary_json = stored
        public = self._public(analysis_id, meta, None)
        head = public.model_dump_json().encode("utf-8")
        if summary_json is None:
            partial = self.store.get_partial_json(analysis_id) if public.status == JobStatus.running else None
            if partial is not None and head.endswith(_NULL_PARTIAL_TAIL):
                head = head[: -len(_NULL_PARTIAL_TAIL)] + b',"partial":' + partial + _NULL_RESULT_TAIL
            return head, public.status
        return head[: -len(_NULL_RESULT_TAIL)] + b',"result":' + _strict(summary_json) + b"}", public.status

    def _done(self, analysis_id: str) -> tuple[str, StoredAnalysis]:
        """The analysis an id answers for and its stored result (unparsed), or 409 when not done."""
        analysis_id, stored = self._resolve(analysis_id)
        status = stored.meta["status"]  # type: ignore[index]
        if status != JobStatus.done:
            raise ServiceError(409, f"analysis {analysis_id} is {status}, not done yet")
        return analysis_id, stored

    def summary(self, analysis_id: str) -> tuple[str, dict]:
        """The finished summary, parsed once per id and kept (a few, most recent) for the views of it."""
        analysis_id, stored = self._done(analysis_id)
        if analysis_id not in self._summaries:
            self._summaries[analysis_id] = loads(stored.summary_json or b"{}")
            while len(self._summaries) > SUMMARIES_KEPT:
                self._summaries.popitem(last=False)
        self._summaries.move_to_end(analysis_id)
        return analysis_id, self._summaries[analysis_id]


def queued_meta(job: AnalysisJob, estimate: CostEstimate | None) -> dict:
    """The status record of a job just queued (by the API, or by a worker that drew a response)."""
    return {
        "status": JobStatus.queued.value,
        "progress": 0.0,
        "stage": None,
        "error": None,
        "request": job.model_dump(mode="json"),
        "cost": None if estimate is None else estimate.model_dump(),
        "created": time.time(),
    }


def _strict(summary_json: bytes) -> bytes:
    """Stored summary bytes as strict JSON: an older store's NaN or Infinity written again as null."""
    return summary_json if is_strict_json_object(summary_json) else dumps(loads(summary_json))
