"""The study page's view of the HTTP API: /api/v1/studies, and the finished studies it has read, by id.

Why a cache here: the browser holds a study's id and status only, never its summary (a SmolLM2 study's
summary is hundreds of KB); the callbacks that draw read the summary by id from this process, which
asks the API once per finished study (a finished study never changes: its id is its request's hash).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any, TypeVar
from urllib.parse import quote

from backend.study_schemas import StudyMaskComparison, StudyMaskView, StudyPublic
from backend.study_summary import StudySummary
from backend.update_schemas import UpdatesPublic
from frontend.api_client import API_PREFIX, ApiClient, ApiError
from frontend.studies.form import PromptLine

KEPT_STUDIES = 16  # finished studies kept in this process (a few hundred KB each)
KEPT_PROMPTS = 1024  # token ids of prompt texts, to match the form's lines with a study's prompts
KEPT_VIEWS = 256  # mask heatmaps (a few KB each) and comparisons of finished studies
View = TypeVar("View", StudyMaskView, StudyMaskComparison)


class StudyClient:
    """Studies over HTTP (`ApiClient` for transport and error messages), and finished ones by id."""

    def __init__(self, api: ApiClient, public_base_url: str | None = None) -> None:
        self.api = api
        self.public_base_url = (public_base_url or api.base_url).rstrip("/")
        self._done: OrderedDict[str, StudyPublic] = OrderedDict()
        self._ids: OrderedDict[tuple[str, str], list[int]] = OrderedDict()
        self._views: OrderedDict[tuple, Any] = OrderedDict()
        self._lock = threading.Lock()

    def models(self) -> list[dict[str, Any]]:
        return self.api.models()

    def submit(self, body: dict[str, Any]) -> StudyPublic:
        """POST a study: done at once when cached (200), else queued (202)."""
        study = StudyPublic.model_validate_json(self.api.request("POST", "/studies", json=body).content)
        self._keep(study)
        return study

    def recent(self) -> list[dict[str, Any]]:
        """The studies last POSTed on the server, newest first: id, name, model, status, created, prompts."""
        return self.api.request("GET", "/studies").json()

    def study(self, study_id: str) -> StudyPublic:
        """GET a study: status, parts, and when done its summary (from here when read before)."""
        with self._lock:
            if study_id in self._done:
                self._done.move_to_end(study_id)
                return self._done[study_id]
        response = self.api.request("GET", f"/studies/{quote(study_id, safe='')}")
        study = StudyPublic.model_validate_json(response.content)
        self._keep(study)
        return study

    def finished(self, study_id: str) -> tuple[StudyPublic, StudySummary]:
        """A finished study and its summary; ApiError when it is not (or no longer) done."""
        study = self.study(study_id)
        if study.status != "done" or study.summary is None:
            raise ApiError(f"study {study_id[:12]}… is {study.status}, not done")
        return study, study.summary

    def prompt_ids(self, model: str, text: str) -> list[int] | None:
        """The token ids a study gives a prompt (special tokens included); None when the API cannot say."""
        key = (model, text)
        with self._lock:
            if key in self._ids:
                return self._ids[key]
        try:
            body = self.api.request(
                "GET", "/tokenize", params={"model": model, "text": text, "special_tokens": True}
            ).json()
            ids = [int(token["id"]) for token in body["tokens"]]
        except (ApiError, KeyError, TypeError, ValueError):
            return None
        with self._lock:
            self._ids[key] = ids
            while len(self._ids) > KEPT_PROMPTS:
                self._ids.popitem(last=False)
        return ids

    def prompt_texts(self, study: StudyPublic, lines: Sequence[PromptLine]) -> list[str | None]:
        """The form's prompt texts where they are this study's prompts (the same token ids), else None.

        The API keeps a study's prompts as token ids; the form's text is shown beside them only where
        it tokenizes to those ids, so an edited form never labels another study's responses.
        """
        if study.prompt_texts:  # kept with the study: right whatever the form says now
            return list(study.prompt_texts)
        model = study.request.model
        texts: list[str | None] = []
        for index, prompt in enumerate(study.request.prompts):
            line = lines[index] if index < len(lines) else None
            same = line is not None and self.prompt_ids(model, line.prompt) == prompt.input_ids
            texts.append(line.prompt if same and line is not None else None)
        return texts

    def mask_view(self, study_id: str, tensor: str, q: float, rows: int, cols: int) -> StudyMaskView:
        """One parameter's mask in blocks; kept, since a finished study never changes."""
        key = ("mask", study_id, tensor, f"{q:g}", rows, cols)
        path = f"/studies/{quote(study_id, safe='')}/masks/{quote(tensor, safe='')}"
        params = {"q": q, "rows": rows, "cols": cols}
        return self._kept(
            key,
            lambda: StudyMaskView.model_validate_json(self.api.request("GET", path, params=params).content),
        )

    def compare(self, a: str, b: str) -> StudyMaskComparison:
        """Two finished studies' masks compared; kept like the studies."""
        params = {"a": a, "b": b}
        return self._kept(
            ("compare", a, b),
            lambda: StudyMaskComparison.model_validate_json(
                self.api.request("GET", "/studies/compare", params=params).content
            ),
        )

    def submit_updates(self, before: str, after: str, study_id: str) -> UpdatesPublic:
        """POST a comparison of two checkpoints with the study's masks: done when cached, else queued."""
        body = {"before": before, "after": after, "study": study_id}
        return UpdatesPublic.model_validate_json(self.api.request("POST", "/updates", json=body).content)

    def updates(self, updates_id: str) -> UpdatesPublic:
        response = self.api.request("GET", f"/updates/{quote(updates_id, safe='')}")
        return UpdatesPublic.model_validate_json(response.content)

    def _kept(self, key: tuple, fetch: Callable[[], View]) -> View:
        with self._lock:
            if key in self._views:
                self._views.move_to_end(key)
                return self._views[key]
        value = fetch()
        with self._lock:
            self._views[key] = value
            while len(self._views) > KEPT_VIEWS:
                self._views.popitem(last=False)
        return value

    def masks_url(self, study_id: str) -> str:
        """Where the browser downloads the masks (safetensors, `q<q>/<param name>`, uint8)."""
        return f"{self.public_base_url}{API_PREFIX}/studies/{quote(study_id, safe='')}/masks"

    def _keep(self, study: StudyPublic) -> None:
        if study.status != "done" or study.summary is None:
            return
        with self._lock:
            self._done[study.id] = study
            self._done.move_to_end(study.id)
            while len(self._done) > KEPT_STUDIES:
                self._done.popitem(last=False)


def status_of(study: StudyPublic) -> dict[str, Any]:
    """What the browser keeps of a study: a few fields per prompt, never the summary."""
    return {
        "id": study.id,
        "status": study.status.value,
        "progress": study.progress,
        "error": study.error,
        "parts": [
            part.model_dump(mode="json", include={"prompt_index", "status", "progress", "stage", "error"})
            for part in study.parts
        ],
    }


def is_settled(status: dict[str, Any] | None) -> bool:
    return not status or status.get("status") in ("done", "failed", "missing")
