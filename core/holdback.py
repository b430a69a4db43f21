"""What of a streaming request's text can be sent now: everything but a trailing incomplete
UTF-8 character and the longest tail that may still grow into one of its stop strings (the
final text excludes a matched stop string, so a client must never have seen its start).

The tail is found by a Knuth-Morris-Pratt automaton per stop string, fed each new character
once: a step costs what the text grew by, however long the stop strings are. (Testing every
prefix of a stop string against the text's end cost the square of its length every step: one
200,000-character stop string slowed every other request forty-fold.)"""

from __future__ import annotations

REPLACEMENT = "\ufffd"  # what a decode makes of an incomplete UTF-8 character


class _Matcher:
    """The longest prefix of ``stop`` that the text fed so far ends with. The failure table
    grows only as far as a match has reached, so a long stop string costs nothing until the
    text resembles it."""

    def __init__(self, stop: str):
        self.stop = stop
        self.fail = [0]  # fail[i]: the longest proper border of stop[: i + 1]
        self.state = 0  # characters of stop matched at the text's end

    def _border(self, i: int) -> int:
        while len(self.fail) <= i:  # extend the table to index i (needs only stop[: i + 1])
            j, k = len(self.fail), self.fail[-1]
            while k and self.stop[j] != self.stop[k]:
                k = self.fail[k - 1]
            self.fail.append(k + (self.stop[j] == self.stop[k]))
        return self.fail[i]

    def feed(self, text: str, start: int, end: int) -> None:
        """Feed text[start:end]."""
        stop, k, i, first = self.stop, self.state, start, self.stop[0]
        while i < end:
            if k == 0:  # no partial match: skip, in C, to the next place the stop string could start
                i = text.find(first, i, end)
                if i < 0:
                    break
            c = text[i]
            while k and stop[k] != c:
                k = self._border(k - 1)
            if stop[k] == c:
                k += 1
            if k == len(stop):  # a whole match (the engine ends the request); look for the next
                k = self._border(k - 1)
            i += 1
        self.state = k


class Holdback:
    """One streaming request's stop strings and how much of its text they hold back. The text
    given to ``stable`` only ever grows (``TextStream`` appends)."""

    def __init__(self, stops: tuple[str, ...]):
        self.matchers = [_Matcher(s) for s in stops if s]
        self.fed = 0  # characters of the text the matchers have seen

    def stable(self, text: str) -> str:
        end = len(text)
        while end > self.fed and text[end - 1] == REPLACEMENT:  # an incomplete character waits
            end -= 1
        if end > self.fed:
            for m in self.matchers:
                m.feed(text, self.fed, end)
            self.fed = end
        hold = max((m.state for m in self.matchers), default=0)
        return text[: end - hold]
