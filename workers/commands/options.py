"""Command-line options that ``analyze`` and ``study`` share, spelled once."""

from __future__ import annotations

import argparse


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
    parser.add_argument("--method", default="exact", help="exact | truncated:F (0<F<=1) | mc:S (S>=2)")


def add_model_options(parser: argparse.ArgumentParser) -> None:
    """Where the model runs and in what precision (as ``fisherscope analyze``)."""
    parser.add_argument("--device", default="cpu", help="torch device, e.g. cpu or cuda")
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
