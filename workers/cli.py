"""The ``fisherscope`` command: fetch and register models, run one analysis or a study to files, read
mask files, start the service or a worker. Every user error ends with exit code 2 and one line on
stderr, never a traceback.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import NoReturn

from workers.commands.analyze import cmd_analyze
from workers.commands.common import EXIT_USAGE, UsageError
from workers.commands.masks import add_masks_parser, cmd_masks
from workers.commands.models import cmd_fetch, cmd_models
from workers.commands.options import (
    add_budget_option,
    add_model_options,
    add_sampler_options,
    port_number,
    text,
)
from workers.commands.study import add_study_parser, cmd_study
from workers.commands.updates import add_updates_parser, cmd_updates

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
    add_study_parser(commands)
    add_masks_parser(commands)
    add_updates_parser(commands)
    serve = commands.add_parser("serve", help="run API + dashboard + in-process worker (embedded mode)")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=port_number, default=8000)
    serve.add_argument(
        "--open-without-token",
        action="store_true",
        help="serve beyond loopback with no FISHERSCOPE_API_TOKEN: anyone who reaches it can compute",
    )
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
    analyze.add_argument("--prefix", required=True, type=text, help="the text the model continues")
    analyze.add_argument(
        "--continuation", default=None, type=text, help="a response: analyse every position of it"
    )
    add_sampler_options(analyze, ("model", "data", "uniform"))
    analyze.add_argument(
        "--data-token", default=None, type=text, help="the data sampler's token: text or '#ID'"
    )
    analyze.add_argument(
        "--reward",
        action="append",
        type=text,
        default=[],
        metavar="TOKEN=VALUE",
        help="reward of a next token (text or '#ID'); repeat; others get 0",
    )
    analyze.add_argument(
        "--rho",
        action="store_true",
        help="off the policy, also the Fisher under p (d_model directions more per position) for rho; "
        "on the policy rho is free and always computed",
    )
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
    add_budget_option(analyze, "default: no limit")
    add_model_options(analyze)


def cmd_serve(args: argparse.Namespace) -> int:
    from workers.serve import serve

    serve(host=args.host, port=args.port, open_without_token=args.open_without_token)
    return 0


def cmd_worker(args: argparse.Namespace) -> int:
    from workers.worker import main as worker_main

    return int(worker_main(redis_url=args.redis_url, burst=args.burst) or 0)


COMMANDS: dict[str, Callable[[argparse.Namespace], int]] = {
    "fetch": cmd_fetch,
    "models": cmd_models,
    "analyze": cmd_analyze,
    "study": cmd_study,
    "masks": cmd_masks,
    "updates": cmd_updates,
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
        ("workers.fisher.parameter_arrays", "NoRoomForSums"),
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
