"""Studies through the service: validate and key a study, fan it out as one job per prompt, report it.

Why one job per prompt: a study's sums are sums over prompts, and each response's draw depends only on
(seed, prompt, response), so parts run on however many workers there are and add up to the same
result. Each part has a status record of its own (id ``part_id``), so parts never write the same
record; the worker that finishes the last part reduces them (``workers.study_jobs``).
"""

from __future__ import annotations

import hashlib
import time
from pathlib import Path

from backend.fastjson import loads
from backend.mask_files import MaskFile, MaskFileError, compare_mask_files, mask_heatmap
from backend.normalize import RequestError, check_text, normalize_sampler
from backend.queue import STUDY_PART_FUNCTION, STUDY_PART_RETRIES
from backend.rewards import RewardKind, RewardRule
from backend.schemas import JobStatus, PooledView
from backend.service import AnalysisService, ServiceError
from backend.store import RECENT_STUDIES, WORKER_DIED
from backend.study_cost import StudyShape, cheaper_study_methods, estimate_study_cost
from backend.study_schemas import (
    StudyCreate,
    StudyJob,
    StudyJobPrompt,
    StudyListItem,
    StudyMaskComparison,
    StudyMaskView,
    StudyPartPublic,
    StudyPrompt,
    StudyPublic,
)
from backend.study_summary import StudySummary
from backend.tokens import TokenCodec
from backend.vocabulary import SamplerKind

MASKS_NAME = "masks.safetensors"
STUDY_KIND = "study"
PART_KIND = "study_part"
REFERENCE_DISTRIBUTIONS = 2  # the Fisher under the model and under the uniform sampler, at each prompt


def part_id(study_id: str, prompt_index: int) -> str:
    """The status record of one prompt's part (hex, like every id the store keeps)."""
    return hashlib.sha256(f"{study_id}:part:{prompt_index}".encode()).hexdigest()


def masks_path(study_dir: Path) -> Path:
    return study_dir / MASKS_NAME


class StudyService:
    """Studies beside analyses: same store, queue, models and limits."""

    def __init__(self, analyses: AnalysisService) -> None:
        self.analyses = analyses
        self.settings = analyses.settings
        self.store = analyses.store
        self.queue = analyses.queue

    def normalize(self, create: StudyCreate) -> tuple[StudyJob, StudyShape]:
        """Tokenize and canonicalize ``create``; every bad content is a 4xx naming the prompt."""
        info, codec = self.analyses.resolve_model(create.model)
        if create.sampler.kind == SamplerKind.data:
            raise RequestError(
                "a study samples its responses: use sampler.kind 'model' or 'uniform', not 'data'",
                field="sampler.kind",
            )
        reward = _reward_rule(create)
        limit = self.settings.max_prefix_tokens
        prompts = [
            _prompt(number, item, codec, limit, reward) for number, item in enumerate(create.prompts, start=1)
        ]
        job = StudyJob(
            model=create.model,
            weights_digest=info.digest,
            dtype=info.dtype,
            prompts=prompts,
            samples=create.samples,
            max_tokens=create.max_tokens,
            seed=create.seed,
            sampler=normalize_sampler(create.sampler, codec, has_continuation=False),
            method=create.method,
            reward=create.reward,
            q=create.q,
        )
        shape = StudyShape.of_prompts(
            prompts,
            n_params=info.n_params,
            d_model=info.d_model,
            samples=job.samples,
            max_tokens=job.max_tokens,
            sampler_kind=job.sampler.kind,
            top_k=job.sampler.top_k,
            on_policy=job.sampler.is_on_policy,
            references=REFERENCE_DISTRIBUTIONS,
            references_everywhere=False,
        )
        return job, shape

    def submit(self, create: StudyCreate) -> tuple[StudyPublic, int]:
        """200 with the finished study when cached, else 202; parts that failed are queued again."""
        job, shape = self.normalize(create)
        cost = estimate_study_cost(shape, job.method, self.analyses.flops_per_second(job.model))
        if cost.flops > self.settings.budget_flops:
            offers = ", ".join(cheaper_study_methods(shape, self.settings.budget_flops)) or "none"
            raise RequestError(
                f"this study is estimated at {cost.flops / 1e12:.1f} TFLOP (~{cost.seconds:.0f} s), over the "
                f"budget of {self.settings.cost_budget_tflop:g} TFLOP; use fewer prompts, samples or "
                f"tokens, or a cheaper method ({offers})",
                field="method",
            )
        study_id = job.key()
        meta = self.store.checked_meta(study_id)
        if meta is None or meta["status"] == JobStatus.failed:  # new, or its reduction failed
            queued = {
                "kind": STUDY_KIND,
                # the name is a label, not part of the id: the first one given stays
                "name": (meta or {}).get("name") or create.name,
                # the texts as written (the job keeps token ids): what a page shows and links to
                "prompt_texts": [item.prompt for item in create.prompts],
                "status": JobStatus.queued.value,
                "progress": 0.0,
                "stage": None,
                "error": None,
                "request": job.model_dump(mode="json"),
                "cost": cost.model_dump(),
                "created": time.time(),
            }
            if self.store.claim(study_id, queued):
                self._enqueue_parts(study_id, job)
        elif meta["status"] != JobStatus.done:
            self._enqueue_parts(study_id, job)  # only parts that failed are queued again
        self.store.remember_recent(RECENT_STUDIES, study_id)  # asked again: first in the list again
        public = self.get(study_id)
        return public, 200 if public.status == JobStatus.done else 202

    def _enqueue_parts(self, study_id: str, job: StudyJob) -> None:
        payload = job.model_dump(mode="json")
        for index in range(len(job.prompts)):
            record = part_id(study_id, index)
            part = self.store.checked_meta(record)
            if part is not None and (part["status"] == JobStatus.done or part.get("permanent")):
                continue  # a retried study runs only the prompts that did not finish and can
            queued = {"kind": PART_KIND, "status": JobStatus.queued.value, "progress": 0.0, "stage": None}
            if self.store.claim(record, {**queued, "error": None, "study": study_id, "prompt_index": index}):
                self.queue.enqueue(
                    STUDY_PART_FUNCTION,
                    {"study": payload, "prompt_index": index},
                    record,
                    retries=STUDY_PART_RETRIES,
                )

    def _retry_abandoned(self, study_id: str, job: StudyJob, index: int, part: dict) -> bool:
        """Queue a part again when its worker died (its lease lapsed), up to STUDY_PART_RETRIES times.

        Why here: the store notices a dead worker within LEASE_TTL_S of its last beat, whereas RQ
        retries an abandoned job only after the whole job timeout; a study is read every second while
        someone waits for it, so the part is queued again within seconds."""
        attempts = int(part.get("attempts") or 1)
        if part.get("status") != JobStatus.failed or part.get("error") != WORKER_DIED:
            return False
        if attempts > STUDY_PART_RETRIES:
            return False
        record = part_id(study_id, index)
        queued = {"kind": PART_KIND, "status": JobStatus.queued.value, "progress": 0.0, "stage": None}
        fields = {"error": None, "study": study_id, "prompt_index": index, "attempts": attempts + 1}
        if not self.store.claim(record, {**queued, **fields}):
            return False
        self.queue.enqueue(
            STUDY_PART_FUNCTION,
            {"study": job.model_dump(mode="json"), "prompt_index": index},
            record,
            retries=STUDY_PART_RETRIES,
        )
        return True

    def _meta(self, study_id: str) -> dict:
        meta = self.store.checked_meta(study_id)
        if meta is None or meta.get("kind") != STUDY_KIND:
            raise ServiceError(404, f"no study with id {study_id!r}; POST /api/v1/studies first")
        return meta

    def recent(self, limit: int) -> list[StudyListItem]:
        """The studies last POSTed, newest first (those whose records expired are left out)."""
        items = []
        for study_id in self.store.recent(RECENT_STUDIES, limit):
            meta = self.store.checked_meta(study_id)
            if meta is None or meta.get("kind") != STUDY_KIND:
                continue
            job = StudyJob.model_validate(meta["request"])
            status = JobStatus(meta["status"])
            if status not in (JobStatus.done, JobStatus.failed):  # only the parts know
                status = _study_status(meta, self._parts(study_id, meta, job))[0]
            items.append(
                StudyListItem(
                    id=study_id,
                    name=meta.get("name"),
                    model=job.model,
                    status=status,
                    created=meta.get("created"),
                    prompts=len(job.prompts),
                )
            )
        return items

    def _parts(self, study_id: str, meta: dict, job: StudyJob) -> list[StudyPartPublic]:
        """Each prompt's part as its own record says (a part whose worker died is queued again)."""
        parts = []
        for index in range(len(job.prompts)):
            part = self.store.checked_meta(part_id(study_id, index)) or {"status": JobStatus.queued.value}
            if meta["status"] != JobStatus.done and self._retry_abandoned(study_id, job, index, part):
                part = self.store.checked_meta(part_id(study_id, index)) or part
            parts.append(
                StudyPartPublic(
                    prompt_index=index,
                    status=part["status"],
                    progress=part.get("progress") or 0.0,
                    stage=part.get("stage"),
                    error=part.get("error"),
                    permanent=bool(part.get("permanent")),
                )
            )
        return parts

    def get(self, study_id: str) -> StudyPublic:
        meta = self._meta(study_id)
        job = StudyJob.model_validate(meta["request"])
        parts = self._parts(study_id, meta, job)
        status, error = _study_status(meta, parts)
        summary = None
        if status == JobStatus.done:
            summary_json = self.store.get_summary_json(study_id)
            if summary_json is None:
                status, error = JobStatus.failed, "the stored summary expired; POST the study again"
            else:
                summary = StudySummary.model_validate(loads(summary_json))
        progress = 1.0 if status == JobStatus.done else sum(p.progress for p in parts) / max(len(parts), 1)
        return StudyPublic(
            id=study_id,
            name=meta.get("name"),
            created=meta.get("created"),
            prompt_texts=meta.get("prompt_texts"),
            status=status,
            progress=min(progress, 1.0),
            parts=parts,
            request=job,
            cost=meta.get("cost"),
            error=error,
            summary=summary,
        )

    def masks(self, study_id: str) -> Path:
        """The masks file of a finished study (404 before, with what to do)."""
        meta = self._meta(study_id)
        if meta["status"] != JobStatus.done:
            raise ServiceError(409, f"study {study_id} is {meta['status']}; its masks come when it is done")
        path = masks_path(self.settings.study_dir(study_id))
        if not path.is_file():
            raise ServiceError(404, f"the masks file of study {study_id} is gone; POST the study again")
        return path

    def _mask_file(self, study_id: str) -> MaskFile:
        """The study's masks file, read and checked; a damaged one is a 404 saying to POST again."""
        try:
            return MaskFile.open(self.masks(study_id))
        except MaskFileError as error:
            detail = f"the masks file of study {study_id} is damaged ({error}); POST the study again"
            raise ServiceError(404, detail) from None

    def mask_view(self, study_id: str, tensor: str, q: float, rows: int, cols: int) -> StudyMaskView:
        masks = self._mask_file(study_id)
        if tensor not in masks.shapes:
            raise ServiceError(404, f"study {study_id} has no parameter {tensor!r}; its summary lists them")
        try:
            mask = masks.mask(q, tensor)
        except MaskFileError as error:
            raise RequestError(str(error), field="q") from None
        return StudyMaskView(
            tensor=tensor,
            q=masks.check_fraction(q),
            shape=list(mask.shape),
            count=int(mask.sum(dtype="int64")),
            size=int(mask.size),
            view=PooledView(**mask_heatmap(mask, rows, cols)),
        )

    def compare(self, a: str, b: str) -> StudyMaskComparison:
        """Two finished studies' masks: 422 when they are of different models or share no density."""
        files = [self._mask_file(study_id) for study_id in (a, b)]
        models = [StudyJob.model_validate(self._meta(study_id)["request"]) for study_id in (a, b)]
        if models[0].weights_digest != models[1].weights_digest:
            raise RequestError(
                f"study {a[:12]} is of {models[0].model} and study {b[:12]} of {models[1].model} (other "
                "weights); compare masks of one model",
                field="b",
            )
        try:
            rows = compare_mask_files(*files)
        except MaskFileError as error:
            raise RequestError(str(error), field="b") from None
        return StudyMaskComparison(a=a, b=b, model=models[0].model, **rows)


def _study_status(meta: dict, parts: list[StudyPartPublic]) -> tuple[JobStatus, str | None]:
    """Done or failed as the reduction left it; before that, what the parts say (no part writes the
    study's own record, so parts finishing together never overwrite each other)."""
    status = JobStatus(meta["status"])
    if status in (JobStatus.done, JobStatus.failed):
        return status, meta.get("error")
    failed = [p for p in parts if p.status == JobStatus.failed]
    permanent = [p for p in failed if p.permanent]
    if permanent:
        first = permanent[0]
        return JobStatus.failed, (
            f"prompt {first.prompt_index + 1} failed: {first.error}; retrying cannot fix this: change the "
            "request (the reward pattern or the prompt's target) and POST the new study"
        )
    if failed:
        first = failed[0]
        return JobStatus.failed, (
            f"prompt {first.prompt_index + 1} failed: {first.error}; POST the study again to retry the "
            f"{len(failed)} failed part(s)"
        )
    if any(p.status != JobStatus.queued for p in parts) or meta.get("stage") == "reduce":
        return JobStatus.running, None
    return JobStatus.queued, None


def _reward_rule(create: StudyCreate) -> RewardRule | None:
    """The study's reward as a rule (its pattern compiled), or a 422 saying what to fix."""
    if create.reward is None:
        return None
    if create.reward.kind == RewardKind.exact and create.reward.pattern is not None:
        raise RequestError("an exact reward takes no pattern; remove it", field="reward.pattern")
    try:
        return RewardRule(create.reward.kind, create.reward.pattern)
    except ValueError as error:
        raise RequestError(str(error), field="reward.pattern") from None


def _prompt(
    number: int, item: StudyPrompt, codec: TokenCodec, limit: int, reward: RewardRule | None
) -> StudyJobPrompt:
    """Prompt ``number`` (1-based) tokenized and checked: not empty, within ``limit`` tokens, with a
    target the reward can take when there is a reward."""
    where = f"prompts[{number - 1}]"
    text = check_text(item.prompt, f"{where}.prompt")
    ids = codec.encode_prefix(text) if text.strip() else []
    if not ids:
        raise RequestError(f"prompt {number} is empty; write its text", field=f"{where}.prompt")
    if len(ids) > limit:
        raise RequestError(
            f"prompt {number} is {len(ids)} tokens, over the limit of {limit}; shorten it",
            field=f"{where}.prompt",
        )
    target_ids = None
    if item.target:
        target_ids = codec.encode_continuation(check_text(item.target, f"{where}.target"))
    elif reward is not None:
        raise RequestError(
            f"prompt {number} has no target; the reward compares each response with it",
            field=f"{where}.target",
        )
    if reward is not None:
        try:
            reward.check_target(item.target or "")
        except ValueError as error:
            raise RequestError(f"prompt {number}: {error}", field="reward.pattern") from None
    return StudyJobPrompt(input_ids=ids, target=item.target or None, target_ids=target_ids)
