"""``fisherscope study``: the Fisher of a prompt set over sampled responses, Fisher masks, the paper's
statistics, from a JSONL prompt file to a mask file and a summary (docs/design.md §7).

Why every check comes first: a study runs for minutes to hours, so the prompt file, the options and the
cost are checked before the model loads, each mistake reported as one line (exit code 2), and nothing
is written unless every output is complete.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from backend.rewards import RewardRule
from workers.commands.common import UsageError, check_outputs, progress_bar, quiet_transformers
from workers.commands.options import (
    add_budget_option,
    add_model_options,
    add_sampler_options,
    check_monte_carlo,
    positive_int,
    text,
)

SAMPLER_KINDS = ("model", "uniform")  # a study samples its responses: no data sampler
# the cost estimate and the summary hold each of a prompt's K x L response tokens, so their number is
# bounded before either exists (a prompt's K = 64 responses of L = 1024 tokens use 1.6% of it)
MAX_RESPONSE_TOKENS = 1 << 22
STUDY_EPILOG = """\
prompt file: one JSON object per line, {"prompt": TEXT, "target": TEXT}; target is optional (the
  expected response: the empirical Fisher's data, and what a reward compares with).
outputs: --masks holds one uint8 tensor per density and parameter, 'q<q>/<name>', 1 = among the top q
  of all coordinates by the study's exact sequence Fisher F (trainable); --summary the per-prompt
  totals, every response's ids, the estimators against F, the masks' shares per tensor, layer and
  module kind, and the paper's statistics on this model; --save the arrays 'F/', 'U/', 'M/'.
"""


def add_study_parser(commands) -> None:
    study = commands.add_parser(
        "study",
        help="Fisher of a prompt set over sampled responses, Fisher masks, the paper's statistics",
        epilog=STUDY_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    study.add_argument("--model", required=True, help="catalog id or a local Hugging Face model folder")
    study.add_argument("--prompts", required=True, type=Path, metavar="FILE.jsonl", help="the prompt file")
    study.add_argument(
        "--samples", type=positive_int, default=4, metavar="K", help="responses per prompt (default 4)"
    )
    study.add_argument(
        "--max-tokens",
        type=positive_int,
        default=16,
        metavar="L",
        help="tokens per response at most (default 16)",
    )
    study.add_argument("--seed", type=int, default=0, help="same seed, same responses (default 0)")
    add_sampler_options(study, SAMPLER_KINDS)
    reward = study.add_mutually_exclusive_group()
    reward.add_argument(
        "--reward-exact", action="store_true", help="reward 1 when a response equals its prompt's target"
    )
    reward.add_argument(
        "--reward-regex",
        type=text,
        default=None,
        metavar="PATTERN",
        help="reward 1 when PATTERN matches the response; {target} stands for the target, escaped "
        "(e.g. '^\\s*{target}\\b')",
    )
    study.add_argument(
        "--q", default="0.001,0.01,0.05", metavar="Q,...", help="mask densities (default 0.001,0.01,0.05)"
    )
    study.add_argument(
        "--compare-uniform",
        choices=["prompts", "responses", "none"],
        default="prompts",
        help="where to compute the Fisher under the model and under uniform (d directions each; "
        "default: at the prompts)",
    )
    study.add_argument("--chat-template", action="store_true", help="wrap each prompt in the chat template")
    study.add_argument(
        "--max-prompt-tokens",
        type=positive_int,
        default=None,
        help="refuse longer prompts (default: the service limit)",
    )
    study.add_argument("--masks", required=True, type=Path, metavar="OUT.safetensors", help="the mask file")
    study.add_argument("--summary", required=True, type=Path, metavar="OUT.json", help="the summary JSON")
    study.add_argument(
        "--save", type=Path, default=None, metavar="OUT.safetensors", help="write F/, U/, M/ and the ids"
    )
    add_budget_option(study, "default: the service budget")
    add_model_options(study)


def study_spec(args: argparse.Namespace):
    """The StudySpec of the arguments (bad values become UsageError naming the option)."""
    from backend.rewards import RewardKind
    from backend.vocabulary import EngineKind, Sampler, SamplerKind
    from workers.studies.spec import CompareAt, StudySpec

    try:
        fractions = tuple(float(q) for q in args.q.split(","))
    except ValueError:
        raise UsageError(
            f"--q: {args.q!r} is not a comma-separated list of numbers, e.g. 0.001,0.01"
        ) from None
    reward = None
    try:
        if args.reward_exact:
            reward = RewardRule(RewardKind.exact)
        elif args.reward_regex is not None:
            reward = RewardRule(RewardKind.regex, args.reward_regex)
    except ValueError as error:
        raise UsageError(f"--reward-regex: {error}") from None
    try:
        sampler = Sampler(
            kind=SamplerKind(args.sampler),
            temperature=args.temperature,
            top_k=args.top_k,
            top_p=args.top_p,
            engine=EngineKind(args.engine),
        )
        return StudySpec(
            sampler,
            samples=args.samples,
            max_tokens=args.max_tokens,
            seed=args.seed,
            method=args.method,
            reward=reward,
            fractions=fractions,
            compare_at=CompareAt(args.compare_uniform),
            chat_template=args.chat_template,
        )
    except ValueError as error:
        raise UsageError(" ".join(str(error).split())) from None


def _check_response_tokens(spec) -> None:
    if spec.samples * spec.max_tokens > MAX_RESPONSE_TOKENS:
        raise UsageError(
            f"--samples {spec.samples} x --max-tokens {spec.max_tokens} response tokens per prompt is over "
            f"the {MAX_RESPONSE_TOKENS:,} a study lists; lower either"
        )


def _check_reward_targets(path: Path, prompts: list, reward: RewardRule) -> None:
    """Every prompt's target in the reward's pattern, tried before any compute."""
    for prompt in prompts:
        try:
            reward.check_target(prompt.target or "")
        except ValueError as error:
            raise UsageError(f"{path} line {prompt.line}: {error}") from None


def cmd_study(args: argparse.Namespace) -> int:
    """A study; under ``torchrun`` every process samples the same responses (the seeds fix them) and runs
    a share of every context's directions; rank 0 writes the outputs (``workers.commands.processes``)."""
    from workers.commands.processes import device_of_process, process_group

    args.device = device_of_process(args.device)
    with process_group(args.device) as rank:
        return _study(args, writes=rank == 0)


def _study(args: argparse.Namespace, writes: bool) -> int:
    from workers.studies.prompts import PromptFileError, read_prompts, require_targets

    spec = study_spec(args)
    _check_response_tokens(spec)
    outputs = check_outputs({"--masks": args.masks, "--summary": args.summary, "--save": args.save})
    try:
        prompts = read_prompts(args.prompts)
        if spec.reward is not None:
            require_targets(
                args.prompts, prompts, "the reward compares each response with its prompt's target"
            )
            _check_reward_targets(args.prompts, prompts, spec.reward)
    except PromptFileError as error:
        raise UsageError(str(error)) from None
    if args.tf32:
        import torch

        torch.backends.cuda.matmul.allow_tf32 = True
    from workers.commands.analyze import _resolve_model

    info, codec, loaded = _resolve_model(args)
    check_monte_carlo(spec.method, info.d_model)
    encoded = _encode(args, prompts, codec)
    cost = _checked_cost(args, info, spec, encoded)
    if loaded is None:
        quiet_transformers()
        from workers.models.loading import load_model

        loaded = load_model(args.model, device=args.device, dtype=args.dtype)
    part = _run_with_progress(loaded, spec, encoded, sums_folder=args.masks.parent)
    if not writes:
        return 0
    from workers.studies.files import atomic_outputs, write_arrays, write_masks, write_summary
    from workers.studies.runner import model_meta
    from workers.studies.summary import finish_study

    finished = finish_study(part, spec, model_meta(loaded), cost.model_dump())
    with atomic_outputs(outputs) as temporaries:
        write_masks(temporaries[0], finished, part, spec)
        write_summary(temporaries[1], finished.summary)
        if args.save is not None:
            write_arrays(temporaries[2], part)
    print(
        f"wrote masks to {args.masks} and the summary to {args.summary}"
        + (f"; arrays to {args.save}" if args.save else "")
    )
    from workers.studies.report import format_study

    print(format_study(finished.summary))
    return 0


def _encode(args: argparse.Namespace, prompts, codec):
    from backend.settings import get_settings
    from workers.studies.prompts import PromptFileError, encode_prompts

    encode_prompt = codec.encode_prefix
    if args.chat_template:
        template = _chat_template(args.model)
        encode_prompt = lambda text: codec.encode_continuation(template(text))  # noqa: E731
    limit = args.max_prompt_tokens or get_settings().max_prefix_tokens
    try:
        return encode_prompts(args.prompts, prompts, encode_prompt, codec.encode_continuation, limit)
    except PromptFileError as error:
        raise UsageError(str(error)) from None


def _chat_template(model: str):
    """text -> the chat template's text of one user turn, ready for the assistant's response."""
    from backend.registry import BUILTIN, model_dir, registered_ids

    quiet_transformers()
    from transformers import AutoTokenizer

    source = str(model_dir(model)) if model in BUILTIN or model in registered_ids() else model
    try:
        tokenizer = AutoTokenizer.from_pretrained(source)
    except Exception as error:
        raise UsageError(f"--chat-template: cannot load the tokenizer of {model}: {error}") from None
    if not getattr(tokenizer, "chat_template", None):
        raise UsageError(f"--chat-template: {model} has no chat template; drop the option")

    def apply(text: str) -> str:
        messages = [{"role": "user", "content": text}]
        return str(tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True))

    return apply


def _checked_cost(args: argparse.Namespace, info, spec, encoded):
    """The estimate, printed; refused over the budget with the methods that would fit."""
    from backend.settings import get_settings
    from backend.study_cost import StudyShape, cheaper_study_methods, estimate_study_cost
    from workers.throughput import matmul_rate

    shape = StudyShape.of_prompts(
        encoded,
        n_params=info.n_params,
        d_model=info.d_model,
        samples=spec.samples,
        max_tokens=spec.max_tokens,
        sampler_kind=spec.sampler.kind,
        top_k=spec.sampler.top_k,
        on_policy=spec.sampler.is_on_policy,
        references=len(spec.references),
        references_everywhere=spec.compare_at == "responses",
    )
    rate = matmul_rate(args.device, info.d_model)
    cost = estimate_study_cost(shape, spec.method, rate)
    print(
        f"estimated cost (upper bound): {cost.flops / 1e12:.3g} TFLOP, ~{cost.seconds:.3g} s at "
        f"{rate / 1e9:.0f} GFLOP/s on {args.device}; {cost.directions_per_position} directions per position"
    )
    budget = args.max_cost_tflop if args.max_cost_tflop is not None else get_settings().cost_budget_tflop
    if cost.flops > budget * 1e12:
        offers = ", ".join(cheaper_study_methods(shape, budget * 1e12)) or "none"
        hint = (
            "; --compare-uniform none saves the reference Fisher"
            if cost.reference_flops > 0.3 * cost.flops
            else ""
        )
        raise UsageError(
            f"estimated {cost.flops / 1e12:.3g} TFLOP is over the budget of {budget:g} TFLOP "
            f"(--max-cost-tflop); cheaper --method choices: {offers}{hint}"
        )
    return cost


def _run_with_progress(loaded, spec, encoded, sums_folder: Path):
    """The study over every prompt, with a tqdm bar on stderr; its running sums memory-mapped in
    ``sums_folder`` (files unlinked as soon as they are mapped)."""
    from backend.settings import get_settings
    from workers.fisher.shards import split_directions
    from workers.studies.runner import run_study_part, study_model_of

    study_model = study_model_of(loaded, spec)
    with progress_bar("study") as progress, split_directions():
        return run_study_part(
            study_model,
            spec,
            encoded,
            memory_budget_bytes=get_settings().engine_memory_bytes,
            progress=progress,
            sums_folder=sums_folder,
        )
