from kinetic.text.stop import StopMatcher


def run(stops, pieces):
    m = StopMatcher(stops)
    out = [m.feed(p) for p in pieces]
    return out, m.flush(), m.stopped


def test_stop_spanning_pieces_is_not_emitted():
    out, tail, stopped = run(["</end>"], ["Hello </", "en", "d> more"])
    assert "".join(out) == "Hello " and tail == "" and stopped == "</end>"
    assert out == ["Hello ", "", ""]  # "</" and "en" held back, never streamed


def test_partial_match_released_when_it_fails():
    out, tail, stopped = run(["STOP"], ["a ST", "OX b"])
    assert out == ["a ", "STOX b"] and stopped is None and tail == ""


def test_held_text_flushed_at_end():
    out, tail, stopped = run(["###"], ["x #", "#"])
    assert out == ["x ", ""] and tail == "##" and stopped is None


def test_earliest_stop_wins_and_no_stops():
    out, _, stopped = run(["b", "a"], ["xxab"])
    assert out == ["xx"] and stopped == "a"
    assert run([], ["a", "b"])[0] == ["a", "b"]
    assert run([""], ["a"])[0] == ["a"]


def test_nothing_after_stop():
    m = StopMatcher(["."])
    assert m.feed("Hi. there") == "Hi" and m.feed("more") == "" and m.flush() == ""
