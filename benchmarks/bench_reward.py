"""A reward change against the whole analysis, through the worker's own path (workers.jobs).

Runs the landing example (SmolLM2-135M by default: " tea with her" after "She drank a cup of", T 0.7,
top-k 50, exact, reward ' tea'=1 ' coffee'=0) as a whole analysis, then the same request under three
other rewards, each answered from the first one's kept Fisher roots (workers.reward_reuse), and once
more whole in a fresh store for comparison; last the first request with rho (the Fisher under p as
well: what the dashboard's second stage runs). Prints the seconds of each and their ratios.

Usage: .venv/bin/python benchmarks/bench_reward.py [--model smollm2-135m] [--prefix-only]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from backend.local_store import LocalStore
from backend.schemas import AnalysisJob
from backend.settings import Settings
from backend.vocabulary import (
    LANDING_CONTINUATION,
    LANDING_PREFIX,
    LANDING_TEMPERATURE,
    LANDING_TOP_K,
    Sampler,
)
from workers import jobs
from workers.jobs import model_pool

REWARDS = [
    {" tea": 1.0, " coffee": 0.0},
    {" tea": 1.0, " coffee": 0.5},
    {" coffee": 1.0},
    {},
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--prefix-only", action="store_true", help="no response: the prefix's next token")
    args = parser.parse_args()
    pool = model_pool()
    loaded = pool.get(args.model)
    encode = loaded.tokenizer.encode

    def job(reward: dict[str, float]) -> AnalysisJob:
        ids = {str(encode(text, add_special_tokens=False).ids[0]): value for text, value in reward.items()}
        return AnalysisJob(
            model=loaded.id,
            weights_digest=loaded.info.digest,
            input_ids=encode(LANDING_PREFIX).ids,
            continuation_ids=[]
            if args.prefix_only
            else encode(LANDING_CONTINUATION, add_special_tokens=False).ids,
            sampler=Sampler(temperature=LANDING_TEMPERATURE, top_k=LANDING_TOP_K),
            reward=ids,
        )

    def timed(store: LocalStore, settings: Settings, request: AnalysisJob) -> float:
        started = time.perf_counter()
        jobs.execute_analysis(request, store, settings, pool)
        seconds = time.perf_counter() - started
        meta = store.get_meta(request.key()) or {}
        if meta.get("status") != "done":
            raise SystemExit(f"bench_reward: the analysis ended {meta.get('status')}: {meta.get('error')}")
        return seconds

    with tempfile.TemporaryDirectory() as folder:
        root = Path(folder)

        def settings(name: str) -> Settings:
            return Settings(
                redis_url=None,
                landing_analysis=False,
                results_dir=root / name / "results",
                exports_dir=root / name / "exports",
                studies_dir=root / name / "studies",
            )

        kept = settings("kept")
        store = LocalStore(kept.results_dir)
        shape = "prefix only" if args.prefix_only else f"response {LANDING_CONTINUATION!r}"
        print(f"{args.model}, {LANDING_PREFIX!r}, {shape}, T {LANDING_TEMPERATURE}, top-k {LANDING_TOP_K}")
        whole = timed(store, kept, job(REWARDS[0]))
        print(f"whole analysis (keeps the Fisher roots): {whole:7.2f} s   reward {REWARDS[0]}")
        for reward in REWARDS[1:]:
            seconds = timed(store, kept, job(reward))
            ratio = whole / seconds
            print(
                f"reward change, Fisher reused:            {seconds:7.2f} s   reward {reward}   {ratio:5.1f}x"
            )
        assert store.read_counter(jobs.REWARD_REUSES) == len(REWARDS) - 1
        alone = settings("alone")
        again = timed(LocalStore(alone.results_dir), alone, job(REWARDS[1]))
        print(f"the same change as a whole analysis:     {again:7.2f} s   reward {REWARDS[1]}")
        staged = settings("rho")
        rho = timed(LocalStore(staged.results_dir), staged, job(REWARDS[0]).model_copy(update={"rho": True}))
        print(f"with rho (the Fisher under p as well):   {rho:7.2f} s   {rho / whole:5.1f}x the first answer")


if __name__ == "__main__":
    main()
