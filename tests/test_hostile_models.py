"""Models that must never earn a certificate: non-finite numbers, non-causal models, invented weights.

Every model is a tiny random one from transformers' own config classes (tests/tiny_models.py),
saved as an ordinary Hugging Face folder where the refusal happens on load. Each refusal through the
CLI is one line on stderr with exit code 2 and leaves the registry as it was.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import transformers as hf
from safetensors.torch import load_file, save_file

from backend import registry
from backend.schemas import ENGINE_VERSION
from backend.vocabulary import is_model_id
from tests.tiny_models import BUDGET, FAMILIES, randomize, save_tiny_tokenizer, tiny_model
from workers.cli import main
from workers.fisher.certificate import certify
from workers.models.loading import ModelLoadError, load_model, load_weights

TINY_VOCAB = 512  # the tiny tokenizer's


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    folder = tmp_path / "cache"
    monkeypatch.setenv(registry.CACHE_ENV, str(folder))
    return folder


def add(capsys, model_id: str, source: Path | str) -> tuple[int, str, str]:
    capsys.readouterr()  # what building the source printed is not the command's output
    code = main(["models", "add", "--", model_id, str(source)])  # "--": ids may start with "-"
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def assert_refused(code: int, err: str, *fragments: str) -> None:
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith("fisherscope: error:"), err
    for fragment in fragments:
        assert fragment in lines[0], err


def assert_registry_untouched(cache: Path) -> None:
    assert registry.registered_ids() == []
    leftovers = [p.name for p in cache.iterdir() if p.name != registry.CERTIFICATES] if cache.exists() else []
    assert leftovers == []


def save_folder(model, folder: Path) -> Path:
    model.save_pretrained(folder)
    save_tiny_tokenizer(folder)
    return folder


def llama_folder(root: Path, name: str = "llama", tied: bool = True, layers: int = 2) -> Path:
    model = tiny_model(
        "llama", tied=tied, dtype=torch.float32, vocab_size=TINY_VOCAB, num_hidden_layers=layers
    )
    return save_folder(model, root / name)


def edit_config(folder: Path, **changes) -> None:
    """Change config.json on disk; a value of None removes the key."""
    config = json.loads((folder / "config.json").read_text())
    for key, value in changes.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    (folder / "config.json").write_text(json.dumps(config))


def tiny_bert(is_decoder: bool) -> hf.BertLMHeadModel:
    config = hf.BertConfig(
        vocab_size=TINY_VOCAB,
        hidden_size=16,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=32,
        max_position_embeddings=64,
        is_decoder=is_decoder,
    )
    model = hf.BertLMHeadModel(config).float()
    randomize(model, seed=0)
    return model.eval()


# --- non-finite numbers never pass --------------------------------------------------------------


POISONED = {
    "matrix": "model.layers.1.mlp.down_proj.weight",
    "norm": "model.layers.0.input_layernorm.weight",
    "embedding": "model.embed_tokens.weight",
    "untied head": "lm_head.weight",
}


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf], ids=["nan", "inf", "-inf"])
@pytest.mark.parametrize("where", list(POISONED))
def test_a_non_finite_weight_fails_the_certificate_naming_it(where, value):
    model = tiny_model("llama", tied=False, dtype=torch.float32)
    name = POISONED[where]
    with torch.no_grad():
        model.get_parameter(name).view(-1)[-1] = value
    certificate = certify(model, BUDGET)
    assert not certificate.passed
    assert certificate.worst_parameter == name and certificate.failing_module == name.rsplit(".", 1)[0]
    assert f"parameter {name} is not finite" in certificate.reason
    assert ("NaN" if math.isnan(value) else "infinite") in certificate.reason
    assert certificate.line().startswith("refused:")


def test_finite_weights_whose_gradients_overflow_fail_naming_the_tensor():
    model = tiny_model("llama", dtype=torch.float32)
    with torch.no_grad():
        model.model.layers[1].mlp.down_proj.weight.mul_(1e37)  # logits survive the final norm
    certificate = certify(model, BUDGET)
    assert not certificate.passed and "are not finite" in certificate.reason
    assert certificate.reason.startswith(f"module {certificate.failing_module}:")
    assert certificate.first_moment_error is None and certificate.square_error is None


def test_logits_that_overflow_fail_naming_the_first_module_that_did():
    model = tiny_model("llama", tied=False, dtype=torch.float32)
    with torch.no_grad():
        model.model.norm.weight.fill_(3e38)
    certificate = certify(model, BUDGET)
    assert not certificate.passed
    assert "logits are not finite" in certificate.reason and certificate.failing_module == "model.norm"


def test_a_nan_weight_in_a_folder_is_refused_by_models_add(cache, tmp_path, capsys):
    folder = llama_folder(tmp_path)
    weights = load_file(folder / "model.safetensors")
    weights["model.layers.0.self_attn.o_proj.weight"][2, 3] = math.nan
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    code, _, err = add(capsys, "poisoned", folder)
    assert_refused(code, err, "parameter model.layers.0.self_attn.o_proj.weight is not finite", "1 NaN")
    assert_registry_untouched(cache)


def test_a_stored_pass_with_nan_errors_is_made_again(cache, tmp_path):
    """A certificate written when ``NaN > tol`` still passed is not trusted: the model is certified anew."""
    folder = llama_folder(tmp_path)
    digest = load_model(str(folder)).info.digest
    forged = {"passed": True, "dtype": "float32", "tolerance": 1e-4, "logits_error": 0.0}
    old_record = {  # as written before the certificate checked finiteness and causality
        "engine_version": ENGINE_VERSION,
        "certificate": {**forged, "first_moment_error": math.nan, "square_error": 0.0},
    }
    path = registry.certificate_path(digest, "float32")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(old_record))
    assert registry.read_certificate(digest, "float32") is None
    certificate = load_model(str(folder)).certificate
    assert certificate.passed and math.isfinite(certificate.first_moment_error)
    assert (
        registry.read_certificate(digest, "float32")["first_moment_error"] == certificate.first_moment_error
    )


# --- only causal LMs, by behaviour and by construction -------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_bidirectional_attention_fails_the_certificate_by_behaviour(dtype):
    certificate = certify(tiny_bert(is_decoder=False).to(dtype), BUDGET)
    assert not certificate.passed
    assert certificate.reason.startswith("not a causal LM: the logits at positions 0-3 change")


def test_a_causal_model_keeps_its_earlier_logits_and_passes():
    model = tiny_model("llama", dtype=torch.float32)
    ids = torch.tensor([4, 9, 7, 1, 12, 5, 3, 8])
    changed = ids.clone()
    changed[4:] = (ids[4:] + 1) % model.config.vocab_size
    with torch.no_grad():
        first, second = (model(input_ids=x[None]).logits[0] for x in (ids, changed))
    torch.testing.assert_close(second[:4], first[:4], rtol=1e-6, atol=1e-6)
    assert certify(model, BUDGET).passed


def test_a_bert_folder_is_refused_by_models_add(cache, tmp_path, capsys):
    code, _, err = add(capsys, "bert", save_folder(tiny_bert(is_decoder=False), tmp_path / "bert"))
    assert_refused(code, err, "model bert is refused: not a causal LM", "bidirectional attention")
    assert_registry_untouched(cache)


def test_a_bert_made_causal_by_its_is_decoder_flag_is_refused(cache, tmp_path, capsys):
    code, _, err = add(capsys, "bert", save_folder(tiny_bert(is_decoder=True), tmp_path / "bert"))
    assert_refused(code, err, "is not a causal LM: BertConfig (bert)", "is_decoder flag")
    assert_registry_untouched(cache)


def test_an_encoder_decoder_is_refused(cache, tmp_path, capsys):
    config = hf.BartConfig(
        vocab_size=TINY_VOCAB,
        d_model=16,
        encoder_layers=1,
        decoder_layers=1,
        encoder_attention_heads=2,
        decoder_attention_heads=2,
        encoder_ffn_dim=32,
        decoder_ffn_dim=32,
        max_position_embeddings=64,
    )
    folder = save_folder(hf.BartForConditionalGeneration(config), tmp_path / "bart")
    code, _, err = add(capsys, "bart", folder)
    assert_refused(code, err, "BartConfig (bart) is an encoder-decoder")
    assert_registry_untouched(cache)
    with pytest.raises(ModelLoadError, match="is an encoder-decoder"):
        load_model(str(folder))


# --- weights are never invented or dropped -------------------------------------------------------


def test_a_config_with_more_layers_than_the_weights_is_refused_naming_the_missing_keys(
    cache, tmp_path, capsys
):
    folder = llama_folder(tmp_path)
    edit_config(folder, num_hidden_layers=3)
    code, _, err = add(capsys, "three", folder)
    assert_refused(
        code,
        err,
        "9 weights missing from the checkpoint",
        "model.layers.2.input_layernorm.weight, model.layers.2.mlp.down_proj.weight",
        ", ...",
    )
    assert_registry_untouched(cache)
    with pytest.raises(ModelLoadError, match="9 weights missing"):
        load_weights(str(folder), "cpu", "float32")


def test_a_config_without_num_hidden_layers_is_refused(cache, tmp_path, capsys):
    folder = llama_folder(tmp_path)
    edit_config(folder, num_hidden_layers=None)  # LlamaConfig's default has 32 layers
    code, _, err = add(capsys, "no-layers", folder)
    assert_refused(code, err, "270 weights missing from the checkpoint", "model.layers.2.")
    assert_registry_untouched(cache)


def test_an_unused_weight_in_the_checkpoint_is_refused(cache, tmp_path, capsys):
    folder = llama_folder(tmp_path)
    weights = load_file(folder / "model.safetensors")
    weights["model.layers.0.mlp.extra_proj.weight"] = torch.zeros(4, 4)
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    code, _, err = add(capsys, "extra", folder)
    assert_refused(
        code, err, "1 weight in the checkpoint but unused by the model: model.layers.0.mlp.extra_proj.weight"
    )
    assert_registry_untouched(cache)


def test_a_tied_llama_folder_is_accepted_and_certified(cache, tmp_path, capsys):
    folder = llama_folder(tmp_path, tied=True)
    assert "lm_head.weight" not in load_file(folder / "model.safetensors")  # saved once, as the embedding
    code, out, err = add(capsys, "tied-llama", folder)
    assert code == 0, err
    assert "certificate: exact (float32)" in out
    info = registry.model_info("tied-llama")
    assert info.tied_embeddings and info.registered


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_every_promised_family_loads_from_its_folder_with_nothing_invented(family, tmp_path):
    for tied in FAMILIES[family].tied_options:
        original = tiny_model(family, tied=tied, dtype=torch.float32)
        folder = tmp_path / f"{family}-{tied}"
        original.save_pretrained(folder)
        loaded = load_weights(str(folder), "cpu", "float32")
        want = dict(original.named_parameters())
        got = dict(loaded.named_parameters())
        assert sorted(got) == sorted(want)
        for name, tensor in want.items():
            torch.testing.assert_close(got[name], tensor, rtol=0, atol=0)


# --- model ids -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "model_id", ["a..b", "a-", "b.", "-a", ".a", "A", "a/b", "a b", "x" * 65, "..", "a_"]
)
def test_ids_that_could_not_be_used_or_removed_are_refused(model_id, cache, capsys):
    code, _, err = add(capsys, model_id, "/nowhere")
    assert_refused(code, err, f"model id {model_id!r} must be 1-64 characters")
    assert_registry_untouched(cache)


@pytest.mark.parametrize("model_id", ["a", "a.b", "my_model-2", "x" * 64])
def test_good_ids_pass_the_id_check(model_id, cache, capsys):
    code, _, err = add(capsys, model_id, "/nowhere")
    assert code == 2 and "no such folder" in err  # past the id, refused for the source
    assert is_model_id(model_id)
