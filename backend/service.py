"""What the routes do: validate, key, look up the cache, enqueue, and read results back.

Why a class apart from the routes: the same operations serve Redis mode and embedded mode (they differ
only in the store and queue passed in), and tests can drive them without HTTP.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path

import numpy as np

from backend import registry
from backend.compare import set_comparison, tensor_pairs
from backend.cost import cheaper_methods, estimate_cost
from backend.disk import mark_used
from backend.export_choice import BYTES_PER_VALUE, check_selects_something, export_key, export_record
from backend.fastjson import dumps, is_strict_json_object, loads
from backend.normalize import RequestError, check_model_id, check_text, normalize
from backend.queue import ANALYSIS_FUNCTION, EXPORT_FUNCTION, JobQueue
from backend.schemas import (
    AnalysisCreate,
    AnalysisJob,
    AnalysisPublic,
    CertificatePublic,
    ComparePublic,
    CostEstimate,
    ExportChoice,
    JobStatus,
    ModelPublic,
    PooledView,
    SetComparison,
    TensorPair,
    TensorView,
    TokenizeResponse,
    TokenPiece,
    TopCoordinate,
    TopCoordinates,
)
from backend.settings import Settings
from backend.store import Store, StoredAnalysis, decode_view
from backend.summary import AnalysisSummary, PositionEntry
from backend.tokens import TokenCodec, codec_for_file
from backend.vocabulary import STATS, TOP_FRACTIONS

# `AnalysisPublic` serializes `result` last; a cache hit replaces this tail with the stored summary.
_NULL_RESULT_TAIL = b',"result":null}'
# ... and a running analysis's latest partial result is spliced in the same way, before it.
_NULL_PARTIAL_TAIL = b',"partial":null,"result":null}'
SUMMARIES_KEPT = 16  # parsed finished summaries kept for the per-position and compare views


class ServiceError(Exception):
    """An answer other than 2xx that is not about the request's content (404, 409, 503)."""

    def __init__(self, status: int, detail: str) -> None:
        super().__init__(detail)
        self.status = status
        self.detail = detail


class AnalysisService:
    def __init__(self, settings: Settings, store: Store, queue: JobQueue) -> None:
        self.settings = settings
        self.store = store
        self.queue = queue
        self._summaries: OrderedDict[str, dict] = OrderedDict()
        self._models: dict[str, tuple[int, registry.ModelInfo, TokenCodec]] = {}
        # what keeps the service from answering at full speed yet (a model loading), or None; the
        # composition that runs a worker in this process sets it
        self.warming: Callable[[], str | None] = lambda: None

    # --- models and tokens -------------------------------------------------------------------
    def resolve_model(self, model_id: str) -> tuple[registry.ModelInfo, TokenCodec]:
        """The manifest and codec of an allowed model, cached until its manifest file changes.

        Why cached: every POST needs both; reading the manifest and stat-ing the tokenizer on each
        request is most of a cache hit's cost. One stat of the manifest (written last when a model is
        fetched) tells whether a refetch happened.
        """
        check_model_id(model_id, self.allowed_models())
        try:
            manifest = registry.model_dir(model_id) / registry.MANIFEST_NAME
            try:
                stamp = manifest.stat().st_mtime_ns
            except FileNotFoundError:
                raise registry.ModelNotAvailable(model_id) from None
            cached = self._models.get(model_id)
            if cached is not None and cached[0] == stamp:
                return cached[1], cached[2]
            info = registry.model_info(model_id)
            codec = codec_for_file(registry.tokenizer_path(model_id))
            self._models[model_id] = (stamp, info, codec)
            return info, codec
        except registry.UnknownModel as error:
            raise RequestError(str(error), field="model") from None
        except registry.ModelNotAvailable as error:
            raise ServiceError(503, str(error)) from None

    def allowed_models(self) -> list[str]:
        """The ids this service answers for: the operator's list, else every id in the registry."""
        known = registry.list_models()
        allowed = self.settings.allowed_models
        return known if allowed is None else [model_id for model_id in allowed if model_id in known]

    def models(self) -> list[ModelPublic]:
        answers = []
        for model_id in self.allowed_models():
            if not registry.is_available(model_id):
                answers.append(ModelPublic(id=model_id, available=False))
                continue
            info = registry.model_info(model_id)
            certificate = registry.read_certificate(info.digest, info.dtype)
            answers.append(
                ModelPublic(
                    id=model_id,
                    available=True,
                    n_params=info.n_params,
                    size_bytes=info.size_bytes,
                    vocab_size=info.vocab_size,
                    n_layers=info.n_layers,
                    d_model=info.d_model,
                    digest=info.digest,
                    architecture=info.architecture,
                    dtype=info.dtype,
                    description=info.description,
                    registered=info.registered,
                    certificate=None
                    if certificate is None
                    else CertificatePublic.model_validate(certificate),
                )
            )
        return answers

    def tokenize(self, model_id: str, text: str, special_tokens: bool) -> TokenizeResponse:
        _, codec = self.resolve_model(model_id)
        check_text(text, "text")
        ids = codec.encode_prefix(text) if special_tokens else codec.encode_continuation(text)
        pieces = [TokenPiece(**piece) for piece in codec.pieces(ids)]
        return TokenizeResponse(model=model_id, text=text, special_tokens=special_tokens, tokens=pieces)

    # --- analyses ----------------------------------------------------------------------------
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
        job = normalize(create, codec, info, self.settings.limits())
        estimate = estimate_cost(info, job, self.settings.flops_per_second)
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
            return self._resolve(analysis_id)
        if meta and meta["status"] == JobStatus.done:
            if stored.summary_json is not None:
                return analysis_id, stored  # the cache hit: one store read in all
            self.store.fail(analysis_id, "the cached result expired")
            meta = self.store.get_meta(analysis_id)
        retry = meta is None or meta["status"] == JobStatus.failed
        if retry and self.store.claim(analysis_id, queued_meta(job, estimate)):
            self.queue.enqueue(ANALYSIS_FUNCTION, job.model_dump(mode="json"), analysis_id)
        return self._resolve(analysis_id)

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
        return AnalysisPublic(
            id=analysis_id,
            status=meta["status"],
            progress=meta.get("progress") or 0.0,
            stage=meta.get("stage"),
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
        """The finished summary, parsed once per id and kept (a few, most recent) for the views below."""
        analysis_id, stored = self._done(analysis_id)
        if analysis_id not in self._summaries:
            self._summaries[analysis_id] = loads(stored.summary_json or b"{}")
            while len(self._summaries) > SUMMARIES_KEPT:
                self._summaries.popitem(last=False)
        self._summaries.move_to_end(analysis_id)
        return analysis_id, self._summaries[analysis_id]

    def overview(self, analysis_id: str) -> dict:
        """The summary with only its first position whole, and every position in brief: what the
        slides draw, the same size for a 64-token response as for a prefix."""
        _, summary = self.summary(analysis_id)
        positions = summary["positions"]
        index = [
            PositionEntry(index=p["index"], context_length=p["context_length"], target=p.get("target"))
            for p in positions
        ]
        return {
            **summary,
            "positions": positions[:1],
            "position_index": [e.model_dump() for e in index],
            "vocabulary": self._row_tokens(summary),
        }

    def _row_tokens(self, summary: dict) -> dict[str, str]:
        """The token of every vocabulary row among the top coordinates (embedding, output layer), by
        id, so a reader sees ' Paris' where the row index is 7042. Empty when the model's tokenizer is
        no longer here: the ids still stand."""
        model = summary.get("model") or {}
        shapes = {t["name"]: t.get("shape") or [] for t in summary.get("tensors") or []}
        rows = {
            int(c["index"][0])
            for coordinates in (summary.get("top_coordinates") or {}).values()
            for c in coordinates
            if c.get("index") and (shapes.get(c.get("tensor")) or [None])[0] == model.get("vocab_size")
        }
        texts = self._token_texts(model, sorted(rows)) if rows else None
        return (
            {} if texts is None else {str(row): text for row, text in zip(sorted(rows), texts, strict=True)}
        )

    def _token_texts(self, model: dict, ids: list[int]) -> list[str] | None:
        """The tokens of ``ids`` in the analysed model's tokenizer; None when that model is no longer
        here (removed, or no longer allowed): the dashboard then names rows by id."""
        try:
            _, codec = self.resolve_model(str(model.get("id")))
        except Exception:
            return None
        return [codec.token_text(int(i)) for i in ids]

    def position(self, analysis_id: str, index: int) -> dict:
        _, summary = self.summary(analysis_id)
        positions = summary["positions"]
        if not 0 <= index < len(positions):
            raise ServiceError(
                404, f"analysis {analysis_id} has positions 0 to {len(positions) - 1}, not {index}"
            )
        return positions[index]

    def compare(self, a: str, b: str) -> ComparePublic:
        """Top-q set overlap and Jaccard (against chance) and per-tensor totals of two analyses."""
        a, summary_a = self.summary(a)
        b, summary_b = self.summary(b)
        try:
            tensors = [TensorPair(**pair) for pair in tensor_pairs(summary_a, summary_b)]
        except ValueError as error:
            raise RequestError(str(error), field="b") from None
        levels = []
        for analysis_id in (a, b):
            path = self.settings.levels_path(analysis_id)
            if not path.is_file():
                raise ServiceError(
                    409,
                    f"the top-q sets of {analysis_id} are not on disk yet (written right after the "
                    "analysis, and removed when the exports folder is over its budget); retry, or POST it "
                    "again",
                )
            mark_used(path)
            levels.append(np.fromfile(path, dtype=np.uint8))
        sets = SetComparison(**set_comparison(levels[0], levels[1], TOP_FRACTIONS))
        return ComparePublic(a=a, b=b, sets=sets, tensors=tensors)

    def tensor_view(self, analysis_id: str, tensor: str, stat: str, rows: int, cols: int) -> TensorView:
        analysis_id, stored = self._done(analysis_id)
        _check_stat(stat)
        header = self.store.get_pooled_header(analysis_id) or {}
        entry = header.get(stat, {}).get(tensor)
        blob = self.store.get_pooled_blob(analysis_id, stat, tensor) if entry else None
        if entry is None or blob is None:
            raise ServiceError(404, f"no tensor {tensor!r} with stat {stat!r} in analysis {analysis_id}")
        view = coarsen(decode_view(entry, blob), rows, cols)
        model = (loads(stored.summary_json) if stored.summary_json else {}).get("model") or {}
        vocabulary_rows = view.row_edges[-1] == model.get("vocab_size")  # the embedding, the LM head
        row_tokens = self._token_texts(model, view.row_edges[:-1]) if vocabulary_rows else None
        return TensorView(tensor=tensor, stat=stat, view=view, row_tokens=row_tokens)

    def tensor_names(self, analysis_id: str) -> list[str]:
        analysis_id, _ = self._done(analysis_id)
        header = self.store.get_pooled_header(analysis_id) or {}
        return list(header.get("fisher", {}))

    def top(self, analysis_id: str, stat: str, limit: int) -> TopCoordinates:
        summary_json = self._done(analysis_id)[1].summary_json
        tops = (loads(summary_json) if summary_json else {}).get("top_coordinates") or {}
        if stat not in tops:
            raise ServiceError(404, f"no top coordinates for stat {stat!r}; available: {sorted(tops)}")
        return TopCoordinates(stat=stat, coordinates=[TopCoordinate(**c) for c in tops[stat][:limit]])

    def export(self, analysis_id: str, choice: ExportChoice) -> Path | AnalysisPublic:
        """One choice's safetensors file when it is written; else start writing it (once) and answer
        the analysis (its status says the export is under way)."""
        answer = self._export(analysis_id, choice, start=True)
        return self.get(analysis_id) if answer is None else answer

    def export_state(self, analysis_id: str, choice: ExportChoice) -> Path | AnalysisPublic | None:
        """As `export` without starting anything (HEAD): None when nobody asked for this choice yet."""
        return self._export(analysis_id, choice, start=False)

    def _export(self, analysis_id: str, choice: ExportChoice, start: bool) -> Path | AnalysisPublic | None:
        analysis_id, stored = self._done(analysis_id)
        meta = stored.meta or {}
        self._check_export(analysis_id, choice)
        path = self.settings.export_path(analysis_id, choice.slug())
        if path.is_file():
            mark_used(path)
            return path
        key = export_key(choice)
        record = meta.get(key) or {}
        if record.get("status") == "failed":
            if record.get("overflow"):  # the values are what they are: asking again changes nothing
                raise RequestError(record.get("error") or "float16 overflows; ask for float32", field="dtype")
            if start:  # say why once; the next request starts a fresh attempt
                self.store.update_meta(analysis_id, **{key: None})
            raise ServiceError(500, f"writing the arrays failed: {record.get('error') or 'no reason given'}")
        started = record.get("started") or 0.0
        if (
            record.get("status") in ("queued", "running")
            and time.time() - started <= self.settings.job_timeout_s
        ):
            return self.get(analysis_id)
        if not start:
            return None
        self.store.update_meta(analysis_id, **{key: export_record(choice, "queued")})
        job = AnalysisJob.model_validate(meta["request"])
        # the job names the analysis; the worker writes every choice queued in its record
        self.queue.enqueue(EXPORT_FUNCTION, job.model_dump(mode="json"), analysis_id)
        return self.get(analysis_id)

    def _check_export(self, analysis_id: str, choice: ExportChoice) -> None:
        """422 for a tensor selection that selects nothing, or a file larger than the exports budget."""
        _, summary = self.summary(analysis_id)
        numel = {tensor["name"]: int(tensor["numel"]) for tensor in summary.get("tensors") or []}
        kept = check_selects_something(choice, numel)
        size = sum(numel[name] for name in kept) * len(choice.stats) * BYTES_PER_VALUE[choice.dtype]
        budget = self.settings.exports_budget_bytes
        if size > budget:
            raise RequestError(
                f"this file would hold {size / 1e9:.2f} GB, over the exports budget of {budget / 1e9:.2f} GB "
                "(FISHERSCOPE_EXPORTS_BUDGET_BYTES); ask for fewer stats, some tensors, or float16",
                field="stats",
            )


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


def _check_stat(stat: str) -> None:
    if stat not in STATS:
        raise RequestError(f"stat must be one of {list(STATS)}; got {stat!r}", field="stat")


def _group_bounds(n_blocks: int, n_groups: int) -> np.ndarray:
    n_groups = max(1, min(n_groups, n_blocks))
    return np.unique(np.linspace(0, n_blocks, n_groups + 1).round().astype(int))


def _strict(summary_json: bytes) -> bytes:
    """Stored summary bytes as strict JSON: an older store's NaN or Infinity written again as null."""
    return summary_json if is_strict_json_object(summary_json) else dumps(loads(summary_json))


def coarsen(view: dict, rows: int, cols: int) -> PooledView:
    """Merge neighbouring blocks of a stored pooled view (block sums stay exact block sums)."""
    values = np.asarray(view["values"], dtype=np.float64)
    row_bounds = _group_bounds(values.shape[0], rows)
    col_bounds = _group_bounds(values.shape[1], cols)
    merged = np.add.reduceat(np.add.reduceat(values, row_bounds[:-1], axis=0), col_bounds[:-1], axis=1)
    row_edges = [int(view["row_edges"][i]) for i in row_bounds]
    col_edges = [int(view["col_edges"][i]) for i in col_bounds]
    return PooledView(
        shape=[int(n) for n in merged.shape],
        row_edges=row_edges,
        col_edges=col_edges,
        values=merged.tolist(),
    )
