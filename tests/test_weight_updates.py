"""``fisherscope updates``: what changed between two checkpoints, against a brute force over whole state
dicts, streamed in blocks or not, and bad input refused in one line."""

from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors.torch import load_file, save_file

from backend.mask_files import mask_key
from tests.test_cli import assert_one_line_error, run_cli
from tests.tiny_models import save_tiny_tokenizer, tiny_llama, tiny_qwen2
from workers import weight_updates
from workers.models.folder import sha256_digest, weight_files
from workers.weight_updates import compare_checkpoints

FRACTIONS = (0.01, 0.05, 0.5)  # 0.5: more than changed, so ties at |delta| = 0 are taken by index


def _save(model, folder):
    model.save_pretrained(folder, safe_serialization=True)
    save_tiny_tokenizer(folder)
    return folder


def _fine_tuned(before_folder, after_folder, seed: int = 1):
    """A copy of ``before_folder`` where some weights moved visibly, some below a bf16 step, most not."""
    import shutil

    shutil.copytree(before_folder, after_folder)
    (path,) = weight_files(after_folder)
    tensors = load_file(str(path))
    generator = torch.Generator().manual_seed(seed)
    for value in tensors.values():
        flat = value.reshape(-1)
        pick = torch.rand(flat.shape, generator=generator)
        visible = pick < 0.05
        flat[visible] += 0.1 * torch.randn(int(visible.sum()), generator=generator)
        tiny = (pick >= 0.05) & (pick < 0.15)
        flat[tiny] *= 1 + 1e-6  # moves the float32 value, rarely its bf16 rounding
    save_file(tensors, str(path), metadata={"format": "pt"})
    return after_folder


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("updates")
    before = _save(tiny_llama(tied=True, dtype=torch.float32), root / "before")
    after = _fine_tuned(before, root / "after")
    return before, after


def _flat(folder, names):
    (path,) = weight_files(folder)
    tensors = load_file(str(path))
    return {name: tensors[name].reshape(-1) for name in names}


def _masks(path, names, shapes, digest, fractions=(0.01, 0.1), seed=3):
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for q in fractions:
        for name in names:
            tensors[mask_key(q, name)] = (torch.rand(shapes[name], generator=generator) < q).to(torch.uint8)
    save_file(
        tensors, str(path), metadata={"digest": digest, "model_id": "tiny", "polarity": "1 = trainable"}
    )
    return path


def brute_force(before, after, names, fractions, masks=None):
    """Whole state dicts in memory: counts, top-q by a stable sort of |delta|, set overlaps."""
    b, a = _flat(before, names), _flat(after, names)
    changed = {n: (b[n] != a[n]) for n in names}
    changed_bf16 = {n: (b[n].bfloat16() != a[n].bfloat16()) for n in names}
    delta = torch.cat([(a[n] - b[n]).abs() for n in names])
    order = torch.argsort(-delta, stable=True)
    total = delta.numel()
    tops = {}
    for q in fractions:
        members = torch.zeros(total, dtype=torch.bool)
        members[order[: math.ceil(q * total)]] = True
        tops[q] = members
    out = {
        "tensors": {n: (int(changed[n].sum()), int(changed_bf16[n].sum())) for n in names},
        "thresholds": [float(delta[order[math.ceil(q * total) - 1]]) for q in fractions],
    }
    if masks is not None:
        sets = [torch.cat([changed[n] for n in names]), torch.cat([changed_bf16[n] for n in names])]
        sets += [tops[q] for q in fractions]
        file = load_file(str(masks))
        mask_q = sorted({float(k.split("/")[0][1:]) for k in file})
        flat_masks = [torch.cat([file[mask_key(q, n)].reshape(-1).bool() for n in names]) for q in mask_q]
        out["in_mask"] = [[int((s & m).sum()) for m in flat_masks] for s in sets]
    return out


def _layout(folder):
    return weight_updates.Checkpoint.open(str(folder)).layout()


@pytest.mark.parametrize("piece_values", [None, 100])
def test_counts_top_sets_and_overlaps_equal_a_brute_force(checkpoints, tmp_path, monkeypatch, piece_values):
    before, after = checkpoints
    if piece_values is not None:  # blocks of a few rows: the streamed path gives the same integers
        monkeypatch.setattr(weight_updates, "PIECE_VALUES", piece_values)
    layout = _layout(before)
    digest = sha256_digest(weight_files(before))
    masks = _masks(tmp_path / "m.safetensors", layout.names, layout.shapes, digest)
    summary = compare_checkpoints(str(before), str(after), FRACTIONS, masks)
    expected = brute_force(before, after, layout.names, FRACTIONS, masks)

    for name, (changed, changed_bf16) in expected["tensors"].items():
        entry = summary["tensors"][name]
        assert (entry["changed"], entry["changed_bf16"]) == (changed, changed_bf16), name
        assert entry["params"] == math.prod(layout.shapes[name])
    total = summary["total"]
    assert total["params"] == sum(math.prod(s) for s in layout.shapes.values())
    assert total["changed"] == sum(c for c, _ in expected["tensors"].values())
    # the fine-tune moved 15% of the values, two thirds of them below a bf16 step
    assert 0.1 < total["changed_share"] < 0.2
    assert total["changed_bf16"] < total["changed"]
    assert [row["threshold"] for row in summary["top_q"]] == expected["thresholds"]
    assert summary["top_q"][-1]["threshold"] == 0.0  # q = 0.5 reaches the unchanged coordinates
    rows = summary["masks"]["sets"]
    assert [row["in_mask"] for row in rows] == expected["in_mask"]
    sizes = [row["size"] for row in rows]
    assert sizes[2:] == [math.ceil(q * total["params"]) for q in FRACTIONS]
    for row in rows:  # chance beside each: an independent set of the same density
        for overlap, chance in zip(row["overlap"], row["chance_overlap"], strict=True):
            assert 0 <= overlap <= 1 and 0 < chance < 1
    by_kind = {row["group"]: row for row in summary["kinds"]}
    assert sum(row["params"] for row in by_kind.values()) == total["params"]
    assert {"head", "q", "down", "norm"} <= set(by_kind)  # tied: the table is the head


def test_identical_checkpoints_changed_nothing(checkpoints):
    before, _ = checkpoints
    summary = compare_checkpoints(str(before), str(before), (0.01,))
    assert summary["total"]["changed"] == 0 == summary["total"]["changed_bf16"]
    assert summary["top_q"][0]["threshold"] == 0.0


def test_the_cli_prints_the_table_and_writes_the_summary(checkpoints, tmp_path, capsys):
    before, after = checkpoints
    layout = _layout(before)
    masks = _masks(
        tmp_path / "m.safetensors", layout.names, layout.shapes, sha256_digest(weight_files(after))
    )
    out_file = tmp_path / "updates.json"
    code, out, err = run_cli(
        capsys, "updates", str(before), str(after), "--masks", str(masks), "--summary", str(out_file)
    )
    assert code == 0, err
    assert "changed:" in out and "visible in bf16" in out and "q=0.01" in out
    summary = json.loads(out_file.read_text())
    assert summary["masks"]["q"] == [0.01, 0.1]
    assert [row["q"] for row in summary["top_q"]] == [0.01, 0.1]  # the mask file's densities
    assert isinstance(summary["total"]["changed"], int)


def test_bad_input_is_one_line(checkpoints, tmp_path, capsys):
    before, after = checkpoints
    other = _save(tiny_qwen2(dtype=torch.float32), tmp_path / "qwen2")
    code, _, err = run_cli(capsys, "updates", str(before), str(other))
    assert_one_line_error(code, err, "not one architecture")

    layout = _layout(before)
    foreign = _masks(tmp_path / "f.safetensors", layout.names, layout.shapes, "sha256:" + "0" * 64)
    code, _, err = run_cli(capsys, "updates", str(before), str(after), "--masks", str(foreign))
    assert_one_line_error(code, err, "not of", "give a mask file from a study of this model")

    code, _, err = run_cli(capsys, "updates", str(before), str(tmp_path / "missing"))
    assert_one_line_error(code, err, "neither a model folder nor a registered id")

    code, _, err = run_cli(capsys, "updates", str(before), str(after), "--q", "0,2")
    assert_one_line_error(code, err, "--q")

    code, _, err = run_cli(capsys, "updates", str(before), str(after), "--masks", str(tmp_path / "none"))
    assert_one_line_error(code, err, "no such file")
