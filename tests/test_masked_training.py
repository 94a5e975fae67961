"""Training inside a mask: after steps of AdamW (weight decay), Adam (coupled decay), SGD (momentum) and
``transformers.Trainer``, every weight outside the mask is bit for bit unchanged and the weights inside
moved; a mask file exported as LoTA or FISH reads back as the same trainable set."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from backend.mask_files import mask_key
from tests.test_cli import assert_one_line_error, run_cli
from tests.tiny_models import tiny_llama
from workers.mask_formats import trainable_masks
from workers.masked_training import MaskMismatch, mask_optimizer

OPTIMIZERS = {
    "adamw": lambda params: torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1),
    "adam-coupled-decay": lambda params: torch.optim.Adam(params, lr=1e-2, weight_decay=0.1),
    "sgd-momentum": lambda params: torch.optim.SGD(params, lr=1e-2, momentum=0.9, weight_decay=0.01),
}


def _random_masks(model, q: float = 0.1, seed: int = 0) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    masks = {
        name: torch.rand(param.shape, generator=generator) < q for name, param in model.named_parameters()
    }
    first = next(iter(masks))
    masks[first] = torch.zeros_like(masks[first])  # a tensor frozen whole
    return masks


def _batch(seed: int = 0, vocab: int = 37) -> torch.Tensor:  # the tiny models' vocabulary
    return torch.randint(0, vocab, (2, 12), generator=torch.Generator().manual_seed(seed))


def _trainer_arguments(folder) -> dict:
    """A trainer's arguments for a few steps on the CPU: AdamW's decay and clipping on, nothing saved
    or reported."""
    return {
        "output_dir": str(folder),
        "learning_rate": 1e-2,
        "weight_decay": 0.1,
        "max_grad_norm": 1.0,
        "report_to": [],
        "use_cpu": True,
        "save_strategy": "no",
        "logging_strategy": "no",
    }


def _assert_frozen_and_moved(model, before: dict[str, torch.Tensor], masks: dict[str, torch.Tensor]) -> None:
    moved = 0
    for name, param in model.named_parameters():
        frozen = ~masks[name]
        # bit for bit: the stored bytes of every frozen coordinate
        assert torch.equal(
            param.detach()[frozen].view(torch.int32), before[name][frozen].view(torch.int32)
        ), name
        moved += int((param.detach()[masks[name]] != before[name][masks[name]]).sum())
    inside = sum(int(m.sum()) for m in masks.values())
    assert moved > 0.9 * inside, (moved, inside)


@pytest.mark.parametrize("kind", list(OPTIMIZERS))
def test_frozen_weights_stay_bit_identical_under_each_optimizer(kind):
    model = tiny_llama(tied=True, dtype=torch.float32).train()
    masks = _random_masks(model)
    before = {name: param.detach().clone() for name, param in model.named_parameters()}
    optimizer = mask_optimizer(OPTIMIZERS[kind](model.parameters()), model, masks)
    for step in range(3):
        ids = _batch(step)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # reads masked gradients only
        optimizer.step()
        optimizer.zero_grad()
    _assert_frozen_and_moved(model, before, masks)
    for param, frozen in optimizer.masked.frozen.items():
        for value in optimizer.state[param].values():
            if isinstance(value, torch.Tensor) and value.shape == param.shape:
                assert not value[frozen].any()


def test_a_resumed_optimizer_state_moves_no_frozen_weight():
    model = tiny_llama(tied=True, dtype=torch.float32).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    ids = _batch()
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()  # moments everywhere, as in a run resumed from an unmasked one
    optimizer.zero_grad()
    masks = _random_masks(model)
    before = {name: param.detach().clone() for name, param in model.named_parameters()}
    mask_optimizer(optimizer, model, masks)
    for step in range(2):
        ids = _batch(step + 1)
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    _assert_frozen_and_moved(model, before, masks)


def test_transformers_trainer_with_the_masked_optimizer(tmp_path):
    """The trainer TRL's GRPOTrainer extends: its accelerate wrapper, clipping and scheduler."""
    from transformers import Trainer, TrainingArguments

    model = tiny_llama(tied=True, dtype=torch.float32).train()
    masks = _random_masks(model)
    before = {name: param.detach().clone() for name, param in model.named_parameters()}
    data = [{"input_ids": row, "labels": row} for row in _batch().repeat(4, 1)]
    args = TrainingArguments(max_steps=3, per_device_train_batch_size=2, **_trainer_arguments(tmp_path))
    optimizer = mask_optimizer(
        torch.optim.AdamW(model.parameters(), lr=args.learning_rate, weight_decay=0.1), model, masks
    )
    Trainer(model=model, args=args, train_dataset=data, optimizers=(optimizer, None)).train()
    _assert_frozen_and_moved(model, before, masks)


def test_masks_that_do_not_fit_the_model_are_refused():
    model = tiny_llama(tied=True, dtype=torch.float32)
    masks = _random_masks(model)
    name = next(iter(masks))
    with pytest.raises(MaskMismatch, match="no mask for"):
        mask_optimizer(
            torch.optim.SGD(model.parameters(), lr=0.1), model, {k: v for k, v in masks.items() if k != name}
        )
    masks[name] = masks[name][:1]
    with pytest.raises(MaskMismatch, match="the mask of"):
        mask_optimizer(torch.optim.SGD(model.parameters(), lr=0.1), model, masks)


def _mask_file(path, model, fractions=(0.01, 0.1)):
    generator = torch.Generator().manual_seed(1)
    tensors = {
        mask_key(q, name): (torch.rand(param.shape, generator=generator) < q).to(torch.uint8)
        for q in fractions
        for name, param in model.named_parameters()
    }
    save_file(tensors, str(path), metadata={"model_id": "tiny", "digest": "sha256:" + "1" * 64})
    return path


def test_export_writes_each_polarity_with_its_name_and_metadata(tmp_path, capsys):
    model = tiny_llama(tied=True, dtype=torch.float32)
    source = _mask_file(tmp_path / "masks.safetensors", model)
    trainable = trainable_masks(source, 0.1)
    for fmt, slug in (("lota", "true-is-frozen"), ("fish", "1-is-trainable")):
        code, out, err = run_cli(capsys, "masks", "export", str(source), "--format", fmt, "--q", "0.1")
        assert code == 0, err
        path = tmp_path / f"masks.q0.1.{fmt}.{slug}.pt"
        meta = json.loads((tmp_path / f"{path.name}.json").read_text())
        assert meta["format"] == fmt and meta["q"] == 0.1 and meta["digest"] == "sha256:" + "1" * 64
        assert meta["trainable"] == sum(int(m.sum()) for m in trainable.values())
        loaded = torch.load(path)
        for name, mask in trainable.items():
            if fmt == "lota":
                assert loaded[name].dtype == torch.bool and torch.equal(loaded[name], ~mask)
            else:
                assert loaded[name].dtype == torch.float32 and torch.equal(loaded[name], mask.float())
    code, _, err = run_cli(capsys, "masks", "export", str(source), "--format", "lota")
    assert_one_line_error(code, err, "several densities", "--q")
    code, _, err = run_cli(capsys, "masks", "export", str(source), "--format", "fish", "--q", "0.5")
    assert_one_line_error(code, err, "no mask of density 0.5")


def test_grpo_with_trl_inside_a_mask(tmp_path):
    """TRL's GRPOTrainer, as the README shows it: sampled completions, group advantages, AdamW with weight
    decay, clipping; on the built-in tiny-random model and its tokenizer."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    from backend.registry import model_dir

    folder = model_dir("tiny-random")
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    masks = _random_masks(model, q=0.05)
    before = {name: param.detach().clone() for name, param in model.named_parameters()}

    def reward(completions, **_):  # differs within a group, so the advantages are not all zero
        return [float(sum(map(ord, text)) % 7) for text in completions]

    config = GRPOConfig(
        max_steps=2,
        per_device_train_batch_size=4,
        num_generations=4,
        max_completion_length=8,
        seed=0,
        **_trainer_arguments(tmp_path),
    )
    optimizer = mask_optimizer(
        torch.optim.AdamW(model.parameters(), lr=config.learning_rate, weight_decay=0.1), model, masks
    )
    prompts = Dataset.from_dict({"prompt": [f"Q: {a}+{a}=? A:" for a in range(8)]})
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=reward,
        args=config,
        train_dataset=prompts,
        processing_class=tokenizer,
        optimizers=(optimizer, None),
    )
    trainer.train()
    _assert_frozen_and_moved(model, before, masks)
