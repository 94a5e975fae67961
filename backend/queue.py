"""Job queues: RQ over Redis for a fleet of workers, or one in-process thread when embedded.

Why RQ: an existing library whose non-forking `SimpleWorker` keeps loaded models between jobs. Its
jobs are serialized as JSON (`JSONSerializer`): nothing read from Redis is ever unpickled. The job
functions live in `workers.jobs` and are named by dotted path, so this module never imports torch.
"""

from __future__ import annotations

import logging
import queue as stdlib_queue
import threading
import uuid
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any

from rq import Queue, Retry, Worker
from rq.serializers import JSONSerializer

ANALYSIS_FUNCTION = "workers.jobs.run_analysis_job"
EXPORT_FUNCTION = "workers.jobs.run_export_job"
STUDY_PART_FUNCTION = "workers.study_jobs.run_study_part_job"
UPDATES_FUNCTION = "workers.update_jobs.run_updates_job"
# a study part whose worker died is queued again this many times: by the API within seconds of its
# lease lapsing (backend.studies), and by RQ once the abandoned job's timeout has passed
STUDY_PART_RETRIES = 2

log = logging.getLogger(__name__)


# the name a worker in this process publishes its rate under (no RQ job, hence no RQ worker name)
IN_PROCESS_WORKER = "in-process"


class JobQueue(ABC):
    @abstractmethod
    def enqueue(self, function: str, payload: dict, analysis_id: str, retries: int = 0) -> None: ...

    def live_workers(self) -> set[str] | None:
        """The names of the workers alive now; None where every worker is this process."""
        return None


class RedisQueue(JobQueue):
    def __init__(self, redis: Any, name: str, job_timeout_s: int) -> None:
        self.queue = Queue(name, connection=redis, serializer=JSONSerializer)
        self.job_timeout_s = job_timeout_s

    def enqueue(self, function: str, payload: dict, analysis_id: str, retries: int = 0) -> None:
        self.queue.enqueue_call(
            function,
            args=[payload],
            timeout=self.job_timeout_s,
            result_ttl=0,  # results go to the store, not to RQ
            failure_ttl=24 * 3600,
            job_id=f"{analysis_id[:32]}-{uuid.uuid4().hex[:8]}",
            description=f"{function.rsplit('.', 1)[-1]} {analysis_id[:12]}",
            retry=Retry(max=retries) if retries else None,
        )

    def live_workers(self) -> set[str] | None:
        # RQ's registry: a worker that stopped or missed its heartbeats is no longer found
        return {worker.name for worker in Worker.all(queue=self.queue)}


class ThreadQueue(JobQueue):
    """One daemon thread runs jobs in order: `runner(function, payload, analysis_id)`."""

    def __init__(self, runner: Callable[[str, dict, str], None]) -> None:
        self.runner = runner
        self.jobs: stdlib_queue.Queue[tuple[str, dict, str]] = stdlib_queue.Queue()
        self._thread: threading.Thread | None = None
        self._start_lock = threading.Lock()

    def enqueue(self, function: str, payload: dict, analysis_id: str, retries: int = 0) -> None:
        # one thread in this process: a job that kills it kills the service too, nothing to retry on
        with self._start_lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="fisherscope-worker", daemon=True)
                self._thread.start()
        self.jobs.put((function, payload, analysis_id))

    def _loop(self) -> None:
        while True:
            function, payload, analysis_id = self.jobs.get()
            try:
                self.runner(function, payload, analysis_id)
            except Exception:  # the job function records failures itself; keep the thread alive
                log.exception("in-process job %s failed", function)
            finally:
                self.jobs.task_done()
