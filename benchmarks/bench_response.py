"""A sampled response through `fisherscope serve`, as the dashboard's Sample button asks for it.

Starts what `fisherscope serve` runs (embedded: API, dashboard and worker in one process, no Redis;
``frontend.devserver.embedded_service``) on a free port and a cache of its own, without the landing
analysis (its two jobs would queue ahead of the cases), waits for it to load SmolLM2 (certificate
included), runs a one-token warm-up, then for each case POSTs the dashboard's own request
(``frontend.state.to_request``: the landing prefix, exact, seed 0) and polls it every 0.5 s, as the
dashboard does. It prints the seconds from the POST to:

- the first partial result, and how many of the response's positions it covers;
- 90% of the trace: the first answer in which every position carries at least 90% of its trace(C_mu)
  (a partial's, or the exact result);
- done; and the floor 2 r P T summed over positions (r: a position's exact directions, T its context)
  at the float32 matmul rate at the model's width, with the ratio of the done time to it. The rate is
  the mean of two measurements of ``RATE_SECONDS`` with the service idle, just before the POST and
  just after done (this 2-core VM's rate moved from 108 to 165 GFLOP/s within 30 s, and a rate measured
  once at the start of a run was minutes away from its last case); the ratio at the higher of the two
  is printed beside it.

Cases: `--tokens` (8,16) sampled tokens, each on the policy (T 1) and at T 0.7, top-k 50.
Usage: .venv/bin/python benchmarks/bench_response.py [--tokens 8,16] [--model smollm2-135m]
[--cases "on the policy,top-k 50 at T 0.7"]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from frontend.devserver import embedded_service, wait_until_ready  # noqa: E402
from frontend.state import DashboardState, to_request  # noqa: E402
from workers.throughput import measure_width  # noqa: E402

CASES = {"on the policy": {}, "top-k 50 at T 0.7": {"temperature": 0.7, "top_k": 50}}
POLL_S = 0.5  # as the dashboard polls (its dcc.Interval)
RATE_SECONDS = 3.0


def min_kept(summary: dict) -> float:
    return min(position["kept_share"] for position in summary["positions"])


def run_case(client: httpx.Client, body: dict) -> dict:
    """POST ``body`` and follow it to the end: the times of the first partial, 90% and done."""
    started = time.perf_counter()
    reply = client.post("/api/v1/analyses", json=body)
    reply.raise_for_status()
    analysis_id = reply.json()["id"]
    found: dict = {"first": None, "first_positions": None, "ninety": None}
    while True:
        now = time.perf_counter() - started
        answer = client.get(f"/api/v1/analyses/{analysis_id}").json()
        status = answer["status"]
        shown = answer.get("result") if status == "done" else (answer.get("partial") or {}).get("result")
        if shown is not None and found["first"] is None and status != "done":
            found["first"], found["first_positions"] = now, len(shown["positions"])
        if shown is not None and found["ninety"] is None and min_kept(shown) >= 0.9:
            found["ninety"] = now
        if status == "done":
            found["done"], found["result"] = now, shown
            return found
        if status == "failed":
            raise SystemExit(f"bench_response: the analysis failed: {answer.get('error')}")
        time.sleep(POLL_S)


def floor_seconds(result: dict, rate: float) -> float:
    """2 r P T over the positions: each position's exact directions back-propagated over its context."""
    prefix = len(result["tokens"]["prefix"])
    n_params = result["model"]["n_params"]
    positions = result["positions"]
    return sum(2 * p["directions"] * n_params * (prefix + t) / rate for t, p in enumerate(positions))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", default="8,16", help="sampled tokens per case, comma-separated")
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--cases", default=",".join(CASES), help=f"comma-separated, of: {', '.join(CASES)}")
    args = parser.parse_args()
    cases = {name: CASES[name] for name in args.cases.split(",")}
    cache = Path(tempfile.mkdtemp(prefix="bench-response-"))
    # nothing cached from an earlier run, and a quiet worker: no landing analysis (and its rho stage)
    # queued ahead of the cases
    with embedded_service(cache / "results", cache / "exports", landing_analysis=False) as url:
        wait_until_ready(url)
        with httpx.Client(base_url=url, timeout=60) as client:
            (info,) = [m for m in client.get("/api/v1/models").json() if m["id"] == args.model]
            width = int(info["d_model"])
            warm = to_request(DashboardState(model=args.model, prefix="Hi"))
            run_case(client, warm)  # loads the model and its certificate
            for tokens in (int(t) for t in args.tokens.split(",")):
                for case, sampler in cases.items():
                    state = DashboardState(model=args.model, sample_seed=0, sample_tokens=tokens, **sampler)
                    # measured with the service idle: while it loaded its model, it read 82 against 172
                    before = measure_width("cpu", width, seconds=RATE_SECONDS)
                    found = run_case(client, to_request(state))
                    after = measure_width("cpu", width, seconds=RATE_SECONDS)
                    result, done = found["result"], found["done"]
                    floor = floor_seconds(result, (before + after) / 2)
                    positions = len(result["positions"])
                    first = "none" if found["first"] is None else f"{found['first']:.1f} s"
                    print(
                        f"  {tokens} tokens ({positions} drawn), {case}: first partial {first} "
                        f"({found['first_positions']} of {positions} positions), 90% of every position's "
                        f"trace {found['ninety']:.1f} s, done {done:.1f} s, floor {floor:.1f} s "
                        f"({done / floor:.2f}x; {done / floor_seconds(result, max(before, after)):.2f}x at "
                        f"the higher rate; {before / 1e9:.0f} before, {after / 1e9:.0f} after, GFLOP/s)"
                    )


if __name__ == "__main__":
    main()
