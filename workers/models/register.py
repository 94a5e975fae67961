"""``fisherscope models add`` and ``remove``: an operator's own checkpoints in the registry.

Why a copy in the cache rather than a pointer to the source: the weights' digest goes into every
cache key, so the registered weights must not change under it, and a Redis worker on another machine
reads the same cache folder. The source (a local Hugging Face folder, or a hub id where the operator
has access and a network) is saved once as safetensors in its own dtype with its tokenizer, loaded
back in the compute dtype and certified (docs/design.md §3a); only a model that passes is moved into place.
Any failure leaves the registry as it was, and says in one line what to fix.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from backend.registry import (
    BUILTIN,
    COMPUTE_DTYPES,
    TOKENIZER_NAME,
    ModelInfo,
    UnknownModel,
    is_available,
    model_dir,
    model_info,
    registered_ids,
)
from backend.vocabulary import model_id_problem
from workers.models.folder import describe_folder, staged, write_manifest
from workers.models.loading import (
    LoadedModel,
    ModelLoadError,
    causal_lm_config,
    ensure_certificate,
    load_weights,
    one_line,
    pretrained_causal_lm,
    tokenizer_from_folder,
)


class RegistryError(ValueError):
    """A registration the operator can fix; the message is one line saying what to fix."""


def add_model(
    model_id: str,
    source: str,
    revision: str | None = None,
    dtype: str = "float32",
    trust_remote_code: bool = False,
) -> tuple[ModelInfo, LoadedModel]:
    """Register ``source`` as ``model_id``: saved, certified, then moved into the cache at once."""
    _check_new_id(model_id)
    if dtype not in COMPUTE_DTYPES:
        raise RegistryError(f"--dtype must be one of {', '.join(COMPUTE_DTYPES)}; got {dtype!r}")
    origin = _check_source(source, revision, trust_remote_code)
    with staged(model_dir(model_id)) as staging:
        _save_source(source, staging, revision, trust_remote_code)
        info = describe_folder(
            staging,
            model_id,
            f"registered from {origin}",
            dtype=dtype,
            source=origin,
            revision=revision,
            trust_remote_code=trust_remote_code,
            registered=True,
        )
        model = load_weights(str(staging), "cpu", dtype, trust_remote_code=trust_remote_code)
        loaded = LoadedModel(model_id, model, info, tokenizer_from_folder(staging))
        loaded.certificate = ensure_certificate(loaded)  # ModelLoadError: refused, nothing moved
        write_manifest(staging, info)
    return model_info(model_id), loaded


def remove_model(model_id: str) -> None:
    """Delete a registered id's folder (its cached analyses stay, keyed by digest, until they expire)."""
    if model_id in BUILTIN:
        raise RegistryError(f"{model_id} is built in and cannot be removed")
    if model_id not in registered_ids():
        raise UnknownModel(model_id)
    shutil.rmtree(model_dir(model_id))


def _check_new_id(model_id: str) -> None:
    problem = model_id_problem(model_id)
    if problem is not None:
        raise RegistryError(problem)
    if model_id in BUILTIN:
        raise RegistryError(f"{model_id} is a built-in id; choose another")
    if is_available(model_id) or model_dir(model_id).exists():
        raise RegistryError(f"{model_id} is already registered; `fisherscope models remove {model_id}` first")


def _check_source(source: str, revision: str | None, trust_remote_code: bool) -> str:
    """What the source is, in words for the manifest; every missing piece is one line to fix."""
    path = Path(source).expanduser()
    if path.exists() or source.startswith((".", "/", "~")) or "/" not in source:
        if not path.is_dir():
            raise RegistryError(
                f"{source}: no such folder (SOURCE is a local Hugging Face folder or a hub id)"
            )
        if not (path / "config.json").is_file():
            raise RegistryError(f"{source} has no config.json; not a Hugging Face model folder")
        try:
            causal_lm_config(str(path), trust_remote_code=trust_remote_code)
        except ModelLoadError as error:
            raise RegistryError(str(error)) from None
        if not any(path.glob("*.safetensors")) and not any(path.glob("*.bin")):
            raise RegistryError(f"{source} has no weight files (*.safetensors or *.bin)")
        if not (path / TOKENIZER_NAME).is_file() and not (path / "tokenizer_config.json").is_file():
            raise RegistryError(
                f"{source} has no tokenizer (tokenizer.json); save the tokenizer beside the model"
            )
        return f"local folder {path.resolve()}"
    try:
        causal_lm_config(source, revision, trust_remote_code)
    except ModelLoadError as error:
        raise RegistryError(str(error)) from None
    return f"hub {source}" + (f"@{revision}" if revision else "")


def _save_source(source: str, staging: Path, revision: str | None, trust_remote_code: bool) -> None:
    """The source's weights in their own dtype (safetensors) and its tokenizer, into ``staging``."""
    from transformers import AutoTokenizer

    location = str(Path(source).expanduser()) if Path(source).expanduser().is_dir() else source
    try:
        tokenizer = AutoTokenizer.from_pretrained(
            location, revision=revision, trust_remote_code=trust_remote_code
        )
    except Exception as error:
        raise RegistryError(f"{source} has no usable tokenizer: {one_line(error)}") from None
    if not getattr(tokenizer, "is_fast", False):
        raise RegistryError(f"{source}: only fast (tokenizer.json) tokenizers are supported")
    try:
        model = pretrained_causal_lm(
            location, revision=revision, trust_remote_code=trust_remote_code, dtype="auto"
        )
    except ModelLoadError as error:  # weights missing, unused or unreadable: nothing is saved
        raise RegistryError(str(error)) from None
    model.save_pretrained(staging, safe_serialization=True)
    tokenizer.save_pretrained(staging)
    if not (staging / TOKENIZER_NAME).is_file():
        raise RegistryError(f"{source}: its tokenizer did not save a tokenizer.json")
