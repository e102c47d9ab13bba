"""Stop strings enforced on the coordinator must behave like vLLM's detokenizer check."""

from coordinator.pipeline.context import StopSpec
from coordinator.pipeline.derender.stop import StopMatcher, truncate_at_stop


def feed_all(spec: StopSpec, deltas: list[str]) -> tuple[str, str | None, int]:
    m = StopMatcher(spec)
    out = ""
    for i, d in enumerate(deltas, start=1):
        r = m.feed(d, 1)
        out += r.text
        if r.stop:
            return out, r.stop, i
    return out + m.flush(), None, len(deltas)


def test_cut_before_stop_string_and_tokens_after_are_not_counted() -> None:
    text, stop, tokens = feed_all(StopSpec(("three",)), ["one", " two", " th", "ree", " four"])
    assert (text, stop, tokens) == ("one two ", "three", 4)


def test_include_stop_str_in_output_keeps_it() -> None:
    text, stop, _ = feed_all(StopSpec(("three",), include_in_output=True), ["one", " two", " three", " x"])
    assert (text, stop) == ("one two three", "three")


def test_partial_stop_string_is_held_back_while_streaming() -> None:
    m = StopMatcher(StopSpec(("END",)))
    # vLLM holds back len(longest stop) - 1 characters, here 2.
    assert m.feed("hello E", 1).text == "hello"
    assert m.feed("N", 1).text == " "
    r = m.feed("x", 1)                                 # "ENx" is not a stop
    assert r.stop is None and r.text == "E"
    assert m.flush() == "Nx"


def test_earliest_completing_stop_wins_within_one_delta() -> None:
    text, stop, _ = feed_all(StopSpec(("bc d", "c")), ["ab", "c d"])
    assert (text, stop) == ("ab", "c")


def test_min_tokens_suppresses_early_matches() -> None:
    # vLLM only searches text of tokens after the first min_tokens ones.
    assert feed_all(StopSpec(("x",), min_tokens=2), ["x", "ax", "b"]) == ("xaxb", None, 3)
    assert feed_all(StopSpec(("x",), min_tokens=2), ["x", "ax", "bx"]) == ("xaxb", "x", 3)


def test_no_stop_strings_passes_text_through_unchanged() -> None:
    text, stop, _ = feed_all(StopSpec(), ["héllo", " 世界", " 🙂"])
    assert (text, stop) == ("héllo 世界 🙂", None)


def test_batch_truncation_matches_streaming_rule() -> None:
    spec = StopSpec(("\n", "."))
    assert truncate_at_stop("Paris is big.\nYes", spec) == ("Paris is big", ".")
    assert truncate_at_stop("no stop here", spec) == ("no stop here", None)
