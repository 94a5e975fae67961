"""Speed and memory of the exact engine on SmolLM2-135M, measured against its own flop floor.

Prints, in one run on this machine: exact time and peak memory for a 5-token and a 32-token prefix;
the floor 2 r P T at the float32 matmul rate measured in the same run, and the ratio; Monte Carlo
with 16/64/256 samples (time, relative L2 error against exact, top-1% overlap); and the
per-candidate brute force (one backward per vocabulary token) extrapolated from timed backwards.

Each measurement runs in its own process so that peak memory (ru_maxrss) is that measurement's own.

    .venv/bin/python benchmarks/bench_engine.py [--model smollm2-135m] [--skip-32]
"""

from __future__ import annotations

import argparse
import json
import math
import resource
import subprocess
import sys
import time

SHORT_PREFIX = "She drank a cup of"
LONG_TEXT = (
    "The Fisher says where learning can happen; the reward decides where it does. After she drank a "
    "cup of coffee, she read the essay again and wrote down why the updates of post-training are sparse"
)


def _peak_gb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6  # kB -> GB


def _load(model_id: str):
    from workers.models.loading import load_model

    return load_model(model_id)


def _job(loaded, ids: list[int], method: str = "exact"):
    from backend.schemas import AnalysisJob

    return AnalysisJob(model=loaded.id, weights_digest=loaded.info.digest, input_ids=ids, method=method)


def _prefix_ids(loaded, which: str) -> list[int]:
    if which == "short":
        return loaded.tokenizer.encode(SHORT_PREFIX).ids
    ids = loaded.tokenizer.encode(LONG_TEXT).ids
    if len(ids) < 32:
        raise SystemExit("the long benchmark text encodes to fewer than 32 tokens")
    return ids[:32]


def child_exact(model_id: str, which: str) -> dict:
    """One exact analysis; time per stage and this process's peak memory."""
    from workers.engine import measured_flops_per_second, run_analysis

    loaded = _load(model_id)
    ids = _prefix_ids(loaded, which)
    rate = measured_flops_per_second(2048)
    stages: dict[str, float] = {}
    start = time.perf_counter()

    def progress(stage: str, fraction: float) -> None:
        stages.setdefault(stage, time.perf_counter() - start)

    analysis = run_analysis(loaded, _job(loaded, ids), progress)
    total = time.perf_counter() - start
    pooled_start = time.perf_counter()
    analysis.pooled()
    pooled = time.perf_counter() - pooled_start
    directions = analysis.summary["method"]["directions"]
    return {
        "tokens": len(ids),
        "seconds": total,
        "pooled_seconds": pooled,
        "stages": stages,
        "peak_gb": _peak_gb(),
        "directions": directions,
        "n_params": loaded.info.n_params,
        "matmul_flops_per_second": rate,
    }


def child_mc(model_id: str, which: str, samples: list[int]) -> dict:
    """Exact once, then Monte Carlo with each sample count: time, relative L2 error, top-1% overlap."""
    import torch

    from workers.engine import run_analysis

    loaded = _load(model_id)
    ids = _prefix_ids(loaded, which)
    exact = torch.cat(
        [v.reshape(-1) for v in run_analysis(loaded, _job(loaded, ids)).per_parameter("fisher").values()]
    )
    k = max(1, math.ceil(0.01 * exact.numel()))
    exact_top = torch.zeros(exact.numel(), dtype=torch.bool)
    exact_top[torch.topk(exact, k).indices] = True
    out = []
    for s in samples:
        start = time.perf_counter()
        analysis = run_analysis(loaded, _job(loaded, ids, f"mc:{s}"))
        seconds = time.perf_counter() - start
        estimate = torch.cat([v.reshape(-1) for v in analysis.per_parameter("fisher").values()])
        error = float((estimate - exact).norm() / exact.norm())
        top = torch.topk(estimate, k).indices
        overlap = float(exact_top[top].float().mean())
        out.append({"samples": s, "seconds": seconds, "relative_l2": error, "top1_overlap": overlap})
        del estimate, analysis
    return {"mc": out}


def child_brute_force(model_id: str, candidates: int = 8) -> dict:
    """Seconds per vocabulary token of the per-candidate brute force, times the vocabulary."""
    import torch

    loaded = _load(model_id)
    model = loaded.model
    ids = torch.tensor(_prefix_ids(loaded, "short"))
    params = [p for p in model.parameters()]
    logits = model(input_ids=ids[None], use_cache=False).logits[0, -1]
    torch.autograd.grad(logits[0], params, retain_graph=True)  # warm up
    start = time.perf_counter()
    for a in range(candidates):
        torch.autograd.grad(logits[a], params, retain_graph=True)
    per_token = (time.perf_counter() - start) / candidates
    vocab = logits.numel()
    return {"seconds_per_token": per_token, "vocab": vocab, "extrapolated_seconds": per_token * vocab}


def _run_child(args: list[str]) -> dict:
    result = subprocess.run(
        [sys.executable, __file__, "--child", *args], capture_output=True, text=True, check=False
    )
    if result.returncode != 0:
        raise SystemExit(f"benchmark child {args} failed:\n{result.stderr[-2000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def _report_exact(label: str, r: dict) -> None:
    floor_flops = 2 * r["directions"] * r["n_params"] * r["tokens"]
    floor_seconds = floor_flops / r["matmul_flops_per_second"]
    print(f"\n== exact, {label} ({r['tokens']} tokens, r = {r['directions']} directions)")
    print(
        f"  time            {r['seconds']:8.2f} s   (stages start at: "
        + ", ".join(f"{k} {v:.2f}s" for k, v in r["stages"].items())
        + ")"
    )
    print(f"  pooled views    {r['pooled_seconds']:8.2f} s   (for the service's heatmaps)")
    print(f"  peak memory     {r['peak_gb']:8.2f} GB")
    print(f"  matmul rate     {r['matmul_flops_per_second'] / 1e9:8.1f} GFLOP/s (float32, measured now)")
    print(f"  floor 2rPT      {floor_flops / 1e12:8.3f} TFLOP = {floor_seconds:.2f} s at that rate")
    print(f"  ratio           {r['seconds'] / floor_seconds:8.2f} x floor")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--skip-32", action="store_true", help="skip the 32-token prefix (slow on a CPU)")
    parser.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        kind, *rest = args.child
        if kind == "exact":
            print(json.dumps(child_exact(args.model, rest[0])))
        elif kind == "mc":
            print(json.dumps(child_mc(args.model, rest[0], [int(s) for s in rest[1:]])))
        elif kind == "brute":
            print(json.dumps(child_brute_force(args.model)))
        return
    print(f"fisherscope engine benchmark: {args.model}, torch threads as configured")
    short = _run_child(["exact", "short"])
    _report_exact(f'"{SHORT_PREFIX}"', short)
    if not args.skip_32:
        _report_exact("32-token prefix", _run_child(["exact", "long"]))
    mc = _run_child(["mc", "short", "16", "64", "256"])["mc"]
    print(f'\n== Monte Carlo against exact, "{SHORT_PREFIX}"')
    for row in mc:
        relative = row["seconds"] / short["seconds"]
        print(
            f"  mc:{row['samples']:<4} {row['seconds']:7.2f} s ({relative:.2f} x exact)"
            f"   relative L2 error {row['relative_l2']:.3f}   top-1% overlap {row['top1_overlap']:.3f}"
        )
    brute = _run_child(["brute"])
    hours = brute["extrapolated_seconds"] / 3600
    print("\n== per-candidate brute force (one backward per vocabulary token)")
    print(
        f"  {brute['seconds_per_token'] * 1000:.1f} ms per token x {brute['vocab']} tokens = {hours:.2f} h"
        f"   ({brute['extrapolated_seconds'] / short['seconds']:.0f} x exact)"
    )


if __name__ == "__main__":
    sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[1]))
    main()
