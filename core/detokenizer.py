"""Incremental detokenization: a streaming request's text grows by decoding its last few ids,
not all of them, at every step (a full decode a step costs a stream of n tokens O(n^2))."""

from __future__ import annotations

from typing import Callable

REPLACEMENT = "\ufffd"  # what a decode makes of an incomplete UTF-8 character
RESYNC = 16  # ids waiting past the text after which a full decode is tried


class TextStream:
    """The decoded text of a growing list of token ids. The text of ids[:read] is fixed once
    decoded; a call decodes ids[prefix:] and ids[prefix:read], where ``prefix`` lies a step's
    ids before ``read``, and appends what the longer decode adds: a tokenizer's clean-up at the
    start of a decode (a leading space dropped, a split character) acts on both alike. While
    the new text ends in an incomplete character, or the two decodes disagree, the text waits
    for more ids, so it never shows what a later id would change. (The scheme of vLLM's and
    TGI's incremental detokenizers.)"""

    def __init__(self, decode: Callable[[list[int]], str]):
        self.decode = decode
        self.text = ""
        self.prefix = 0  # ids[prefix:read] decoded give the tail of ``text``'s decode context
        self.read = 0  # ids[:read] are in ``text``

    def update(self, ids: list[int]) -> str:
        if len(ids) > self.read:
            before = self.decode(ids[self.prefix : self.read]) if self.read > self.prefix else ""
            after = self.decode(ids[self.prefix :])
            if len(after) > len(before) and after.startswith(before) and not after.endswith(REPLACEMENT):
                self.text += after[len(before) :]
                self.prefix, self.read = self.read, len(ids)
            elif len(ids) - self.read > RESYNC:
                self._resync(ids)
        return self.text

    def _resync(self, ids: list[int]) -> None:
        """A long wait (a tokenizer whose window decodes keep disagreeing): take the full
        decode where it extends the text so far."""
        full = self.decode(ids)
        if full.startswith(self.text) and not full.endswith(REPLACEMENT):
            self.text, self.prefix, self.read = full, len(ids) - 1, len(ids)
