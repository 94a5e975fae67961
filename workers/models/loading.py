"""Load a model for analysis: float32, eval mode, sdpa attention, gradients enabled.

Accepts a catalog id (weights from the cache, identified by the manifest digest), a local Hugging
Face model folder, or a hub id. ``ModelPool`` keeps one ``LoadedModel`` per id in a long-lived
worker, so a model is loaded once per process rather than once per job.
"""

from __future__ import annotations

import copy
import functools
import hashlib
import json
import threading
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tokenizers import Tokenizer
from transformers import AutoModelForCausalLM, PreTrainedModel

from workers.models.catalog import (
    CATALOG,
    TOKENIZER_NAME,
    ModelInfo,
    ModelNotAvailable,
    UnknownModel,
    is_available,
    model_dir,
    model_info,
)
from workers.models.fetch import sha256_digest

WEIGHT_PATTERNS = ("*.safetensors", "*.bin")


class ModelLoadError(RuntimeError):
    """A model that could not be loaded; the message is one line saying why."""


@dataclass
class LoadedModel:
    """A model ready for the engine, with its identity, sizes and tokenizer."""

    id: str
    model: PreTrainedModel
    info: ModelInfo
    tokenizer: Tokenizer
    _bf16: PreTrainedModel | None = field(default=None, init=False, repr=False)
    _bf16_lock: threading.Lock = field(default_factory=threading.Lock, init=False, repr=False)

    def decode_token(self, token_id: int) -> str:
        """The text of one token as it appears in the decoded string (e.g. ``" coffee"``).

        A byte-level token that holds part of a UTF-8 character decodes to U+FFFD on its own; many
        tokens would then look alike, so those show their bytes instead (``" \\xe2\\x80"``).
        """
        text = self.tokenizer.decode([int(token_id)], skip_special_tokens=False)
        if "\ufffd" not in text:
            return text
        piece = self.tokenizer.id_to_token(int(token_id)) or ""
        decoder = _byte_decoder()
        if not piece or any(ch not in decoder for ch in piece):
            return text
        return bytes(decoder[ch] for ch in piece).decode("utf-8", errors="backslashreplace")

    def bf16(self) -> PreTrainedModel:
        """The same weights in bfloat16: the inference engine of the training-inference mismatch.

        Built on first use and cached, since most analyses never need it.
        """
        with self._bf16_lock:
            if self._bf16 is None:
                self._bf16 = copy.deepcopy(self.model).bfloat16().eval()
            return self._bf16


@functools.cache
def _byte_decoder() -> dict[str, int]:
    """Inverse of GPT-2's byte-to-unicode table, used by byte-level BPE vocabularies."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    codes = list(printable)
    extra = 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            codes.append(256 + extra)
            extra += 1
    return {chr(code): byte for byte, code in zip(printable, codes, strict=True)}


def load_model(id_or_path: str, device: str = "cpu", fetch: bool = False) -> LoadedModel:
    """Load a catalog id, a local model folder or a hub id.

    Catalog ids missing from the cache are fetched when ``fetch`` is true, else ModelNotAvailable.
    """
    if id_or_path in CATALOG:
        return _load_catalog(id_or_path, device, fetch)
    path = Path(id_or_path).expanduser()
    if path.is_dir():
        return _load_local(path, device)
    if "/" in id_or_path and not path.exists():
        return _load_hub(id_or_path, device)
    raise UnknownModel(id_or_path)


def _load_catalog(model_id: str, device: str, fetch: bool) -> LoadedModel:
    if not is_available(model_id):
        if not fetch:
            raise ModelNotAvailable(model_id)
        from workers.models.fetch import fetch_model

        fetch_model(model_id)
    folder = model_dir(model_id)
    model = _from_pretrained(str(folder), device)
    return LoadedModel(
        id=model_id, model=model, info=model_info(model_id), tokenizer=_tokenizer_from_folder(folder)
    )


def _load_local(folder: Path, device: str) -> LoadedModel:
    if not (folder / "config.json").is_file():
        raise ModelLoadError(f"{folder} has no config.json; not a Hugging Face model folder")
    weights = sorted(p for pattern in WEIGHT_PATTERNS for p in folder.glob(pattern))
    if not weights:
        raise ModelLoadError(f"{folder} has no weight files (*.safetensors or *.bin)")
    model = _from_pretrained(str(folder), device)
    model_id = str(folder.resolve())
    info = _info_from_model(
        model_id,
        model,
        sha256_digest(weights),
        f"local folder {folder}",
        sum(p.stat().st_size for p in weights),
    )
    return LoadedModel(id=model_id, model=model, info=info, tokenizer=_tokenizer_from_folder(folder))


def _load_hub(hub_id: str, device: str) -> LoadedModel:
    model = _from_pretrained(hub_id, device)
    digest = _state_dict_digest(model)
    size = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    info = _info_from_model(hub_id, model, digest, f"hub model {hub_id}", size)
    try:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(hub_id).backend_tokenizer
    except Exception as error:  # any failure of the hub is reported as one line
        raise ModelLoadError(f"cannot load the tokenizer of {hub_id!r}: {_one_line(error)}") from None
    return LoadedModel(id=hub_id, model=model, info=info, tokenizer=tokenizer)


def _from_pretrained(source: str, device: str) -> PreTrainedModel:
    try:
        model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32, attn_implementation="sdpa")
    except Exception as error:  # corrupt folders, offline hub, unknown architectures: one line
        raise ModelLoadError(f"cannot load model {source!r}: {_one_line(error)}") from None
    return model.to(torch.device(device)).eval()  # type: ignore[arg-type]  # HF wraps .to


def _tokenizer_from_folder(folder: Path) -> Tokenizer:
    path = folder / TOKENIZER_NAME
    if path.is_file():
        return Tokenizer.from_file(str(path))
    try:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(folder)).backend_tokenizer
    except Exception as error:
        raise ModelLoadError(f"{folder} has no usable tokenizer: {_one_line(error)}") from None


def _info_from_model(
    model_id: str, model: PreTrainedModel, digest: str, description: str, size_bytes: int
) -> ModelInfo:
    config = model.config
    return ModelInfo(
        id=model_id,
        digest=digest,
        n_params=sum(p.numel() for p in model.parameters()),
        d_model=int(config.hidden_size),
        vocab_size=int(config.vocab_size),
        n_layers=int(config.num_hidden_layers),
        tied_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
        description=description,
        size_bytes=int(size_bytes),
    )


def _state_dict_digest(model: PreTrainedModel) -> str:
    """``sha256:<hex>`` over parameter names, shapes and bytes, for weights without a local file."""
    sha = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        sha.update(json.dumps([name, list(tensor.shape), str(tensor.dtype)]).encode())
        sha.update(tensor.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return "sha256:" + sha.hexdigest()


def _one_line(error: BaseException) -> str:
    text = " ".join(str(error).split())
    return (text[:300] + "...") if len(text) > 300 else text or type(error).__name__


class ModelPool:
    """Process-level cache of loaded models: each (id, device) is loaded once, even under threads."""

    def __init__(self, device: str = "cpu", fetch: bool = False) -> None:
        self.device = device
        self.fetch = fetch
        self._models: dict[str, LoadedModel] = {}
        self._locks: dict[str, threading.Lock] = {}
        self._guard = threading.Lock()

    def get(self, id_or_path: str) -> LoadedModel:
        """The loaded model for ``id_or_path``, loading it on first request."""
        with self._guard:
            if id_or_path in self._models:
                return self._models[id_or_path]
            lock = self._locks.setdefault(id_or_path, threading.Lock())
        with lock:  # one loader per id; other threads asking for it wait here
            with self._guard:
                if id_or_path in self._models:
                    return self._models[id_or_path]
            loaded = load_model(id_or_path, device=self.device, fetch=self.fetch)
            with self._guard:
                self._models[id_or_path] = loaded
            return loaded

    def loaded_ids(self) -> list[str]:
        with self._guard:
            return sorted(self._models)
