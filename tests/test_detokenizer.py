"""Incremental detokenization: the streamed text is always a prefix of the full decode, and
catches up with it whenever the ids end on a whole character."""

import random

import pytest

from draftline.core.detokenizer import REPLACEMENT, TextStream
from draftline.core.models.tokenizer import byte_tokenizer, load_tokenizer

TOKENIZERS = {"trained BPE": lambda: load_tokenizer("specs/tiny/target"), "bytes": lambda: byte_tokenizer(512)}


@pytest.mark.parametrize("name", sorted(TOKENIZERS))
def test_streamed_text_is_the_full_decodes_prefix_at_every_step(name):
    tok, rng = TOKENIZERS[name](), random.Random(0)
    decode = lambda ids: tok.decode(ids, skip_special_tokens=True)  # noqa: E731 (as Engine._decode)
    text = "".join(chr(c) for c in range(32, 127)) + " héllo wörld — ☃ 日本語 " * 3
    pools = {"text": tok.encode(text, add_special_tokens=False).ids,
             "random": [rng.randrange(tok.get_vocab_size()) for _ in range(400)]}
    for pool in pools.values():
        for _ in range(20):
            stream, ids, grown = TextStream(decode), [], 0
            while grown < len(pool):
                grown += rng.randint(1, 7)  # a round's tokens
                ids = pool[:grown]
                shown, full = stream.update(ids), decode(ids)
                assert full.startswith(shown)
                if not full.endswith(REPLACEMENT):
                    assert len(full) - len(shown) <= len(decode(ids[stream.prefix :]))  # only the window's text waits
            if pool is pools["text"]:
                assert stream.update(ids) == decode(ids)  # whole characters: all of it


def test_a_window_that_never_agrees_falls_back_to_the_full_decode():
    def odd(ids):  # a window not from the start decodes to something no longer window extends
        return "".join(f"<{i}>" for i in ids) if not ids or ids[0] == 0 else f"[{len(ids)}]"

    stream, ids = TextStream(odd), list(range(40))
    for n in range(1, 41):
        stream.update(ids[:n])
    assert stream.read > 16 and stream.text == odd(ids[: stream.read])
