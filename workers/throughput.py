"""A device's float32 matmul rate at a model's width, measured once and remembered, for cost estimates
in seconds.

Why the model's width and not one large square: the batched backward multiplies at the model's shapes,
and how fast those run against a 2048^2 square differs by machine: constants fitted against the square
on one CPU fell short by a fifth to a third on another whose products at SmolLM2's width ran slower
than its square (docs/speed.md). The square's rate (`measure`) stays the benchmarks' floor.

Why one rate: a second, the memory's (a float32 sum streamed out of cache), varied within one run while
the analyses' times did not follow it, and estimates through it spread wider than through the matmul
rate alone (docs/speed.md).

Why remembered: measuring takes a second, and a CLI run for a 2-direction estimate should not spend it
every time. The rate is kept per device (CPU model and thread count, or the GPU's name) and width in the
model cache folder; `refresh` measures again (the benchmarks always do, to compare with their own runs).
Why it can be forgotten: a rate measured while other work ran on the machine is several times too low,
and kept for good it would make every later estimate as wrong; a run whose estimate missed by more than
MISS_FACTOR (`check_estimate`) drops the width's rate, so the next run measures it again.
"""

from __future__ import annotations

import json
import os
import platform
import time
from collections.abc import Callable
from pathlib import Path

import torch

from backend.registry import cache_dir

CACHE_NAME = "throughput.json"
# how a remembered rate was measured: one measured another way (the 2048^2 square) is measured again
METHOD = "width-1s"
MLP_RATIO = 3  # a block's MLP width against d_model: 8/3 (Llama, SmolLM2) to 4 (GPT-2); Qwen3-1.7B's is 3
WIDTH_ROWS = 2048  # rows of each product: a chunk of directions times tokens, as the batched backward has
# an estimate off by more than this (either way) means the remembered rate no longer describes the device
MISS_FACTOR = 2.0
# a shorter run is mostly fixed costs (loading, the forward, the summary) that the rate does not describe
JUDGED_SECONDS = 10.0


def device_key(device: str) -> str:
    """What the rate depends on: the GPU's name, or the CPU's model and the threads torch uses."""
    target = torch.device(device)
    if target.type == "cuda":
        tf32 = "+tf32" if torch.backends.cuda.matmul.allow_tf32 else ""
        return f"cuda:{torch.cuda.get_device_name(target)}{tf32}"
    return f"cpu:{platform.machine()}:{_cpu_model()}:{torch.get_num_threads()} threads"


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as info:
            return next((line.split(":", 1)[1].strip() for line in info if line.startswith("model name")), "")
    except OSError:
        return platform.processor()


def _sustained(target: torch.device, step: Callable[[], object], units: float, seconds: float) -> float:
    """``units`` per call of ``step``, repeated for ``seconds`` after one warm-up call, per second.

    Why sustained rather than the fastest of a few: on a small shared CPU the fastest of five 2048^2
    multiplies varied nearly twofold between processes minutes apart, a second of them far less, and
    the engine's measured times followed the second (the same analysis took the same time at either).
    """
    step()
    if target.type == "cuda":
        torch.cuda.synchronize(target)
    count = 0
    start = time.perf_counter()
    while True:
        step()
        if target.type == "cuda":
            torch.cuda.synchronize(target)
        count += 1
        elapsed = time.perf_counter() - start
        if elapsed >= seconds:
            return units * count / elapsed


def measure(device: str = "cpu", size: int | None = None, seconds: float = 1.0) -> float:
    """Sustained float32 flops per second of ``size`` x ``size`` multiplies on ``device`` (at the
    backend's setting: full precision unless TF32 is allowed, as the worker leaves it unless asked):
    the benchmarks' floor 2 r P T is counted at this rate."""
    target = torch.device(device)
    size = size or (4096 if target.type == "cuda" else 2048)
    a = torch.randn(size, size, device=target)
    return _sustained(target, lambda: a @ a, 2.0 * size**3, seconds)


def measure_width(device: str, d_model: int, seconds: float = 1.0, rows: int = WIDTH_ROWS) -> float:
    """Sustained float32 flops per second of a block's products at width ``d_model``: ``rows`` rows
    through d x d (attention's projections), d x 3d and 3d x d (the MLP's), in turn: the shapes the
    batched backward multiplies at (why not 2048^2: the module's docstring)."""
    target = torch.device(device)
    wide = MLP_RATIO * d_model
    x = torch.randn(rows, d_model, device=target)
    h = torch.randn(rows, wide, device=target)
    square = torch.randn(d_model, d_model, device=target)
    up = torch.randn(d_model, wide, device=target)
    down = torch.randn(wide, d_model, device=target)

    def block() -> None:
        x @ square
        x @ up
        h @ down

    return _sustained(target, block, 2.0 * rows * d_model * (d_model + 2 * wide), seconds)


def _remembered(path: Path) -> dict:
    """The cache file's entries by device, or none where it is missing, unreadable or not a mapping."""
    try:
        known = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return known if isinstance(known, dict) else {}


def _widths(known: dict, key: str) -> dict[str, dict]:
    """The widths remembered for device ``key`` that were measured the current way and hold a rate."""
    entry = known.get(key)
    if not (
        isinstance(entry, dict) and entry.get("method") == METHOD and isinstance(entry.get("widths"), dict)
    ):
        return {}
    return {
        width: measured
        for width, measured in entry["widths"].items()
        if isinstance(measured, dict) and _is_rate(measured.get("flops_per_second"))
    }


def _is_rate(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and value > 0


def matmul_rate(device: str, d_model: int, refresh: bool = False) -> float:
    """The remembered rate of ``device`` at width ``d_model`` (measured on first use, or when
    ``refresh``)."""
    path = cache_dir() / CACHE_NAME
    key, width = device_key(device), str(d_model)
    remembered = None if refresh else _widths(_remembered(path), key).get(width)
    if remembered is not None:
        return float(remembered["flops_per_second"])
    rate = measure_width(device, d_model)
    known = _remembered(path)  # read again: what another process measured meanwhile is kept
    widths = {**_widths(known, key), width: {"flops_per_second": rate, "measured_at": time.time()}}
    known[key] = {"method": METHOD, "widths": widths}
    _write(path, known)
    return rate


def check_estimate(device: str, d_model: int, estimated_seconds: float, measured_seconds: float) -> bool:
    """Forget the remembered rate of ``device`` at ``d_model`` when a run took more than MISS_FACTOR
    times its estimate or less than its inverse; True when it was forgotten (the next run measures)."""
    if estimated_seconds <= 0 or max(estimated_seconds, measured_seconds) < JUDGED_SECONDS:
        return False
    ratio = measured_seconds / estimated_seconds
    if 1 / MISS_FACTOR <= ratio <= MISS_FACTOR:
        return False
    path = cache_dir() / CACHE_NAME
    key, width = device_key(device), str(d_model)
    known = _remembered(path)
    widths = _widths(known, key)
    if width not in widths:
        return False
    del widths[width]
    known[key] = {"method": METHOD, "widths": widths}
    _write(path, known)
    return True


def _write(path: Path, known: dict) -> None:
    """Replace the cache file whole (another process reads either the old file or the new one)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.{os.getpid()}.part")
    partial.write_text(json.dumps(known, indent=1))
    partial.replace(path)
