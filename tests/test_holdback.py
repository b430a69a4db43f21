"""What a stream may send while stop strings could still match (core/holdback.py): the same
text as the definition (the longest tail that is a proper prefix of a stop string is held,
and a trailing incomplete character), at a cost linear in the text, whatever the stop
strings' lengths."""

import random
import time

from draftline.core.holdback import Holdback


def held_by_definition(text: str, stops: tuple[str, ...]) -> str:
    text = text.rstrip("\ufffd")
    hold = max((n for s in stops for n in range(1, len(s)) if text.endswith(s[:n])), default=0)
    return text[: len(text) - hold]


def test_the_same_text_as_the_definition_as_the_text_grows():
    rng = random.Random(0)
    for trial in range(2000):
        alphabet = "ab\ufffd" if trial % 3 == 0 else "abc"
        stops = tuple("".join(rng.choice("ab") for _ in range(rng.randint(1, 7))) for _ in range(rng.randint(1, 3)))
        holdback, text = Holdback(stops), ""
        for _ in range(rng.randint(1, 10)):
            text += "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 6)))
            if any(s in text.rstrip("\ufffd") for s in stops):
                break  # the engine ends the request at a whole match; nothing more is streamed
            assert holdback.stable(text) == held_by_definition(text, stops), (stops, text)


def test_a_long_stop_string_costs_what_the_text_grew_by():
    """A 200,000-character stop string: the failure table grows only as far as the text has
    matched it, so 2,000 steps over 10,000 characters take milliseconds (the definition took
    about half a second a step here)."""
    stop = "x" * 199_999 + "y"
    holdback, text = Holdback((stop, "zz")), ""
    start = time.perf_counter()
    for _ in range(2000):
        text += "xxxxx"
        assert holdback.stable(text) == ""  # all of it may still become the stop string
    assert time.perf_counter() - start < 2.0
    assert len(holdback.matchers[0].fail) <= len(text) + 1
    text += "ok"
    assert holdback.stable(text) == text
