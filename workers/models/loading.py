"""Load a model for analysis: its compute dtype, eval mode, gradients on, and a passed certificate.

Accepts an id in the registry (weights from the cache, identified by the manifest digest), a local
Hugging Face model folder, or a hub id. Attention runs through sdpa where the architecture supports
it and nothing in its config needs eager (attention softcapping); mixture-of-experts layers run
transformers' eager expert loop (the same function as its grouped kernels, one matrix per expert).
Every load ends with the certificate of docs/design.md §3a, cached per weights digest and engine version:
a model the engine cannot make exact is refused here, with the module named. Before it, a model that
is not a causal LM by construction, or a load that would invent or drop weights, is refused with the
reason in one line (``workers.models.integrity``). ``ModelPool`` keeps one
``LoadedModel`` per id in a long-lived worker.
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
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel

from backend.registry import (
    BUILTIN,
    COMPUTE_DTYPES,
    TOKENIZER_NAME,
    ModelInfo,
    ModelNotAvailable,
    UnknownModel,
    check_id,
    is_available,
    model_dir,
    model_info,
    read_certificate,
    write_certificate,
)
from backend.settings import get_settings
from workers.fisher.certificate import Certificate, certify
from workers.models.folder import sha256_digest, weight_files
from workers.models.integrity import config_refusal, loading_refusal
from workers.process_memory import returning_freed_memory

TF32_TOLERANCE = 1e-2  # TF32 keeps 10 mantissa bits: ~1e-3 relative per product


class ModelLoadError(RuntimeError):
    """A model that could not be loaded or was refused; the message is one line saying why."""


@dataclass
class LoadedModel:
    """A model ready for the engine, with its identity, sizes, tokenizer and certificate."""

    id: str
    model: PreTrainedModel
    info: ModelInfo
    tokenizer: Tokenizer
    certificate: Certificate | None = None
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


@dataclass(frozen=True)
class LoadOptions:
    """How to load: compute dtype (None: the registered one, else float32), hub revision, remote code."""

    device: str = "cpu"
    dtype: str | None = None
    revision: str | None = None
    trust_remote_code: bool = False
    certify: bool = True


def load_model(id_or_path: str, device: str = "cpu", fetch: bool = False, **options) -> LoadedModel:
    """Load a registry id, a local model folder or a hub id; refuse it if its certificate fails.

    Built-in ids missing from the cache are fetched when ``fetch`` is true, else ModelNotAvailable.
    """
    opts = LoadOptions(device=device, **options)
    if id_or_path in BUILTIN or (not Path(id_or_path).expanduser().exists() and _is_registry_id(id_or_path)):
        loaded = _load_registered(id_or_path, opts, fetch)
    elif Path(id_or_path).expanduser().is_dir():
        loaded = _load_local(Path(id_or_path).expanduser(), opts)
    elif "/" in id_or_path and not Path(id_or_path).expanduser().exists():
        loaded = _load_hub(id_or_path, opts)
    else:
        raise UnknownModel(id_or_path)
    if opts.certify:
        loaded.certificate = ensure_certificate(loaded)
    return loaded


def _is_registry_id(name: str) -> bool:
    try:
        check_id(name)
    except UnknownModel:
        return False
    return True


def matmul_precision(model: PreTrainedModel) -> str:
    """The model's dtype, marked ``+tf32`` where CUDA float32 matmuls run in TF32 (asked for)."""
    param = next(model.parameters())
    dtype = str(param.dtype).removeprefix("torch.")
    tf32 = (
        param.device.type == "cuda" and param.dtype == torch.float32 and torch.backends.cuda.matmul.allow_tf32
    )
    return dtype + ("+tf32" if tf32 else "")


def ensure_certificate(loaded: LoadedModel) -> Certificate:
    """The model's certificate (cached per digest, dtype and engine version); refuse a failing model.

    With TF32 matmuls (asked for with FISHERSCOPE_ALLOW_TF32) the certificate measures their error
    against autograd and allows 1e-2 instead of float32's 1e-4.
    """
    dtype = matmul_precision(loaded.model)
    stored = read_certificate(loaded.info.digest, dtype)
    if stored is not None:
        certificate = Certificate.from_dict(stored)
    else:
        tolerance = TF32_TOLERANCE if dtype.endswith("+tf32") else None
        with returning_freed_memory():  # a backward whose gradients are let go one by one, once per load
            certificate = certify(loaded.model, get_settings().engine_memory_bytes, tolerance=tolerance)
    if stored is None:
        write_certificate(loaded.info.digest, dtype, certificate.to_dict())
    if not certificate.passed:
        raise ModelLoadError(f"model {loaded.id} is refused: {certificate.reason}")
    return certificate


def _load_registered(model_id: str, opts: LoadOptions, fetch: bool) -> LoadedModel:
    if not is_available(model_id):
        if not fetch or model_id not in BUILTIN:
            raise ModelNotAvailable(model_id)
        from workers.models.fetch import fetch_model

        fetch_model(model_id)
    folder = model_dir(model_id)
    info = model_info(model_id)
    dtype = opts.dtype or info.dtype
    model = load_weights(str(folder), opts.device, dtype, trust_remote_code=info.trust_remote_code)
    info.dtype = dtype
    return LoadedModel(id=model_id, model=model, info=info, tokenizer=tokenizer_from_folder(folder))


def _load_local(folder: Path, opts: LoadOptions) -> LoadedModel:
    if not (folder / "config.json").is_file():
        raise ModelLoadError(f"{folder} has no config.json; not a Hugging Face model folder")
    weights = weight_files(folder)
    if not weights:
        raise ModelLoadError(f"{folder} has no weight files (*.safetensors or *.bin)")
    model = load_weights(
        str(folder), opts.device, opts.dtype or "float32", trust_remote_code=opts.trust_remote_code
    )
    info = info_from_model(
        str(folder.resolve()),
        model,
        sha256_digest(weights),
        f"local folder {folder}",
        sum(p.stat().st_size for p in weights),
    )
    return LoadedModel(id=info.id, model=model, info=info, tokenizer=tokenizer_from_folder(folder))


def _load_hub(hub_id: str, opts: LoadOptions) -> LoadedModel:
    model = load_weights(
        hub_id,
        opts.device,
        opts.dtype or "float32",
        revision=opts.revision,
        trust_remote_code=opts.trust_remote_code,
    )
    size = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    info = info_from_model(hub_id, model, state_dict_digest(model), f"hub model {hub_id}", size)
    try:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(hub_id, revision=opts.revision).backend_tokenizer
    except Exception as error:  # any failure of the hub is reported as one line
        raise ModelLoadError(f"cannot load the tokenizer of {hub_id!r}: {one_line(error)}") from None
    return LoadedModel(id=hub_id, model=model, info=info, tokenizer=tokenizer)


def causal_lm_config(source: str, revision: str | None = None, trust_remote_code: bool = False):
    """The config of ``source``, checked to be a causal LM this transformers can build (or refused)."""
    try:
        config = AutoConfig.from_pretrained(source, revision=revision, trust_remote_code=trust_remote_code)
    except Exception as error:
        message = one_line(error)
        if "trust_remote_code" in message:
            raise ModelLoadError(
                f"{source} ships its own modeling code; pass --trust-remote-code only if you trust it"
            ) from None
        raise ModelLoadError(f"cannot read the config of {source!r}: {message}") from None
    if getattr(config, "auto_map", None) and not trust_remote_code:
        raise ModelLoadError(
            f"{source} ships its own modeling code; pass --trust-remote-code only if you trust it"
        )
    if type(config) not in AutoModelForCausalLM._model_mapping and not trust_remote_code:
        raise ModelLoadError(
            f"{source} is not a causal LM: {type(config).__name__} ({config.model_type}) has no causal-LM "
            "class in transformers"
        )
    refusal = config_refusal(config)
    if refusal is not None:
        raise ModelLoadError(f"{source} is not a causal LM: {refusal}")
    return config


def pretrained_causal_lm(source: str, **options) -> PreTrainedModel:
    """``AutoModelForCausalLM.from_pretrained`` that refuses weights invented or left unused.

    transformers initialises parameters missing from the checkpoint from the config (and ignores
    tensors it has no place for), logging it only; here either is a one-line ModelLoadError naming
    the keys. Any other failure of the load is one line too.
    """
    try:
        pair: tuple[PreTrainedModel, dict] = AutoModelForCausalLM.from_pretrained(  # type: ignore[assignment]
            source, output_loading_info=True, **options
        )
    except Exception as error:  # corrupt folders, offline hub, unknown architectures: one line
        raise ModelLoadError(f"cannot load model {source!r}: {one_line(error)}") from None
    model, info = pair
    refusal = loading_refusal(info)
    if refusal is not None:
        raise ModelLoadError(f"the weights of {source} do not match its config: {refusal}")
    return model


def load_weights(
    source: str, device: str, dtype: str, revision: str | None = None, trust_remote_code: bool = False
) -> PreTrainedModel:
    """The model of ``source`` in ``dtype``, eval mode, every parameter differentiable."""
    if dtype not in COMPUTE_DTYPES:
        raise ModelLoadError(f"dtype must be one of {', '.join(COMPUTE_DTYPES)}; got {dtype!r}")
    config = causal_lm_config(source, revision, trust_remote_code)
    model = pretrained_causal_lm(
        source,
        revision=revision,
        trust_remote_code=trust_remote_code,
        dtype=getattr(torch, dtype),
        attn_implementation=attention_for(config),
        experts_implementation="eager",
    )
    model.requires_grad_(True)
    return model.to(torch.device(device)).eval()  # type: ignore[arg-type]  # HF wraps .to


def attention_for(config) -> str:
    """sdpa where the architecture supports it and the config needs nothing sdpa cannot do."""
    if getattr(config, "attn_logit_softcapping", None):
        return "eager"  # sdpa has no softcapping of attention scores
    model_class = AutoModelForCausalLM._model_mapping.get(type(config), None)
    return "sdpa" if model_class is None or getattr(model_class, "_supports_sdpa", False) else "eager"


def tokenizer_from_folder(folder: Path) -> Tokenizer:
    path = folder / TOKENIZER_NAME
    if path.is_file():
        return Tokenizer.from_file(str(path))
    try:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(folder)).backend_tokenizer
    except Exception as error:
        raise ModelLoadError(f"{folder} has no usable tokenizer: {one_line(error)}") from None


def info_from_model(
    model_id: str, model: PreTrainedModel, digest: str, description: str, size_bytes: int
) -> ModelInfo:
    config = model.config
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return ModelInfo(
        id=model_id,
        digest=digest,
        n_params=sum(p.numel() for p in model.parameters()),
        d_model=int(text.hidden_size),
        vocab_size=int(text.vocab_size),
        n_layers=int(text.num_hidden_layers),
        tied_embeddings=model.get_output_embeddings().weight is model.get_input_embeddings().weight,
        description=description,
        size_bytes=int(size_bytes),
        architecture=type(model).__name__,
        dtype=str(next(model.parameters()).dtype).removeprefix("torch."),
    )


def state_dict_digest(model: PreTrainedModel) -> str:
    """``sha256:<hex>`` over parameter names, shapes and bytes, for weights without a local file."""
    sha = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        sha.update(json.dumps([name, list(tensor.shape), str(tensor.dtype)]).encode())
        sha.update(tensor.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return "sha256:" + sha.hexdigest()


def one_line(error: BaseException) -> str:
    text = " ".join(str(error).split())
    return (text[:300] + "...") if len(text) > 300 else text or type(error).__name__


class ModelPool:
    """Process-level cache of loaded models: each (id, device) is loaded once, even under threads."""

    def __init__(self, device: str = "cpu", fetch: bool = False) -> None:
        self.device = device
        self.fetch = fetch
        self._models: dict[str, LoadedModel] = {}
        # one load at a time in the process: transformers' loading is not thread-safe (two models
        # loading at once on two threads fail with "Cannot copy out of meta tensor")
        self._loading = threading.Lock()
        self._guard = threading.Lock()

    def get(self, id_or_path: str) -> LoadedModel:
        """The loaded model for ``id_or_path``, loading it on first request."""
        with self._guard:
            if id_or_path in self._models:
                return self._models[id_or_path]
        with self._loading:  # other threads asking for any model wait here
            with self._guard:
                if id_or_path in self._models:
                    return self._models[id_or_path]
            loaded = load_model(id_or_path, device=self.device, fetch=self.fetch)
            with self._guard:
                self._models[id_or_path] = loaded
            return loaded

    def forget(self, id_or_path: str) -> None:
        """Drop a loaded model (its id was removed or re-registered)."""
        with self._guard:
            self._models.pop(id_or_path, None)

    def loaded_ids(self) -> list[str]:
        with self._guard:
            return sorted(self._models)
