"""Speed and memory of the exact engine on SmolLM2-135M, measured against its own flop floor.

Prints, in one run on this machine:
- exact on a 5-token and a 32-token prefix: time per stage (the fastest of three runs), peak memory,
  the floor 2 r P T at the float32 matmul rate measured in the same process, the ratio to it, the
  summary stage against the direction pass, and when the first partial result comes in a run that
  makes them (as the service does, on a worker that has made them before);
- the cost estimate (`backend.cost.estimate_cost` at the rate measured around each case) against the
  measured time, for prefixes of 5 to 256 tokens and continuations up to 64 (the long ones with Monte
  Carlo directions, which the estimate models the same way, so the run stays in minutes);
- Monte Carlo with 16/64/256 samples against exact (time, relative L2 error, top-1% overlap), and the
  per-candidate brute force (one backward per vocabulary token) extrapolated from timed backwards.

Each measurement runs in its own process so that peak memory (ru_maxrss) is that measurement's own.

    .venv/bin/python benchmarks/bench_engine.py [--model smollm2-135m] [--skip-long] [--device cpu]
"""

from __future__ import annotations

import argparse
import json
import math
import resource
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SHORT_PREFIX = "She drank a cup of"
LONG_TEXT = (
    "The Fisher says where learning can happen; the reward decides where it does. After she drank a "
    "cup of coffee, she read the essay again and wrote down why the updates of post-training are sparse"
)
# (prefix tokens, continuation tokens, method) whose estimate is compared with the measured time
ESTIMATE_CASES = [
    (5, 0, "exact"),
    (32, 0, "exact"),
    (64, 0, "exact"),
    (128, 0, "mc:32"),
    (256, 0, "mc:16"),
    (5, 16, "mc:16"),
    (5, 64, "mc:4"),
]


def _peak_gb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6  # kB -> GB


def _setup(model_id: str, device: str):
    from backend.settings import get_settings
    from workers.models.loading import load_model

    return load_model(model_id, device=device), get_settings()


def _ids(loaded, tokens: int) -> list[int]:
    if tokens == 5:
        return loaded.tokenizer.encode(SHORT_PREFIX).ids
    ids: list[int] = []
    while len(ids) < tokens:
        ids += loaded.tokenizer.encode(LONG_TEXT).ids
    return ids[:tokens]


def _job(loaded, ids: list[int], continuation: list[int] | None = None, method: str = "exact"):
    from backend.schemas import AnalysisJob

    return AnalysisJob(
        model=loaded.id,
        weights_digest=loaded.info.digest,
        input_ids=ids,
        continuation_ids=continuation or [],
        method=method,
    )


REPEATS = 3  # timed analyses per length; the fastest is reported (the machines are shared and noisy)


def child_exact(model_id: str, device: str, tokens: int) -> dict:
    """Exact analyses of one length: time per stage and this process's peak memory.

    The fastest of ``REPEATS`` runs is reported, against the floor at the highest matmul rate measured
    (one measurement before each run and one after the last); every run is listed with the rates
    measured just before and after it, so that the machine's noise is in view.
    """
    from workers.jobs import analyze_job
    from workers.throughput import measure

    loaded, settings = _setup(model_id, device)
    job = _job(loaded, _ids(loaded, tokens))
    analyze_job(loaded, _job(loaded, _ids(loaded, 3)), settings)  # warm: first calls compile and allocate
    # the first analysis of this length also pays for memory the process has never touched (on this
    # project's VMs ~6 us per 4 kB page, 1.1 s per GB); a worker pays it once, so it is reported apart
    first_start = time.perf_counter()
    analyze_job(loaded, job, settings)
    first_seconds = time.perf_counter() - first_start
    runs = []
    analysis = None
    for _ in range(REPEATS):
        analysis = None  # the last run's sums are freed first, as a worker frees a finished analysis
        rate = measure(device, size=2048)
        stages: dict[str, float] = {}
        start = time.perf_counter()

        def progress(stage: str, fraction: float, start: float = start, stages: dict = stages) -> None:
            stages.setdefault(stage, time.perf_counter() - start)

        analysis = analyze_job(loaded, job, settings, progress)
        runs.append({"seconds": time.perf_counter() - start, "stages": stages, "rate": rate})
    # the rate after each run: the next run's "before", and one more measurement after the last
    after = [run["rate"] for run in runs[1:]] + [measure(device, size=2048)]
    for run, rate_after in zip(runs, after, strict=True):
        run["rate_after"] = rate_after
    best = min(runs, key=lambda run: run["seconds"])
    assert analysis is not None
    pooled_start = time.perf_counter()
    analysis.pooled()
    pooled_seconds = time.perf_counter() - pooled_start
    peak_gb = _peak_gb()  # before the run with partials, whose snapshots add ghost squares and head copies
    directions = analysis.summary["method"]["directions"]
    # freed, as a worker frees a finished analysis before it takes the next job: held, its sums kept
    # the next analysis from the memory they were lent (workers.fisher.recycled) and it touched as much
    # new memory
    analysis = None
    # as the service runs it: light partial summaries after each chunk, the first chunk kept small. A
    # worker's first analysis with them also touches memory for what the snapshots form (ghost squares,
    # head copies) for the first time (as the first run above does for the sums): reported apart, and
    # the second one is what a warm worker (the service's landing analysis done) gives a person
    with_partials = []
    for _ in range(2):
        partials: list[tuple[float, float]] = []
        partial_start = time.perf_counter()
        analyze_job(
            loaded,
            job,
            settings,
            on_partial=lambda summary, kept, start=partial_start, into=partials: into.append(
                (time.perf_counter() - start, kept)
            ),
        )
        with_partials.append((partials, time.perf_counter() - partial_start))
    (first_partials, _), (partials, partials_seconds) = with_partials
    return {
        "tokens": tokens,
        "seconds": best["seconds"],
        "first_seconds": first_seconds,
        "pooled_seconds": pooled_seconds,
        "partials": partials,
        "with_partials_seconds": partials_seconds,
        "first_partial_cold": first_partials[0][0] if first_partials else None,
        "stages": best["stages"],
        "runs": [
            {"seconds": run["seconds"], "rate": run["rate"], "rate_after": run["rate_after"]} for run in runs
        ],
        "peak_gb": peak_gb,
        "peak_with_partials_gb": _peak_gb(),
        "directions": directions,
        "n_params": loaded.info.n_params,
        # the highest rate seen: the floor at the machine's best (a slow measurement is noise, not a
        # slower machine, and would flatter the ratio)
        "matmul_flops_per_second": max(max(run["rate"], run["rate_after"]) for run in runs),
    }


def child_estimate(model_id: str, device: str, cases: list[tuple[int, int, str]]) -> dict:
    """Estimated against measured seconds, each case's estimate at the mean of the matmul rates (at the
    model's width, as the CLI measures it) just before and just after it (the shared machine's speed
    drifts by up to ~1.8x within a run of the long cases: one rate for all of them made the estimate
    follow the drift, not the model)."""
    from backend.cost import estimate_cost
    from workers.jobs import analyze_job
    from workers.throughput import measure_width

    loaded, settings = _setup(model_id, device)
    analyze_job(loaded, _job(loaded, _ids(loaded, 3), method="mc:2"), settings)  # warm
    rows = []
    for tokens, continuation, method in cases:
        ids = _ids(loaded, tokens + continuation)
        job = _job(loaded, ids[:tokens], ids[tokens:], method)
        before = measure_width(device, loaded.info.d_model)
        start = time.perf_counter()
        analyze_job(loaded, job, settings)
        seconds = time.perf_counter() - start
        rate = (before + measure_width(device, loaded.info.d_model)) / 2
        rows.append(
            {
                "tokens": tokens,
                "continuation": continuation,
                "method": method,
                "seconds": seconds,
                "estimate": estimate_cost(loaded.info, job, rate).seconds,
                "rate": rate,
            }
        )
    return {"rows": rows}


def child_mc(model_id: str, device: str, samples: list[int]) -> dict:
    """Exact once, then Monte Carlo with each sample count: time, relative L2 error, top-1% overlap."""
    import torch

    from workers.jobs import analyze_job

    loaded, settings = _setup(model_id, device)
    ids = _ids(loaded, 5)
    exact_analysis = analyze_job(loaded, _job(loaded, ids), settings)
    exact = torch.cat([v.reshape(-1) for v in exact_analysis.per_parameter("fisher").values()])
    del exact_analysis
    k = max(1, math.ceil(0.01 * exact.numel()))
    exact_top = torch.zeros(exact.numel(), dtype=torch.bool)
    exact_top[torch.topk(exact, k).indices] = True
    out = []
    for s in samples:
        start = time.perf_counter()
        analysis = analyze_job(loaded, _job(loaded, ids, method=f"mc:{s}"), settings)
        seconds = time.perf_counter() - start
        estimate = torch.cat([v.reshape(-1) for v in analysis.per_parameter("fisher").values()])
        error = float((estimate - exact).norm() / exact.norm())
        overlap = float(exact_top[torch.topk(estimate, k).indices].float().mean())
        out.append({"samples": s, "seconds": seconds, "relative_l2": error, "top1_overlap": overlap})
        del estimate, analysis
    return {"mc": out}


def child_brute_force(model_id: str, device: str, candidates: int = 8) -> dict:
    """Seconds per vocabulary token of the per-candidate brute force, times the vocabulary."""
    import torch

    loaded, _ = _setup(model_id, device)
    model = loaded.model
    ids = torch.tensor(_ids(loaded, 5), device=device)
    params = list(model.parameters())
    logits = model(input_ids=ids[None], use_cache=False).logits[0, -1]
    torch.autograd.grad(logits[0], params, retain_graph=True)  # warm up
    start = time.perf_counter()
    for a in range(candidates):
        torch.autograd.grad(logits[a], params, retain_graph=True)
    per_token = (time.perf_counter() - start) / candidates
    return {
        "seconds_per_token": per_token,
        "vocab": logits.numel(),
        "extrapolated_seconds": per_token * logits.numel(),
    }


def _run_child(args: list[str], options: argparse.Namespace) -> dict:
    command = [
        sys.executable,
        __file__,
        "--model",
        options.model,
        "--device",
        options.device,
        "--child",
        *args,
    ]
    result = subprocess.run(command, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise SystemExit(f"benchmark child {args} failed:\n{result.stderr[-2000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def _report_exact(label: str, r: dict) -> None:
    floor_flops = 2 * r["directions"] * r["n_params"] * r["tokens"]
    floor_seconds = floor_flops / r["matmul_flops_per_second"]
    stages = r["stages"]
    directions = stages.get("summary", r["seconds"]) - stages.get("directions", 0.0)
    summary = r["seconds"] - stages.get("summary", r["seconds"])
    print(f"\n== exact, {label} ({r['tokens']} tokens, r = {r['directions']} directions)")
    print(
        f"  time            {r['seconds']:8.2f} s   = prepare (forward, C_mu) "
        f"{stages.get('directions', 0):.2f} s"
        f" + directions {directions:.2f} s + summary {summary:.2f} s"
    )
    print(
        f"  first run       {r['first_seconds']:8.2f} s   (the first analysis of this length in the process)"
    )
    print(
        f"  pooled views    {r['pooled_seconds']:8.2f} s   (for the service's heatmaps, after the analysis)"
    )
    if r["partials"]:
        at, kept = r["partials"][0]
        print(
            f"  first partial   {at:8.2f} s   ({kept:.0%} of the C_mu trace; {len(r['partials'])} partials,"
            f" the analysis with them {r['with_partials_seconds']:.2f} s, peak memory"
            f" {r['peak_with_partials_gb']:.2f} GB; the process's first analysis with partials had its"
            f" first at {r['first_partial_cold']:.2f} s)"
        )
    print(f"  peak memory     {r['peak_gb']:8.2f} GB")
    print(
        f"  matmul rate     {r['matmul_flops_per_second'] / 1e9:8.1f} GFLOP/s"
        " (float32 2048^2 for 1 s before each run and after the last: the highest)"
    )
    print(f"  floor 2rPT      {floor_flops / 1e12:8.3f} TFLOP = {floor_seconds:.2f} s at that rate")
    ratio = r["seconds"] / floor_seconds
    runs = r["runs"]
    print(f"  ratio           {ratio:8.2f} x floor (end to end, warm model, fastest of {len(runs)} runs)")
    # each run at the mean of the rates measured just before and just after it: the shared machine's
    # speed drifts within minutes, and the highest rate paired with the fastest run is the bound above
    each = []
    for run in runs:
        rate = (run["rate"] + run.get("rate_after", run["rate"])) / 2
        each.append((run["seconds"], rate, run["seconds"] * rate / floor_flops))
    listed = ", ".join(f"{sec:.2f} s at {rate / 1e9:.0f} GFLOP/s = {x:.2f} x" for sec, rate, x in each)
    print(f"  every run       {listed} (each at the mean of the rates before and after it)")
    print(f"  median run      {sorted(x for _, _, x in each)[len(each) // 2]:8.2f} x floor")
    print(f"  summary         {summary / max(directions, 1e-9):8.1%} of the direction pass")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--skip-long", action="store_true", help="only the 5-token exact analysis")
    parser.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        kind, *rest = args.child
        if kind == "exact":
            print(json.dumps(child_exact(args.model, args.device, int(rest[0]))))
        elif kind == "estimate":
            cases = [(int(t), int(c), m) for t, c, m in (case.split(",") for case in rest)]
            print(json.dumps(child_estimate(args.model, args.device, cases)))
        elif kind == "mc":
            print(json.dumps(child_mc(args.model, args.device, [int(s) for s in rest])))
        elif kind == "brute":
            print(json.dumps(child_brute_force(args.model, args.device)))
        return
    print(f"fisherscope engine benchmark: {args.model} on {args.device}")
    short = _run_child(["exact", "5"], args)
    _report_exact(f'"{SHORT_PREFIX}"', short)
    if args.skip_long:
        return
    _report_exact("32-token prefix", _run_child(["exact", "32"], args))
    estimate = _run_child(["estimate", *(f"{t},{c},{m}" for t, c, m in ESTIMATE_CASES)], args)
    print("\n== cost estimate against measured time (each at the matmul rate at the model's width around it)")
    for row in estimate["rows"]:
        ratio = row["estimate"] / row["seconds"]
        print(
            f"  prefix {row['tokens']:>3} + continuation {row['continuation']:>2}, {row['method']:<6}"
            f" measured {row['seconds']:7.1f} s  estimated {row['estimate']:7.1f} s  ({ratio:.2f} x)"
            f"  at {row['rate'] / 1e9:.0f} GFLOP/s"
        )
    mc = _run_child(["mc", "16", "64", "256"], args)["mc"]
    print(f'\n== Monte Carlo against exact, "{SHORT_PREFIX}"')
    for row in mc:
        print(
            f"  mc:{row['samples']:<4} {row['seconds']:7.2f} s "
            f"({row['seconds'] / short['seconds']:.2f} x exact)"
            f"   relative L2 error {row['relative_l2']:.3f}   top-1% overlap {row['top1_overlap']:.3f}"
        )
    brute = _run_child(["brute"], args)
    print("\n== per-candidate brute force (one backward per vocabulary token)")
    print(
        f"  {brute['seconds_per_token'] * 1000:.1f} ms per token x {brute['vocab']} tokens ="
        f" {brute['extrapolated_seconds'] / 3600:.2f} h"
        f"   ({brute['extrapolated_seconds'] / short['seconds']:.0f} x exact)"
    )


if __name__ == "__main__":
    main()
