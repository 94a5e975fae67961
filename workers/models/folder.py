"""A model folder in the cache: built aside, described by its manifest, moved into place at once.

Why one module: the built-in fetches and ``fisherscope models add`` both write a folder of weights,
config and tokenizer. Each writes into a temporary sibling and renames it into place as its last step,
so an interrupted or refused build never leaves a half-written model (or a changed registry) behind.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

from backend.registry import MANIFEST_NAME, ModelInfo, is_available

WEIGHT_PATTERNS = ("*.safetensors", "*.bin")


def sha256_digest(paths: list[Path]) -> str:
    """``sha256:<hex>`` over the bytes of ``paths`` in the given order (the weights' identity)."""
    sha = hashlib.sha256()
    for path in paths:
        with path.open("rb") as handle:
            for chunk in iter(lambda: handle.read(1 << 20), b""):
                sha.update(chunk)
    return "sha256:" + sha.hexdigest()


def weight_files(folder: Path) -> list[Path]:
    """The weight files of a Hugging Face folder, in a stable order (safetensors preferred)."""
    for pattern in WEIGHT_PATTERNS:
        found = sorted(folder.glob(pattern))
        if found:
            return found
    return []


def count_parameters(files: list[Path]) -> int:
    """Entries over the saved tensors (a tied weight is saved, and counted, once)."""
    from safetensors import safe_open

    total = 0
    for path in files:
        with safe_open(str(path), framework="pt") as handle:
            for name in handle.keys():  # noqa: SIM118 (safe_open is not a mapping)
                numel = 1
                for size in handle.get_slice(name).get_shape():
                    numel *= size
                total += numel
    return total


def describe_folder(folder: Path, model_id: str, description: str, **extra) -> ModelInfo:
    """The manifest of a saved folder: digest and sizes from its files, shape facts from its config."""
    config = json.loads((folder / "config.json").read_text())
    text = config.get("text_config") or config  # a multimodal wrapper keeps the decoder's sizes inside
    files = weight_files(folder)
    return ModelInfo(
        id=model_id,
        digest=sha256_digest(files),
        n_params=count_parameters(files),
        d_model=int(text.get("hidden_size") or text.get("n_embd") or text.get("d_model")),
        vocab_size=int(text["vocab_size"]),
        n_layers=int(text.get("num_hidden_layers") or text.get("n_layer") or text.get("num_layers")),
        tied_embeddings=bool(config.get("tie_word_embeddings", text.get("tie_word_embeddings", False))),
        description=description,
        size_bytes=sum(path.stat().st_size for path in files),
        architecture=(config.get("architectures") or [config.get("model_type", "?")])[0],
        **extra,
    )


def write_manifest(folder: Path, info: ModelInfo) -> None:
    """manifest.json: written last, it marks the folder complete."""
    (folder / MANIFEST_NAME).write_text(json.dumps(info.to_dict(), indent=2) + "\n")


@contextlib.contextmanager
def staged(target: Path) -> Iterator[Path]:
    """A fresh sibling folder to build ``target`` in; renamed into place when the block succeeds."""
    target.parent.mkdir(parents=True, exist_ok=True)
    _remove_abandoned(target)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.partial-{os.getpid()}-", dir=target.parent))
    try:
        yield staging
        _move_into_place(staging, target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _remove_abandoned(target: Path) -> None:
    """Delete staging folders of builds whose process died (killed before its cleanup ran)."""
    for partial in target.parent.glob(f".{target.name}.partial-*"):
        pid_text = partial.name.removeprefix(f".{target.name}.partial-").split("-", 1)[0]
        if pid_text.isdigit() and not _process_alive(int(pid_text)):
            shutil.rmtree(partial, ignore_errors=True)


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _move_into_place(staging: Path, target: Path) -> None:
    """Rename the finished folder to its final name; a concurrent finished build wins."""
    if is_available(target.name):
        return
    staging.chmod(0o755)  # mkdtemp (and safetensors) make files private; the cache is shared
    for path in staging.iterdir():
        path.chmod(0o644)
    if target.exists():  # leftover of an older interrupted layout: never half-done, just stale
        shutil.rmtree(target)
    staging.rename(target)
