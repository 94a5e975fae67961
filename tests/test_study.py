"""Studies (docs/design.md §7) against float64 brute force, their masks against direct set computations, the
Monte Carlo Fisher's convergence, and ``fisherscope study`` end to end with its bad-input errors."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from backend.mask_files import MaskFile, MaskFileError, compare_mask_files, mask_heatmap
from backend.rewards import RewardKind, RewardRule
from tests.test_cli import assert_one_line_error, run_cli
from tests.tiny_models import BUDGET, tiny_model
from workers.fisher.reference import brute_force_logit_sensitivities, brute_force_moments
from workers.fisher.sampler import Sampler, uniform_distribution, warped_distribution
from workers.fisher.study import StudyStat, StudySums, relative_l2_error
from workers.studies.files import read_masks, read_part, write_masks, write_part
from workers.studies.masks import compare_levels, level_map
from workers.studies.prompts import EncodedPrompt
from workers.studies.runner import StudyModel, StudyPart, merge_parts, run_study_part
from workers.studies.spec import CompareAt, StudySpec
from workers.studies.summary import finish_study

EOS = 3  # the tiny models' eos_token_id
Table = dict[str, dict[str, torch.Tensor]]


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny models: on a machine with few cores the hand-off between threads costs more than each
    tiny matmul, so these tests run on one."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _decode(ids: list[int]) -> str:
    """Token ids as text: a reward on the decoded response reads them."""
    return " ".join(str(i) for i in ids)


def _accumulate(table: Table, stat: str, name: str, value: torch.Tensor) -> None:
    slot = table.setdefault(stat, {})
    slot[name] = slot[name] + value if name in slot else value.clone()


class BruteForce:
    """Brute-force sensitivities per context, each computed once (the prompt is every response's first)."""

    def __init__(self, model) -> None:
        self.model = model
        self.cache: dict[tuple[int, ...], tuple[torch.Tensor, dict[str, torch.Tensor]]] = {}

    def __call__(self, ids: list[int]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        if tuple(ids) not in self.cache:
            self.cache[tuple(ids)] = brute_force_logit_sensitivities(self.model, torch.tensor(ids))
        return self.cache[tuple(ids)]

    def fisher_total(self, ids: list[int], distribution) -> float:
        logits, kappa = self(ids)
        moments = brute_force_moments(kappa, torch.softmax(logits, -1), distribution(logits), None)
        return sum(float(v.sum()) for v in moments["fisher"].values())

    def positions(self, prompt: list[int], tokens: list[int], sampler, table: Table | None) -> dict:
        """Per position of ``tokens`` after ``prompt``: the moments into ``table`` (when given); returns the
        sequence score sum_t (kappa[y_t] - kbar^p_t) = d log pi(tokens | prompt) / dtheta."""
        score: dict[str, torch.Tensor] = {}
        for t, token in enumerate(tokens):
            logits, kappa = self(prompt + tokens[:t])
            p = torch.softmax(logits, -1)
            if table is not None:
                moments = brute_force_moments(kappa, p, sampler(logits), None)
                for stat in ("fisher", "uncentered", "mean_shift"):
                    for name, value in moments[stat].items():
                        _accumulate(table, stat, name, value)
            for name, k in kappa.items():
                step = k[token] - torch.tensordot(p, k, dims=1)
                score[name] = score[name] + step if name in score else step
        return score

    def study(self, part: StudyPart, prompts: list[EncodedPrompt], sampler) -> Table:
        """Every study sum from explicit per-token gradients at every sampled position."""
        expected: Table = {}
        for prompt in prompts:
            records = [r for r in part.responses if r.prompt_index == prompt.index]
            rewards = [r.reward or 0.0 for r in records]
            mean = sum(rewards) / len(rewards)
            for record, reward in zip(records, rewards, strict=True):
                score = self.positions(prompt.input_ids, record.continuation_ids, sampler, expected)
                for name, value in score.items():
                    _accumulate(expected, StudyStat.mc_fisher, name, value.square())
                    if record.reward is not None:
                        _accumulate(expected, StudyStat.policy_gradient, name, (reward - mean) * value)
            if prompt.target_ids:
                score = self.positions(prompt.input_ids, prompt.target_ids, sampler, None)
                for name, value in score.items():
                    _accumulate(expected, StudyStat.empirical_fisher, name, value.square())
        return expected


def _labelled(label: str):
    def message(detail: str) -> str:
        return f"{label}: {detail}"

    return message


def _on_policy(logits):
    return torch.softmax(logits, -1)


def _uniform(logits):
    return uniform_distribution(logits.numel())


def _top_k(logits):
    return warped_distribution(logits, 0.8, 5, 1.0)


SAMPLERS = {
    "on_policy": (Sampler(), _on_policy),
    "top_k": (Sampler(temperature=0.8, top_k=5), _top_k),
}
PROMPTS = [EncodedPrompt(0, 1, [2, 5, 8], "odd", [7, 4]), EncodedPrompt(1, 2, [2, 9], "odd", None)]
PARITY = RewardRule(RewardKind.regex, "[13579]$")  # 1 when the last token id is odd


# seeds whose two responses differ in reward (so the policy gradient is not zero); all but the last
# share their first sampled token, so contexts beyond the prompt are shared too
CASES = [("llama", True, "on_policy", 10), ("llama", True, "top_k", 7), ("qwen3", False, "top_k", 5)]
CASES += [("qwen3", True, "on_policy", 0)]


@pytest.mark.usefixtures("float64_reference")
@pytest.mark.parametrize(("family", "tied", "sampler", "seed"), CASES)
def test_study_sums_equal_the_brute_force_sum_over_sampled_positions(family, tied, sampler, seed):
    model = tiny_model(family, tied=tied)
    config, distribution = SAMPLERS[sampler]
    spec = StudySpec(config, samples=2, max_tokens=2, seed=seed, reward=PARITY)
    prompts = PROMPTS[:1]
    part = run_study_part(StudyModel(model, _decode, {EOS}), spec, prompts, memory_budget_bytes=BUDGET)
    assert sorted(r.reward or 0.0 for r in part.responses) == [0.0, 1.0]
    brute = BruteForce(model)
    expected = brute.study(part, prompts, distribution)
    assert set(expected) == {
        "fisher",
        "uncentered",
        "mean_shift",
        "mc_fisher",
        "policy_gradient",
        "empirical_fisher",
    }
    for stat, table in expected.items():
        scale = max(float(v.abs().max()) for v in table.values())
        for name, want in table.items():
            torch.testing.assert_close(
                part.sums.stat(stat, name),
                want,
                rtol=1e-9,
                atol=1e-12 * scale,
                msg=_labelled(f"{stat} {name}"),
            )
    assert part.sums.has(StudyStat.mean_shift) == (sampler != "on_policy")
    # at the prompt, the Fisher under the sampler, the model and uniform (counted once per response)
    compared = part.prompts[0].compared
    for key, reference in (("fisher", distribution), ("model", _on_policy), ("uniform", _uniform)):
        total = spec.samples * brute.fisher_total(prompts[0].input_ids, reference)
        assert compared[key] == pytest.approx(total, rel=1e-9), key
    for record in part.responses:
        per_position: Table = {}
        brute.positions(record.input_ids, record.continuation_ids, distribution, per_position)
        for key in ("fisher", "uncentered"):
            total = sum(float(v.sum()) for v in per_position[key].values())
            assert record.totals[key] == pytest.approx(total, rel=1e-9), key


def _cheap_spec(seed: int) -> StudySpec:
    return StudySpec(Sampler(top_k=3), samples=2, max_tokens=2, seed=seed, compare_at=CompareAt.none)


def test_same_seed_same_responses_whatever_the_split(tmp_path):
    """Parts of disjoint prompts, run in any order and passed through files, add up to the whole."""
    model = tiny_model("llama", tied=True)
    study_model = StudyModel(model, _decode, {EOS})
    whole = run_study_part(study_model, _cheap_spec(11), PROMPTS, memory_budget_bytes=BUDGET)
    parts = [
        run_study_part(study_model, _cheap_spec(11), [prompt], memory_budget_bytes=BUDGET)
        for prompt in reversed(PROMPTS)
    ]
    for i, part in enumerate(parts):
        write_part(tmp_path / f"part{i}.safetensors", part)
    merged = merge_parts([read_part(tmp_path / f"part{i}.safetensors") for i in range(len(parts))])
    assert [(r.prompt_index, r.continuation_ids) for r in merged.responses] == [
        (r.prompt_index, r.continuation_ids) for r in whole.responses
    ]
    assert (merged.sums.responses, merged.sums.positions) == (whole.sums.responses, whole.sums.positions)
    for stat in ("fisher", "uncentered", "mean_shift", "mc_fisher", "empirical_fisher"):
        for name in whole.sums.names:
            torch.testing.assert_close(merged.sums.stat(stat, name), whole.sums.stat(stat, name))
    other = run_study_part(study_model, _cheap_spec(12), PROMPTS[:1], memory_budget_bytes=BUDGET)
    assert [r.continuation_ids for r in other.responses] != [r.continuation_ids for r in whole.responses[:2]]


def test_running_sums_in_memory_mapped_files_equal_those_in_memory(tmp_path):
    """A study's sums in files of a folder (the kernel may write them out under memory pressure) add up
    to the same numbers, and leave nothing in the folder."""
    model = tiny_model("llama", tied=True, dtype=torch.float32)
    study_model = StudyModel(model, _decode, {EOS})
    spec = StudySpec(
        Sampler(temperature=0.7, top_k=3), samples=2, max_tokens=2, seed=5, compare_at=CompareAt.none
    )
    in_memory = run_study_part(study_model, spec, PROMPTS, memory_budget_bytes=BUDGET)
    mapped = run_study_part(
        study_model, spec, PROMPTS, memory_budget_bytes=BUDGET, sums_folder=tmp_path / "sums"
    )
    assert set(mapped.sums.sums) == set(in_memory.sums.sums) and len(mapped.sums.sums) >= 5
    for stat in mapped.sums.sums:
        for name in mapped.sums.names:
            torch.testing.assert_close(mapped.sums.stat(stat, name), in_memory.sums.stat(stat, name))
    assert not any((tmp_path / "sums").iterdir())  # unlinked once mapped
    # a part written from mapped sums reads back the same
    write_part(tmp_path / "part.safetensors", mapped)
    again = read_part(tmp_path / "part.safetensors")
    for name in mapped.sums.names:
        torch.testing.assert_close(again.sums.stat("fisher", name), in_memory.sums.stat("fisher", name))


def _hand_made_part(values: dict[str, torch.Tensor]) -> StudyPart:
    """A part whose F is ``values`` (for mask tests: no model needed)."""
    sums = StudySums(
        list(values), {n: tuple(v.shape) for n, v in values.items()}, torch.float64, torch.device("cpu")
    )
    sums.add(StudyStat.fisher, values)
    sums.responses = 1
    return StudyPart(sums, head_name="lm_head.weight", embedding_name="model.embed_tokens.weight")


TIED_VALUES = {  # few distinct values: many ties at every threshold
    "model.embed_tokens.weight": torch.tensor([[2.0, 0.0, 1.0], [1.0, 2.0, 0.0]]),
    "model.layers.0.mlp.down_proj.weight": torch.tensor([[1.0, 1.0], [0.0, 2.0], [2.0, 1.0]]),
    "model.norm.weight": torch.tensor([0.0, 2.0, 1.0, 1.0, 0.0]),
    "lm_head.weight": torch.tensor([[3.0, 1.0, 0.0, 2.0]]),
}
FRACTIONS = (0.1, 0.3, 0.5)
HAND_MADE_MODEL = {  # what the summary records of a model (workers.studies.runner.model_meta)
    "id": "hand-made",
    "digest": "sha256:0",
    "n_params": sum(v.numel() for v in TIED_VALUES.values()),
    "d_model": 3,
    "vocab_size": 2,
    "architecture": "none",
    "dtype": "float64",
}


def _reference_mask(values: dict[str, torch.Tensor], q: float) -> set[int]:
    """The top ceil(qP) coordinates by value, the lower index first among equal values."""
    flat = torch.cat([v.reshape(-1) for v in values.values()]).tolist()
    order = sorted(range(len(flat)), key=lambda i: (-flat[i], i))
    return set(order[: math.ceil(q * len(flat))])


def _flat_members(masks: dict[str, torch.Tensor], names) -> set[int]:
    flat = torch.cat([masks[name].reshape(-1) for name in names])
    return set(flat.nonzero().flatten().tolist())


def _write_hand_made_masks(path: Path, values: dict[str, torch.Tensor]) -> None:
    part = _hand_made_part(values)
    spec = StudySpec(Sampler(), fractions=FRACTIONS, compare_at=CompareAt.none)
    finished = finish_study(part, spec, HAND_MADE_MODEL)
    write_masks(path, finished, part, spec)


def test_mask_file_holds_exactly_ceil_qP_ones_ties_by_index_and_round_trips(tmp_path):
    path = tmp_path / "masks.safetensors"
    _write_hand_made_masks(path, TIED_VALUES)
    masks, metadata = read_masks(path)
    assert sorted(masks) == list(FRACTIONS)
    total = sum(v.numel() for v in TIED_VALUES.values())
    counts = json.loads(metadata["counts"])
    for q in FRACTIONS:
        assert all(
            masks[q][n].dtype == torch.uint8 and masks[q][n].shape == v.shape for n, v in TIED_VALUES.items()
        )
        members = _flat_members(masks[q], TIED_VALUES)
        assert len(members) == math.ceil(q * total)
        assert members == _reference_mask(TIED_VALUES, q)
        assert counts[f"{q:g}"] == {n: int(masks[q][n].sum()) for n in TIED_VALUES}
    with safe_open(str(path), framework="pt") as handle:
        assert "q0.3/model.layers.0.mlp.down_proj.weight" in handle.keys()  # noqa: SIM118
    assert metadata["model_id"] == "hand-made" and metadata["digest"] == "sha256:0"
    assert (
        metadata["polarity"].startswith("1 = in the mask") and "0 = outside the mask" in metadata["polarity"]
    )


def test_overlap_and_jaccard_equal_a_direct_set_computation(tmp_path):
    generator = torch.Generator().manual_seed(3)
    other = {n: torch.rand(v.shape, generator=generator, dtype=torch.float64) for n, v in TIED_VALUES.items()}
    _write_hand_made_masks(tmp_path / "a.safetensors", TIED_VALUES)
    _write_hand_made_masks(tmp_path / "b.safetensors", other)
    from_files = compare_mask_files(
        MaskFile.open(tmp_path / "a.safetensors"), MaskFile.open(tmp_path / "b.safetensors")
    )
    sums_a, sums_b = _hand_made_part(TIED_VALUES).sums, _hand_made_part(other).sums
    from_levels = compare_levels(
        level_map(sums_a, StudyStat.fisher, FRACTIONS),
        level_map(sums_b, StudyStat.fisher, FRACTIONS),
        FRACTIONS,
    )
    for i, q in enumerate(FRACTIONS):
        a, b = _reference_mask(TIED_VALUES, q), _reference_mask(other, q)
        for result in (from_files, from_levels):
            assert result["overlap"][i] == pytest.approx(len(a & b) / len(a))
            assert result["jaccard"][i] == pytest.approx(len(a & b) / len(a | b))
            assert result["chance_overlap"][i] == pytest.approx(q)
            assert result["chance_jaccard"][i] == pytest.approx(q / (2 - q))


def test_mask_heatmap_counts_each_block_of_the_mask(tmp_path):
    path = tmp_path / "masks.safetensors"
    _write_hand_made_masks(path, TIED_VALUES)
    masks = MaskFile.open(path)
    assert masks.fractions == list(FRACTIONS) and masks.shapes == {
        n: tuple(v.shape) for n, v in TIED_VALUES.items()
    }
    for name in TIED_VALUES:
        mask = masks.mask(0.3, name)
        view = mask_heatmap(mask, rows=3, cols=2)
        matrix = mask.reshape(1, -1) if mask.ndim == 1 else mask
        rows, cols = view["row_edges"], view["col_edges"]
        assert rows[0] == 0 and rows[-1] == matrix.shape[0] and cols[0] == 0 and cols[-1] == matrix.shape[1]
        for i in range(len(rows) - 1):
            for j in range(len(cols) - 1):
                block = matrix[rows[i] : rows[i + 1], cols[j] : cols[j + 1]]
                assert view["values"][i][j] == int(block.sum())
        assert sum(map(sum, view["values"])) == int(mask.sum()) == int(_flat_count(masks, name))


def _flat_count(masks: MaskFile, name: str) -> int:
    return json.loads(masks.metadata["counts"])["0.3"][name]


def test_mask_files_that_cannot_be_compared_say_why(tmp_path):
    _write_hand_made_masks(tmp_path / "a.safetensors", TIED_VALUES)
    fewer = {n: v for n, v in TIED_VALUES.items() if "down_proj" not in n}
    _write_hand_made_masks(tmp_path / "b.safetensors", fewer)
    with pytest.raises(MaskFileError, match="different parameters"):
        compare_mask_files(
            MaskFile.open(tmp_path / "a.safetensors"), MaskFile.open(tmp_path / "b.safetensors")
        )
    with pytest.raises(MaskFileError, match="no mask of density 0.02; this file holds"):
        MaskFile.open(tmp_path / "a.safetensors").mask(0.02, next(iter(TIED_VALUES)))
    save_file({"F/w": torch.zeros(2)}, str(tmp_path / "arrays.safetensors"))
    with pytest.raises(MaskFileError, match="not a mask key"):
        MaskFile.open(tmp_path / "arrays.safetensors")
    (tmp_path / "junk.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(MaskFileError, match="not a readable safetensors file"):
        MaskFile.open(tmp_path / "junk.safetensors")


def test_monte_carlo_fisher_converges_to_the_exact_fisher():
    """One-token responses on-policy: E_y[score^2] is the prompt's Fisher, which F holds exactly."""
    model = tiny_model("llama", tied=True)
    errors = []
    for samples in (16, 128):
        spec = StudySpec(Sampler(), samples=samples, max_tokens=1, seed=samples, compare_at=CompareAt.none)
        part = run_study_part(
            StudyModel(model, _decode, {EOS}), spec, PROMPTS[:1], memory_budget_bytes=BUDGET
        )
        assert part.sums.contexts == 1  # the prompt, computed once for every response
        errors.append(relative_l2_error(part.sums, StudyStat.mc_fisher, samples, StudyStat.fisher, samples))
    assert errors[1] < errors[0] / 2, errors  # ~1/sqrt(S): 8x the samples, ~1/2.8 the error
    assert errors[1] < 0.1, errors


# ---------------------------------------------------------------- the CLI


def _write_jsonl(path: Path, *items: object) -> Path:
    path.write_text("".join((item if isinstance(item, str) else json.dumps(item)) + "\n" for item in items))
    return path


def test_cli_study_end_to_end(capsys, tmp_path, tiny_random):
    prompts = _write_jsonl(
        tmp_path / "prompts.jsonl",
        {"prompt": "The Fisher says", "target": " where"},
        "",
        {"prompt": "She drank a cup of", "target": " tea"},
    )
    outputs = {
        name: tmp_path / f"{name}.{ext}"
        for name, ext in (("masks", "st"), ("summary", "json"), ("save", "st"))
    }
    argv = [
        "study",
        "--model",
        "tiny-random",
        "--prompts",
        str(prompts),
        "--samples",
        "2",
        "--max-tokens",
        "2",
    ]
    argv += ["--top-k", "4", "--seed", "3", "--reward-regex", "{target}", "--q", "0.001,0.01"]
    argv += [item for name, path in outputs.items() for item in (f"--{name}", str(path))]
    code, out, err = run_cli(capsys, *argv)
    assert code == 0, err
    assert "top-1% F vs top-1% |policy gradient|" in out
    summary = json.loads(outputs["summary"].read_text())
    assert [(r["prompt_index"], len(r["input_ids"])) for r in summary["responses"]][::2] == [
        (0, len(tiny_random.tokenizer.encode("The Fisher says").ids)),
        (1, len(tiny_random.tokenizer.encode("She drank a cup of").ids)),
    ]
    assert all(1 <= len(r["continuation_ids"]) <= 2 for r in summary["responses"])
    assert [p["line"] for p in summary["prompts"]] == [1, 3]
    assert summary["estimators"]["mc_fisher"]["top_q_vs_fisher"]["chance_overlap"] == [0.001, 0.01]
    assert summary["paper"]["model_vs_uniform"]["ratio_model_to_uniform"] > 0
    n_params = tiny_random.info.n_params
    masks, metadata = read_masks(outputs["masks"])
    for q in (0.001, 0.01):
        assert sum(int(m.sum()) for m in masks[q].values()) == math.ceil(q * n_params)
        assert summary["masks"]["by_q"][f"{q:g}"]["count"] == math.ceil(q * n_params)
    assert "model.layers.0.mlp.down_proj.weight" in masks[0.01]
    assert metadata["model_id"] == "tiny-random" and metadata["digest"] == tiny_random.info.digest
    kinds = summary["masks"]["by_q"]["0.01"]["kinds"]
    assert sum(g["share_of_mask"] for g in kinds) == pytest.approx(1.0)
    names = [n for n, _ in tiny_random.model.named_parameters()]
    with safe_open(str(outputs["save"]), framework="pt") as handle:
        keys = set(handle.keys())  # noqa: SIM118
        assert {f"{s}/{n}" for s in "FUM" for n in names} <= keys
        assert (
            handle.get_tensor("continuation_ids/1/0").tolist() == summary["responses"][2]["continuation_ids"]
        )
    _check_cli_masks(capsys, argv, outputs["masks"], tmp_path, n_params)


def _check_cli_masks(capsys, argv: list[str], masks: Path, tmp_path: Path, n_params: int) -> None:
    """``fisherscope masks``: what a file holds, and a second sampler's study compared with the first."""
    code, out, err = run_cli(capsys, "masks", "info", str(masks))
    assert code == 0, err
    assert "model: tiny-random" in out and f"{math.ceil(0.01 * n_params):,}" in out
    other = tmp_path / "other.st"
    study = [*argv[: argv.index("--top-k")], "--top-k", "2", "--seed", "3", "--q", "0.01,0.05"]
    code, _, err = run_cli(capsys, *study, "--masks", str(other), "--summary", str(tmp_path / "o.json"))
    assert code == 0, err
    code, out, err = run_cli(capsys, "masks", "compare", str(masks), str(other), "--json")
    assert code == 0, err
    compared = json.loads(out)
    first, second = read_masks(masks)[0][0.01], read_masks(other)[0][0.01]
    a = torch.cat([first[n].reshape(-1) for n in sorted(first)]).bool()
    b = torch.cat([second[n].reshape(-1) for n in sorted(first)]).bool()
    assert compared["q"] == [0.01] and compared["chance_overlap"] == [0.01]
    assert compared["overlap"] == [pytest.approx(int((a & b).sum()) / int(a.sum()))]
    assert compared["jaccard"] == [pytest.approx(int((a & b).sum()) / int((a | b).sum()))]
    code, out, _ = run_cli(capsys, "masks", "compare", str(masks), str(masks))
    assert code == 0 and "100.00%" in out
    code, _, err = run_cli(capsys, "masks", "compare", str(masks), str(tmp_path / "missing.st"))
    assert_one_line_error(code, err, "missing.st: no such file")
    code, _, err = run_cli(capsys, "masks", "info", str(tmp_path / "o.json"))
    assert_one_line_error(code, err, "not a readable safetensors file")


BAD_INPUTS: dict[str, tuple[list, list[str], str]] = {
    "empty": ([""], [], "has no prompts"),
    "not_json": ([{"prompt": "a"}, "{prompt: b}"], [], "line 2 is not JSON"),
    "unknown_field": ([{"prompt": "a", "answer": "b"}], [], "line 1 has unknown field 'answer'"),
    "too_long": (
        [{"prompt": "a"}, {"prompt": "The Fisher says where learning can happen"}],
        ["--max-prompt-tokens", "4"],
        "line 2: the prompt is",
    ),
    "no_target": (
        [{"prompt": "a", "target": "b"}, {"prompt": "c"}],
        ["--reward-exact"],
        "line 2 has no 'target'",
    ),
    "over_budget": ([{"prompt": "a"}], ["--max-cost-tflop", "1e-12"], "cheaper --method choices"),
    "bad_pattern": ([{"prompt": "a", "target": "b"}], ["--reward-regex", "({target}"], "is not a regex"),
    "no_chat_template": ([{"prompt": "a"}], ["--chat-template"], "has no chat template"),
}


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_input_exits_2_with_one_line_and_writes_nothing(capsys, tmp_path, tiny_random, case):
    lines, extra, fragment = BAD_INPUTS[case]
    prompts = _write_jsonl(tmp_path / "prompts.jsonl", *lines)
    masks, summary = tmp_path / "masks.st", tmp_path / "summary.json"
    argv = ["study", "--model", "tiny-random", "--prompts", str(prompts), "--max-tokens", "2", *extra]
    code, _, err = run_cli(capsys, *argv, "--masks", str(masks), "--summary", str(summary))
    assert_one_line_error(code, err, fragment)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["prompts.jsonl"]
