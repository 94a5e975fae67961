"""Models an operator adds: `fisherscope models add/remove`, served by the API, analysed by the workers.

Each test gets its own cache folder (FISHERSCOPE_CACHE), so the real cache is never touched. Sources
are tiny random models saved as ordinary Hugging Face folders with the tiny BPE tokenizer.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from fastapi.testclient import TestClient
from transformers import PreTrainedTokenizerFast, ViTConfig, ViTModel

from backend import registry
from backend.main import create_app
from backend.settings import Settings
from tests.test_redis_e2e import wait_done
from tests.tiny_models import tiny_model
from workers.cli import main
from workers.models.fetch import TINY_SPECIAL_TOKEN, TINY_TOKENIZER_PATH
from workers.serve import embedded_api

HIDDEN_USE_MODULE = '''
import torch
from torch.nn import functional as F
from transformers import Qwen3ForCausalLM


class HiddenUseQwen3(Qwen3ForCausalLM):
    """A Qwen3 whose first down projection also uses its weight where torch functions are disabled."""

    def __init__(self, config):
        super().__init__(config)
        proj = self.model.layers[0].mlp.down_proj

        def forward(x):
            with torch._C.DisableTorchFunction():
                unseen = 0.5 * F.linear(x, proj.weight)
            return F.linear(x, proj.weight) + unseen

        proj.forward = forward
'''


def save_tokenizer(folder: Path) -> None:
    PreTrainedTokenizerFast(
        tokenizer_file=str(TINY_TOKENIZER_PATH),
        bos_token=TINY_SPECIAL_TOKEN,
        eos_token=TINY_SPECIAL_TOKEN,
        unk_token=TINY_SPECIAL_TOKEN,
        pad_token=TINY_SPECIAL_TOKEN,
    ).save_pretrained(folder)


def qwen3_folder(root: Path, name: str = "qwen3-src") -> Path:
    """A tiny random Qwen3 (the paper's family) in bfloat16, as a training run would save it."""
    folder = root / name
    model = tiny_model("qwen3", tied=False, dtype=torch.bfloat16, vocab_size=512, pad_token_id=0)
    model.save_pretrained(folder)
    save_tokenizer(folder)
    return folder


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    folder = tmp_path / "cache"
    monkeypatch.setenv(registry.CACHE_ENV, str(folder))
    return folder


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def snapshot(cache: Path) -> list[str]:
    return sorted(p.name for p in cache.iterdir()) if cache.exists() else []


def test_add_lists_and_removes_a_qwen3_folder(cache, tmp_path, capsys):
    source = qwen3_folder(tmp_path)
    code, out, err = run_cli(capsys, "models", "add", "my-qwen3", str(source))
    assert code == 0, err
    assert "added my-qwen3: Qwen3ForCausalLM" in out
    assert "certificate: exact (float32)" in out
    info = registry.model_info("my-qwen3")
    assert info.registered and info.dtype == "float32" and info.architecture == "Qwen3ForCausalLM"
    assert info.source == f"local folder {source.resolve()}"
    assert registry.read_certificate(info.digest, "float32")["passed"]

    code, out, _ = run_cli(capsys, "models")
    row = next(line for line in out.splitlines() if line.startswith("my-qwen3"))
    assert "Qwen3ForCausalLM" in row and f"{info.n_params:,}" in row and "exact" in row

    code, out, _ = run_cli(capsys, "models", "remove", "my-qwen3")
    assert code == 0 and "removed my-qwen3" in out
    assert "my-qwen3" not in registry.list_models()
    code, _, err = run_cli(capsys, "models", "remove", "my-qwen3")
    assert code == 2 and err.count("\n") == 1 and "unknown model 'my-qwen3'" in err


def _not_a_causal_lm(root: Path) -> Path:
    folder = root / "vit"
    ViTModel(
        ViTConfig(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=8)
    ).save_pretrained(folder)
    return folder


def _without_tokenizer(root: Path) -> Path:
    folder = root / "no-tokenizer"
    tiny_model("llama", dtype=torch.float32, vocab_size=512).save_pretrained(folder)
    return folder


def _refused_by_the_certificate(root: Path) -> Path:
    folder = qwen3_folder(root, "hidden-use")
    (folder / "modeling_hidden.py").write_text(HIDDEN_USE_MODULE)
    config = json.loads((folder / "config.json").read_text())
    config["auto_map"] = {"AutoModelForCausalLM": "modeling_hidden.HiddenUseQwen3"}
    (folder / "config.json").write_text(json.dumps(config))
    return folder


BAD_SOURCES = {
    "missing folder": (lambda root: root / "nowhere", [], "no such folder"),
    "no config": (lambda root: (root / "empty").mkdir() or root / "empty", [], "has no config.json"),
    "no tokenizer": (_without_tokenizer, [], "has no tokenizer"),
    "not a causal LM": (_not_a_causal_lm, [], "is not a causal LM"),
    "remote code not allowed": (_refused_by_the_certificate, [], "--trust-remote-code"),
    "refused certificate": (
        _refused_by_the_certificate,
        ["--trust-remote-code"],
        "is refused: module model.layers.0.mlp.down_proj:",
    ),
}


@pytest.mark.parametrize("case", list(BAD_SOURCES))
def test_a_bad_source_gets_one_line_and_leaves_the_registry_as_it_was(case, cache, tmp_path, capsys):
    make, flags, expected = BAD_SOURCES[case]
    source = make(tmp_path)
    before = snapshot(cache)
    code, out, err = run_cli(capsys, "models", "add", "bad-one", str(source), *flags)
    assert code == 2, out + err
    assert err.count("\n") == 1 and err.startswith("fisherscope: error:") and expected in err, err
    assert [name for name in snapshot(cache) if name != registry.CERTIFICATES] == before
    assert "bad-one" not in registry.list_models()


def test_ids_that_cannot_be_added(cache, tmp_path, capsys):
    source = qwen3_folder(tmp_path)
    for model_id, expected in (("tiny-random", "built-in id"), ("Bad/Id", "must be 1-64 characters")):
        code, _, err = run_cli(capsys, "models", "add", model_id, str(source))
        assert code == 2 and expected in err
    assert run_cli(capsys, "models", "add", "twice", str(source))[0] == 0
    code, _, err = run_cli(capsys, "models", "add", "twice", str(source))
    assert code == 2 and "already registered" in err


@pytest.mark.slow
def test_a_registered_model_through_the_embedded_service_and_the_allow_list(cache, tmp_path, capsys):
    assert run_cli(capsys, "models", "add", "my-qwen3", str(qwen3_folder(tmp_path)))[0] == 0
    settings = Settings(redis_url=None, results_dir=tmp_path / "results", exports_dir=tmp_path / "exports")
    client = TestClient(embedded_api(settings))
    listed = {m["id"]: m for m in client.get("/api/v1/models").json()}
    assert listed["my-qwen3"]["architecture"] == "Qwen3ForCausalLM" and listed["my-qwen3"]["registered"]
    assert listed["my-qwen3"]["certificate"]["passed"]
    body = {"model": "my-qwen3", "prefix": "She drank a cup of", "sampler": {"top_k": 5}}
    done = wait_done(client, client.post("/api/v1/analyses", json=body).json()["id"])
    assert done["status"] == "done", done["error"]
    assert done["result"]["model"]["architecture"] == "Qwen3ForCausalLM"
    names = {t["name"] for t in done["result"]["tensors"]}
    assert "model.layers.0.self_attn.q_norm.weight" in names

    limited = TestClient(embedded_api(settings.model_copy(update={"allowed_models": ["tiny-random"]})))
    assert [m["id"] for m in limited.get("/api/v1/models").json()] == ["tiny-random"]
    refused = limited.post("/api/v1/analyses", json=body)
    assert refused.status_code == 422 and "my-qwen3" in refused.json()["detail"]

    assert run_cli(capsys, "models", "remove", "my-qwen3")[0] == 0
    gone = client.post("/api/v1/analyses", json=body)
    assert gone.status_code == 422 and "unknown model 'my-qwen3'" in gone.json()["detail"]


@pytest.mark.slow
def test_a_registered_model_through_a_redis_worker_sharing_the_cache(cache, tmp_path, capsys):
    """The worker process finds the id in the same cache folder (FISHERSCOPE_CACHE), loads and runs it."""
    import redis

    from tests.test_redis_e2e import start_worker, stop_worker

    assert run_cli(capsys, "models", "add", "my-qwen3", str(qwen3_folder(tmp_path)))[0] == 0
    url, queue = "redis://127.0.0.1:6379/13", "fisherscope-registry-test"
    redis.Redis.from_url(url).flushdb()
    worker = start_worker(tmp_path / "exports", redis_url=url, queue=queue)
    try:
        settings = Settings(redis_url=url, queue_name=queue, exports_dir=tmp_path / "exports")
        client = TestClient(create_app(settings))
        body = {"model": "my-qwen3", "prefix": "She drank a cup of", "continuation": " tea"}
        done = wait_done(client, client.post("/api/v1/analyses", json=body).json()["id"])
        assert done["status"] == "done", done["error"]
        assert done["result"]["model"]["id"] == "my-qwen3"
        assert done["request"]["weights_digest"] == registry.model_info("my-qwen3").digest
    finally:
        stop_worker(worker)
        redis.Redis.from_url(url).flushdb()
