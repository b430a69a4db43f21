"""Tokenizers through the ``tokenizers`` library: a checkpoint's ``tokenizer.json``, or a
byte-level one (256 byte tokens + specials) for random-init models that ship none."""

from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from .config import ConfigError

END_OF_TEXT = "<|endoftext|>"
MASK = "<|mask|>"


def _byte_alphabet() -> list[str]:
    """The printable stand-in character for each byte 0..255 (GPT-2 byte-level convention)."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in range(256)]


def byte_tokenizer(vocab_size: int) -> Tokenizer:
    """Byte ids 0..255, then end-of-text (256), mask (257) and reserved specials up to vocab_size."""
    if vocab_size < 258:
        raise ValueError(f"a byte tokenizer needs vocab_size >= 258, got {vocab_size}")
    vocab = {ch: i for i, ch in enumerate(_byte_alphabet())}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    specials = [END_OF_TEXT, MASK] + [f"<|reserved_{i}|>" for i in range(vocab_size - 258)]
    tok.add_special_tokens(specials)
    return tok


def load_tokenizer(folder: str | Path) -> Tokenizer:
    path = Path(folder) / "tokenizer.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path}: not found; ship tokenizer.json beside config.json")
    try:
        return Tokenizer.from_file(str(path))
    except Exception as exc:  # noqa: BLE001 (the tokenizers library raises a bare Exception)
        reason = str(exc).splitlines()[0][:160] if str(exc) else type(exc).__name__
        raise ConfigError(f"{path}: not a tokenizer file the tokenizers library reads ({reason}); replace it with "
                          "the checkpoint's own tokenizer.json") from None
