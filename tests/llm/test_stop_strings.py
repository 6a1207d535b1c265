"""StopStringStream: whatever the pieces, the stream shows exactly the text before the first stop string."""

from __future__ import annotations

import random

import pytest

from llmplan.llm.text.stop_strings import StopStringStream

CASES = [
    ("Hello world. The end. More", ["The end"], "Hello world. "),
    ("abcabcabd tail", ["abd"], "abcabc"),
    ("no stop in here at all", ["zzz", "q!"], "no stop in here at all"),
    ("ends with a partial sto", ["stop"], "ends with a partial sto"),  # held back, then shown at the end
    ("two: B then A", ["A", "B"], "two: "),  # the earliest stop wins
    ("日本語の文。次の文", ["。"], "日本語の文"),
]


@pytest.mark.parametrize(("text", "stops", "shown"), CASES)
def test_every_split_streams_the_text_before_the_stop(text: str, stops: list[str], shown: str) -> None:
    rng = random.Random(0)
    for _ in range(50):
        out: list[str] = []
        stream = StopStringStream(out.append, stops)
        cuts = sorted(rng.sample(range(1, len(text)), k=rng.randint(0, min(6, len(text) - 1))))
        for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True):
            stream.push(text[a:b])
            assert not any(s in "".join(out) for s in stops)
        stream.end()
        assert "".join(out) == shown


def test_text_is_held_back_only_while_it_can_still_become_a_stop() -> None:
    out: list[str] = []
    stream = StopStringStream(out.append, ["</answer>"])
    stream.push("The result is 4 </ans")
    assert "".join(out) == "The result is 4 "  # "</ans" may still become the stop string
    stream.push("wer")
    assert "".join(out) == "The result is 4 "
    stream.push("s> and more")  # it did not: "</answers>" is text
    assert "".join(out) == "The result is 4 </answers> and more"
