"""API speed on loopback: cache-hit GET and repeat POST medians, then 50 concurrent clients for 10 s.

Starts its own API (uvicorn) and worker against Redis db 14 unless --url points at a running API.
Usage: .venv/bin/python benchmarks/bench_api.py [--model tiny-random,smollm2-135m] [--clients 50]
       [--seconds 10] [--keep-cache]

Several models (comma-separated) are measured one after the other on the same service: the summary of
a real model (SmolLM2, ~170 kB) costs more to serve than tiny-random's (~40 kB). An exact SmolLM2
analysis takes a while to compute once per prefix; --keep-cache leaves the Redis db unflushed so a
second run measures the cached analyses without computing them again.

The load clients share one connection pool (one keep-alive connection per client) and the script
reports its own CPU time, so one can see whether the client, not the server, was the bottleneck.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import statistics
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import httpx
import redis

ROOT = Path(__file__).resolve().parents[1]
PREFIXES = ["She drank a cup of", "The cat sat on the", "Once upon a time", "I like to read", "The sky is"]


@contextmanager
def local_service(port: int, redis_url: str, keep_cache: bool):
    if not keep_cache:
        redis.Redis.from_url(redis_url).flushdb()
    env = {**os.environ, "REDIS_URL": redis_url, "FISHERSCOPE_QUEUE_NAME": "fisherscope-bench"}
    api = subprocess.Popen(
        [sys.executable, "-m", "uvicorn", "backend.main:app", "--port", str(port), "--log-level", "warning"],
        cwd=ROOT,
        env=env,
    )
    worker = subprocess.Popen(
        [sys.executable, "-m", "workers.worker"],
        cwd=ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        for process in (api, worker):
            process.send_signal(signal.SIGTERM)
        for process in (api, worker):
            try:
                process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                process.kill()
        if not keep_cache:
            redis.Redis.from_url(redis_url).flushdb()


def wait_ready(client: httpx.Client, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if client.get("/readyz").status_code == 200:
                return
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            raise SystemExit("the API did not become ready")
        time.sleep(0.2)


def prepare(
    client: httpx.Client, model: str
) -> tuple[list[tuple[dict, str]], list[tuple[float | None, float]]]:
    """Submit one analysis per prefix, each once the one before is done, as a person typing prefixes
    would: (body, id) of each, and the seconds from its POST to its first partial result (None when it
    had none: cached, or too short for one) and to done."""
    cached, timings = [], []
    for prefix in PREFIXES:
        body = {"model": model, "prefix": prefix}
        started = time.perf_counter()
        answer = client.post("/api/v1/analyses", json=body)
        answer.raise_for_status()
        analysis_id = answer.json()["id"]
        first_partial = None
        deadline = time.monotonic() + 600
        while (reply := poll(client, analysis_id))["status"] != "done":
            if reply["status"] == "failed" or time.monotonic() > deadline:
                raise SystemExit(f"analysis {analysis_id} {reply['status']}")
            if first_partial is None and reply.get("partial"):
                first_partial = time.perf_counter() - started
            time.sleep(0.05)
        timings.append((first_partial, time.perf_counter() - started))
        cached.append((body, analysis_id))
    return cached, timings


def poll(client: httpx.Client, analysis_id: str) -> dict:
    answer = client.get(f"/api/v1/analyses/{analysis_id}")
    if answer.status_code != 200:
        raise SystemExit(f"GET {analysis_id} answered {answer.status_code}: {answer.text[:300]}")
    return answer.json()


def median_ms(call, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        response = call()
        times.append((time.perf_counter() - started) * 1000)
        assert response.status_code == 200, response.text
    return statistics.median(times)


async def load(base_url: str, cached: list[tuple[dict, str]], clients: int, seconds: float) -> dict:
    latencies: list[float] = []
    errors = 0
    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
    pool = httpx.AsyncClient(base_url=base_url, timeout=30, limits=limits)
    cpu_started = time.process_time()
    stop_at = time.monotonic() + seconds

    async def one_client(index: int, client: httpx.AsyncClient) -> None:
        nonlocal errors
        n = index
        while time.monotonic() < stop_at:
            body, analysis_id = cached[n % len(cached)]
            n += 1
            started = time.perf_counter()
            try:
                if n % 2:
                    response = await client.get(f"/api/v1/analyses/{analysis_id}")
                else:
                    response = await client.post("/api/v1/analyses", json=body)
                ok = response.status_code == 200
            except httpx.HTTPError:
                ok = False
            latencies.append((time.perf_counter() - started) * 1000)
            errors += not ok

    async with pool:
        await asyncio.gather(*(one_client(i, pool) for i in range(clients)))
    client_cpu_s = time.process_time() - cpu_started
    latencies.sort()
    return {
        "client_cpu_share": client_cpu_s / seconds,
        "requests": len(latencies),
        "errors": errors,
        "rps": len(latencies) / seconds,
        "p50_ms": latencies[len(latencies) // 2],
        "p99_ms": latencies[min(len(latencies) - 1, int(len(latencies) * 0.99))],
    }


def run(base_url: str, args: argparse.Namespace) -> None:
    for model in args.model.split(","):
        run_model(base_url, model.strip(), args)


def run_model(base_url: str, model: str, args: argparse.Namespace) -> None:
    with httpx.Client(base_url=base_url, timeout=30) as client:
        wait_ready(client)
        cached, timings = prepare(client, model)
        body, analysis_id = cached[0]
        get_ms = median_ms(lambda: client.get(f"/api/v1/analyses/{analysis_id}"), args.repeats)
        post_ms = median_ms(lambda: client.post("/api/v1/analyses", json=body), args.repeats)
        size_kb = len(client.get(f"/api/v1/analyses/{analysis_id}").content) / 1024
    print(f"model {model}, summary {size_kb:.0f} KiB per answer", flush=True)
    each = ", ".join(
        f"{done:.2f} s" + ("" if partial is None else f" (first partial {partial:.2f} s)")
        for partial, done in timings
    )
    print(f"new prefixes, POST to done, one after the other (the first loads the model): {each}", flush=True)
    print(
        f"cache-hit GET median: {get_ms:.1f} ms; repeat POST median: {post_ms:.1f} ms ({args.repeats} each)",
        flush=True,
    )
    figures = asyncio.run(load(base_url, cached, args.clients, args.seconds))
    print(
        f"{args.clients} concurrent clients for {args.seconds:g} s (GET and POST on cached analyses): "
        f"{figures['requests']} requests, {figures['errors']} errors, {figures['rps']:.0f} req/s, "
        f"p50 {figures['p50_ms']:.1f} ms, p99 {figures['p99_ms']:.1f} ms; "
        f"load client busy {100 * figures['client_cpu_share']:.0f}% of one core",
        flush=True,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", help="benchmark a running API instead of starting one")
    parser.add_argument("--model", default="tiny-random", help="model id(s), comma-separated")
    parser.add_argument("--clients", type=int, default=50)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--repeats", type=int, default=200)
    parser.add_argument("--port", type=int, default=8765)
    parser.add_argument("--redis-url", default="redis://127.0.0.1:6379/14")
    parser.add_argument(
        "--keep-cache", action="store_true", help="do not flush the Redis db before or after (reuse analyses)"
    )
    args = parser.parse_args()
    if args.url:
        run(args.url, args)
        return
    with local_service(args.port, args.redis_url, args.keep_cache) as base_url:
        run(base_url, args)


if __name__ == "__main__":
    main()
