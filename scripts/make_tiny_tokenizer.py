"""Regenerate workers/models/tiny_tokenizer.json, the tokenizer of the ``tiny-random`` model.

A real byte-level BPE (GPT-2 style pre-tokenizer, 512 entries) trained on the essays the dashboard is
built on ("The Gradient Is a Covariance", "Sparsity Comes from Score Centering", as plain-text files in
the folder given with --seeds), plus the running example "She drank a cup of tea/coffee" repeated so that
" tea" and " coffee" are single tokens and the example prefix encodes to a handful of tokens.
The committed JSON is what the model uses; this script only exists to regenerate it.

Usage: python scripts/make_tiny_tokenizer.py --seeds DIR [--out FILE]
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

VOCAB_SIZE = 512
SPECIAL_TOKENS = ["<|endoftext|>", "<unk>"]
EXAMPLE_SENTENCES = [
    "She drank a cup of tea.",
    "She drank a cup of coffee.",
    "He drank a cup of coffee and she drank a cup of tea.",
    "A cup of tea or a cup of coffee: the reward is indifferent between tea and coffee.",
]
EXAMPLE_REPEATS = 200
REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = REPO_ROOT / "workers" / "models" / "tiny_tokenizer.json"


def training_text(seeds: Path) -> list[str]:
    """Lines of the essays (sorted by file name, so the order is fixed) and the repeated example."""
    lines: list[str] = []
    for path in sorted(seeds.glob("*.txt")):
        lines.extend(line for line in path.read_text(encoding="utf-8").splitlines() if line.strip())
    if not lines:
        raise SystemExit(f"no essay text found in {seeds}")
    return lines + EXAMPLE_SENTENCES * EXAMPLE_REPEATS


def build_tokenizer(lines: list[str]):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(lines, trainer=trainer)
    return tokenizer


def check(tokenizer) -> None:
    """The properties tests rely on; fail loudly rather than commit a tokenizer without them."""
    for word in (" tea", " coffee"):
        ids = tokenizer.encode(word).ids
        if len(ids) != 1:
            raise SystemExit(f"{word!r} encodes to {len(ids)} tokens, expected 1")
    prefix_ids = tokenizer.encode("She drank a cup of").ids
    if len(prefix_ids) > 6:
        raise SystemExit(f"the example prefix encodes to {len(prefix_ids)} tokens, expected <= 6")
    if tokenizer.get_vocab_size() != VOCAB_SIZE:
        raise SystemExit(f"vocab size {tokenizer.get_vocab_size()} != {VOCAB_SIZE}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=Path, required=True, help="the folder of the essays' .txt files")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args()
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    tokenizer = build_tokenizer(training_text(args.seeds))
    check(tokenizer)
    tokenizer.save(str(args.out), pretty=True)
    print(f"wrote {args.out} ({tokenizer.get_vocab_size()} tokens)")


if __name__ == "__main__":
    main()
