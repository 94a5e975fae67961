"""The float32 matmul rate of a device, measured once and remembered, for cost estimates in seconds.

Why remembered: measuring takes a second, and a CLI run for a 2-direction estimate should not spend
it every time. The rate is kept per device (CPU model and thread count, or the GPU's name) in the model
cache folder; `refresh` measures again (the benchmarks always do, to compare with their own runs).
"""

from __future__ import annotations

import json
import os
import platform
import time

import torch

from backend.registry import cache_dir

CACHE_NAME = "throughput.json"
METHOD = "sustained-1s"  # how a remembered rate was measured: one taken another way is measured again


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


def measure(device: str = "cpu", size: int | None = None, seconds: float = 1.0) -> float:
    """Sustained float32 matmul flops per second on ``device`` (at the backend's setting: full precision
    unless TF32 is allowed, as the worker leaves it unless asked):
    multiplies of ``size`` x ``size`` repeated for ``seconds``.

    Why sustained rather than the fastest of a few: on the 2-core CPU machine the fastest of five 2048^2
    multiplies ranged 101-181 GFLOP/s between processes minutes apart, a second of them 132-146, and
    the engine's measured times followed the second (the same analysis took the same time at either).
    """
    target = torch.device(device)
    size = size or (4096 if target.type == "cuda" else 2048)
    a = torch.randn(size, size, device=target)
    a @ a  # warm up
    if target.type == "cuda":
        torch.cuda.synchronize(target)
    count = 0
    start = time.perf_counter()
    while True:
        a @ a
        if target.type == "cuda":
            torch.cuda.synchronize(target)
        count += 1
        elapsed = time.perf_counter() - start
        if elapsed >= seconds:
            return 2 * size**3 * count / elapsed


def matmul_rate(device: str = "cpu", refresh: bool = False) -> float:
    """The remembered rate of ``device`` (measured on first use, or when ``refresh``)."""
    path = cache_dir() / CACHE_NAME
    key = device_key(device)
    try:
        known = json.loads(path.read_text())
    except (OSError, ValueError):
        known = {}
    entry = known.get(key)
    fresh = isinstance(entry, dict) and entry.get("method") == METHOD and entry.get("flops_per_second", 0) > 0
    if fresh and not refresh:
        return float(entry["flops_per_second"])  # type: ignore[index]
    rate = measure(device)
    known[key] = {"flops_per_second": rate, "measured_at": time.time(), "method": METHOD}
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.{os.getpid()}.part")
    partial.write_text(json.dumps(known, indent=1))
    partial.replace(path)
    return rate
