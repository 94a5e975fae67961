"""Hostile input to the fisherscope CLI: each ends with exit code 2 and one line on stderr naming the fix
(never a traceback, never exit 1, never a wrong answer), and bad outputs are found before any compute."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.numpy import save_file as save_numpy
from safetensors.torch import save_file

from backend.mask_files import MaskFile, MaskFileError
from tests.test_cli import run_cli  # given capfd here: RE2 and other C libraries write at the descriptor

REPO_ROOT = Path(__file__).resolve().parents[1]
PROMPT = {"prompt": "Q: 2+3=? A:", "target": " five apples"}  # escaped, the target is no group name


def assert_one_line(code: int, err: str, *fragments: str) -> None:
    lines = err.strip().splitlines()
    assert code == 2, err
    assert len(lines) == 1 and lines[0].strip(), err
    assert lines[0].startswith("fisherscope") and "Traceback" not in err
    for fragment in fragments:
        assert fragment in lines[0], lines[0]


@pytest.fixture
def no_compute(monkeypatch):
    """Fails the test if a command gets as far as resolving (loading) its model."""

    def refuse(*_args, **_kwargs):
        raise AssertionError("the model was resolved: the input should have been refused before")

    monkeypatch.setattr("workers.commands.analyze._resolve_model", refuse)


def write_jsonl(path: Path, *lines: object) -> Path:
    path.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines))
    return path


def study_argv(tmp_path: Path, prompts: Path, *extra: str) -> list[str]:
    return [
        "study",
        "--model",
        "tiny-random",
        "--prompts",
        str(prompts),
        "--samples",
        "1",
        "--max-tokens",
        "1",
        "--q",
        "0.5",
        "--compare-uniform",
        "none",
        "--masks",
        str(tmp_path / "masks.st"),
        "--summary",
        str(tmp_path / "summary.json"),
        *extra,
    ]


ANALYZE = ["analyze", "--model", "tiny-random", "--prefix", "She drank a cup of"]


@pytest.mark.parametrize("device", ["cuda:7", "bogus", "", "meta", "cuda:-1"])
def test_a_device_this_machine_lacks_is_refused_before_loading(capfd, no_compute, device):
    if device == "cuda:7" and torch.cuda.device_count() > 7:
        pytest.skip("this machine has a cuda:7")
    code, _, err = run_cli(capfd, *ANALYZE, "--device", device)
    assert_one_line(code, err, "--device")


@pytest.mark.parametrize(
    ("command", "flag", "target", "fragment"),
    [
        ("analyze", "--save", "missing/a.st", "not an existing folder"),
        ("analyze", "--summary", "folder", "is a folder"),
        ("analyze", "--summary", "file.txt/a.json", "not an existing folder"),
        ("analyze", "--save", "locked/a.st", "no write permission"),
        ("analyze", "--save", "same.json", "different files"),
        ("study", "--save", "missing/a.st", "not an existing folder"),
        ("study", "--masks", "folder", "is a folder"),
        ("study", "--summary", "locked/s.json", "no write permission"),
        ("study", "--save", "masks.st", "different files"),
    ],
)
def test_outputs_are_checked_before_any_compute(
    capfd, tmp_path, monkeypatch, no_compute, command, flag, target, fragment
):
    (tmp_path / "folder").mkdir()
    (tmp_path / "locked").mkdir()
    (tmp_path / "file.txt").write_text("")
    real_access = os.access
    # permission bits do not stop root, so the folder's refusal is what os.access reports
    monkeypatch.setattr(os, "access", lambda p, mode: "locked" not in str(p) and real_access(p, mode))
    if command == "analyze":
        argv = [*ANALYZE, "--summary", str(tmp_path / "same.json")] if flag == "--save" else [*ANALYZE]
    else:
        argv = study_argv(tmp_path, write_jsonl(tmp_path / "p.jsonl", PROMPT))
    started = time.perf_counter()
    code, out, err = run_cli(capfd, *argv, flag, str(tmp_path / target))
    assert_one_line(code, err, flag if fragment != "different files" else "", fragment)
    assert "estimated cost" not in out and time.perf_counter() - started < 5


@pytest.mark.parametrize(
    ("lines", "fragment"),
    [
        (["[" * 100_000], "line 1 nests too deeply"),
        ([PROMPT, "[1, 2]"], "line 2 is a JSON list, not an object"),
        (["7"], "line 1 is a JSON int, not an object"),
        (["1" * 5000], "line 1 is not JSON"),
        ([{"prompt": 5}], "line 1 needs a non-empty string 'prompt'"),
        ([{"prompt": "a", "target": ["b"]}], "line 1: 'target' must be a string"),
        (['{"prompt": "a", "prompt": "b"}'], "line 1 gives the field 'prompt' twice"),
        ([{"prompt": "\udc80"}], "line 1: 'prompt' is not valid Unicode text"),
        ([PROMPT, {"prompt": "a", "target": "b\udc80"}], "line 2: 'target' is not valid Unicode text"),
    ],
)
def test_a_bad_prompt_line_is_one_line_naming_it(capfd, tmp_path, no_compute, lines, fragment):
    prompts = tmp_path / "p.jsonl"
    # json.dumps writes a lone surrogate as the escape "\udc80", which json.loads turns back into one
    write_jsonl(prompts, *lines)
    code, _, err = run_cli(capfd, *study_argv(tmp_path, prompts))
    assert_one_line(code, err, fragment)


@pytest.mark.parametrize(
    ("make", "fragment"),
    [
        (lambda p: p.mkdir(), "not a regular file"),
        (lambda p: None, "no such file"),
        (lambda p: p.write_bytes(b"\x00\xff\xfe" + bytes(range(256))), "cannot read the prompt file"),
    ],
    ids=["folder", "missing", "binary"],
)
def test_a_prompt_file_that_is_not_one_is_refused(capfd, tmp_path, no_compute, make, fragment):
    prompts = tmp_path / "p.jsonl"
    make(prompts)
    code, _, err = run_cli(capfd, *study_argv(tmp_path, prompts))
    assert_one_line(code, err, fragment)


def test_a_device_file_as_prompts_is_not_read_forever(capfd, tmp_path, no_compute):
    code, _, err = run_cli(capfd, *study_argv(tmp_path, Path("/dev/zero")))
    assert_one_line(code, err, "not a regular file")


@pytest.mark.parametrize("option", ["--prefix", "--continuation", "--data-token", "--reward"])
def test_a_lone_surrogate_in_an_option_is_refused_naming_it(capfd, no_compute, option):
    code, _, err = run_cli(capfd, *ANALYZE, option, "tea\udc80")
    assert_one_line(code, err, option, "not valid Unicode text")


def test_undecodable_argv_bytes_are_refused_in_a_real_process():
    result = subprocess.run(
        [sys.executable.encode(), b"-m", b"workers.cli", *[a.encode() for a in ANALYZE[:3]]]
        + [b"--prefix", b"\xed\xb3\x80"],
        cwd=REPO_ROOT,
        capture_output=True,
    )
    assert_one_line(result.returncode, result.stderr.decode("utf-8", "replace"), "--prefix", "Unicode")


@pytest.mark.parametrize(
    "pattern",
    [
        r"([\s\S]|[\s\S])*(?!)",
        "a{4294967295}",
        "a{1,99999999999}",
        "(" * 499,
        "(?P<{target}>.)",
        "(a)\\1",
    ],
    ids=["backtracking", "huge-count", "huge-range", "499-open", "target-as-name", "backreference"],
)
def test_a_hostile_reward_regex_is_refused_or_runs_at_once(capfd, tmp_path, tiny_random, pattern):
    prompts = write_jsonl(tmp_path / "p.jsonl", PROMPT)
    started = time.perf_counter()
    code, _, err = run_cli(capfd, *study_argv(tmp_path, prompts, "--reward-regex", pattern))
    # RE2 refuses what it cannot match in linear time; what it takes as a literal runs at once
    if code != 0:
        assert_one_line(code, err, "line 1" if "{target}" in pattern else "--reward-regex")
    assert time.perf_counter() - started < 20


def test_a_target_that_breaks_the_pattern_is_refused_before_compute(capfd, tmp_path, no_compute):
    prompts = write_jsonl(tmp_path / "p.jsonl", PROMPT)
    code, _, err = run_cli(capfd, *study_argv(tmp_path, prompts, "--reward-regex", "(?P<{target}>.)"))
    assert_one_line(code, err, "line 1")


def _masks(path: Path, tensors: dict[str, torch.Tensor]) -> Path:
    save_file({key: value.clone() for key, value in tensors.items()}, str(path))  # no shared storage
    return path


ONES = torch.ones(4, 4, dtype=torch.uint8)
BAD_MASK_FILES = {
    "nan-q": ({"qnan/w": ONES}, "'qnan/w'"),
    "negative-q": ({"q-1/w": ONES}, "'q-1/w'"),
    "q-over-1": ({"q5/w": ONES}, "'q5/w'"),
    "infinite-q": ({"qinf/w": ONES}, "'qinf/w'"),
    "zero-q": ({"q0/w": ONES}, "'q0/w'"),
    "other-spelling": ({"q0.50/w": ONES}, "'q0.50/w'"),
    "no-density": ({"w": ONES}, "'w'"),
    "float32": ({"q0.5/w": ONES.float()}, "'q0.5/w' as F32"),
    "not-0-1": ({"q0.5/w": ONES * 2}, "'q0.5/w'"),
    "uneven": ({"q0.5/w": ONES, "q0.1/v": ONES}, "differ at 'v'"),
    "reshaped": ({"q0.5/w": ONES, "q0.1/w": ONES.reshape(-1)}, "differ at 'w'"),
}


@pytest.mark.parametrize("case", list(BAD_MASK_FILES))
def test_a_file_that_is_not_a_mask_file_is_refused(capfd, tmp_path, case):
    tensors, fragment = BAD_MASK_FILES[case]
    bad = _masks(tmp_path / "bad.st", tensors)
    good = _masks(tmp_path / "good.st", {"q0.5/w": ONES})
    for argv in (["info", str(bad)], ["compare", str(good), str(bad)], ["compare", str(bad), str(good)]):
        code, _, err = run_cli(capfd, "masks", *argv)
        assert_one_line(code, err, fragment, "a mask file holds")


def test_a_mask_file_that_is_a_folder_or_garbage_is_refused(capfd, tmp_path):
    (tmp_path / "garbage.st").write_bytes(os.urandom(4096))
    for name, fragment in (("folder", "not a file"), ("garbage.st", "not a readable safetensors file")):
        (tmp_path / "folder").mkdir(exist_ok=True)
        code, _, err = run_cli(capfd, "masks", "info", str(tmp_path / name))
        assert_one_line(code, err, fragment)


def test_mask_info_counts_the_ones_in_the_tensors(capfd, tmp_path):
    path = _masks(tmp_path / "m.st", {"q1/w": ONES, "q0.25/w": torch.eye(4, dtype=torch.uint8)})
    code, out, err = run_cli(capfd, "masks", "info", str(path))
    assert code == 0, err
    rows = {line.split()[0]: line.split()[1:3] for line in out.splitlines()[4:]}
    assert rows == {"0.25": ["4", "4"], "1": ["16", "16"]}


def test_the_service_still_reads_its_mask_errors_as_mask_file_errors(tmp_path):
    """backend.studies answers a MaskFileError as 422 (a ValueError elsewhere would be a 500)."""
    path = tmp_path / "m.st"
    save_numpy({"q0.5/w": np.full((2, 2), 3, dtype=np.uint8)}, str(path))
    masks = MaskFile.open(path)
    with pytest.raises(MaskFileError, match="not only 0 and 1"):
        masks.mask(0.5, "w")
    with pytest.raises(MaskFileError, match="no mask of density"):
        masks.mask(0.2, "w")


@pytest.mark.parametrize(
    ("command", "extra", "fragment"),
    [
        ("analyze", ["--max-cost-tflop", "nan"], "--max-cost-tflop"),
        ("analyze", ["--max-cost-tflop", "-1"], "--max-cost-tflop"),
        ("analyze", ["--method", "mc:99999999999999999999"], "--method"),
        ("analyze", ["--top-k", "-5"], "--top-k"),
        ("analyze", ["--temperature", "inf"], "--temperature"),
        ("analyze", ["--reward", " tea=nan"], "--reward"),
        ("analyze", ["--prefix", ""], "--prefix"),
        ("study", ["--samples", "0"], "--samples"),
        ("study", ["--samples", "99999999999999999999"], "--samples"),
        ("study", ["--max-tokens", "99999999999999999999"], "--max-tokens"),
        ("study", ["--max-prompt-tokens", "0"], "--max-prompt-tokens"),
        ("study", ["--method", "mc:99999999999999999999", "--max-cost-tflop", "inf"], "--method"),
        ("study", ["--q", "nan"], "q"),
        ("study", ["--q", ""], "--q"),
        ("study", ["--top-p", "nan"], "top_p"),
    ],
)
def test_out_of_range_numbers_exit_2_with_one_line(capfd, tmp_path, tiny_random, command, extra, fragment):
    if command == "analyze":
        argv = [*ANALYZE, *extra]
    else:
        argv = study_argv(tmp_path, write_jsonl(tmp_path / "p.jsonl", PROMPT), *extra)
    code, _, err = run_cli(capfd, *argv)
    assert_one_line(code, err, fragment)
    assert not (tmp_path / "masks.st").exists()
