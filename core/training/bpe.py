"""A byte-level BPE tokenizer trained with the `tokenizers` library."""

from __future__ import annotations

from typing import Iterable

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from ..models.tokenizer import END_OF_TEXT, MASK

SPECIALS = [END_OF_TEXT, MASK]  # ids 0 and 1


def train_bpe(texts: Iterable[str], vocab_size: int) -> Tokenizer:
    if not 512 <= vocab_size <= 65535:
        raise ValueError(f"vocab_size {vocab_size} out of range; use 512..65535 (4096-8192 suits the tiny model)")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return tok
