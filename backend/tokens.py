"""Tokenization for the API, over the model's own `tokenizer.json` (no transformers, no torch).

Why a codec: the cache key is made of token ids, so the API tokenizes exactly as the model was
trained (the prefix with the tokenizer's default special tokens, a continuation without), and reward
and data tokens must name exactly one token so "reward on ' tea'" means one row of the LM head.
"""

from __future__ import annotations

import re
from functools import lru_cache
from pathlib import Path

from tokenizers import Tokenizer

_ID_FORM = re.compile(r"#(\d{1,9})")


class TokenError(ValueError):
    """A text that does not name exactly one known token (the message says why)."""


class TokenCodec:
    """Encode prefixes and continuations, and resolve single tokens by text or `#ID`."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.vocab_size: int = tokenizer.get_vocab_size(with_added_tokens=True)
        self._unknown_id = _unknown_token_id(tokenizer)

    @classmethod
    def from_file(cls, path: str | Path) -> TokenCodec:
        return cls(Tokenizer.from_file(str(path)))

    def encode_prefix(self, text: str) -> list[int]:
        """Token ids of a prefix, with the tokenizer's default special tokens (e.g. BOS)."""
        return list(self.tokenizer.encode(text, add_special_tokens=True).ids)

    def encode_continuation(self, text: str) -> list[int]:
        """Token ids of a continuation: it follows the prefix, so no special tokens."""
        return list(self.tokenizer.encode(text, add_special_tokens=False).ids)

    def token_text(self, token_id: int) -> str:
        """The text a single token stands for (byte-level pieces decoded, e.g. ' coffee')."""
        text = self.tokenizer.decode([token_id], skip_special_tokens=False)
        if text:
            return text
        piece = self.tokenizer.id_to_token(token_id)
        return piece if piece is not None else f"#{token_id}"

    def pieces(self, ids: list[int]) -> list[dict]:
        return [{"id": token_id, "text": self.token_text(token_id)} for token_id in ids]

    def single_token_id(self, text_or_id: str) -> int:
        """The id of a text that encodes to exactly one known token, or of `#ID`.

        Raises TokenError naming the pieces when the text splits into several tokens, none, or the
        unknown token.
        """
        match = _ID_FORM.fullmatch(text_or_id)
        if match:
            token_id = int(match.group(1))
            if token_id >= self.vocab_size:
                raise TokenError(f"token {text_or_id!r} is outside the vocabulary (size {self.vocab_size})")
            return token_id
        if text_or_id == "":
            raise TokenError("a token text must not be empty; give its text (e.g. ' tea') or '#ID'")
        ids = self.encode_continuation(text_or_id)
        if len(ids) != 1:
            pieces = [self.token_text(token_id) for token_id in ids]
            raise TokenError(
                f"{text_or_id!r} is {len(ids)} tokens {pieces!r}, not exactly one; "
                "pick one of them (GET /api/v1/tokenize shows the split) or use '#ID'"
            )
        if ids[0] == self._unknown_id:
            raise TokenError(f"{text_or_id!r} is the unknown token; pick a token in the vocabulary")
        return ids[0]


def _unknown_token_id(tokenizer: Tokenizer) -> int | None:
    unk = getattr(tokenizer.model, "unk_token", None)
    return tokenizer.token_to_id(unk) if unk else None


@lru_cache(maxsize=16)
def codec_for_path(path: str, mtime_ns: int) -> TokenCodec:
    """A codec per tokenizer file (cached; the mtime makes a refetched model reload)."""
    return TokenCodec.from_file(path)


def codec_for_file(path: Path) -> TokenCodec:
    return codec_for_path(str(path), path.stat().st_mtime_ns)
