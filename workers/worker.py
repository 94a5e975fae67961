"""`fisherscope worker`: a long-lived RQ worker that keeps loaded models between jobs.

Why `SimpleWorker`: RQ's default worker forks per job, which would reload the model every time; the
simple worker runs jobs in this process, so `workers.jobs.model_pool()` stays warm. Any number of these
on any number of machines can share one Redis.

Under `torchrun --nproc-per-node N` the N processes are one worker: rank 0 is the RQ worker, the only
process that talks to Redis, and the others repeat each engine run of its jobs on their share of the
directions (`workers.commands.processes`: `leading`, `follow`, `together`), a GPU each.
"""

from __future__ import annotations

import argparse
import logging
from collections.abc import Sequence

from redis import Redis
from redis.exceptions import RedisError
from rq import Queue, SimpleWorker
from rq.serializers import JSONSerializer

from backend.settings import get_settings
from workers.commands.processes import device_of_process, follow, launched_by_torchrun, leading, process_group


def build_worker(redis_url: str, queue_name: str) -> SimpleWorker:
    connection = Redis.from_url(redis_url, health_check_interval=30)
    queue = Queue(queue_name, connection=connection, serializer=JSONSerializer)
    return SimpleWorker([queue], connection=connection, serializer=JSONSerializer)


def main(argv: Sequence[str] | None = None, *, redis_url: str | None = None, burst: bool = False) -> int:
    parser = argparse.ArgumentParser(prog="fisherscope worker")
    parser.add_argument("--redis-url", default=redis_url, help="default: $REDIS_URL")
    parser.add_argument("--queue", default=None, help="queue name (default: $FISHERSCOPE_QUEUE_NAME)")
    parser.add_argument("--burst", action="store_true", default=burst, help="exit when the queue is empty")
    args = parser.parse_args(list(argv) if argv is not None else [])
    settings = get_settings()
    url = args.redis_url or settings.redis_url
    if not url:
        parser.exit(2, "fisherscope worker: error: set REDIS_URL or pass --redis-url\n")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")

    def work() -> int:
        try:  # RQ's worker talks to Redis as it is made: a wrong URL is one line, not a traceback
            worker = build_worker(url, args.queue or settings.queue_name)
        except (RedisError, ValueError) as error:
            parser.exit(2, f"fisherscope worker: error: cannot reach Redis at {url}: {error}\n")
        worker.work(burst=args.burst, with_scheduler=False)
        return 0

    if not launched_by_torchrun():
        return work()
    import torch

    # `cuda` is this process's own GPU from here on: the model pool puts its models there
    with process_group(device_of_process("cuda" if torch.cuda.is_available() else "cpu")) as rank:
        if rank:
            follow()
            return 0
        with leading():
            return work()


if __name__ == "__main__":
    import sys

    raise SystemExit(main(sys.argv[1:]))
