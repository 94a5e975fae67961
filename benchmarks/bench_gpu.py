"""The engine on a CUDA GPU, in one prepared run: everything a GPU machine is asked to measure.

Prints, and writes as JSON to ``--out``:
- the device and the versions it ran with; its float32 matmul rate at full precision (4096^2 and
  8192^2) and with TF32;
- exactness: tests/test_gpu.py (tiny models of three families on the GPU in float32 against float64
  brute force on the CPU), run by pytest;
- SmolLM2-135M's shape exact on 5 and 32 tokens: end-to-end time (forward to finished summary, warm
  model, the fastest of three), the floor 2 r P T at the measured rate and the ratio to it, when the
  first partial result comes, peak GPU memory; at the worker's default workspace and at a larger one.
  Targets: 0.3 s and 1 s;
- precision on that shape (5 tokens): every stat of float32 and of TF32 against float64, all on the GPU,
  as the largest relative L2 error over stats;
- Qwen3-1.7B's shape on 5 tokens, exact on the policy (target 2 s) and the first answer at T 0.7, top-k
  50 (C_mu's 49 directions, no rho), with their peak GPU memory.

The models are built from transformers' own config classes with random weights (nothing is downloaded
on the GPU machine, and SmolLM2's 538 MB of weights exceed what travels there): matrices drawn as the
architecture initializes them, norm weights around 1. The time depends on the shapes, not the values.

On a GPU machine whose image has torch, transformers and numba but not pydantic: first, on a machine
with this checkout's venv, ``bash benchmarks/device_wheels.sh`` puts the wheels it lacks into ``.whl/``;
copy the checkout with ``.whl`` to the GPU machine and run there (within 9 minutes):

    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \\
        --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:. || exit; \\
    PYTHONUNBUFFERED=1 python3 benchmarks/bench_gpu.py --out $OUT/gpu.json

Here, on the CPU, ``--quick`` runs every step on small shapes (tests/test_bench_gpu.py does), so that
the script is known to run before a GPU's minutes are spent on it.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# the shapes of the models the issue names, from their Hugging Face configs (tests/test_bench_gpu.py
# checks SmolLM2's against the config.json the setup fetched)
SHAPES: dict[str, dict] = {
    "smollm2-135m": {
        "model_type": "llama",
        "vocab_size": 49152,
        "hidden_size": 576,
        "intermediate_size": 1536,
        "num_hidden_layers": 30,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "head_dim": 64,
        "max_position_embeddings": 8192,
        "rms_norm_eps": 1e-5,
        "rope_theta": 100000.0,
        "tie_word_embeddings": True,
    },
    "qwen3-1.7b": {
        "model_type": "qwen3",
        "vocab_size": 151936,
        "hidden_size": 2048,
        "intermediate_size": 6144,
        "num_hidden_layers": 28,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "max_position_embeddings": 40960,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "tie_word_embeddings": True,
    },
}
# --quick: the same architectures, small enough for a CPU test
QUICK = {
    "vocab_size": 512,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
}
TOP_K_50 = {"temperature": 0.7, "top_k": 50}  # the dashboard's first example's sampler
TARGETS_S = {("smollm2-135m", 5): 0.3, ("smollm2-135m", 32): 1.0, ("qwen3-1.7b", 5): 2.0}
LARGE_BUDGET = 32 << 30  # the engine workspace (half of it a direction chunk) beside the default 2 GiB
REPEATS = 3


def build_model(name: str, device: str, quick: bool, seed: int = 0):
    """A LoadedModel of ``name``'s shape with random weights, built on ``device``, as the loader sets
    models up (sdpa where supported, eager experts, eval mode, every parameter differentiable)."""
    import torch
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from transformers import AutoConfig, AutoModelForCausalLM

    from workers.models.loading import LoadedModel, attention_for, info_from_model

    shape = dict(SHAPES[name], **(QUICK if quick else {}))
    model_type = shape.pop("model_type")
    rope_theta = shape.pop("rope_theta")
    config = AutoConfig.for_model(
        model_type, rope_parameters={"rope_type": "default", "rope_theta": rope_theta}, **shape
    )
    torch.manual_seed(seed)
    with torch.device(device):  # drawn where it runs: 1.7B parameters drawn on a CPU take minutes
        model = AutoModelForCausalLM.from_config(
            config, attn_implementation=attention_for(config), experts_implementation="eager"
        ).float()
        with torch.no_grad():
            for param_name, param in model.named_parameters():
                if param.dim() == 1 and "norm" in param_name:
                    param.copy_(1 + 0.3 * torch.randn_like(param))
    model.requires_grad_(True).eval()
    vocabulary = {f"<{i}>": i for i in range(config.vocab_size)}
    tokenizer = Tokenizer(WordLevel(vocabulary, unk_token="<0>"))
    size = sum(p.numel() * p.element_size() for p in model.parameters())
    info = info_from_model(f"{name}-shape", model, f"random:{seed}", f"{name}'s shape, random", size)
    return LoadedModel(id=info.id, model=model, info=info, tokenizer=tokenizer)


def _synchronize(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _peak_gb(device: str) -> float | None:
    import torch

    return torch.cuda.max_memory_allocated() / 1e9 if device.startswith("cuda") else None


def _reset_peak(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()


@contextmanager
def _tf32(on: bool) -> Iterator[None]:
    """CUDA float32 matmuls in TF32 while inside, then at full precision again (the worker's default)."""
    import torch

    torch.backends.cuda.matmul.allow_tf32 = on
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = False


def _ids(loaded, tokens: int) -> list[int]:
    """A prefix of ``tokens`` ids spread over the vocabulary (the weights are random: any ids do)."""
    return [(7 * i + 3) % loaded.info.vocab_size for i in range(tokens)]


def rates(device: str, quick: bool) -> dict:
    """Float32 matmul rates at full precision and with TF32 (sustained for a second each), and at each
    model's width as the CLI's cost estimate measures it (never measured on a GPU before)."""
    from workers.throughput import measure, measure_width

    sizes = (256,) if quick else (4096, 8192)
    found = {f"float32_{n}": measure(device, size=n) for n in sizes}
    widths = (QUICK["hidden_size"],) if quick else tuple(shape["hidden_size"] for shape in SHAPES.values())
    found.update({f"width_{d}": measure_width(device, d) for d in widths})
    if device.startswith("cuda"):
        with _tf32(True):
            found[f"tf32_{sizes[-1]}"] = measure(device, size=sizes[-1])
    return found


EXACTNESS_TIMEOUT_S = 240  # the GPU run's other steps need the rest of its device time


def exactness() -> dict:
    """tests/test_gpu.py in a pytest of its own (it skips where there is no GPU); a failure or a hang
    is this step's error, reported with the output's end."""
    command = [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-p",
        "no:cacheprovider",
        "-m",
        "gpu",
        "tests/test_gpu.py",
    ]
    result = subprocess.run(
        command, cwd=ROOT, capture_output=True, text=True, check=False, timeout=EXACTNESS_TIMEOUT_S
    )
    tail = result.stdout[-1500:] + result.stderr[-1500:]
    if result.returncode != 0:
        raise RuntimeError(f"pytest exited {result.returncode}: {tail}")
    return {"returncode": result.returncode, "tail": tail}


def exact_runs(
    loaded,
    tokens: int,
    device: str,
    budget: int,
    repeats: int = REPEATS,
    math_attention=False,
    sampler: dict | None = None,
) -> dict:
    """``repeats`` exact analyses (warm: one before), their floor, the first partial. ``math_attention``:
    attention through sdpa's math kernel, whose parts functorch batches (CUDA's fused attention
    backward has no batching rule: functorch runs it once per direction)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    if math_attention:
        with sdpa_kernel(SDPBackend.MATH):
            return {"attention": "math", **exact_runs(loaded, tokens, device, budget, repeats)}
    from backend.vocabulary import Sampler
    from workers.engine import AnalysisRequest, run_analysis

    ids = _ids(loaded, tokens)
    mu = Sampler(**(sampler or {}))  # the model's own distribution unless given
    request = AnalysisRequest(input_ids=ids, sampler=mu)
    run_analysis(loaded, AnalysisRequest(input_ids=ids[:3], sampler=mu), budget)  # compiles, allocates
    seconds, analysis = [], None
    _reset_peak(device)
    for _ in range(repeats):
        analysis = None  # the last run's sums are freed first, as a worker frees a finished analysis
        _synchronize(device)
        start = time.perf_counter()
        analysis = run_analysis(loaded, request, budget)
        _synchronize(device)
        seconds.append(time.perf_counter() - start)
    peak = _peak_gb(device)
    assert analysis is not None
    directions = analysis.summary["method"]["directions"]
    analysis = None  # freed before the next, as in the timed runs (on Qwen3's shape: tens of GB)
    partials: list[float] = []
    start = time.perf_counter()
    run_analysis(
        loaded, request, budget, on_partial=lambda summary, kept: partials.append(time.perf_counter() - start)
    )
    return {
        "tokens": tokens,
        "budget_gb": budget / 2**30,
        "seconds": seconds,
        "directions": directions,
        "floor_flops": 2 * directions * loaded.info.n_params * tokens,
        "first_partial_s": partials[0] if partials else None,
        "peak_gb": peak,
    }


def precision(loaded, device: str, tokens: int = 5) -> dict:
    """Each stat (but rho, a ratio) of float32 and TF32 against float64, on the same device and
    weights: the relative L2 error of the whole stat and the largest of its tensors'."""
    import copy

    from backend.vocabulary import STATS, Sampler
    from workers.engine import AnalysisRequest, run_analysis
    from workers.models.loading import LoadedModel

    ids = _ids(loaded, tokens)
    # tempered, so that the sampler's own stats (the mean shift, the uncentered Fisher) are not zero
    request = AnalysisRequest(input_ids=ids, sampler=Sampler(temperature=0.7), reward={3: 1.0})
    model64 = copy.deepcopy(loaded.model).double()
    reference = run_analysis(
        LoadedModel(id=loaded.id, model=model64, info=loaded.info, tokenizer=loaded.tokenizer),
        request,
        LARGE_BUDGET,
    ).sequence.sums
    runs = {"float32": False, "tf32": True} if device.startswith("cuda") else {"float32": False}
    found: dict[str, dict] = {}
    for label, tf32 in runs.items():
        with _tf32(tf32):
            sums = run_analysis(loaded, request, LARGE_BUDGET).sequence.sums
        found[label] = {}
        for stat in STATS:
            if stat == "rho" or reference.identically_zero(stat):  # rho: a ratio, noise where it is 0/0
                continue
            error_sq, norm_sq, worst = 0.0, 0.0, 0.0
            for (_, want), (_, got) in zip(reference.iter_stat(stat), sums.iter_stat(stat), strict=True):
                difference = float((got.double() - want).square().sum())
                size = float(want.square().sum())
                error_sq, norm_sq = error_sq + difference, norm_sq + size
                if size > 0:
                    worst = max(worst, math.sqrt(difference / size))
            found[label][stat] = {
                "relative_l2": math.sqrt(error_sq / norm_sq) if norm_sq else 0.0,
                "worst_tensor": worst,
            }
    del model64
    return found


def certificate(loaded, budget: int) -> dict:
    """The loader's check of the engine against autograd on this model, and its time."""
    from workers.fisher.certificate import certify

    start = time.perf_counter()
    found = certify(loaded.model, budget)
    return {"seconds": time.perf_counter() - start, **found.to_dict()}


class _Report(dict):
    """The run's results by step, written to ``out`` after every step: a run on a lent GPU that is
    stopped at its time limit still returns what it measured."""

    def __init__(self, out: Path | None, **head) -> None:
        super().__init__(head)
        self.out = out
        print(json.dumps(head), flush=True)

    def step(self, key: str, work: Callable[[], Any], describe: Callable[[Any], dict] = dict) -> Any:
        """``work()``'s result (as ``describe`` reports it) under ``key``, or its error: a failing step
        does not stop the ones after it."""
        start = time.perf_counter()
        try:
            found = work()
            self[key] = describe(found)
        except Exception as error:  # noqa: BLE001 - reported, and the run goes on
            found = None
            self[key] = {
                "error": f"{type(error).__name__}: {error}",
                "traceback": traceback.format_exc()[-3000:],
            }
        text = json.dumps(self[key], default=str)
        print(f"[{time.perf_counter() - start:7.1f} s] {key}: {text[:600]}", flush=True)
        if self.out:
            self.out.write_text(json.dumps(self, indent=1, default=str))
        return found


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--quick", action="store_true", help="small shapes, for a run on the CPU")
    parser.add_argument("--out", type=Path, help="where to write the report as JSON")
    parser.add_argument("--skip-tests", action="store_true", help="leave out the pytest of tests/test_gpu.py")
    args = parser.parse_args(argv)

    import numba
    import torch
    import transformers

    from backend.settings import Settings
    from workers.throughput import device_key

    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit("no CUDA device here: pass --device cpu --quick for a run on the CPU")
    torch.backends.cuda.matmul.allow_tf32 = False  # the worker's default: full-precision float32
    default_budget = Settings().engine_memory_bytes
    report = _Report(
        args.out,
        device=device_key(args.device),
        versions={
            "python": platform.python_version(),
            "torch": torch.__version__,
            "cuda": torch.version.cuda,
            "transformers": transformers.__version__,
            "numba": numba.__version__,
        },
        quick=args.quick,
    )
    report.step("rates", lambda: rates(args.device, args.quick))
    if not args.skip_tests:
        report.step("exactness", exactness)
    for name, token_counts in {"smollm2-135m": (5, 32), "qwen3-1.7b": (5,)}.items():
        loaded = report.step(
            f"{name}/built",
            lambda name=name: build_model(name, args.device, args.quick),
            describe=lambda loaded: loaded.info.to_dict(),
        )
        if loaded is None:
            continue
        report.step(f"{name}/certificate", lambda loaded=loaded: certificate(loaded, default_budget))
        budgets = (default_budget, LARGE_BUDGET) if name == "smollm2-135m" else (LARGE_BUDGET,)
        repeats = 2 if name == "qwen3-1.7b" else REPEATS  # its analyses take the longest
        for tokens in token_counts:
            for budget in budgets:
                report.step(
                    f"{name}/exact/{tokens}/{budget >> 30}GiB",
                    lambda loaded=loaded, tokens=tokens, budget=budget, repeats=repeats: exact_runs(
                        loaded, tokens, args.device, budget, repeats=repeats
                    ),
                )
        if name == "qwen3-1.7b":  # the first answer off the policy: C_mu's 49 directions, no rho
            report.step(
                f"{name}/top-k-50/5/{LARGE_BUDGET >> 30}GiB",
                lambda loaded=loaded: exact_runs(
                    loaded, 5, args.device, LARGE_BUDGET, repeats=2, sampler=TOP_K_50
                ),
            )
        if name == "smollm2-135m":
            report.step(
                f"{name}/exact/5/{LARGE_BUDGET >> 30}GiB/math-attention",
                lambda loaded=loaded: exact_runs(loaded, 5, args.device, LARGE_BUDGET, math_attention=True),
            )
            report.step(f"{name}/precision", lambda loaded=loaded: precision(loaded, args.device))
        del loaded
        if args.device.startswith("cuda"):
            torch.cuda.empty_cache()
    _summarize(report)
    return dict(report)


def _summarize(report: dict) -> None:
    """The figures the issue asks for, one line each."""
    found = report.get("rates", {})
    rate = max((v for k, v in found.items() if k.startswith("float32")), default=None)
    print("\n== summary")
    if rate is not None:
        tf32 = ", ".join(f"{k} {v / 1e12:.1f}" for k, v in found.items() if k.startswith("tf32"))
        print(
            f"  matmul rate: float32 {rate / 1e12:.2f} TFLOP/s at full precision; TF32 {tf32 or '-'} TFLOP/s"
        )
        widths = ", ".join(f"{k} {v / 1e12:.2f}" for k, v in found.items() if k.startswith("width"))
        print(f"  at the models' widths (the cost estimate's rate): {widths or '-'} TFLOP/s")
    for key, value in report.items():
        if ("/exact/" not in key and "/top-k-50/" not in key) or "seconds" not in value:
            continue
        name, _, tokens, *how = key.split("/")
        best = min(value["seconds"])
        floor = value["floor_flops"] / rate if rate else math.nan
        print(
            f"  {name} {tokens} tokens ({', '.join(how)}): {best:.3f} s, {best / floor:.2f} x the floor"
            f" {floor:.3f} s (runs {', '.join(f'{s:.3f}' for s in value['seconds'])}); first partial"
            f" {value['first_partial_s']}; peak {value['peak_gb']} GB;"
            f" target {TARGETS_S.get((name, int(tokens)))} s"
        )
    for key, value in report.items():
        if isinstance(value, dict) and "error" in value:
            print(f"  FAILED {key}: {value['error']}")
    if "exactness" in report:
        print(f"  tests/test_gpu.py: exit {report['exactness'].get('returncode')}")
    for label, stats in report.get("smollm2-135m/precision", {}).items():
        if isinstance(stats, dict):
            worst = max(stats.items(), key=lambda item: item[1]["relative_l2"], default=None)
            print(f"  {label} against float64: largest relative L2 {worst}")


if __name__ == "__main__":
    main()
