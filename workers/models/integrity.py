"""What a checkpoint must be before its weights are trusted: a causal LM, loaded with nothing invented.

Why a module of its own: transformers is lenient on purpose. It builds BERT's ``BertLMHeadModel``
(bidirectional unless a config flag says otherwise) when asked for a causal LM, fills parameters
missing from a checkpoint with values drawn from the config's initialiser and drops checkpoint
tensors it has no place for, and only logs it. Any of these would be certified as an exact analysis
of a model that is not the one on disk. These checks read what the model is (its config and
transformers' loading report), not its name; causality by behaviour is part of the certificate
(``workers.fisher.certificate``).
"""

from __future__ import annotations

import re
from collections.abc import Iterable

SHOWN_KEYS = 3  # keys named in a refusal; the rest are counted


def config_refusal(config) -> str | None:
    """Why ``config`` is not a decoder-only causal LM by construction, or None.

    Encoder-decoders are refused (the decoder's logits depend on an encoder input the engine never
    sees). BERT-like encoder families (those with a masked-LM class in transformers) become causal
    only through their ``is_decoder`` flag: with it off they are bidirectional, which the
    certificate's behavioural check catches; with it on they run causally, but the flag is a
    run-time switch over an architecture built (and usually trained) to attend both ways, and
    nothing in the folder says which way the weights were trained. They are refused rather than
    certified as causal LMs they may never have been. Decoder families that merely carry the
    attribute (GPT-NeoX declares ``is_decoder``) have no masked-LM class and are unaffected.
    """
    from transformers import AutoModelForMaskedLM

    family = f"{type(config).__name__} ({getattr(config, 'model_type', '?')})"
    for part in (config, getattr(config, "text_config", None)):
        if part is not None and getattr(part, "is_encoder_decoder", False):
            return f"{family} is an encoder-decoder; only decoder-only causal LMs are analysed"
    if getattr(config, "is_decoder", False) and type(config) in AutoModelForMaskedLM._model_mapping:
        return (
            f"{family} is an encoder family made causal only by its is_decoder flag; models that "
            "need that flag (or attend in both directions without it) are refused"
        )
    return None


def loading_refusal(info: dict) -> str | None:
    """Why a load is refused, from transformers' ``output_loading_info`` report, or None.

    Tied weights (an LM head sharing the embedding table) are not reported missing: transformers
    removes a tied key from ``missing_keys`` once its source was loaded.
    """
    mismatched = [key[0] if isinstance(key, tuple) else key for key in info.get("mismatched_keys") or ()]
    problems = [
        _keys("missing from the checkpoint (would be initialised from the config)", info.get("missing_keys")),
        _keys("in the checkpoint but unused by the model", info.get("unexpected_keys")),
        _keys("of the wrong shape", mismatched),
    ]
    errors = [" ".join(str(message).split()) for message in info.get("error_msgs") or ()]
    if errors:
        problems.append(f"{len(errors)} loading errors, first: {errors[0][:200]}")
    found = [problem for problem in problems if problem]
    return "; ".join(found) if found else None


def _keys(what: str, keys: Iterable[str] | None) -> str | None:
    """``'N weights <what>: a, b, c, ...'``, or None when there are none."""
    names = sorted(keys or (), key=_natural)
    if not names:
        return None
    shown = ", ".join(names[:SHOWN_KEYS]) + (", ..." if len(names) > SHOWN_KEYS else "")
    return f"{len(names)} weight{'s' * (len(names) != 1)} {what}: {shown}"


def _natural(key: str) -> list:
    """Sort key that puts layer 2 before layer 10 (the first keys named are the first layers)."""
    return [(0, int(part), "") if part.isdigit() else (1, 0, part) for part in re.split(r"(\d+)", key)]
