"""One analysis over two processes (torch.distributed, gloo on the CPU), as ``torchrun`` runs it: each
process back-propagates a share of every position's directions and the results are summed; the
numbers equal one process's, on three families (one of them MoE), off the policy, along a response."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from safetensors.torch import load_file

from backend.vocabulary import STATS, Method, Sampler
from tests.tiny_models import BUDGET, tiny_model
from workers.fisher.parameter_arrays import SumsStorage
from workers.fisher.response import SequenceAnalysis, analyze_sequence
from workers.fisher.shards import Shard, current_shard, gathered, split_directions

ROOT = Path(__file__).resolve().parents[1]
FAMILIES = ("llama", "qwen2", "qwen3_moe", "gpt2")  # GPT-2: Conv1D blocks, whose sums are transposed views
PROCESSES = 2


def _analysis(family: str, method: Method) -> SequenceAnalysis:
    model = tiny_model(family, tied=True)
    reward = torch.zeros(model.config.vocab_size, dtype=torch.float64)
    reward[5], reward[8] = 1.0, -0.5
    return analyze_sequence(
        model,
        torch.tensor([3, 5, 3]),
        torch.tensor([8, 3, 1]),
        Sampler(temperature=0.7, top_k=5),
        method,
        reward,
        memory_budget_bytes=BUDGET,
        fisher_under_p=True,
    )


def _stats(result: SequenceAnalysis) -> dict[str, dict[str, torch.Tensor]]:
    found = {stat: {name: value.clone() for name, value in result.sums.iter_stat(stat)} for stat in STATS}
    # rho's parts as well: where rho is noise over noise (``_where_rho_is_defined``), they still agree
    parts = {name: result.sums.rho_terms(name) for name in result.sums.names}
    found["rho's denominator"] = {name: terms.formed().clone() for name, terms in parts.items()}
    found["rho's numerator"] = {
        name: (terms.extra.square() if terms.squared else terms.extra.clone())
        for name, terms in parts.items()
        if terms.extra is not None
    }
    return found


def _at(where: str) -> Callable[[str], str]:
    return lambda message: f"{where}: {message}"


def _where_rho_is_defined(result: SequenceAnalysis) -> dict[str, torch.Tensor]:
    """rho is common_sq / (fisher_p + common_sq). Where that raw Fisher under p is at the rounding level
    of the model's largest (GPT-2's key biases: softmax ignores a shift shared by every key, so their
    sensitivity is rounding noise), rho is noise over noise, different in every summation order; its
    numerator and denominator are compared on their own (``_stats``)."""
    raw = {name: result.sums.rho_terms(name).formed().clone() for name in result.sums.names}
    floor = 1e-9 * max(float(v.max()) for v in raw.values())
    return {name: value > floor for name, value in raw.items()}


def _process(rank: int, world: int, rendezvous: str, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=world)
    try:
        assert current_shard() is None  # a process group alone splits nothing
        found = {}
        with split_directions():
            assert current_shard() == Shard(rank, world)
            for family in FAMILIES:
                for method in (Method(), Method.parse("mc:3")):  # mc: a group wholly on the last rank
                    result = _analysis(family, method)
                    counts = gathered(result.directions)  # every process takes part
                    found[(family, str(method))] = {"stats": _stats(result), "directions": counts}
        if rank == 0:
            torch.save(found, out)
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def split(tmp_path_factory) -> dict:
    folder = tmp_path_factory.mktemp("shards")
    out = folder / "rank0.pt"
    mp.spawn(_process, args=(PROCESSES, str(folder / "rendezvous"), str(out)), nprocs=PROCESSES, join=True)
    return torch.load(out)


@pytest.mark.parametrize("method", ["exact", "mc:3"])
@pytest.mark.parametrize("family", FAMILIES)
def test_two_processes_give_one_processs_numbers(split, family, method):
    assert current_shard() is None  # this process runs alone
    alone = _analysis(family, Method.parse(method))
    expected = _stats(alone)
    defined = _where_rho_is_defined(alone)
    for stat, table in split[(family, method)]["stats"].items():
        scale = max(float(v.abs().max()) for v in expected[stat].values()) or 1.0
        for name, value in table.items():
            want = expected[stat][name]
            if stat == "rho":  # a ratio: compared where it is not rounding over rounding
                value, want = value[defined[name]], want[defined[name]]
            torch.testing.assert_close(
                value, want, rtol=1e-4, atol=1e-9 * scale, msg=_at(f"{stat} of {name}")
            )
    counts = split[(family, method)]["directions"]
    assert sum(counts) == alone.directions and all(count > 0 for count in counts)


def test_the_shares_cover_every_direction_once():
    for lead, total in ((0, 0), (3, 3), (3, 4), (2, 103), (0, 7)):
        for world in (1, 2, 3, 8):
            rows = [
                r
                for rank in range(world)
                for lo, hi in Shard(rank, world).rows(lead, total)
                for r in range(lo, hi)
            ]
            assert rows == list(range(total)), (lead, total, world)


def _without_room(rank: int, world: int, rendezvous: str, folder: str) -> None:
    """A worker's process under torchrun: each runs the analysis and goes on whatever it raised (its
    failure is reported, not its exit), so a process waiting for one that gave up waits until the group's
    timeout, here a short one. Rank 1's sums folder cannot be made."""
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=world, timeout=timedelta(seconds=30)
    )
    root = Path(folder)
    sums = root / f"sums{rank}"
    if rank == 1:
        (root / "a file").write_text("")
        sums = root / "a file" / "sums"  # below a file: mkdir fails
    try:
        model = tiny_model("llama", tied=True)
        with split_directions():
            analyze_sequence(
                model,
                torch.tensor([3, 5, 3]),
                torch.tensor([8, 3, 1]),
                Sampler(temperature=0.7, top_k=5),
                Method(),
                memory_budget_bytes=BUDGET,
                sums_storage=SumsStorage(sums, memory_bytes=0),
            )
        outcome = "finished"
    except Exception as error:  # what a worker's process does: report, go on
        outcome = f"{type(error).__name__}: {error}"
    (root / f"outcome{rank}").write_text(outcome)
    dist.destroy_process_group()


def test_a_process_without_room_for_its_sums_stops_the_others(tmp_path):
    """Each process maps its own sums; where one cannot, every process fails at that table with its
    message, instead of the others waiting in the next collective until the group's timeout."""
    rendezvous = str(tmp_path / "rendezvous")
    mp.spawn(_without_room, args=(PROCESSES, rendezvous, str(tmp_path)), nprocs=PROCESSES, join=True)
    own, other = ((tmp_path / f"outcome{rank}").read_text() for rank in (1, 0))
    assert own.startswith("NoRoomForSums: no room for") and "FISHERSCOPE_SUMS_DIR" in own
    assert other.startswith("NoRoomForSums: process 1 of 2: no room for"), other
    assert list((tmp_path / "sums0").iterdir()) == []  # its files were unlinked once mapped


def run_alone_and_split(folder: Path, argv: list[str], *outputs: tuple[str, str]) -> tuple[Path, Path]:
    """``fisherscope argv`` in one process and under ``torchrun --nproc-per-node 2``, each writing
    ``outputs`` (option, file name) into a folder of its own: (that of one process, that of two)."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    torchrun = [str(Path(sys.executable).parent / "torchrun"), "--nproc-per-node", str(PROCESSES)]
    folders = folder / "alone", folder / "split"
    for into, launcher in zip(folders, ([sys.executable], torchrun), strict=True):
        into.mkdir()
        written = [part for option, name in outputs for part in (option, str(into / name))]
        command = [*launcher, "-m", "workers.cli", *argv, *written]
        done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
        assert done.returncode == 0, done.stderr[-2000:]
    return folders


@pytest.mark.slow
def test_fisherscope_analyze_under_torchrun_writes_one_processs_numbers(tmp_path, tiny_random):
    """``torchrun --nproc-per-node 2 -m workers.cli analyze``: rank 0 writes the summary and arrays, which
    equal one process's; the summary says how the directions were split."""
    argv = [
        "analyze", "--model", "tiny-random", "--prefix", "She drank a cup of", "--continuation", " tea with",
        "--temperature", "0.7", "--top-k", "9", "--reward", " tea=1", "--rho",
    ]  # fmt: skip
    alone, split = run_alone_and_split(tmp_path, argv, ("--summary", "s.json"), ("--save", "a.safetensors"))
    one, two = (json.loads((folder / "s.json").read_text()) for folder in (alone, split))
    assert (one["processes"], two["processes"]) == (1, 2)
    assert sum(two["directions_per_process"]) == one["directions_per_process"][0]
    assert all(count > 0 for count in two["directions_per_process"])
    for key, value in one["totals"].items():
        assert two["totals"][key] == pytest.approx(value, rel=1e-4), key
    a, b = load_file(alone / "a.safetensors"), load_file(split / "a.safetensors")
    assert a.keys() == b.keys()
    for key in a:
        scale = float(a[key].abs().max()) or 1.0
        torch.testing.assert_close(b[key], a[key], rtol=1e-4, atol=1e-6 * scale, msg=key)


@pytest.mark.slow
def test_fisherscope_study_under_torchrun_samples_the_same_responses_and_sums(tmp_path, tiny_random):
    """``torchrun --nproc-per-node 2 -m workers.cli study``: the seeds fix the responses on every process,
    each runs a share of every context's directions; rank 0 writes what one process would."""
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(
        '{"prompt": "2+2=", "target": "4"}\n{"prompt": "She drank a cup of", "target": " tea"}\n'
    )
    argv = [
        "study", "--model", "tiny-random", "--prompts", str(prompts), "--samples", "2", "--max-tokens", "3",
        "--temperature", "0.7", "--top-k", "9", "--reward-regex", "{target}", "--q", "0.01,0.05",
    ]  # fmt: skip
    alone, split = run_alone_and_split(tmp_path, argv, ("--summary", "s.json"), ("--masks", "m.safetensors"))
    one, two = (json.loads((folder / "s.json").read_text()) for folder in (alone, split))
    assert [r["continuation_ids"] for r in two["responses"]] == [
        r["continuation_ids"] for r in one["responses"]
    ]
    assert two["counts"] == one["counts"]
    for key, value in one["totals"].items():
        assert two["totals"][key] == pytest.approx(value, rel=1e-4, abs=1e-9), key
    for q, shares in one["masks"]["by_q"].items():
        assert two["masks"]["by_q"][q]["count"] == shares["count"]
    a, b = load_file(alone / "m.safetensors"), load_file(split / "m.safetensors")
    held = sum(int(a[key].sum()) for key in a)
    shared = sum(int((a[key] & b[key]).sum()) for key in a)
    assert shared >= 0.99 * held  # the same top sets, but for ties float32 rounding may reorder


def test_under_torchrun_a_gpu_is_each_processs_own(monkeypatch):
    from workers.commands.common import UsageError
    from workers.commands.processes import device_of_process

    assert device_of_process("cuda:1") == "cuda:1"  # alone: as named
    for name, value in {
        "RANK": "1",
        "WORLD_SIZE": "2",
        "MASTER_ADDR": "x",
        "MASTER_PORT": "1",
        "LOCAL_RANK": "1",
    }.items():
        monkeypatch.setenv(name, value)
    assert device_of_process("cuda") == "cuda:1" and device_of_process("cpu") == "cpu"
    with pytest.raises(UsageError, match="each process takes its own GPU"):
        device_of_process("cuda:0")
