"""The fisherscope CLI: help documents every quantity, errors are one line with exit code 2, and
``analyze`` writes every per-parameter array and the summary."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors import safe_open

from backend.vocabulary import STATS
from workers.cli import build_parser, main
from workers.commands.analyze import parse_rewards

REPO_ROOT = Path(__file__).resolve().parents[1]


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    """Run ``fisherscope argv`` in-process: (exit code, stdout, stderr)."""
    try:
        code = main(list(argv))
    except SystemExit as exit_:
        code = exit_.code if isinstance(exit_.code, int) else 1
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def assert_one_line_error(code: int, err: str, *fragments: str) -> None:
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("fisherscope") and "Traceback" not in err
    for fragment in fragments:
        assert fragment in lines[0]


def test_help_documents_every_quantity():
    for parser_help in (build_parser().format_help(), _analyze_help()):
        for stat in STATS:
            assert f"\n  {stat} " in parser_help, stat


def _analyze_help() -> str:
    parser = build_parser()
    subparsers = next(a for a in parser._actions if a.dest == "command")
    return subparsers.choices["analyze"].format_help()


def test_models_lists_every_builtin_id_with_its_certificate(capsys, tiny_random):
    code, out, _ = run_cli(capsys, "models")
    assert code == 0
    header, *lines = out.strip().splitlines()
    assert header.split() == ["id", "architecture", "parameters", "dtype", "digest", "certificate"]
    rows = {line.split()[0]: line for line in lines}
    assert {"smollm2-135m", "tiny-random"} <= set(rows)
    assert rows["tiny-random"].split()[1:4] == [
        "LlamaForCausalLM",
        f"{tiny_random.info.n_params:,}",
        "float32",
    ]
    assert "exact, max rel. error" in rows["tiny-random"]  # tiny_random was loaded, so it is certified


def test_fetch_builds_into_the_configured_cache(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("FISHERSCOPE_CACHE", str(tmp_path))
    code, out, _ = run_cli(capsys, "fetch", "tiny-random")
    assert code == 0
    assert str(tmp_path / "tiny-random") in out
    assert (tmp_path / "tiny-random" / "manifest.json").is_file()


@pytest.mark.parametrize(
    ("argv", "fragments"),
    [
        (["--model", "gpt-17"], ["unknown model 'gpt-17'", "tiny-random"]),
        (["--model", "tiny-random", "--method", "fast"], ["method"]),
        (["--model", "tiny-random", "--method", "truncated:1.5"], ["0 < F <= 1"]),
        (["--model", "tiny-random", "--reward", "tea"], ["--reward", "TOKEN=VALUE"]),
        (["--model", "tiny-random", "--reward", " tea=lots"], ["not a number"]),
        (["--model", "tiny-random", "--top-p", "1.5"], ["--top-p"]),
        (["--model", "tiny-random", "--temperature", "0"], ["--temperature"]),
        (["--model", "tiny-random", "--top-k", "three"], ["--top-k"]),
        (["--model", "tiny-random", "--engine", "fp8"], ["--engine"]),
        (["--model", "tiny-random", "--reward", " zzqx=1"], ["not exactly one"]),
        (["--model", "tiny-random", "--sampler", "data"], ["data_token"]),
    ],
)
def test_bad_analyze_input_exits_2_with_one_line(capsys, tiny_random, argv, fragments):
    code, _, err = run_cli(capsys, "analyze", "--prefix", "She drank a cup of", *argv)
    assert_one_line_error(code, err, *fragments)


def test_missing_model_says_how_to_fetch_it(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("FISHERSCOPE_CACHE", str(tmp_path))
    code, _, err = run_cli(capsys, "analyze", "--model", "smollm2-135m", "--prefix", "hi")
    assert_one_line_error(code, err, "fisherscope fetch smollm2-135m")


def test_cost_over_the_limit_is_refused_with_cheaper_methods(capsys, tiny_random):
    code, out, err = run_cli(
        capsys,
        "analyze",
        "--model",
        "tiny-random",
        "--prefix",
        "She drank a cup of",
        "--max-cost-tflop",
        "1e-7",
    )
    assert_one_line_error(code, err, "--max-cost-tflop", "cheaper --method")
    assert "estimated cost" in out


def test_parse_rewards_splits_on_the_last_equals_sign():
    assert parse_rewards([" tea=1", "a=b=-0.5", "#7=2e-1"]) == {" tea": 1.0, "a=b": -0.5, "#7": 0.2}


def test_errors_in_a_real_process_have_no_traceback(tiny_random):
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    for argv in (
        ["analyze", "--model", "gpt-17", "--prefix", "hi"],
        ["analyze", "--model", "no-such-org/no-such-model", "--prefix", "hi"],
        ["fetch", "gpt-17"],
    ):
        result = subprocess.run(
            [sys.executable, "-m", "workers.cli", *argv],
            cwd=REPO_ROOT,
            env=env,
            capture_output=True,
            text=True,
        )
        assert_one_line_error(result.returncode, result.stderr)


def test_analyze_writes_every_parameter_of_every_stat(capsys, tmp_path, tiny_random):
    arrays, summary = tmp_path / "analysis.safetensors", tmp_path / "summary.json"
    code, out, err = run_cli(
        capsys,
        "analyze", "--model", "tiny-random", "--prefix", "She drank a cup of",
        "--reward", " tea=1", "--reward", " coffee=1", "--save", str(arrays), "--summary", str(summary),
    )  # fmt: skip
    assert code == 0, err
    assert "estimated cost" in out and "top 5 tensors by fisher" in out
    shapes = {name: list(p.shape) for name, p in tiny_random.model.named_parameters()}
    with safe_open(str(arrays), framework="pt") as handle:
        keys = set(handle.keys())
        expected = {f"{stat}/{name}" for stat in STATS for name in shapes}
        assert expected <= keys
        for stat in STATS:
            for name, shape in shapes.items():
                assert list(handle.get_slice(f"{stat}/{name}").get_shape()) == shape
        assert (
            handle.get_tensor("input_ids").tolist() == tiny_random.tokenizer.encode("She drank a cup of").ids
        )
    written = json.loads(summary.read_text())
    assert written["model"]["digest"] == tiny_random.info.digest
    assert len(written["positions"]) == 1
    assert {row["text"] for row in written["reward"]} == {" tea", " coffee"}
