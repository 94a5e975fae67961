"""The dashboard's cancel button and expected time: the handle's stage line, what a DELETE's answer
turns the handle into, and the message of a cancelled run. Pure functions and a stand-in API."""

from __future__ import annotations

from typing import Any

from backend.vocabulary import CANCELLED
from frontend.api_client import ApiError
from frontend.callbacks.run import cancelled, failure
from frontend.handles import expected_words, handle_from, is_cancellable, is_settled, stage_line

ANALYSIS = "c" * 64


class CancelApi:
    def __init__(self, answer: Any) -> None:
        self.answer, self.calls = answer, []

    def cancel(self, analysis_id: str) -> dict[str, Any]:
        self.calls.append(analysis_id)
        if isinstance(self.answer, Exception):
            raise self.answer
        return self.answer


def running(stage: str = "directions", seconds: float | None = 95.4) -> dict[str, Any]:
    cost = None if seconds is None else {"seconds": seconds, "flops": 1e12}
    return {"id": ANALYSIS, "status": "running", "progress": 0.3, "stage": stage, "cost": cost}


def test_the_stage_says_the_expected_time_until_the_analysis_settles():
    assert expected_words(95.4) == " · about 1 min 35 s in all"
    assert expected_words(0.2) == " · about 1 s in all" and expected_words(None) == ""
    assert stage_line(handle_from(running(), ANALYSIS)) == "directions · about 1 min 35 s in all"
    queued = {**running(), "status": "queued", "stage": None}
    assert stage_line(handle_from(queued, ANALYSIS)) == "queued · about 1 min 35 s in all"
    assert stage_line(handle_from(running(seconds=None), ANALYSIS)) == "directions"
    done = {**running(), "status": "done", "result": {"rho_available": True}}
    assert stage_line(handle_from(done, ANALYSIS)) == "done"


def test_cancel_is_offered_while_queued_or_running_and_turns_the_handle():
    handle = handle_from(running(), ANALYSIS)
    assert is_cancellable(handle)
    api = CancelApi({**running(stage="cancelling"), "partial": {"kept_share": 0.4, "result": {}}})
    after = cancelled(api, handle)  # running: the worker stops at its next chunk, the poll goes on
    assert api.calls == [ANALYSIS] and after["stage"] == "cancelling" and not is_settled(after)
    stopped = {**running(), "status": "failed", "error": CANCELLED}
    after = cancelled(CancelApi(stopped), handle)  # queued: failed at once
    assert is_settled(after) and not is_cancellable(after)
    message = failure(after, "analysis")[0].children
    assert message == "the analysis was cancelled; press Run (or Sample) to run it again"
    refused = cancelled(CancelApi(ApiError("analysis c is done: there is nothing to cancel", 409)), handle)
    assert refused["stage"].startswith("could not cancel: analysis c is done")
    assert not is_cancellable(handle_from({"id": None, "status": "failed", "error": "no"}, None))
