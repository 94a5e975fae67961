"""benchmarks/bench_gpu.py, the run prepared for a lent GPU machine: every step runs here on the CPU
with small shapes, and the full shapes it builds are the models' own."""

from __future__ import annotations

import importlib.util
import json
import math
import re
from pathlib import Path

import pytest
import torch

from backend.registry import cache_dir

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_gpu", ROOT / "benchmarks" / "bench_gpu.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_step_of_the_gpu_run_runs_on_the_cpu_with_small_shapes(bench, tmp_path):
    out = tmp_path / "gpu.json"
    report = bench.main(["--device", "cpu", "--quick", "--out", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(report, default=str))
    failed = {
        key: value["error"] for key, value in report.items() if isinstance(value, dict) and "error" in value
    }
    assert not failed
    runs = [key for key in report if "/exact/" in key]
    assert runs == [
        "smollm2-135m/exact/5/2GiB",
        "smollm2-135m/exact/5/32GiB",
        "smollm2-135m/exact/32/2GiB",
        "smollm2-135m/exact/32/32GiB",
        "smollm2-135m/exact/5/32GiB/math-attention",
        "qwen3-1.7b/exact/5/32GiB",
    ]
    hidden = bench.QUICK["hidden_size"]
    for key in runs:
        run = report[key]
        assert all(seconds > 0 for seconds in run["seconds"])
        assert run["directions"] == hidden  # exact: C_mu's rank, the hidden size on a random model
        assert run["first_partial_s"] is not None
    # the first answer off the policy: C_mu of 50 tokens has rank 49 at most
    first_answer = report["qwen3-1.7b/top-k-50/5/32GiB"]
    assert first_answer["directions"] == min(hidden, 49) and all(s > 0 for s in first_answer["seconds"])
    assert report["smollm2-135m/certificate"]["passed"] and report["qwen3-1.7b/certificate"]["passed"]
    # its pytest ran: its GPU tests pass where there is a GPU and are skipped where there is none
    ran = re.search(r"(\d+) (passed|skipped)", report["exactness"]["tail"])
    assert ran and ran.group(2) == ("passed" if torch.cuda.is_available() else "skipped"), report["exactness"]
    # float32 on the CPU against float64: at float32 rounding for every stat formed
    precision = report["smollm2-135m/precision"]["float32"]
    assert {"fisher", "uncentered", "raw", "mean_shift", "common", "policy_grad", "bound"} == set(precision)
    assert max(entry["relative_l2"] for entry in precision.values()) < 1e-4


def test_the_smollm2_shape_is_the_fetched_models_own(bench, smollm2):
    config = json.loads((cache_dir() / "smollm2-135m" / "config.json").read_text())
    shape = dict(bench.SHAPES["smollm2-135m"])
    assert shape.pop("rope_theta") == config["rope_parameters"]["rope_theta"]
    assert math.isclose(shape.pop("rms_norm_eps"), config["rms_norm_eps"], rel_tol=1e-6)
    assert shape == {key: config[key] for key in shape}
    built = bench.build_model("smollm2-135m", "meta", quick=False)
    assert {n: p.shape for n, p in built.model.named_parameters()} == {
        n: p.shape for n, p in smollm2.model.named_parameters()
    }
    assert built.info.n_params == smollm2.info.n_params


def test_the_qwen3_shape_has_qwen3_1_7bs_parameter_count(bench):
    built = bench.build_model("qwen3-1.7b", "meta", quick=False)
    embedding = built.model.get_input_embeddings().weight
    assert built.info.tied_embeddings and built.info.architecture == "Qwen3ForCausalLM"
    # its model card: 1.7B parameters, 1.4B of them outside the (tied) embedding
    assert round(built.info.n_params / 1e9, 1) == 1.7
    assert round((built.info.n_params - embedding.numel()) / 1e9, 1) == 1.4
    assert embedding.device == torch.device("meta")
