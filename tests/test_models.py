"""The model registry: torch-free catalog, deterministic tiny-random, real SmolLM2, loading, pool."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer

from backend import registry as catalog
from backend.registry import ModelNotAvailable, UnknownModel
from workers.models.fetch import TINY_TOKENIZER_PATH, FetchError, fetch_model
from workers.models.loading import ModelPool, load_model

REPO_ROOT = Path(__file__).resolve().parents[1]


def test_registry_imports_without_torch():
    code = (
        "import sys, backend.registry as r; r.list_models(); "
        "assert 'torch' not in sys.modules and 'transformers' not in sys.modules, 'heavy import'"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_unknown_id_lists_known_ids():
    with pytest.raises(UnknownModel) as error:
        catalog.check_id("gpt-17")
    assert "smollm2-135m" in str(error.value) and "tiny-random" in str(error.value)


def test_missing_model_message_is_one_line_with_the_fix(tmp_path, monkeypatch):
    monkeypatch.setenv(catalog.CACHE_ENV, str(tmp_path))
    assert catalog.cache_dir() == tmp_path
    assert not catalog.is_available("smollm2-135m")
    with pytest.raises(ModelNotAvailable) as error:
        catalog.model_info("smollm2-135m")
    message = str(error.value)
    assert "\n" not in message
    assert "fisherscope fetch smollm2-135m" in message and str(tmp_path) in message


def test_tiny_tokenizer_has_single_tokens_for_the_running_example():
    tokenizer = Tokenizer.from_file(str(TINY_TOKENIZER_PATH))
    assert tokenizer.get_vocab_size() == 512
    for word in (" tea", " coffee"):
        ids = tokenizer.encode(word).ids
        assert len(ids) == 1
        assert tokenizer.decode(ids) == word
    prefix = tokenizer.encode("She drank a cup of")
    assert 1 <= len(prefix.ids) <= 6
    assert tokenizer.decode(prefix.ids) == "She drank a cup of"
    assert tokenizer.token_to_id("<|endoftext|>") is not None


def test_tiny_tokenizer_generator_is_deterministic_and_keeps_the_running_example_whole(tmp_path):
    """The generator on a corpus the repository holds (its docs in place of the essays): two runs write
    the same file, and it passes the checks the committed tokenizer was written under."""
    seeds = tmp_path / "seeds"
    seeds.mkdir()
    for path in (REPO_ROOT / "docs").glob("*.md"):
        (seeds / f"{path.stem}.txt").write_text(path.read_text(encoding="utf-8"), encoding="utf-8")
    script = REPO_ROOT / "scripts" / "make_tiny_tokenizer.py"
    written = []
    for run in ("a", "b"):
        out = tmp_path / f"{run}.json"
        subprocess.run([sys.executable, str(script), "--seeds", str(seeds), "--out", str(out)], check=True)
        written.append(out.read_bytes())
    assert written[0] == written[1]
    tokenizer = Tokenizer.from_str(written[0].decode())
    assert tokenizer.get_vocab_size() == 512 and len(tokenizer.encode(" coffee").ids) == 1


def _build_tiny(cache: Path, monkeypatch) -> catalog.ModelInfo:
    monkeypatch.setenv(catalog.CACHE_ENV, str(cache))
    return fetch_model("tiny-random", progress=False)


def test_tiny_random_build_is_deterministic_and_matches_its_manifest(tmp_path, monkeypatch, tiny_random):
    first = _build_tiny(tmp_path / "a", monkeypatch)
    second = _build_tiny(tmp_path / "b", monkeypatch)
    assert first.digest == second.digest == tiny_random.info.digest
    weights = tmp_path / "a" / "tiny-random" / "model.safetensors"
    assert first.digest == "sha256:" + hashlib.sha256(weights.read_bytes()).hexdigest()
    assert first.size_bytes == weights.stat().st_size
    assert first.n_params == sum(p.numel() for p in tiny_random.model.parameters())
    config = tiny_random.model.config
    assert (first.d_model, first.n_layers, first.vocab_size) == (64, 2, 512)
    assert config.tie_word_embeddings and first.tied_embeddings
    assert (config.num_attention_heads, config.num_key_value_heads, config.intermediate_size) == (4, 2, 128)


def test_second_fetch_does_nothing(tmp_path, monkeypatch):
    info = _build_tiny(tmp_path, monkeypatch)
    manifest = tmp_path / "tiny-random" / catalog.MANIFEST_NAME
    stamp = manifest.stat().st_mtime_ns
    assert fetch_model("tiny-random", progress=False) == info
    assert manifest.stat().st_mtime_ns == stamp


def test_failed_fetch_leaves_nothing_behind(tmp_path, monkeypatch):
    monkeypatch.setenv(catalog.CACHE_ENV, str(tmp_path))
    monkeypatch.setattr("workers.models.fetch.TINY_TOKENIZER_PATH", tmp_path / "missing.json")
    with pytest.raises(FetchError, match="missing.json"):
        fetch_model("tiny-random", progress=False)
    assert list(tmp_path.iterdir()) == []
    assert not catalog.is_available("tiny-random")


def test_loaded_model_is_float32_eval_sdpa_with_gradients(tiny_random):
    model = tiny_random.model
    assert tiny_random.id == "tiny-random"
    assert not model.training
    assert model.config._attn_implementation == "sdpa"
    assert all(p.dtype == torch.float32 and p.requires_grad for p in model.parameters())
    coffee = tiny_random.tokenizer.encode(" coffee").ids[0]
    assert tiny_random.decode_token(coffee) == " coffee"


def test_bf16_copy_is_built_once_and_leaves_the_model_alone(tiny_random):
    engine = tiny_random.bf16()
    assert engine is tiny_random.bf16()
    assert all(p.dtype == torch.bfloat16 for p in engine.parameters())
    assert all(p.dtype == torch.float32 for p in tiny_random.model.parameters())
    ids = torch.tensor([tiny_random.tokenizer.encode("She drank a cup of").ids])
    with torch.no_grad():
        exact = tiny_random.model(ids).logits[0, -1]
        rounded = engine(ids).logits[0, -1].float()
    torch.testing.assert_close(rounded, exact, atol=5e-2, rtol=5e-2)
    assert not torch.equal(rounded, exact)


def test_local_folder_loads_with_the_same_digest(tiny_random):
    folder = catalog.model_dir("tiny-random")
    local = load_model(str(folder))
    assert local.info.digest == tiny_random.info.digest
    assert local.info.n_params == tiny_random.info.n_params
    assert local.tokenizer.encode(" tea").ids == tiny_random.tokenizer.encode(" tea").ids


def test_pool_loads_each_model_once_across_threads(tiny_random):
    pool = ModelPool()
    results: list = []
    threads = [threading.Thread(target=lambda: results.append(pool.get("tiny-random"))) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(results) == 4 and all(loaded is results[0] for loaded in results)
    assert pool.get("tiny-random") is results[0]
    assert pool.loaded_ids() == ["tiny-random"]


@pytest.mark.slow
def test_smollm2_prefers_coffee_after_she_drank_a_cup_of(smollm2):
    info = smollm2.info
    assert (info.n_params, info.d_model, info.n_layers, info.vocab_size) == (134515008, 576, 30, 49152)
    assert info.tied_embeddings
    weights = catalog.model_dir("smollm2-135m") / "model.safetensors"
    sha = hashlib.sha256()
    with weights.open("rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 24), b""):
            sha.update(chunk)
    assert info.digest == "sha256:" + sha.hexdigest()
    manifest = json.loads((weights.parent / catalog.MANIFEST_NAME).read_text())
    assert catalog.ModelInfo.from_dict(manifest) == info
    ids = torch.tensor([smollm2.tokenizer.encode("She drank a cup of").ids])
    with torch.no_grad():
        logits = smollm2.model(ids).logits[0, -1]
    assert smollm2.decode_token(int(logits.argmax())) == " coffee"


def test_fetch_removes_staging_folders_of_dead_fetches(tmp_path, monkeypatch):
    abandoned = tmp_path / ".tiny-random.partial-999999999-abcd"  # no process has this pid
    abandoned.mkdir()
    (abandoned / "model.safetensors").write_bytes(b"half")
    _build_tiny(tmp_path, monkeypatch)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tiny-random"]
