"""Safetensors exports of a finished analysis: the file of one choice of stats, tensors and precision
when it is written, else its writing queued once (a worker writes it)."""

from __future__ import annotations

import time
from pathlib import Path

from backend.analysis_records import AnalysisRecords
from backend.disk import mark_used
from backend.export_choice import BYTES_PER_VALUE, check_selects_something, export_key, export_record
from backend.normalize import RequestError
from backend.queue import EXPORT_FUNCTION
from backend.schemas import AnalysisJob, AnalysisPublic, ExportChoice
from backend.service_error import ServiceError
from backend.vocabulary import RHO_NOT_ASKED


class ExportRequests(AnalysisRecords):
    """The safetensors file of an export choice, or its writing started (once)."""

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
        if "rho" in choice.stats and not summary.get("rho_available", True):
            raise RequestError(
                f"{RHO_NOT_ASKED}: POST /api/v1/analyses/{analysis_id}/rho and export from its analysis",
                field="stats",
            )
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
