"""Stop strings over text deltas: earliest match, exact hold-back, trimming, inclusion."""

from __future__ import annotations

from gateway.stop_strings import StopCheck, StopStringMatcher


def feed_all(matcher: StopStringMatcher, deltas: list[str]) -> list[StopCheck]:
    return [matcher.feed(d) for d in deltas]


def test_no_stops_passes_text_through():
    assert StopStringMatcher([]).feed("abc") == StopCheck("abc")


def test_match_split_across_deltas_is_trimmed():
    matcher = StopStringMatcher(["STOP"])
    checks = feed_all(matcher, ["hello S", "TO", "P after"])
    assert checks == [StopCheck("hello "), StopCheck(""), StopCheck("", "STOP")]


def test_hold_back_only_while_a_prefix_can_still_match():
    matcher = StopStringMatcher(["STOP"])
    assert matcher.feed("ST") == StopCheck("")
    assert matcher.feed("X") == StopCheck("STX")  # "STX" cannot start "STOP": released at once
    assert matcher.feed("end") == StopCheck("end")
    assert matcher.flush() == ""


def test_flush_releases_held_text_at_the_end():
    matcher = StopStringMatcher(["STOP"])
    assert matcher.feed("abcSTO") == StopCheck("abc")
    assert matcher.flush() == "STO"


def test_earliest_of_several_stops_wins():
    matcher = StopStringMatcher(["world", "lo"])
    assert matcher.feed("hello world") == StopCheck("hel", "lo")


def test_include_stop_string_in_output_emits_eagerly():
    matcher = StopStringMatcher(["STOP"], include_in_output=True)
    assert feed_all(matcher, ["a ST", "OP b"]) == [StopCheck("a ST"), StopCheck("OP", "STOP")]


def test_match_inside_one_delta_drops_what_follows():
    assert StopStringMatcher(["\n\n"]).feed("line one\n\nline two") == StopCheck("line one", "\n\n")
