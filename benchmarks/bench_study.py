"""A study on SmolLM2-135M: speed against its flop floor, peak memory, and exact against Monte Carlo.

Prints, measured in one run on this machine (not a timed test):
- the study (8 arithmetic prompts x K responses x L tokens, top-k 20, exact, a regex reward on each
  prompt's answer): time per stage, the floor sum over computed contexts of 2 r P t at the float32
  matmul rate measured in the same process, the ratio to it, and the process's peak memory;
- what it finds, as this model's values of the paper's statistics (never a reproduction): the 1% mask's
  shares per module kind, the Monte Carlo and empirical masks' overlap with the exact one against
  chance, the top-1% Fisher against top-1% |policy gradient| overlap, and the total Fisher under the
  model against under the uniform sampler at the prompts (with the time those d-direction passes take);
- exact against the Monte Carlo Fisher (squared scores of more sampled responses): time, relative L2
  error and top-1% overlap at each size, and what as many backward passes as the exact pass's
  directions would cost.

    .venv/bin/python benchmarks/bench_study.py [--tokens 16] [--samples 2] [--mc 64,256] [--prompts 8]
        [--device cpu]
"""

from __future__ import annotations

import argparse
import resource
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from backend.rewards import RewardKind, RewardRule  # noqa: E402
from backend.settings import get_settings  # noqa: E402
from backend.tokens import TokenCodec  # noqa: E402
from backend.vocabulary import Sampler  # noqa: E402
from workers.fisher.position import HeadLayout  # noqa: E402
from workers.fisher.response import log_likelihood_gradient  # noqa: E402
from workers.fisher.sampling import (
    sample_continuation,  # noqa: E402
    stop_ids,  # noqa: E402
)
from workers.fisher.study import (  # noqa: E402
    UNCENTERED,
    Reference,
    StudyStat,
    context_moments,
    relative_l2_error,
)
from workers.models.loading import load_model  # noqa: E402
from workers.studies.masks import compare_levels, level_map  # noqa: E402
from workers.studies.prompts import StudyPrompt, encode_prompts  # noqa: E402
from workers.studies.runner import StudyModel, StudyPart, model_meta, run_study_part  # noqa: E402
from workers.studies.spec import CompareAt, StudySpec  # noqa: E402
from workers.studies.summary import finish_study  # noqa: E402
from workers.throughput import measure  # noqa: E402

ARITHMETIC = [
    ("Q: 2+3=? A:", " 5"),
    ("Q: 4+4=? A:", " 8"),
    ("Q: 7-2=? A:", " 5"),
    ("Q: 3*3=? A:", " 9"),
    ("Q: 10-4=? A:", " 6"),
    ("Q: 1+8=? A:", " 9"),
    ("Q: 6+1=? A:", " 7"),
    ("Q: 9-5=? A:", " 4"),
]
ANSWER_FIRST = r"^\s*{target}(\D|$)"  # the answer, and not a longer number, before anything else
MC_SEED_OFFSET = 1_000  # the extra Monte Carlo responses are indices K + 1000.. of each prompt's stream


def _peak_gb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6  # kB -> GB


def _log(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def run_exact(study_model: StudyModel, spec: StudySpec, prompts) -> tuple[StudyPart, float]:
    last = [0.0]

    def progress(stage: str, fraction: float) -> None:
        if fraction - last[0] >= 0.05 or fraction >= 1.0:
            last[0] = fraction
            _log(f"  study {fraction:4.0%} [{stage}]")

    start = time.perf_counter()
    part = run_study_part(
        study_model, spec, prompts, memory_budget_bytes=get_settings().engine_memory_bytes, progress=progress
    )
    return part, time.perf_counter() - start


def fisher_under_references(
    study_model: StudyModel, spec: StudySpec, prompts
) -> tuple[dict[str, float], float]:
    """Total Fisher under the sampler, the model's p and uniform at every prompt (d directions each)."""
    model = study_model.model
    layout = HeadLayout.of(model)
    device = next(model.parameters()).device
    totals = {"sampler": 0.0, Reference.model: 0.0, Reference.uniform: 0.0}
    start = time.perf_counter()
    for prompt in prompts:
        moments = context_moments(
            model,
            layout,
            torch.tensor(prompt.input_ids, device=device),
            spec.sampler,
            spec.method_config(),
            references=(Reference.model, Reference.uniform),
            memory_budget_bytes=get_settings().engine_memory_bytes,
        )
        totals["sampler"] += sum(float(v.sum()) for v in moments.fisher.values())
        for name, params in moments.fisher_under.items():
            totals[name] += sum(float(v.sum()) for v in params.values())
        _log(f"  references at prompt {prompt.index}: {time.perf_counter() - start:.0f} s")
        del moments
    return totals, time.perf_counter() - start


def add_monte_carlo(
    study_model: StudyModel, spec: StudySpec, prompts, part: StudyPart, per_prompt: int
) -> dict:
    """``per_prompt`` more responses of each prompt, their squared scores summed under ``mc_<total>``."""
    model, sums = study_model.model, part.sums
    device = next(model.parameters()).device
    stat = f"mc_{per_prompt * len(prompts)}"
    sampling = scoring = 0.0
    for prompt in prompts:
        prompt_ids = torch.tensor(prompt.input_ids, device=device)
        for j in range(per_prompt):
            start = time.perf_counter()
            seed = spec.response_seed(prompt.index, spec.samples + MC_SEED_OFFSET + j)
            response = sample_continuation(
                model, prompt_ids, spec.sampler, seed, spec.max_tokens, study_model.stop_ids
            )
            middle = time.perf_counter()
            score = log_likelihood_gradient(model, prompt_ids, torch.tensor(response, device=device))
            sums.add_square(stat, score)
            del score
            sampling += middle - start
            scoring += time.perf_counter() - middle
    return {"stat": stat, "responses": per_prompt * len(prompts), "sampling": sampling, "scoring": scoring}


def _quality(part: StudyPart, stat: str, count: int, fisher_levels) -> tuple[float, float, float]:
    sums = part.sums
    levels = level_map(sums, stat, [0.01])
    overlap = compare_levels(levels, fisher_levels, [0.01])["overlap"][0]
    return (
        relative_l2_error(sums, stat, count, StudyStat.fisher, sums.responses),
        relative_l2_error(sums, stat, count, UNCENTERED, sums.responses),
        overlap,
    )


def report_study(part: StudyPart, seconds: float, rate: float, n_params: int, spec: StudySpec) -> None:
    sums = part.sums
    floor_flops = 2.0 * n_params * sums.direction_tokens
    floor_seconds = floor_flops / rate
    stages = part.seconds
    print(
        f"\n== study: {len(part.prompts)} prompts x {spec.samples} responses x <= {spec.max_tokens} tokens, "
        f"top-k {spec.sampler.top_k}, {spec.method}"
    )
    print(
        f"  positions       {sums.positions} ({sums.contexts} distinct contexts computed, "
        f"{sums.directions} directions)"
    )
    print(
        f"  time            {seconds:8.1f} s = sampling {stages.get('sampling', 0):.1f} + exact pass "
        f"{stages.get('fisher', 0):.1f} + scores {stages.get('scores', 0):.1f} s"
    )
    print(f"  matmul rate     {rate / 1e9:8.1f} GFLOP/s (float32 2048^2, measured now)")
    print(f"  floor sum 2rPt  {floor_flops / 1e12:8.3f} TFLOP = {floor_seconds:.1f} s at that rate")
    print(f"  ratio           {stages.get('fisher', 0) / floor_seconds:8.2f} x floor (the exact pass)")
    print(f"  peak memory     {_peak_gb():8.2f} GB (this process, model included)")


def report_findings(summary: dict, references: dict[str, float], reference_seconds: float) -> None:
    print("\n== what it finds (same statistics as the paper, this model; not a reproduction)")
    rewards = [r["reward"] for r in summary["responses"]]
    print(f"  reward          mean {sum(rewards) / len(rewards):.3f} over {len(rewards)} responses")
    mask = summary["masks"]["by_q"]["0.01"]
    kinds = sorted((g for g in mask["kinds"] if g["count"]), key=lambda g: -g["share_of_mask"])
    print("  1% mask by module kind (share of the mask / density within the kind):")
    for group in kinds:
        print(f"    {group['group']:<10} {group['share_of_mask']:7.2%}   {group['density']:7.3%}")
    for name in ("mc_fisher", "empirical_fisher"):
        row = summary["estimators"][name]
        top = row["top_q_vs_fisher"]
        overlaps = ", ".join(
            f"q={q:g} {o:.3f} (chance {c:g}, Jaccard {j:.3f} vs {cj:.3g})"
            for q, o, c, j, cj in zip(
                top["q"],
                top["overlap"],
                top["chance_overlap"],
                top["jaccard"],
                top["chance_jaccard"],
                strict=True,
            )
        )
        print(f"  {name:<17} mask overlap with exact: {overlaps}")
    gradient = summary["paper"]["fisher_vs_policy_gradient"]
    if gradient["overlap"] is None:
        print(f"  top-1% F vs |policy gradient|: {gradient['reason']}")
    else:
        print(
            f"  top-1% F vs top-1% |policy gradient|: {gradient['overlap']:.2%} (chance 1%; "
            f"{gradient['prompts_with_reward_variance']} prompts with reward variance; paper: 47.40%)"
        )
    ratio = references[Reference.model] / references[Reference.uniform]
    sampler_ratio = references["sampler"] / references[Reference.uniform]
    print(
        f"  Fisher under the model / under uniform at the prompts: {ratio:.3f} (under the top-k sampler: "
        f"{sampler_ratio:.3f}; paper: 0.16); {reference_seconds:.0f} s for those passes"
    )


def report_monte_carlo(part: StudyPart, exact_seconds: float, runs: list[dict], fisher_levels) -> None:
    sums = part.sums
    print("\n== exact F against the Monte Carlo Fisher (squared score of each sampled response)")
    print(f"  exact           {exact_seconds:8.1f} s, {sums.directions} directions back-propagated")
    rows: list[dict[str, Any]] = [
        {"stat": StudyStat.mc_fisher, "responses": sums.responses, "seconds": part.seconds.get("scores")}
    ]
    rows += [{**run, "seconds": run["sampling"] + run["scoring"]} for run in runs]
    for row in rows:
        error_f, error_u, overlap = _quality(part, row["stat"], row["responses"], fisher_levels)
        print(
            f"  MC {row['responses']:>5} resp. {row['seconds'] or 0.0:8.1f} s   relative L2 error vs F "
            f"{error_f:.3f} (vs U {error_u:.3f})   top-1% overlap with F {overlap:.3f}"
        )
    if runs:
        # the machine's load varies: the rate over every extra response, not the last run's
        per_response = sum(run["sampling"] + run["scoring"] for run in runs) / sum(
            run["responses"] for run in runs
        )
        print(
            f"  as many backward passes as the exact pass: {sums.directions} responses, about "
            f"{sums.directions * per_response:.0f} s at the {per_response:.2f} s per response measured above"
        )
    print(
        "  (F averages the exact Fisher over the study's own responses only: against more responses the MC "
        "error also holds F's sampling noise; off the policy the squared score estimates neither F nor U)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--samples", type=int, default=2, help="responses per prompt (K)")
    parser.add_argument("--tokens", type=int, default=16, help="tokens per response at most (L)")
    parser.add_argument("--top-k", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--mc", default="64,256", help="Monte Carlo responses in total, beyond the study's")
    parser.add_argument(
        "--prompts", type=int, default=len(ARITHMETIC), help="the first N of the 8 prompts (memory checks)"
    )
    args = parser.parse_args()
    loaded = load_model(args.model, device=args.device)
    rate = measure(args.device, size=2048)
    codec = TokenCodec(loaded.tokenizer)
    prompts = encode_prompts(
        Path("bench_study"),
        [StudyPrompt(i, i + 1, text, target) for i, (text, target) in enumerate(ARITHMETIC[: args.prompts])],
        codec.encode_prefix,
        codec.encode_continuation,
        get_settings().max_prefix_tokens,
    )
    spec = StudySpec(
        Sampler(top_k=args.top_k),
        samples=args.samples,
        max_tokens=args.tokens,
        seed=args.seed,
        reward=RewardRule(RewardKind.regex, ANSWER_FIRST),
        compare_at=CompareAt.none,  # the reference passes run on their own below, timed apart
    )
    study_model = StudyModel(
        loaded.model,
        lambda ids: loaded.tokenizer.decode(list(ids), skip_special_tokens=True),
        stop_ids(loaded.model),
    )
    print(f"fisherscope study benchmark: {args.model} on {args.device}")
    part, seconds = run_exact(study_model, spec, prompts)
    report_study(part, seconds, rate, loaded.info.n_params, spec)
    finished = finish_study(part, spec, model_meta(loaded))
    references, reference_seconds = fisher_under_references(study_model, spec, prompts)
    report_findings(finished.summary, references, reference_seconds)
    runs = []
    for total in (int(n) for n in args.mc.split(",") if n):
        runs.append(add_monte_carlo(study_model, spec, prompts, part, max(1, total // len(prompts))))
        _log(f"  Monte Carlo with {runs[-1]['responses']} responses done")
    report_monte_carlo(part, part.seconds.get("fisher", seconds), runs, finished.fisher_levels)
    for response in finished.summary["responses"]:
        print(f"  prompt {response['prompt_index']} reward {response['reward']:.0f}: {response['text']!r}")


if __name__ == "__main__":
    main()
