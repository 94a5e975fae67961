"""``fisherscope analyze``: one analysis of a prefix (and continuation) to the terminal and to files.

Why a CLI next to the API: a notebook user wants every per-parameter array (134.5M floats per stat for
SmolLM2), which never travels through the service; ``--save`` writes them as safetensors.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path

from workers.commands.common import UsageError, check_outputs, progress_bar, quiet_transformers
from workers.commands.options import check_monte_carlo
from workers.commands.processes import device_of_process, launched_by_torchrun, process_group


def parse_rewards(items: Sequence[str]) -> dict[str, float]:
    """``TOKEN=VALUE`` pairs (the last '=' splits, so a token may contain '=')."""
    rewards: dict[str, float] = {}
    for item in items:
        token, sep, value = item.rpartition("=")
        if not sep or not token:
            raise UsageError(f"bad --reward {item!r}: expected TOKEN=VALUE, e.g. ' tea=1'")
        try:
            rewards[token] = float(value)
        except ValueError:
            raise UsageError(f"bad --reward {item!r}: {value!r} is not a number") from None
    return rewards


FLAG_OF_FIELD = {
    "model": "--model",
    "prefix": "--prefix",
    "continuation": "--continuation",
    "kind": "--sampler",
    "temperature": "--temperature",
    "top_k": "--top-k",
    "top_p": "--top-p",
    "engine": "--engine",
    "data_token": "--data-token",
    "reward": "--reward",
    "method": "--method",
}


def _validation_line(error) -> str:
    """One line out of a pydantic ValidationError, naming the CLI option at fault."""
    parts = []
    for item in error.errors():
        flags = [FLAG_OF_FIELD[str(part)] for part in item["loc"] if str(part) in FLAG_OF_FIELD]
        message = item["msg"].removeprefix("Value error, ")
        parts.append(f"{flags[-1] if flags else 'request'}: {message}")
    return "; ".join(parts)


def build_create(args: argparse.Namespace):
    """The ``AnalysisCreate`` of the analyze arguments (validation errors become UsageError)."""
    from pydantic import ValidationError

    from backend.schemas import AnalysisCreate, SamplerSpec

    try:
        return AnalysisCreate(
            model=args.model,
            prefix=args.prefix,
            continuation=args.continuation,
            sampler=SamplerSpec(
                kind=args.sampler,
                temperature=args.temperature,
                top_k=args.top_k,
                top_p=args.top_p,
                engine=args.engine,
                data_token=args.data_token,
            ),
            reward=parse_rewards(args.reward),
            method=args.method,
            rho=args.rho,
        )
    except ValidationError as error:
        raise UsageError(_validation_line(error)) from None


def cmd_analyze(args: argparse.Namespace) -> int:
    """One analysis; under ``torchrun`` every process runs it on a share of the directions and rank 0
    writes the outputs (``workers.commands.processes``)."""
    args.device = device_of_process(args.device)
    with process_group(args.device) as rank:
        return _analyze(args, writes=rank == 0)


def _analyze(args: argparse.Namespace, writes: bool) -> int:
    create = build_create(args)
    check_outputs({"--save": args.save, "--summary": args.summary})
    if args.tf32:
        import torch

        torch.backends.cuda.matmul.allow_tf32 = True
    info, codec, loaded = _resolve_model(args)
    check_monte_carlo(create.method, info.d_model)
    from backend.cost import cheaper_methods, estimate_cost
    from backend.memory_estimate import estimate_peak, refuse_over_memory
    from backend.normalize import RequestError, normalize
    from backend.settings import get_settings

    settings = get_settings()
    job = normalize(create, codec, info, settings.limits())
    from workers.throughput import MISS_FACTOR, check_estimate, matmul_rate

    # seconds on the device at hand: its float32 matmul rate at the model's width (measured once,
    # remembered), not a guess
    rate = matmul_rate(args.device, info.d_model)
    sums_memory = settings.sums_memory_on(args.device)
    cost = estimate_cost(
        info, job, rate, workspace_bytes=settings.engine_memory_bytes, sums_memory_bytes=sums_memory
    )
    print(
        f"estimated cost: {cost.flops / 1e12:.3g} TFLOP, {cost.directions} directions, ~{cost.seconds:.3g} s "
        f"at {rate / 1e9:.0f} GFLOP/s on {args.device}{' (upper bound)' if cost.upper_bound else ''}, "
        f"{estimate_peak(info, job, settings.engine_memory_bytes, sums_memory).line()}"
    )
    try:
        refuse_over_memory(info, job, settings, args.device)
    except RequestError as error:
        raise UsageError(str(error)) from None
    if args.max_cost_tflop is not None and cost.flops > args.max_cost_tflop * 1e12:
        offers = ", ".join(cheaper_methods(info, job, args.max_cost_tflop * 1e12)) or "none"
        raise UsageError(
            f"estimated {cost.flops / 1e12:.3g} TFLOP is over --max-cost-tflop "
            f"{args.max_cost_tflop:g}; cheaper --method choices: {offers}"
        )
    if loaded is None:
        quiet_transformers()
        from workers.models.loading import load_model

        loaded = load_model(args.model, device=args.device, dtype=args.dtype)
    print(f"certificate: {loaded.certificate.line() if loaded.certificate else 'none'}")
    analysis = _run_with_progress(loaded, job, settings, rate)
    took = float(analysis.summary["timing"]["seconds"])
    # an upper bound (truncated) is no measure of the rate; nor is a run split over processes
    judged = not cost.upper_bound and not launched_by_torchrun()
    if judged and check_estimate(args.device, info.d_model, cost.seconds, took):
        print(
            f"the estimate ({cost.seconds:.3g} s) missed the run ({took:.3g} s) by more than "
            f"{MISS_FACTOR:g}x: the matmul rate at this width will be measured again next time"
        )
    if not writes:
        return 0
    if args.save is not None:
        analysis.save(args.save, metadata={"job": job.canonical_json()})
        print(f"saved per-parameter arrays to {args.save}")
    if args.summary is not None:
        args.summary.write_text(json.dumps(analysis.summary, indent=1) + "\n")
        print(f"saved summary to {args.summary}")
    print(format_summary(analysis.summary))
    return 0


def _resolve_model(args: argparse.Namespace):
    """(info, codec, loaded-or-None): registry ids are checked from the manifest without loading torch."""
    from backend.registry import BUILTIN, model_info, registered_ids, tokenizer_path
    from backend.tokens import TokenCodec, codec_for_file

    model = args.model
    path = Path(model).expanduser()
    if (
        model in BUILTIN
        or (not path.exists() and model in registered_ids())
        or not (path.is_dir() or "/" in model)
    ):
        info = model_info(model)  # UnknownModel / ModelNotAvailable: one line, before any heavy import
        return info, codec_for_file(tokenizer_path(model)), None
    quiet_transformers()
    from workers.models.loading import load_model

    loaded = load_model(model, device=args.device, dtype=args.dtype, trust_remote_code=args.trust_remote_code)
    return loaded.info, TokenCodec(loaded.tokenizer), loaded


def _run_with_progress(loaded, job, settings, rate: float):
    """Run the engine with a tqdm bar on stderr fed by its (stage, fraction) callback."""
    from workers.fisher.shards import split_directions
    from workers.jobs import analyze_job

    # the model is loaded and certified by each process alone; the analysis splits (under torchrun)
    with progress_bar("analyze") as progress, split_directions():
        analysis = analyze_job(loaded, job, settings, progress, flops_per_second=rate)
    return analysis


def format_summary(summary: dict, n_tokens: int = 8, n_tensors: int = 5) -> str:
    """A short human reading of the summary: next tokens, C_mu rank, totals, top tensors."""
    lines: list[str] = []
    positions = summary.get("positions") or []
    if positions:
        first = positions[0]
        lines.append(f"next token at position 0 (context {first.get('context_length')} tokens):")
        lines.append(f"  {'token':<20} {'p':>8} {'mu':>8}")
        for row in first["p"]["top"][:n_tokens]:
            lines.append(f"  {row['text']!r:<20} {row['p']:8.4f} {row['mu']:8.4f}")
        spectrum = first.get("spectrum") or {}
        lines.append(
            f"C_mu: numerical rank {spectrum.get('numerical_rank')} (bound "
            f"{spectrum.get('rank_bound')}), effective rank {_num(spectrum.get('effective_rank'))}"
        )
    if len(positions) > 1:
        lines.append(f"{len(positions)} positions analysed along the continuation")
    totals = summary.get("totals") or {}
    lines.append("totals: " + ", ".join(f"{key} {_num(value)}" for key, value in totals.items()))
    tensors = sorted(summary.get("tensors") or [], key=lambda t: -t["totals"].get("fisher", 0.0))
    if tensors:
        lines.append(f"top {min(n_tensors, len(tensors))} tensors by fisher:")
        for tensor in tensors[:n_tensors]:
            lines.append(f"  {tensor['name']:<48} {_num(tensor['totals'].get('fisher'))}")
    return "\n".join(lines)


def _num(value) -> str:
    return f"{value:.4g}" if isinstance(value, int | float) else str(value)
