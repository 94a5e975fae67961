"""The models researchers train, at their real shapes: peak memory and time of `fisherscope analyze`.

Builds a model folder from transformers' own config class at a real model's sizes (random bf16 weights,
its own norms; SmolLM2's tokenizer files, whose ids are all inside the vocabulary), then runs the CLI on
it in a child process per case under `/usr/bin/time -v`: peak resident memory, wall time, the
directions the summary counts, and the floor 2 r P T at the float32 matmul rate this script measures at
the model's width before its cases (the CLI's remembered rate may come from a busier moment). Cases:
the 5-token prefix "She drank a cup of" at T 0.7, top-k 50 (the first answer: no rho), the same with
`--rho`, on the policy, and a response of `--response-tokens` (64) at T 0.7, top-k 50 (its floor sums
each position's directions over its own context), exact and by 16 Monte Carlo directions per position
(the same sums over positions, for the memory of a long response in minutes), and that response's
last context as a prefix (what a response holds beside its mapped sums). Each shape's runs share
a cache folder of their own (``FISHERSCOPE_CACHE``): the model's certificate (once per load) is
measured on its own first, by `fisherscope models add` (as the id ``bench``), and every case analyzes
that id. The peak of the CLI's anonymous memory is sampled beside its peak resident set, which counts
the pages of a response's sums mapped from files (``--sums-memory-gb``: what they may hold in memory),
and beside the CLI's own estimate of its peak.

Usage: .venv/bin/python benchmarks/bench_scale.py [--shapes qwen3-0.6b,qwen3-1.7b] [--cases ...]
    [--memory-limit-gb G] [--response-tokens N] [--sums-memory-gb G]
A case whose estimated peak is above the CLI's memory limit (the machine's memory, or G) is refused by
the CLI, with the estimate; G above the machine's memory measures what the CLI would refuse.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ANON_POLL_S = 0.1
PREFIX = "She drank a cup of"
SHAPES: dict[str, dict] = {  # the real configs' sizes (Qwen3-0.6B, Qwen3-1.7B), tied embeddings
    "qwen3-0.6b": {"hidden_size": 1024, "num_hidden_layers": 28, "intermediate_size": 3072,
                   "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128},
    "qwen3-1.7b": {"hidden_size": 2048, "num_hidden_layers": 28, "intermediate_size": 6144,
                   "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128},
}  # fmt: skip
CASES: dict[str, list[str]] = {
    "top-k 50 T 0.7": ["--temperature", "0.7", "--top-k", "50"],
    "top-k 50 T 0.7 rho": ["--temperature", "0.7", "--top-k", "50", "--rho"],
    "on-policy": [],
    "response top-k 50": ["--temperature", "0.7", "--top-k", "50"],  # and a continuation (``response``)
    # the same sums over positions in a fraction of the time: the memory of a long response
    "response top-k 50 mc:16": ["--temperature", "0.7", "--top-k", "50", "--method", "mc:16"],
    # the response's last position alone, as a prefix: what a response holds beside its mapped sums
    "longest context top-k 50": ["--temperature", "0.7", "--top-k", "50"],
}
# a response's text, cut to --response-tokens of SmolLM2's tokenizer (64 here); from its second position
# on, the sums over positions are arrays, whatever its length
RESPONSE = (
    " tea with milk and honey every morning before work, because her grandmother had taught her that a"
    " warm drink settles the mind. She would sit by the window, watch the rain fall on the quiet street,"
    " and think about the long day ahead of her at the hospital where she worked as a nurse on the long"
    " night shift."
)


def response(tokens: int) -> str:
    """The first ``tokens`` tokens of ``RESPONSE``, as text."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(
        str(Path.home() / ".cache" / "fisherscope" / "smollm2-135m" / "tokenizer.json")
    )
    return tokenizer.decode(tokenizer.encode(RESPONSE).ids[:tokens])


def build(shape: str, folder: Path) -> int:
    """The model folder of ``shape``; its parameter count."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(
        vocab_size=151936, tie_word_embeddings=True, max_position_embeddings=4096, **SHAPES[shape]
    )
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(config).to(torch.bfloat16)
    with torch.no_grad():  # norms of their own, not all ones
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.uniform_(0.5, 1.5)
    model.save_pretrained(folder)
    tokenizer = Path.home() / ".cache" / "fisherscope" / "smollm2-135m"
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer / name, folder / name)
    return sum(p.numel() for p in model.parameters())


def _anonymous_kb(time_pid: int) -> int | None:
    """RssAnon of the CLI, the child of ``/usr/bin/time`` (None before it starts or once it is gone)."""
    try:
        child = Path(f"/proc/{time_pid}/task/{time_pid}/children").read_text().split()
        status = Path(f"/proc/{child[0]}/status").read_text() if child else ""
    except OSError:
        return None
    found = re.search(r"RssAnon:\s+(\d+) kB", status)
    return int(found.group(1)) if found else None


def run_cli(
    arguments: list[str], cache: Path, limit: int | None = None, sums_memory: int | None = None
) -> dict:
    """One `fisherscope` run under `/usr/bin/time -v`: its peak RSS (GB), the peak of its anonymous
    memory (sampled every ``ANON_POLL_S``: the resident set counts the pages of a response's mapped sums
    too, which the kernel can write out) and wall seconds, or the CLI's own error line (printed before
    /usr/bin/time's report)."""
    command = ["/usr/bin/time", "-v", sys.executable, "-m", "workers.cli", *arguments]
    environment = {**os.environ, "FISHERSCOPE_CACHE": str(cache)}
    if limit is not None:
        environment["FISHERSCOPE_MEMORY_LIMIT_BYTES"] = str(limit)
    if sums_memory is not None:
        environment["FISHERSCOPE_SUMS_MEMORY_BYTES"] = str(sums_memory)
    started = time.perf_counter()
    # stderr to a file: a pipe nobody reads while the CLI runs would fill with its progress bar and stall it
    with tempfile.TemporaryFile("w+") as errors, tempfile.TemporaryFile("w+") as said:
        process = subprocess.Popen(command, cwd=ROOT, stdout=said, stderr=errors, text=True, env=environment)
        anonymous = 0
        while process.poll() is None:
            anonymous = max(anonymous, _anonymous_kb(process.pid) or 0)
            time.sleep(ANON_POLL_S)
        errors.seek(0)
        stderr = errors.read()
        said.seek(0)
        estimated = re.search(r"~([0-9.]+) GB at peak", said.read())
    wall = time.perf_counter() - started
    if process.returncode != 0:
        said = [line for line in stderr.splitlines() if line.startswith("fisherscope")]
        return {"error": said[-1] if said else f"exit status {process.returncode}"}
    peak_kb = int(re.search(r"Maximum resident set size \(kbytes\): (\d+)", stderr).group(1))
    found = {"peak_gb": peak_kb / 1e6, "anonymous_gb": anonymous / 1e6, "wall": wall}
    return found | ({"estimated_gb": float(estimated.group(1))} if estimated else {})


def run_certificate(folder: Path, cache: Path) -> dict:
    """`fisherscope models add` of the folder (as ``bench``): its certificate's peak RSS and wall."""
    return run_cli(["models", "add", "bench", str(folder)], cache)


def run_case(
    model: str,
    prefix: str,
    flags: list[str],
    out: Path,
    rate: float,
    cache: Path,
    limit: int | None,
    sums_memory: int | None,
) -> dict:
    """One analysis: peak RSS and anonymous memory (GB), wall seconds, directions, the floor at ``rate``."""
    found = run_cli(
        ["analyze", "--model", model, "--prefix", prefix, "--summary", str(out), *flags],
        cache,
        limit,
        sums_memory,
    )
    if "error" in found:
        return found
    summary = json.loads(out.read_text())
    directions = sum(summary["directions_per_process"])
    # each position's directions run over its own context: the directions' mean context length
    positions = summary["positions"]
    per_position = [max(1, position["directions"]) for position in positions]
    tokens = sum(d * p["context_length"] for d, p in zip(per_position, positions, strict=True)) / sum(
        per_position
    )
    floor = 2 * directions * summary["model"]["n_params"] * tokens / rate
    engine = summary["timing"]["seconds"]
    return {**found, "engine": engine, "directions": directions, "rate": rate, "floor": floor,
            "ratio": engine / floor}  # fmt: skip


def peak(found: dict, n_params: int) -> str:
    over = found["peak_gb"] * 1e9 / (4 * n_params)
    anonymous = found["anonymous_gb"] * 1e9 / (4 * n_params)
    return (
        f"peak {found['peak_gb']:5.1f} GB ({over:.1f}x the float32 weights; anonymous "
        f"{found['anonymous_gb']:.1f} GB, {anonymous:.1f}x"
        + (f"; estimated {found['estimated_gb']:.1f} GB)" if "estimated_gb" in found else ")")
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument("--cases", default=",".join(CASES), help="comma list of: " + ", ".join(CASES))
    parser.add_argument(
        "--memory-limit-gb", type=float, help="the CLI's memory limit (default: the machine's)"
    )
    parser.add_argument("--response-tokens", type=int, default=64, help="the response case's length")
    parser.add_argument(
        "--sums-memory-gb",
        type=float,
        help="what a response's sums may hold in memory, the rest mapped from files (default: the setting's; "
        "1000 keeps them all in memory)",
    )
    args = parser.parse_args()
    limit = None if args.memory_limit_gb is None else int(args.memory_limit_gb * 1e9)
    sums_memory = None if args.sums_memory_gb is None else int(args.sums_memory_gb * 1e9)
    from workers.throughput import measure_width

    for shape in args.shapes.split(","):
        with tempfile.TemporaryDirectory(prefix=f"bench-{shape}-") as scratch:
            folder = Path(scratch) / shape
            n_params = build(shape, folder)
            print(f"{shape}: {n_params / 1e9:.2f}B parameters, float32 weights {4 * n_params / 1e9:.1f} GB")
            width = SHAPES[shape]["hidden_size"]
            rate = measure_width("cpu", width, seconds=3.0)
            print(f"  float32 rate at width {width}: {rate / 1e9:.0f} GFLOP/s")
            summary, cache = Path(scratch) / "summary.json", Path(scratch) / "cache"
            certified = run_certificate(folder, cache)
            if "error" in certified:
                print(f"  {'certificate':<22} failed: {certified['error']}")
                continue
            print(
                f"  {'certificate':<22} {peak(certified, n_params)}, wall {certified['wall']:6.1f} s "
                "(once per load)"
            )
            for case in args.cases.split(","):
                flags = CASES[case] + (
                    ["--continuation", response(args.response_tokens)] * case.startswith("response")
                )
                prefix = PREFIX
                if case.startswith("longest context"):
                    prefix += response(args.response_tokens - 1)
                found = run_case("bench", prefix, flags, summary, rate, cache, limit, sums_memory)
                if "error" in found:
                    print(f"  {case:<22} refused or failed: {found['error']}")
                    continue
                print(
                    f"  {case:<22} {peak(found, n_params)}, {found['directions']:5d} directions, "
                    f"engine {found['engine']:6.1f} s (wall "
                    f"{found['wall']:6.1f} s), {found['ratio']:.2f}x the floor {found['floor']:.1f} s at "
                    f"{found['rate'] / 1e9:.0f} GFLOP/s"
                )


if __name__ == "__main__":
    main()
