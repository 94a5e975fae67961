"""Command-line options that ``analyze`` and ``study`` share, spelled once, with the checks of their
values: most run as argparse reads them, so a bad value is one line naming the option before any work."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable

from backend.vocabulary import Method
from workers.commands.common import UsageError
from workers.studies.prompts import unicode_problem

# devices the engine computes on; others torch knows (meta, xla, ...) hold no data or are not supported
COMPUTE_DEVICES = ("cpu", "cuda", "mps")


def text(value: str) -> str:
    """Text for the tokenizer: argv bytes that are not UTF-8 arrive as lone surrogates, which it refuses."""
    problem = unicode_problem(value)
    if problem:
        raise argparse.ArgumentTypeError(f"{problem}; pass UTF-8 text")
    return value


def whole_number(low: int, high: int | None = None) -> Callable[[str], int]:
    """An argparse type: a whole number in [low, high]."""

    def parse(value: str) -> int:
        try:
            number = int(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{value!r} is not a whole number") from None
        if number < low or (high is not None and number > high):
            bounds = f"at least {low}" if high is None else f"in {low}-{high}"
            raise argparse.ArgumentTypeError(f"{number} must be {bounds}")
        return number

    return parse


positive_int = whole_number(1)
port_number = whole_number(1, 65535)


def budget_tflop(value: str) -> float:
    """A cost budget: a positive number of TFLOP (inf: no limit); NaN would compare as never exceeded."""
    try:
        number = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not a number of TFLOP") from None
    if math.isnan(number) or number <= 0:
        raise argparse.ArgumentTypeError(f"{value!r} must be a positive number of TFLOP, e.g. 10")
    return number


def device(value: str) -> str:
    """A torch device this machine has, checked before any model loads (``cpu`` without importing torch)."""
    if value == "cpu":
        return value
    import torch

    try:
        target = torch.device(value)
    except (RuntimeError, ValueError):
        raise argparse.ArgumentTypeError(f"{value!r} is not a torch device; e.g. cpu, cuda, cuda:1") from None
    if target.type not in COMPUTE_DEVICES:
        raise argparse.ArgumentTypeError(f"{value!r}: the engine computes on {', '.join(COMPUTE_DEVICES)}")
    if target.type == "cpu":
        return value
    backend = getattr(torch, target.type)
    count = backend.device_count() if backend.is_available() else 0
    if not count:
        raise argparse.ArgumentTypeError(f"{value!r}: no {target.type} device on this machine; use cpu")
    if target.index is not None and target.index >= count:
        raise argparse.ArgumentTypeError(
            f"{value!r}: this machine has {count} {target.type} device(s), {target.type}:0 to "
            f"{target.type}:{count - 1}"
        )
    return value


def method(value: str) -> Method:
    """A method, parsed where it enters (argparse), so a bad one is one line naming --method."""
    try:
        return Method.parse(value)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def check_monte_carlo(method: Method, d_model: int) -> None:
    """``mc:S`` with more samples than ``d_model``, the most directions the exact method ever takes,
    costs more than exact and only estimates it (and S past an int64 overflows torch)."""
    samples = method.samples
    if samples is not None and samples > d_model:
        raise UsageError(
            f"--method {method}: more samples than the exact method's at most {d_model} directions "
            f"cost more and estimate less; use --method exact or mc:S with S <= {d_model}"
        )


def add_sampler_options(parser: argparse.ArgumentParser, kinds: tuple[str, ...]) -> None:
    """The sampler mu and method options, spelled as ``fisherscope analyze`` spells them."""
    parser.add_argument("--temperature", type=float, default=1.0, help="sampler temperature T > 0")
    parser.add_argument("--top-k", type=int, default=None, help="keep the k most probable tokens")
    parser.add_argument("--top-p", type=float, default=1.0, help="nucleus mass in (0, 1]")
    parser.add_argument(
        "--engine",
        choices=["model", "bf16"],
        default="model",
        help="logits of the float32 model or of the bf16 inference engine",
    )
    meanings = {
        "model": "the model's (tempered/truncated) p",
        "data": "one-hot on data",
        "uniform": "uniform",
    }
    parser.add_argument(
        "--sampler",
        choices=list(kinds),
        default="model",
        help="mu: " + ", ".join(meanings[kind] for kind in kinds),
    )
    parser.add_argument(
        "--method", type=method, default=Method(), help="exact | truncated:F (0<F<=1) | mc:S (S>=2)"
    )


def add_budget_option(parser: argparse.ArgumentParser, default: str) -> None:
    parser.add_argument(
        "--max-cost-tflop",
        type=budget_tflop,
        default=None,
        help=f"refuse to run when the estimate is above this many TFLOP ({default})",
    )


def add_model_options(parser: argparse.ArgumentParser) -> None:
    """Where the model runs and in what precision (as ``fisherscope analyze``)."""
    parser.add_argument("--device", type=device, default="cpu", help="torch device, e.g. cpu, cuda or cuda:1")
    parser.add_argument(
        "--tf32",
        action="store_true",
        help="CUDA float32 matmuls in TF32: faster, ~1e-3 relative (the certificate measures it)",
    )
    parser.add_argument(
        "--dtype",
        default=None,
        choices=["float32", "float64", "bfloat16", "float16"],
        help="compute dtype (default: the registered one, float32 for folders and hub ids)",
    )
    parser.add_argument(
        "--trust-remote-code", action="store_true", help="allow modeling code shipped with a folder or hub id"
    )
