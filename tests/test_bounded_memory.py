"""The memory rule (docs/design.md §3b): an analysis of one position holds the weights, one
parameter-sized sum (the Fisher) and a workspace that does not grow with the model; its first moments
(kbar under mu and p, the mean shift, the policy gradient) stay in their small form and are formed one
tensor at a time. Counted, not timed: the bytes of the arrays the engine's torch ops create and that
are still alive, at their peak, in parameter-sized units."""

from __future__ import annotations

import errno
import math
import os
import weakref

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from backend.vocabulary import Method
from tests.tiny_models import BUDGET, tiny_llama, tiny_model
from workers.fisher import first_moments
from workers.fisher.certificate import certify
from workers.fisher.first_moments import Factored
from workers.fisher.model_summary import model_summary
from workers.fisher.parameter_arrays import NoRoomForSums, SumsStorage
from workers.fisher.position import HeadLayout, PositionInputs, position_moments
from workers.fisher.response import analyze_sequence
from workers.fisher.sampler import Sampler
from workers.fisher.scratch_pool import summary_scratch
from workers.fisher.stats import MomentSums
from workers.fisher.study import StudyStat, StudySums
from workers.studies.prompts import EncodedPrompt
from workers.studies.runner import StudyModel, run_study_part
from workers.studies.spec import StudySpec

IDS = torch.tensor([3, 5, 8, 3, 11])
CURVE_STATS = ("fisher", "uncentered", "raw")


class LiveArrays(TorchDispatchMode):
    """The bytes of the arrays torch's ops create in this thread that are alive now, and their peak (an
    array counts until the tensor that created it is gone; ``existing`` tensors' arrays, the weights,
    never count, seen again through a view)."""

    def __init__(self, existing) -> None:
        super().__init__()
        self.existing = {tensor.untyped_storage().data_ptr() for tensor in existing}
        self.live: dict[int, int] = {}
        self.now = self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in tree_leaves(out):
            if isinstance(tensor, torch.Tensor) and tensor.device.type == "cpu":
                self._count(tensor)
        return out

    def _count(self, tensor: torch.Tensor) -> None:
        storage = tensor.untyped_storage()
        key = storage.data_ptr()
        size = storage.nbytes()
        # a mapped file's pages are the kernel's to write out, not the process's memory
        if key in self.live or key in self.existing or size == 0 or storage.filename is not None:
            return
        self.live[key] = size
        self.now += size
        self.peak = max(self.peak, self.now)
        weakref.finalize(tensor, self._free, key)

    def _free(self, key: int) -> None:
        self.now -= self.live.pop(key, 0)


@pytest.fixture(scope="module")
def model():
    # wide matrices, a short context: the parameters outweigh every activation many times over
    return tiny_llama(
        tied=False, seed=5, vocab_size=512, hidden_size=64, intermediate_size=512, num_hidden_layers=4,
        dtype=torch.float32,
    )  # fmt: skip


def _inputs(model, reward: bool) -> PositionInputs:
    logits = model(input_ids=IDS[None]).logits[0, -1].detach().double()
    p = torch.softmax(logits, -1)
    mu = torch.softmax(logits / 0.7, -1)
    rewards = torch.linspace(-1, 1, p.numel(), dtype=torch.float64) if reward else None
    return PositionInputs(IDS, p, mu, rewards, on_policy=False, fisher_under_p=False)


def test_one_position_holds_one_parameter_sized_sum(model, monkeypatch):
    parameter_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    largest = max(p.numel() * p.element_size() for p in model.parameters())
    # a workspace of a few tensors (its settings scale with the machine; the rule with the model): the
    # formed tensors kept, and a direction chunk's gradients at the modules' outputs
    monkeypatch.setattr(first_moments, "FORMED_KEPT_BYTES", 2 * largest)
    workspace = 2 * largest
    layout = HeadLayout.of(model)
    with LiveArrays(model.parameters()) as counted:
        moments = position_moments(
            model, _inputs(model, reward=True), Method(), memory_budget_bytes=workspace
        )
        sums = MomentSums(layout.names, layout.shapes)
        sums.add(moments)
        del moments
        for stat in ("mean_shift", "common", "policy_grad", "bound", "raw"):  # each read once, in turn
            for name in layout.names:
                sums.stat(stat, name)
    summary = model_summary(sums, layout.head_name, layout.embedding_name, CURVE_STATS)
    assert summary["totals"]["fisher"] > 0
    # the Fisher, and a workspace of a few of the largest tensors; held as arrays, the first moments and
    # the bound were five sums more (kbar under mu and p, the mean shift, the policy gradient, the bound)
    assert counted.peak <= parameter_bytes + 8 * largest, counted.peak / parameter_bytes


def test_first_moments_stay_small_until_read(model):
    layout = HeadLayout.of(model)
    moments = position_moments(model, _inputs(model, reward=True), Method(), memory_budget_bytes=BUDGET)
    sums = MomentSums(layout.names, layout.shapes)
    sums.add(moments)
    for key in ("common", "mean_shift", "policy_grad"):
        entries = sums.sums[key].entries
        assert all(isinstance(entry, Factored) for entry in entries.values()), key
        held = sum(
            math.prod(getattr(term, "delta", getattr(term, "rows", getattr(term, "per_row", None))).shape)
            for entry in entries.values()
            for term in entry.terms
            if not isinstance(term, first_moments.Whole)
        )
        assert held < sum(math.prod(s) for s in layout.shapes.values()) / 4, key
    # read, a tensor is the first moment itself: the mean shift is kbar_mu - kbar_p
    for name in layout.names:
        torch.testing.assert_close(
            sums.sums["mean_shift"][name], moments.kbar_mu[name] - moments.kbar_p[name], rtol=1e-5, atol=1e-7
        )


def test_a_second_position_sums_first_moments_as_arrays(model):
    layout = HeadLayout.of(model)
    inputs = _inputs(model, reward=False)
    sums = MomentSums(layout.names, layout.shapes)
    moments = [position_moments(model, inputs, Method(), memory_budget_bytes=BUDGET) for _ in range(2)]
    for m in moments:
        sums.add(m)
    for name in layout.names:
        assert isinstance(sums.sums["common"].entry(name), torch.Tensor)
        torch.testing.assert_close(
            sums.sums["common"][name], 2 * moments[0].kbar_p[name], rtol=1e-5, atol=1e-7
        )


def test_the_bound_sums_each_positions_own_fisher_when_the_first_has_none(model):
    """A response whose first position's mu is one-hot (no Fisher, no bound) and whose later ones are not:
    the bound is sum_t std_t sqrt(fisher_t), each read off its own position's Fisher, never off the
    running sum that later positions add into."""
    layout = HeadLayout.of(model)
    inputs = _inputs(model, reward=True)
    moments = [position_moments(model, inputs, Method(), memory_budget_bytes=BUDGET) for _ in range(3)]
    first = moments[0]
    first.fisher = {name: torch.zeros_like(value) for name, value in first.fisher.items()}
    first.fisher_zero = True
    expected = {
        name: sum(m.reward_std * m.fisher[name].clamp_min(0).sqrt() for m in moments[1:])
        for name in layout.names
    }
    sums = MomentSums(layout.names, layout.shapes)
    for m in moments:
        sums.add(m)
    for name in layout.names:
        torch.testing.assert_close(sums.stat("bound", name), expected[name])


def _close(found, expected, where: str = "summary") -> None:
    """Equal summaries: floats within float64 summation order (pieces add their sums in another
    order), everything else exactly."""
    if isinstance(expected, dict):
        assert found.keys() == expected.keys(), where
        for key in expected:
            _close(found[key], expected[key], f"{where}.{key}")
    elif isinstance(expected, list):
        assert len(found) == len(expected), where
        for k, (a, b) in enumerate(zip(found, expected, strict=True)):
            _close(a, b, f"{where}[{k}]")
    elif isinstance(expected, float):
        assert math.isclose(found, expected, rel_tol=1e-12, abs_tol=1e-300), (where, found, expected)
    else:
        assert found == expected, where


def _position_sums(model, positions: int) -> tuple[MomentSums, HeadLayout]:
    layout = HeadLayout.of(model)
    ids = torch.tensor([3, 5, 8, 3, 11])
    logits = model(input_ids=ids[None]).logits[0, -1].detach().double()
    p = torch.softmax(logits, -1)
    mu = torch.softmax(logits / 0.7, -1)
    rewards = torch.linspace(-1, 1, p.numel(), dtype=torch.float64)
    inputs = PositionInputs(ids, p, mu, rewards, on_policy=False, fisher_under_p=True)
    sums = MomentSums(layout.names, layout.shapes)
    for _ in range(positions):
        sums.add(position_moments(model, inputs, Method(), memory_budget_bytes=BUDGET))
    return sums, layout


@pytest.mark.parametrize(
    ("family", "tied", "positions"),
    [("llama", True, 1), ("gpt2", True, 1), ("qwen3_moe", False, 1), ("llama", True, 2)],
)
def test_a_summary_read_in_blocks_of_rows_is_the_whole_tensors_summary(family, tied, positions, monkeypatch):
    """Large tensors are summarized a block of rows at a time (``MomentSums.in_pieces``): the tied
    head's outer product and looked-up rows, a transposed use (GPT-2's Conv1D), routed experts' slices,
    and arrays summed over positions, cut into blocks, give the summary of the whole tensors."""
    model = tiny_model(family, tied=tied)
    sums, layout = _position_sums(model, positions)
    whole = model_summary(sums, layout.head_name, layout.embedding_name, CURVE_STATS)
    monkeypatch.setattr(first_moments, "PIECE_VALUES", 40)  # every matrix in blocks of a few rows
    pieces, of_tensor = sums.in_pieces()
    assert len(pieces.names) > 3 * len(sums.names)
    assert {piece.tensor for piece in of_tensor.values()} == set(sums.names)
    in_blocks = model_summary(sums, layout.head_name, layout.embedding_name, CURVE_STATS)
    _close(in_blocks, whole)
    assert whole["overlap"] is not None and whole["top_coordinates"]["policy_grad"]


def test_a_small_form_in_rows_is_those_rows_of_the_tensor(monkeypatch):
    model = tiny_model("qwen3_moe", tied=False)
    sums, _ = _position_sums(model, 1)
    monkeypatch.setattr(first_moments, "PIECE_VALUES", 40)
    pieces, of_tensor = sums.in_pieces()
    for key in ("common", "mean_shift", "policy_grad", "bound"):
        for name, piece in of_tensor.items():
            if piece.rows is None:
                continue
            start, stop = piece.rows
            torch.testing.assert_close(
                pieces.sums[key][name], sums.sums[key][piece.tensor][start:stop], rtol=1e-12, atol=1e-15
            )


@pytest.mark.parametrize(("family", "tied"), [("llama", True), ("qwen3_moe", False)])
def test_the_certificate_compares_large_tensors_in_blocks_of_rows(family, tied, monkeypatch):
    """The certificate forms a large tensor's sides a block of rows at a time: it passes the same, at
    the same rounding level, on a tied head (outer product and looked-up rows) and routed experts."""
    model = tiny_model(family, tied=tied)
    whole = certify(model, BUDGET)
    monkeypatch.setattr(first_moments, "PIECE_VALUES", 40)
    in_blocks = certify(model, BUDGET)
    assert whole.passed and in_blocks.passed
    assert in_blocks.first_moment_error < 1e-12 and in_blocks.square_error < 1e-12
    assert in_blocks.worst_parameter in dict(model.named_parameters())


def test_non_finite_counts_add_up_over_blocks_of_rows(monkeypatch):
    def reason() -> str:
        model = tiny_model("llama", dtype=torch.float32)
        with torch.no_grad():
            model.model.layers[1].mlp.down_proj.weight.mul_(1e37)  # logits survive the final norm
        return certify(model, BUDGET).reason

    whole = reason()
    monkeypatch.setattr(first_moments, "PIECE_VALUES", 40)
    assert reason() == whole and "are not finite" in whole and " of " in whole


@pytest.mark.parametrize(
    ("family", "tied"), [("llama", True), ("gpt2", True), ("qwen3_moe", False), ("qwen2", False)]
)
def test_a_small_forms_sum_of_squares_is_the_formed_tensors(family, tied, monkeypatch):
    """The square totals of first moments come from their terms' Gram matrices (never formed): the tied
    head's outer product with the looked-up rows, transposed uses, routed experts' slices, a mean shift
    (a difference of two first moments), and blocks of rows of each."""
    model = tiny_model(family, tied=tied)
    sums, _ = _position_sums(model, 1)
    monkeypatch.setattr(first_moments, "PIECE_VALUES", 40)
    pieces, _ = sums.in_pieces()
    from_terms = 0
    for table in (sums, pieces):
        for key in ("common", "mean_shift", "policy_grad"):
            at_once = first_moments.square_sums(table.sums[key].entries)  # batched over tensors
            for name, entry in table.sums[key].entries.items():
                assert isinstance(entry, Factored)
                formed = float(entry.form().double().square().sum())
                if at_once[name] is not None:
                    assert math.isclose(at_once[name], formed, rel_tol=1e-9, abs_tol=1e-300), (key, name)
                found = entry.square_sum()
                if found is None:  # a whole array among its terms (a norm's or bias's gradient)
                    assert any(isinstance(t, first_moments.Whole | first_moments.Root) for t in entry.terms)
                    continue
                assert math.isclose(found, formed, rel_tol=1e-9, abs_tol=1e-300), (key, name)
                from_terms += 1
    assert from_terms > len(sums.names)
    # and the summary's square totals, now from the terms, are the formed tensors'
    layout = HeadLayout.of(model)
    summary = model_summary(sums, layout.head_name, layout.embedding_name, CURVE_STATS)
    for key, stat in (("common_sq", "common"), ("mean_shift_sq", "mean_shift")):
        formed = sum(float(sums.stat(stat, name).double().square().sum()) for name in sums.names)
        assert math.isclose(summary["totals"][key], formed, rel_tol=1e-9)


def test_a_responses_squared_first_moments_formed_in_blocks_of_rows_are_the_whole_tensors(monkeypatch):
    """From the second pass on, a response's squared first moments are formed a block of rows at a time
    into one buffer (``formed_in_pieces``): the sums of squares equal those formed whole."""
    model = tiny_llama(tied=True)
    prefix, response = torch.tensor([3, 5, 8, 7]), torch.tensor([9, 4, 2])

    def squares() -> dict[str, dict[str, torch.Tensor]]:
        result = analyze_sequence(
            model, prefix, response, Sampler(temperature=0.7, top_k=6), Method(),
            memory_budget_bytes=BUDGET, on_partial=lambda snapshot, kept: None,
        )  # fmt: skip
        return {key: dict(result.sums.sums[key].entries) for key in ("mean_shift_sq", "kbar_mu_sq")}

    whole = squares()
    monkeypatch.setattr(first_moments, "PIECE_VALUES", 40)  # every matrix in blocks of a few rows
    in_blocks = squares()
    for key, table in whole.items():
        assert table.keys() == in_blocks[key].keys()
        for name, value in table.items():
            torch.testing.assert_close(in_blocks[key][name], value, rtol=1e-12, atol=1e-15)


def test_a_studys_mean_shift_added_in_blocks_of_rows_is_the_whole_tensors(monkeypatch):
    """A study adds each context's mean shift and its square a block of rows at a time from one buffer:
    the running sums equal those of the whole tensors."""
    model = tiny_llama(tied=True)
    spec = StudySpec(Sampler(temperature=0.8, top_k=5), samples=2, max_tokens=2, seed=7)
    prompts = [EncodedPrompt(0, 1, [2, 5, 8], "odd", None)]
    study_model = StudyModel(model, lambda ids: " ".join(map(str, ids)), set())

    def sums() -> StudySums:
        return run_study_part(study_model, spec, prompts, memory_budget_bytes=BUDGET).sums

    whole = sums()
    monkeypatch.setattr(first_moments, "PIECE_VALUES", 40)
    in_blocks = sums()
    for stat in (StudyStat.mean_shift, StudyStat.mean_shift_sq, StudyStat.fisher):
        for name, value in whole.iter_stat(stat):
            torch.testing.assert_close(in_blocks.stat(stat, name), value, rtol=1e-12, atol=1e-15)


def _response(model, storage: SumsStorage | None, first_pass: bool, workspace: int, tokens: int = 3):
    """An off-policy response (the Fisher, the first moments and their squares summed over positions;
    without a first pass, with a reward: its policy gradient and bound too), from the tensors alone:
    its sums. ``tokens`` 0: the prefix of its last position, alone."""
    ids = torch.tensor([3, 5, 8, 3, 11, 7, 2, 9])
    prefix, continuation = ids[: 8 - max(tokens, 1)], ids[8 - tokens :]
    vocab = model.get_output_embeddings().weight.shape[0]
    # a first pass with a reward forms the Fisher of the positions it back-propagates together
    reward = None if first_pass else torch.linspace(-1, 1, vocab, dtype=torch.float64)
    analysis = analyze_sequence(
        model, prefix, continuation, Sampler(temperature=0.7), Method(), reward,
        memory_budget_bytes=workspace, fisher_under_p=False, sums_storage=storage,
        on_partial=(lambda snapshot, kept: None) if first_pass else None,
    )  # fmt: skip
    return analysis.sums


@pytest.mark.parametrize("first_pass", [False, True])
def test_a_responses_sums_beyond_their_budget_are_mapped_files(model, tmp_path, monkeypatch, first_pass):
    """The memory rule along a response: its sums over positions (up to seven parameter-sized arrays) live
    in memory-mapped files beyond the storage's budget, so the process's own arrays are one position's
    Fisher and a workspace, as a prefix's; the sums are bit for bit those kept in memory, and no file
    is left in the folder."""
    parameter_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    largest = max(p.numel() * p.element_size() for p in model.parameters())
    monkeypatch.setattr(first_moments, "FORMED_KEPT_BYTES", 2 * largest)
    workspace = 2 * largest
    # each run makes its own scratch buffers: one kept from an earlier analysis in this process (of any
    # model) would be counted at its own size where a run first writes into it
    monkeypatch.setattr(summary_scratch, "free", {})
    with LiveArrays(model.parameters()) as in_memory:
        expected = _response(model, None, first_pass, workspace)
    storage = SumsStorage(tmp_path / "sums", memory_bytes=0)
    monkeypatch.setattr(summary_scratch, "free", {})
    with LiveArrays(model.parameters()) as counted:
        found = _response(model, storage, first_pass, workspace)
    monkeypatch.setattr(summary_scratch, "free", {})
    with LiveArrays(model.parameters()) as one_position:
        _response(model, None, first_pass, workspace, tokens=0)
    assert found.sums.keys() == expected.sums.keys()
    for key, table in found.sums.items():
        for name in found.names:
            value = table[name]
            assert value.untyped_storage().filename is not None, (key, name)
            assert torch.equal(value, expected.sums[key][name]), (key, name)
    assert storage.in_memory == 0
    assert storage.mapped == len(found.sums) * parameter_bytes
    assert list((tmp_path / "sums").iterdir()) == []  # unlinked once mapped
    # kept in memory the sums were most of the peak; mapped, what is left is what the response's longest
    # context holds as a prefix (its Fisher, its first moments' small forms, a workspace), and what a
    # first pass keeps for the exact pass (within a workspace again)
    assert in_memory.peak > 5 * parameter_bytes, in_memory.peak / parameter_bytes
    kept = workspace if first_pass else 0
    assert counted.peak <= one_position.peak + kept + 2 * largest, (counted.peak, one_position.peak)


def test_a_storage_keeps_sums_in_memory_within_its_budget(tmp_path):
    names, shapes = ["a", "b"], {"a": (3, 4), "b": (5,)}
    table_bytes = 17 * 4
    storage = SumsStorage(tmp_path, memory_bytes=2 * table_bytes)
    tables = [storage.table(stat, names, shapes, torch.float32, torch.device("cpu")) for stat in "xyz"]
    assert tables[:2] == [None, None]  # in memory: each sum an array of its own
    assert (storage.in_memory, storage.mapped) == (2 * table_bytes, table_bytes)
    mapped = tables[2]
    assert mapped is not None
    assert {name: tuple(value.shape) for name, value in mapped.items()} == shapes  # views of one file
    assert all(value.untyped_storage().filename is not None for value in mapped.values())
    assert all(not value.any() for value in mapped.values())  # zeros


def test_a_folder_without_room_for_a_sum_is_a_clear_error(tmp_path, monkeypatch):
    """The blocks are reserved before the file is mapped: a disk without room is an error that says what
    to change, not a SIGBUS at the first write; nothing is left in the folder."""

    def full(descriptor, offset, length):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "posix_fallocate", full)
    storage = SumsStorage(tmp_path, memory_bytes=0)
    with pytest.raises(NoRoomForSums, match="no room for .* GB of sums .*FISHERSCOPE_SUMS_DIR"):
        storage.table("fisher", ["a"], {"a": (1000, 1000)}, torch.float32, torch.device("cpu"))
    assert list(tmp_path.iterdir()) == []
