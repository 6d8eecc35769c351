"""StopMatcher: stop strings over streamed text deltas, against a brute-force reference."""

from __future__ import annotations

from itertools import pairwise

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.unit.conftest import stop_reference
from trio_llm.text.stop import StopMatcher

PROPERTY_SETTINGS = settings(max_examples=400, deadline=None, derandomize=True, database=None)


def _stream(matcher: StopMatcher, deltas: list[str], *, finish: bool = True) -> str:
    out = []
    for index, delta in enumerate(deltas):
        out.append(matcher.feed(delta, finished=finish and index == len(deltas) - 1))
    return "".join(out)


def test_without_stop_strings_text_passes_through() -> None:
    matcher = StopMatcher(["", ""])
    assert matcher.stop_strings == ()
    assert matcher.feed("anything at all") == "anything at all"
    assert matcher.held_text == ""
    assert not matcher.stopped


def test_duplicates_and_empty_strings_are_dropped() -> None:
    assert StopMatcher(["x", "", "y", "x"]).stop_strings == ("x", "y")


def test_a_stop_string_spanning_deltas_is_cut() -> None:
    matcher = StopMatcher(["STOP"])
    assert matcher.feed("Hello ST") == "Hello "
    assert matcher.held_text == "ST"
    assert not matcher.stopped
    assert matcher.feed("O") == ""
    assert matcher.held_text == "STO"
    assert matcher.feed("P and more") == ""
    assert matcher.stopped
    assert matcher.stop_string == "STOP"
    assert matcher.held_text == ""
    assert matcher.feed("later text") == ""
    assert matcher.feed("", finished=True) == ""


def test_held_text_is_released_once_it_cannot_be_a_stop() -> None:
    matcher = StopMatcher(["STOP"])
    assert matcher.feed("Hello ST") == "Hello "
    assert matcher.feed("ART") == "START"
    assert matcher.held_text == ""
    assert matcher.feed("S") == ""
    assert matcher.feed("S") == "S"  # "SS" is no prefix of "STOP", but its tail "S" is
    assert matcher.held_text == "S"
    assert not matcher.stopped


def test_only_the_part_that_can_still_match_is_held() -> None:
    matcher = StopMatcher(["aab"])
    assert matcher.feed("aaa") == "a"
    assert matcher.held_text == "aa"
    assert matcher.feed("b") == ""
    assert matcher.stop_string == "aab"


def test_a_self_overlapping_stop_is_found_after_a_false_start() -> None:
    matcher = StopMatcher(["abab"])
    assert matcher.feed("xaba") == "x"
    assert matcher.feed("a") == "aba"  # "abaa": only the last "a" can still start "abab"
    assert matcher.held_text == "a"
    assert matcher.feed("bab") == ""  # "abab" + "ab": the stop begins the buffer
    assert matcher.stop_string == "abab"


def test_finished_flushes_the_held_text() -> None:
    matcher = StopMatcher(["STOP"])
    assert matcher.feed("Hello ST") == "Hello "
    assert matcher.feed("", finished=True) == "ST"
    assert matcher.held_text == ""
    assert not matcher.stopped


def test_finished_with_text_releases_it_unless_it_completes_a_stop() -> None:
    released = StopMatcher(["STOP"])
    assert released.feed("a STO", finished=True) == "a STO"
    assert released.stop_string is None

    stopped = StopMatcher(["STOP"])
    assert stopped.feed("a ST") == "a "
    assert stopped.feed("OP b", finished=True) == ""
    assert stopped.stop_string == "STOP"


def test_include_stop_str_in_output() -> None:
    matcher = StopMatcher(["STOP"], include_stop_str_in_output=True)
    assert matcher.feed("a ST") == "a "
    assert matcher.feed("OP b") == "STOP"
    assert matcher.stop_string == "STOP"
    assert matcher.feed("c") == ""


def test_with_overlapping_stops_the_one_ending_first_wins() -> None:
    matcher = StopMatcher(["abcd", "bc"])
    assert matcher.feed("xabcd") == "xa"
    assert matcher.stop_string == "bc"

    included = StopMatcher(["abcd", "bc"], include_stop_str_in_output=True)
    assert included.feed("xabcd") == "xabc"
    assert included.stop_string == "bc"


def test_with_overlapping_stops_across_deltas() -> None:
    matcher = StopMatcher(["abcd", "bc"])
    assert matcher.feed("xab") == "x"
    assert matcher.held_text == "ab"
    assert matcher.feed("c") == "a"
    assert matcher.stop_string == "bc"


def test_when_stops_end_together_the_longest_wins() -> None:
    matcher = StopMatcher(["bc", "abc"])
    assert matcher.feed("xabcd") == "x"
    assert matcher.stop_string == "abc"


def test_an_earlier_ending_short_stop_beats_a_longer_one_starting_first() -> None:
    matcher = StopMatcher(["abcdef", "cd"])
    assert matcher.feed("ab") == ""
    assert matcher.feed("cdef") == "ab"
    assert matcher.stop_string == "cd"


@pytest.mark.parametrize("deltas", [["STOP here"], ["STOP"], ["S", "T", "O", "P"], ["", "STOP"]])
def test_a_stop_at_the_very_start_gives_empty_output(deltas: list[str]) -> None:
    matcher = StopMatcher(["STOP"])
    assert _stream(matcher, deltas, finish=False) == ""
    assert matcher.stop_string == "STOP"


def test_unicode_stop_strings() -> None:
    matcher = StopMatcher(["🎉🚀", "東京"])
    assert matcher.feed("party 🎉") == "party "
    assert matcher.held_text == "🎉"
    assert matcher.feed("🎊 東") == "🎉🎊 "
    assert matcher.feed("京タワー") == ""
    assert matcher.stop_string == "東京"


def test_stops_compare_code_points_without_normalization() -> None:
    matcher = StopMatcher(["e\u0301"])  # decomposed é
    assert matcher.feed("caf\u00e9 ", finished=True) == "caf\u00e9 "  # precomposed é
    assert matcher.stop_string is None


def test_held_text_stays_shorter_than_the_longest_stop() -> None:
    matcher = StopMatcher(["aaab", "c"])
    released = [matcher.feed("a") for _ in range(1000)]
    assert released == ["", "", "", *["a"] * 997]
    assert matcher.held_text == "aaa"
    assert matcher.feed("c") == "aaa"
    assert matcher.stop_string == "c"


# --- properties ------------------------------------------------------------------------

ALPHABET = "abc é🎉"
texts = st.text(alphabet=ALPHABET, max_size=40)
stop_lists = st.lists(st.text(alphabet=ALPHABET, max_size=5), max_size=4)


@st.composite
def splits(draw: st.DrawFn, text: str) -> list[str]:
    """``text`` cut at random points (empty deltas allowed)."""
    cuts = sorted(draw(st.lists(st.integers(0, len(text)), max_size=12)))
    bounds = [0, *cuts, len(text)]
    return [text[a:b] for a, b in pairwise(bounds)]


def _longest_held_suffix(text: str, stops: list[str]) -> str:
    """Brute force: the longest suffix of ``text`` that is a proper prefix of a stop."""
    for start in range(len(text) + 1):
        suffix = text[start:]
        if any(len(suffix) < len(s) and s.startswith(suffix) for s in stops):
            return suffix
    return ""


@PROPERTY_SETTINGS
@given(text=texts, stops=stop_lists, include=st.booleans(), data=st.data())
def test_any_split_matches_the_reference(
    text: str, stops: list[str], include: bool, data: st.DataObject
) -> None:
    deltas = data.draw(splits(text))
    separate_finish = data.draw(st.booleans())
    matcher = StopMatcher(stops, include_stop_str_in_output=include)

    out = []
    for index, delta in enumerate(deltas):
        last = index == len(deltas) - 1 and not separate_finish
        out.append(matcher.feed(delta, finished=last))
    if separate_finish:
        out.append(matcher.feed("", finished=True))

    expected, expected_stop = stop_reference(text, stops, include_stop_str_in_output=include)
    assert "".join(out) == expected
    assert matcher.stop_string == expected_stop
    assert matcher.stopped == (expected_stop is not None)
    assert matcher.held_text == ""


@PROPERTY_SETTINGS
@given(text=texts, stops=stop_lists, data=st.data())
def test_exactly_the_possible_stop_prefix_is_held(
    text: str, stops: list[str], data: st.DataObject
) -> None:
    """Before any match, everything fed is released except the longest possible stop start."""
    matcher = StopMatcher(stops)
    fed = released = ""
    for delta in data.draw(splits(text)):
        fed += delta
        released += matcher.feed(delta)
        if matcher.stopped:
            expected, stop = stop_reference(fed, stops)
            assert (released, matcher.stop_string) == (expected, stop)
            assert matcher.feed(data.draw(texts), finished=data.draw(st.booleans())) == ""
            return
        held = _longest_held_suffix(fed, [s for s in stops if s])
        assert matcher.held_text == held
        assert released + held == fed


def test_a_stop_string_may_begin_before_stopping_is_allowed() -> None:
    """vLLM's min_tokens: a stop string counts if it ends once stopping is allowed."""
    matcher = StopMatcher(["is.\n"])
    released = matcher.feed(" Par", stop_allowed=False)
    released += matcher.feed("is", stop_allowed=False)  # held: it may begin the stop string
    assert matcher.held_text == "is"
    released += matcher.feed(".\n", stop_allowed=True)
    assert (released, matcher.stop_string) == (" Par", "is.\n")


def test_a_stop_string_completed_before_stopping_is_allowed_is_text() -> None:
    matcher = StopMatcher([","])
    assert matcher.feed("a, b", stop_allowed=False) == "a, b"
    assert matcher.feed(", c", stop_allowed=True) == ""
    assert matcher.stop_string == ","
