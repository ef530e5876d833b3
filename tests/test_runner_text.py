"""Stop sequences and partial UTF-8: ports of Ollama's runner/common stop tests, plus the pending buffer."""

import pytest

from ollama_engine.runner.text import (
    PendingOutput,
    StopCut,
    contains_stop_suffix,
    decode_valid_prefix,
    find_stop,
    incomplete_utf8,
    truncate_stop,
)
from ollama_engine.sample import Logprob


@pytest.mark.parametrize(
    ("pieces", "stop", "expected", "truncated"),
    [
        ([b"Hello", b"world"], b"world", [b"Hello"], False),
        ([b"Hello", b" wor"], b"or", [b"Hello", b" w"], True),
        ([b"Hello", b" there", b"!"], b"!", [b"Hello", b" there"], False),
        ([b"Hello", b" the", b"re!"], b"there!", [b"Hello", b" "], True),
        ([b"Hello", b" wo"], b"llo w", [b"He"], True),
    ],
)
def test_truncate_stop(pieces, stop, expected, truncated):
    assert truncate_stop(pieces, stop) == (expected, truncated)


def test_truncate_stop_without_the_stop_returns_the_pieces():
    assert truncate_stop([b"a", b"b"], b"zz") == ([b"a", b"b"], False)


def test_truncate_stop_cuts_at_the_first_occurrence():
    assert truncate_stop([b"x!", b"y!"], b"!") == ([b"x"], True)


def test_truncate_stop_counts_bytes_not_characters():
    # "é" is two bytes; the cut falls after it, inside the second piece.
    assert truncate_stop(["café".encode(), b" END"], b"END") == (["café".encode(), b" "], True)


@pytest.mark.parametrize(
    "text",
    [b"hi", "\u00e9".encode(), "\u20ac".encode(), "\U0001f600".encode(), b"", b"ab\xff"],
)
def test_complete_text_is_not_incomplete(text):
    assert not incomplete_utf8(text)


@pytest.mark.parametrize(
    "text",
    [b"\xc2", b"\xe0\xa0", b"\xe0", b"\xf0\x92\x8a", b"\xf0\x92", b"\xf0", b"hi \xe2\x82"],
)
def test_truncated_multibyte_tail_is_incomplete(text):
    assert incomplete_utf8(text)


def test_find_stop_takes_the_first_stop_in_list_order():
    assert find_stop(b"say goodbye now", [b"now", b"good"]) == b"now"
    assert find_stop(b"say goodbye now", [b"bye", b"now"]) == b"bye"
    assert find_stop(b"say goodbye now", [b"later"]) is None
    assert find_stop(b"anything", []) is None


def test_contains_stop_suffix():
    assert contains_stop_suffix(b"Hello <|e", [b"<|end|>"])
    assert contains_stop_suffix(b"Hello <", [b"STOP", b"<|end|>"])
    assert contains_stop_suffix(b"Hello <|end|>", [b"<|end|>"])
    assert not contains_stop_suffix(b"Hello <|x", [b"<|end|>"])
    assert not contains_stop_suffix(b"Hello", [b"", b"<|end|>"])


@pytest.mark.parametrize(
    ("data", "text"),
    [
        (b"plain", "plain"),
        ("caf\u00e9".encode(), "caf\u00e9"),
        (b"caf\xc3", "caf"),
        (b"ok\xff then", "ok"),
        (b"\xf0\x9f\x98", ""),
    ],
)
def test_decode_valid_prefix(data, text):
    assert decode_valid_prefix(data) == text


def logprob(token: str, value: float) -> Logprob:
    return {"token": token, "logprob": value}


@pytest.mark.parametrize(
    ("pieces", "stop", "expected"),
    [
        (["Hello", " world", "!"], "!", ["Hello", " world"]),
        (["Hello", " ", "there", "STOP"], "STOP", ["Hello", " ", "there"]),
        (["Hello", " the", "re!"], "there!", ["Hello", " "]),
        (["Hello", " world", "END"], "END", ["Hello", " world"]),
        (["Text", " ", "with", " ", "stop", " ", "word"], "stop word", ["Text", " ", "with", " "]),
        (["ST", "OP"], "STOP", []),  # the stop is all there is: no logprob survives
    ],
)
def test_logprobs_follow_stop_truncation(pieces, stop, expected):
    """Port of TestLogprobsWithStopSequences: one logprob per piece survives the cut."""
    pending = PendingOutput.for_stops([stop])
    for i, piece in enumerate(pieces):
        pending.add(piece.encode(), [logprob(piece, -0.1 * (i + 1))])
    cut = pending.cut_at_stop()
    assert cut is not None and cut.stop == stop.encode()
    assert pending.pieces == [p.encode() for p in expected]
    assert len(pending.logprobs) == len(expected)
    checked = len(expected) - 1 if cut.token_truncated else len(expected)
    assert [lp["token"] for lp in pending.logprobs[:checked]] == expected[:checked]
    assert cut.pieces_removed == len(pieces) - len(expected)


def flush(pending: PendingOutput) -> tuple[str, list]:
    """Everything pending, as the runner sends it when a sequence ends."""
    pending.seal()
    return pending.take()


def test_sealed_groups_keep_their_text_however_sends_are_grouped():
    """A broken character drops the text of its own group only: sent alone or together with the tokens
    before it (the stream interval's grouping), the same text and logprobs come out."""
    tokens = [(b" singles", -1.0), (b"\xe2", -2.0), (b" Buffer", -3.0), (b" x", -4.0)]
    results = []
    for group in (1, 2, 4):  # tokens taken per send
        pending, text, logprobs = PendingOutput.for_stops([]), "", []
        for i, (piece, value) in enumerate(tokens, 1):
            pending.add(piece, [logprob(piece.decode(errors="replace"), value)])
            if not pending.must_hold():
                pending.seal()
            if i % group == 0:
                sent, lps = pending.take()
                text, logprobs = text + sent, logprobs + [lp["logprob"] for lp in lps]
        sent, lps = flush(pending)
        results.append((text + sent, logprobs + [lp["logprob"] for lp in lps]))
    assert results[0] == (" singles x", [-1.0, -4.0])
    assert results[1] == results[0] and results[2] == results[0]


def test_pending_output_streams_like_the_runner():
    """Simulate the runner's per-token decisions on a stream that ends in a split stop sequence."""
    pending = PendingOutput.for_stops(["<|end|>"])
    sent: list[str] = []

    def step(piece: bytes) -> StopCut | None:
        pending.add(piece)
        cut = pending.cut_at_stop()
        if cut is None and not pending.must_hold():
            text, _ = flush(pending)
            sent.append(text)
        return cut

    assert step(b"Hi") is None
    assert step(b" \xe2\x82") is None  # the first two bytes of the euro sign: held back
    assert step(b"\xac") is None
    assert step(b" <|") is None  # could start "<|end|>": held back
    assert step(b"x") is None  # it did not
    assert step(b" <|en") is None
    cut = step(b"d|> tail")
    # " <|en" is shortened to " " and "d|> tail" is dropped.
    assert cut == StopCut(stop=b"<|end|>", pieces_removed=1, token_truncated=True)
    assert sent == ["Hi", " \u20ac", " <|x"]
    assert flush(pending) == (" ", [])


def test_pending_flush_takes_everything_and_drops_a_broken_tail():
    pending = PendingOutput.for_stops([])
    pending.add(b"ab", [logprob("ab", -0.5)])
    pending.add(b"\xe2\x82", [logprob("?", -1.0)])
    assert pending.must_hold()
    text, logprobs = flush(pending)
    assert text == "ab"
    assert [lp["token"] for lp in logprobs] == ["ab", "?"]
    assert pending.pieces == [] and pending.logprobs == []
    assert flush(pending) == ("", [])


def test_pending_without_logprobs_keeps_none():
    pending = PendingOutput.for_stops(["!"])
    pending.add(b"Hi")
    pending.add(b"!")
    cut = pending.cut_at_stop()
    assert cut == StopCut(stop=b"!", pieces_removed=1, token_truncated=False)
    assert pending.logprobs == []
    assert flush(pending) == ("Hi", [])


def test_stop_strings_are_matched_as_utf8():
    pending = PendingOutput.for_stops(["\u00e9t\u00e9"])
    pending.add("un \u00e9".encode())
    assert pending.cut_at_stop() is None and pending.must_hold()
    pending.add("t\u00e9 chaud".encode())
    cut = pending.cut_at_stop()
    assert cut == StopCut(stop="\u00e9t\u00e9".encode(), pieces_removed=1, token_truncated=True)
    assert flush(pending) == ("un ", [])
