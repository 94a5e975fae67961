"""Which module kind and which layer a parameter belongs to, from its name alone.

Why names: every Hugging Face family spells its modules differently (Llama's q_proj, GPT-2's c_attn,
GPT-NeoX's query_key_value, OPT's fc1), and the summaries group tensors by kind and layer for every one
of them. The kinds are the shared vocabulary's ``MODULE_KINDS``.
"""

from __future__ import annotations

import re

from backend.vocabulary import MODULE_KINDS

# first match wins: the names of Llama-likes, GPT-2 (c_attn, c_fc, c_proj), GPT-NeoX and Falcon
# (query_key_value, dense_*), OPT (fc1, fc2, out_proj), mixture-of-experts (gate_up_proj, the router)
KIND_PATTERNS: tuple[tuple[str, re.Pattern[str]], ...] = tuple(
    (kind, re.compile(pattern))
    for kind, pattern in (
        ("norm", r"norm|(^|\.)ln_"),
        ("position", r"wpe|embed_positions|position_embeddings"),
        ("qkv", r"qkv|query_key_value|c_attn"),
        ("gate_up", r"gate_up_proj"),
        ("q", r"q_proj"),
        ("k", r"k_proj"),
        ("v", r"v_proj"),
        ("o", r"o_proj|out_proj|attn\.c_proj|attention\.dense\."),
        ("gate", r"gate_proj"),
        ("up", r"up_proj|c_fc|fc1|dense_h_to_4h"),
        ("down", r"down_proj|mlp\.c_proj|fc2|dense_4h_to_h"),
        ("router", r"mlp\.gate\.|router"),
    )
)
assert all(kind in MODULE_KINDS for kind, _ in KIND_PATTERNS)
_LAYER = re.compile(r"(?:^|\.)(?:layers|h|blocks|layer)\.(\d+)\.")


def module_kind(name: str, head_name: str, embedding_name: str) -> str:
    if name == head_name:
        return "head"
    if name == embedding_name:
        return "embedding"
    return next((kind for kind, pattern in KIND_PATTERNS if pattern.search(name)), "other")


def layer_of(name: str, embedding_name: str) -> int | str:
    """The block index, or "embed" for the tables before the first block, "final" for what follows."""
    match = _LAYER.search(name)
    if match:
        return int(match.group(1))
    return "embed" if name == embedding_name or module_kind(name, "", "") == "position" else "final"
