"""Where a fine-tuning run changed the weights, through the service: check two models (and a study's
masks) against each other, key the comparison, queue it for a worker, report it.

Why a job: the comparison reads both checkpoints (and rounds to bf16) in torch, which the API never
imports; it is cached like an analysis, by the two weights digests, the study and the densities.
"""

from __future__ import annotations

import time

from backend.fastjson import loads
from backend.mask_files import MaskFile, MaskFileError
from backend.normalize import RequestError
from backend.queue import UPDATES_FUNCTION
from backend.schemas import JobStatus
from backend.service import ServiceError
from backend.studies import StudyService
from backend.update_schemas import UpdatesCreate, UpdatesJob, UpdatesPublic, UpdatesSummary

UPDATES_KIND = "updates"


class UpdatesService:
    def __init__(self, studies: StudyService) -> None:
        self.studies = studies
        self.analyses = studies.analyses
        self.store = studies.store
        self.queue = studies.queue

    def normalize(self, create: UpdatesCreate) -> UpdatesJob:
        before, _ = self.analyses.resolve_model(create.before)
        after, _ = self.analyses.resolve_model(create.after)
        shape = ("architecture", "n_params", "d_model", "vocab_size", "n_layers")
        differing = [key for key in shape if getattr(before, key) != getattr(after, key)]
        if differing:
            key = differing[0]
            raise RequestError(
                f"{create.before} and {create.after} are not one architecture ({key}: {getattr(before, key)} "
                f"and {getattr(after, key)}); compare two checkpoints of the same model",
                field="after",
            )
        q = create.q
        if create.study is not None:
            masks = self._study_masks(create.study)
            if masks.metadata.get("digest") not in (before.digest, after.digest):
                raise RequestError(
                    f"study {create.study} is of {masks.model_id}, not of {create.before} or {create.after}; "
                    "give a study of one of the two models",
                    field="study",
                )
            q = q or list(masks.fractions)
        return UpdatesJob(
            before=create.before,
            after=create.after,
            before_digest=before.digest,
            after_digest=after.digest,
            study=create.study,
            q=q,
        )

    def _study_masks(self, study_id: str) -> MaskFile:
        try:
            return MaskFile.open(self.studies.masks(study_id))
        except ServiceError as error:
            raise RequestError(f"study: {error.detail}", field="study") from None
        except MaskFileError as error:
            raise RequestError(
                f"the masks of study {study_id} are damaged ({error})", field="study"
            ) from None

    def submit(self, create: UpdatesCreate) -> tuple[UpdatesPublic, int]:
        """200 with the finished comparison when cached, else 202 (a failed one is queued again)."""
        job = self.normalize(create)
        updates_id = job.key()
        meta = self.store.checked_meta(updates_id)
        if meta is None or meta["status"] == JobStatus.failed:
            queued = {
                "kind": UPDATES_KIND,
                "status": JobStatus.queued.value,
                "progress": 0.0,
                "stage": None,
                "error": None,
                "request": job.model_dump(mode="json"),
                "created": time.time(),
            }
            if self.store.claim(updates_id, queued):
                self.queue.enqueue(UPDATES_FUNCTION, job.model_dump(mode="json"), updates_id)
        public = self.get(updates_id)
        return public, 200 if public.status == JobStatus.done else 202

    def get(self, updates_id: str) -> UpdatesPublic:
        meta = self.store.checked_meta(updates_id)
        if meta is None or meta.get("kind") != UPDATES_KIND:
            raise ServiceError(404, f"no comparison with id {updates_id!r}; POST /api/v1/updates first")
        status, error, summary = JobStatus(meta["status"]), meta.get("error"), None
        if status == JobStatus.done:
            stored = self.store.get_summary_json(updates_id)
            if stored is None:
                status, error = JobStatus.failed, "the stored comparison expired; POST it again"
            else:
                summary = UpdatesSummary.model_validate(loads(stored))
        return UpdatesPublic(
            id=updates_id,
            status=status,
            progress=1.0 if status == JobStatus.done else float(meta.get("progress") or 0.0),
            stage=meta.get("stage"),
            error=error,
            request=UpdatesJob.model_validate(meta["request"]),
            summary=summary,
        )
