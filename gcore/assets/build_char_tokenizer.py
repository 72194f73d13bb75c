"""Rebuilds ``char_tokenizer.json``, the embedded default's character-level tokenizer.

Run ``python -m gcore.assets.build_char_tokenizer`` after changing the vocabulary. Ids 0-3 are
``<pad> <s> </s> <unk>``; then every printable ASCII character and newline, one token each.
"""

from __future__ import annotations

import string
from pathlib import Path

SPECIAL_TOKENS = ["<pad>", "<s>", "</s>", "<unk>"]
CHARACTERS = [c for c in string.printable if c not in "\t\r\x0b\x0c"]


def build(path: Path) -> None:
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    vocab = {token: i for i, token in enumerate(SPECIAL_TOKENS + CHARACTERS)}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tokenizer.decoder = decoders.Fuse()
    tokenizer.add_special_tokens(SPECIAL_TOKENS)
    tokenizer.save(str(path))


if __name__ == "__main__":
    build(Path(__file__).with_name("char_tokenizer.json"))
