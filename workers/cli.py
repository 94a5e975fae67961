"""The ``fisherscope`` command: fetch models, run one analysis to a file, start the service or a worker.

Why a CLI next to the API: a notebook user wants every per-parameter array (134.5M floats per stat for
SmolLM2), which never travels through the service; ``analyze --save`` writes them as safetensors.
Every user error ends with exit code 2 and one line on stderr, never a traceback.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import NoReturn

EXIT_USAGE = 2

QUANTITIES_EPILOG = """\
quantities (per parameter i; kappa_{i,a} = d z_a / d theta_i, kbar^q_i = sum_a q_a kappa_{i,a}):
  fisher       Var_{a~mu}[kappa_i,a]: centered token Fisher, where a policy-gradient step can land
  uncentered   E_{a~mu}[(kappa_i,a - kbar^p_i)^2] = fisher + mean_shift^2: plain softmax score, centering off
  raw          E_{a~mu}[kappa_i,a^2] = fisher + (kbar^mu_i)^2: no subtraction at all
  mean_shift   kbar^mu_i - kbar^p_i: what a sampler mu != p adds; zero on-policy
  common       kbar^p_i: the common component every logit moves by
  rho          (kbar^p_i)^2 / E_{a~p}[kappa_i,a^2]: share of the raw second moment that centering removes
  policy_grad  Cov_{a~mu}(r_a, kappa_i,a): the policy gradient of reward r over next tokens
  bound        std_{a~mu}(r) * sqrt(fisher): |policy_grad| <= bound, every coordinate
sampler mu: temperature -> top-k -> top-p on the model's (or bf16 engine's) logits, or one-hot on a
data token (SFT), or uniform. mu = p exactly at T=1, no truncation, engine model.
"""


class UsageError(Exception):
    """Bad input the user can fix; reported as one line with exit code 2."""


class OneLineParser(argparse.ArgumentParser):
    """argparse that reports errors as one line (no usage block) and exits 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(
        prog="fisherscope",
        description=__doc__.splitlines()[0],
        epilog=QUANTITIES_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    commands = parser.add_subparsers(dest="command", required=True, parser_class=OneLineParser)
    fetch = commands.add_parser("fetch", help="fetch a built-in model into the cache (converted once)")
    fetch.add_argument("model", help="built-in id: smollm2-135m or tiny-random")
    _add_models(commands)
    _add_analyze(commands)
    serve = commands.add_parser("serve", help="run API + dashboard + in-process worker (embedded mode)")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    worker = commands.add_parser("worker", help="run a job worker against Redis")
    worker.add_argument("--redis-url", default=None, help="default: $REDIS_URL")
    worker.add_argument("--burst", action="store_true", help="exit when the queue is empty")
    return parser


def _add_models(commands) -> None:
    models = commands.add_parser(
        "models", help="list the registry (ids, architecture, parameters, digest, certificate); add or remove"
    )
    actions = models.add_subparsers(dest="action", parser_class=OneLineParser)
    add = actions.add_parser("add", help="register your own checkpoint (certified before it is added)")
    add.add_argument("id", help="the new id: a-z, 0-9, '.', '_', '-'")
    add.add_argument(
        "source", help="a local Hugging Face model folder, or a hub id (needs access and a network)"
    )
    add.add_argument("--revision", default=None, help="hub revision (branch, tag or commit)")
    add.add_argument(
        "--dtype",
        default="float32",
        choices=["float32", "float64", "bfloat16", "float16"],
        help="what the engine computes in (default float32, also for bf16/fp16 checkpoints)",
    )
    add.add_argument(
        "--trust-remote-code", action="store_true", help="allow modeling code shipped with the checkpoint"
    )
    remove = actions.add_parser("remove", help="remove a registered id")
    remove.add_argument("id")


def _add_analyze(commands) -> None:
    analyze = commands.add_parser(
        "analyze",
        help="compute every per-parameter statistic for one prefix (and continuation)",
        epilog=QUANTITIES_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    analyze.add_argument("--model", required=True, help="catalog id or a local Hugging Face model folder")
    analyze.add_argument("--prefix", required=True, help="the text the model continues")
    analyze.add_argument("--continuation", default=None, help="a response: analyse every position of it")
    analyze.add_argument("--temperature", type=float, default=1.0, help="sampler temperature T > 0")
    analyze.add_argument("--top-k", type=int, default=None, help="keep the k most probable tokens")
    analyze.add_argument("--top-p", type=float, default=1.0, help="nucleus mass in (0, 1]")
    analyze.add_argument(
        "--engine",
        choices=["model", "bf16"],
        default="model",
        help="logits of the float32 model or of the bf16 inference engine",
    )
    analyze.add_argument(
        "--sampler",
        choices=["model", "data", "uniform"],
        default="model",
        help="mu: the model's (tempered/truncated) p, one-hot on data, or uniform",
    )
    analyze.add_argument("--data-token", default=None, help="the data sampler's token: text or '#ID'")
    analyze.add_argument(
        "--reward",
        action="append",
        default=[],
        metavar="TOKEN=VALUE",
        help="reward of a next token (text or '#ID'); repeat; others get 0",
    )
    analyze.add_argument("--method", default="exact", help="exact | truncated:F (0<F<=1) | mc:S (S>=2)")
    analyze.add_argument(
        "--save",
        type=Path,
        default=None,
        metavar="FILE.safetensors",
        help="write every per-parameter array, keys '<stat>/<param name>'",
    )
    analyze.add_argument(
        "--summary",
        type=Path,
        default=None,
        metavar="FILE.json",
        help="write the summary JSON (what the dashboard draws)",
    )
    analyze.add_argument(
        "--max-cost-tflop",
        type=float,
        default=None,
        help="refuse to run when the estimate is above this many TFLOP",
    )
    analyze.add_argument("--device", default="cpu", help="torch device, e.g. cpu or cuda")
    analyze.add_argument(
        "--dtype",
        default=None,
        choices=["float32", "float64", "bfloat16", "float16"],
        help="compute dtype (default: the registered one, float32 for folders and hub ids)",
    )
    analyze.add_argument(
        "--trust-remote-code", action="store_true", help="allow modeling code shipped with a folder or hub id"
    )


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
        )
    except ValidationError as error:
        raise UsageError(_validation_line(error)) from None


def cmd_fetch(args: argparse.Namespace) -> int:
    from backend.registry import model_dir
    from workers.models.fetch import fetch_model

    info = fetch_model(args.model, progress=True)
    print(f"{info.id}: {model_dir(info.id)} ({info.n_params:,} parameters, {info.digest[:19]}...)")
    _quiet_transformers()
    from workers.models.loading import load_model

    loaded = load_model(info.id)  # certifies once per digest and engine version (cached)
    print(f"certificate: {loaded.certificate.line() if loaded.certificate else 'none'}")
    return 0


def cmd_models(args: argparse.Namespace) -> int:
    if args.action == "add":
        return _models_add(args)
    if args.action == "remove":
        from workers.models.register import remove_model

        remove_model(args.id)
        print(f"removed {args.id}")
        return 0
    print(format_registry())
    return 0


def _models_add(args: argparse.Namespace) -> int:
    _quiet_transformers()
    from workers.models.register import add_model

    info, loaded = add_model(args.id, args.source, args.revision, args.dtype, args.trust_remote_code)
    print(f"added {info.id}: {info.architecture}, {info.n_params:,} parameters, {info.digest[:19]}...")
    print(f"certificate: {loaded.certificate.line() if loaded.certificate else 'none'}")
    return 0


def format_registry() -> str:
    """The registry as a table: ids, architecture, parameters, digest and the certificate's verdict."""
    from backend.registry import is_available, list_models, model_info, read_certificate

    rows = [("id", "architecture", "parameters", "dtype", "digest", "certificate")]
    for model_id in list_models():
        if not is_available(model_id):
            rows.append((model_id, "-", "-", "-", "-", f"not fetched: fisherscope fetch {model_id}"))
            continue
        info = model_info(model_id)
        certificate = read_certificate(info.digest, info.dtype)
        verdict = "not yet (made on first load)"
        if certificate is not None:
            verdict = "exact" if certificate["passed"] else f"refused: {certificate['reason']}"
            if certificate["passed"]:
                worst = max(certificate["first_moment_error"], certificate["square_error"])
                verdict += f", max rel. error {worst:.1e}"
        rows.append(
            (model_id, info.architecture, f"{info.n_params:,}", info.dtype, info.digest[:19], verdict)
        )
    widths = [max(len(row[col]) for row in rows) for col in range(len(rows[0]))]
    return "\n".join(
        "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip() for row in rows
    )


def cmd_analyze(args: argparse.Namespace) -> int:
    create = build_create(args)
    info, codec, loaded = _resolve_model(args)
    from backend.cost import cheaper_methods, estimate_cost
    from backend.normalize import normalize
    from backend.settings import get_settings

    settings = get_settings()
    job = normalize(create, codec, info, settings.limits())
    from workers.engine import measured_flops_per_second

    # seconds on the device at hand: the float32 matmul rate measured now, not a configured guess
    rate = measured_flops_per_second()
    cost = estimate_cost(info, job, flops_per_second=rate)
    print(
        f"estimated cost: {cost.flops / 1e12:.3g} TFLOP, {cost.directions} directions, "
        f"~{cost.seconds:.3g} s at {rate / 1e9:.0f} GFLOP/s{' (upper bound)' if cost.upper_bound else ''}"
    )
    if args.max_cost_tflop is not None and cost.flops > args.max_cost_tflop * 1e12:
        offers = ", ".join(cheaper_methods(info, job, args.max_cost_tflop * 1e12)) or "none"
        raise UsageError(
            f"estimated {cost.flops / 1e12:.3g} TFLOP is over --max-cost-tflop "
            f"{args.max_cost_tflop:g}; cheaper --method choices: {offers}"
        )
    if loaded is None:
        _quiet_transformers()
        from workers.models.loading import load_model

        loaded = load_model(args.model, device=args.device, dtype=args.dtype)
    print(f"certificate: {loaded.certificate.line() if loaded.certificate else 'none'}")
    analysis = _run_with_progress(loaded, job)
    if args.save is not None:
        analysis.save(args.save)
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
    _quiet_transformers()
    from workers.models.loading import load_model

    loaded = load_model(model, device=args.device, dtype=args.dtype, trust_remote_code=args.trust_remote_code)
    return loaded.info, TokenCodec(loaded.tokenizer), loaded


def _quiet_transformers() -> None:
    """The CLI speaks in its own lines: no progress bars or retry warnings from the HF libraries."""
    from huggingface_hub.utils import logging as hub_logging
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    hub_logging.set_verbosity_error()


def _run_with_progress(loaded, job):
    """Run the engine with a tqdm bar on stderr fed by its (stage, fraction) callback."""
    from tqdm import tqdm

    from workers.engine import run_analysis

    with tqdm(
        total=100,
        desc="analyze",
        unit="%",
        file=sys.stderr,
        bar_format="{desc}: {percentage:3.0f}%|{bar}| {elapsed}",
    ) as bar:

        def progress(stage: str, fraction: float) -> None:
            bar.set_description_str(f"analyze [{stage}]", refresh=False)
            bar.update(max(0, round(100 * min(max(fraction, 0.0), 1.0)) - bar.n))

        analysis = run_analysis(loaded, job, progress)
        bar.update(100 - bar.n)
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


def cmd_serve(args: argparse.Namespace) -> int:
    from backend.embedded import serve

    serve(host=args.host, port=args.port)
    return 0


def cmd_worker(args: argparse.Namespace) -> int:
    from workers.worker import main as worker_main

    return int(worker_main(redis_url=args.redis_url, burst=args.burst) or 0)


COMMANDS: dict[str, Callable[[argparse.Namespace], int]] = {
    "fetch": cmd_fetch,
    "models": cmd_models,
    "analyze": cmd_analyze,
    "serve": cmd_serve,
    "worker": cmd_worker,
}


def _user_errors() -> tuple[type[BaseException], ...]:
    """Exception types that mean bad input or a missing model (reported in one line, exit 2).

    Looked up in sys.modules: a module that was never imported cannot have raised, and importing
    torch just to classify an error would cost seconds.
    """
    from backend.registry import ModelNotAvailable, UnknownModel

    errors: list[type[BaseException]] = [UsageError, UnknownModel, ModelNotAvailable]
    for module, name in (
        ("workers.models.fetch", "FetchError"),
        ("workers.models.register", "RegistryError"),
        ("backend.normalize", "RequestError"),
        ("backend.tokens", "TokenError"),
        ("workers.models.loading", "ModelLoadError"),
    ):
        found = getattr(sys.modules.get(module), name, None)
        if isinstance(found, type) and issubclass(found, BaseException):
            errors.append(found)
    return tuple(errors)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return COMMANDS[args.command](args)
    except KeyboardInterrupt:
        print("fisherscope: interrupted", file=sys.stderr)
        return 130
    except Exception as error:
        if isinstance(error, _user_errors()):
            message = " ".join(str(error).split())
            print(f"fisherscope: error: {message}", file=sys.stderr)
            return EXIT_USAGE
        raise


if __name__ == "__main__":
    sys.exit(main())
