"""Stop sequences and partial UTF-8 in streamed output (Ollama's runner/common helpers).

A token's text can be a fragment of a character (byte-fallback tokens) or of a stop sequence, so
the runner keeps generated pieces as bytes and holds them back until they are safe to send. Matching
and cutting work on bytes, as Go's string functions do, so offsets agree with Ollama's.
"""

from collections.abc import Sequence
from dataclasses import dataclass, field

from ollama_engine.sample import Logprob


def find_stop(text: bytes, stops: Sequence[bytes]) -> bytes | None:
    """The first stop, in list order, that occurs anywhere in text."""
    return next((stop for stop in stops if stop in text), None)


def contains_stop_suffix(text: bytes, stops: Sequence[bytes]) -> bool:
    """Whether text ends with the beginning of some stop, so the next tokens may complete it."""
    return any(text.endswith(stop[:i]) for stop in stops for i in range(1, len(stop) + 1))


def truncate_stop(pieces: Sequence[bytes], stop: bytes) -> tuple[list[bytes], bool]:
    """Pieces cut just before the first occurrence of stop, and whether the last kept piece was shortened.

    Pieces wholly after the cut are dropped; pieces are returned unchanged if stop does not occur.
    """
    joined = b"".join(pieces)
    index = joined.find(stop)
    if index == -1:
        return list(pieces), False
    kept: list[bytes] = []
    shortened = False
    start = 0
    for piece in pieces:
        if start >= index:
            break
        end = start + len(piece)
        shortened = end > index
        kept.append(joined[start : min(end, index)])
        start = end
    return kept, shortened


def incomplete_utf8(text: bytes) -> bool:
    """Whether text ends part-way through a multi-byte UTF-8 character.

    Looks back over at most 4 bytes for the lead byte of the last character; text that is invalid
    for other reasons is not reported here.
    """
    for back in range(1, min(4, len(text)) + 1):
        byte = text[-back]
        if byte & 0xC0 == 0x80:  # continuation byte 10xxxxxx: keep looking for the lead byte
            continue
        if byte & 0xE0 == 0xC0:  # 110xxxxx leads a 2-byte character
            return back < 2
        if byte & 0xF0 == 0xE0:  # 1110xxxx leads a 3-byte character
            return back < 3
        if byte & 0xF8 == 0xF0:  # 11110xxx leads a 4-byte character
            return back < 4
        return False
    return False


def decode_valid_prefix(data: bytes) -> str:
    """The longest prefix of data that is valid UTF-8, decoded.

    Ollama's runner drops bytes from the end until its output is valid, so anything from the first
    invalid byte on is lost, not carried over to the next message.
    """
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as error:
        return data[: error.start].decode("utf-8")


@dataclass(frozen=True)
class StopCut:
    """What `PendingOutput.cut_at_stop` removed; the runner trims its record of cached tokens by it."""

    stop: bytes
    pieces_removed: int
    token_truncated: bool


@dataclass
class PendingOutput:
    """Generated text and logprobs of one sequence that have not been sent to the client yet.

    Per sampled token the runner calls `add`, then ends the sequence if `cut_at_stop` finds a stop,
    keeps waiting while `must_hold`, and otherwise `seal`s the pending pieces into text that is ready;
    `take` hands the ready text over when the stream interval lets it go. Sealing at every token where
    nothing needs holding, not at each send, keeps the text the same however the sends are grouped:
    the valid UTF-8 prefix is cut per sealed group (as Ollama cuts each line), never across a group
    that another timing would have sent alone.
    """

    stops: list[bytes]
    pieces: list[bytes] = field(default_factory=list)
    logprobs: list[Logprob] = field(default_factory=list)
    ready: list[str] = field(default_factory=list)
    ready_logprobs: list[Logprob] = field(default_factory=list)

    @classmethod
    def for_stops(cls, stops: Sequence[str]) -> "PendingOutput":
        return cls(stops=[stop.encode("utf-8") for stop in stops])

    def add(self, piece: bytes, logprobs: Sequence[Logprob] = ()) -> None:
        self.pieces.append(piece)
        self.logprobs.extend(logprobs)

    def cut_at_stop(self) -> StopCut | None:
        """Remove the first stop found and everything after it, with the removed tokens' logprobs."""
        stop = find_stop(b"".join(self.pieces), self.stops)
        if stop is None:
            return None
        kept, token_truncated = truncate_stop(self.pieces, stop)
        removed = len(self.pieces) - len(kept)
        self.pieces = kept
        del self.logprobs[max(len(self.logprobs) - removed, 0) :]
        return StopCut(stop=stop, pieces_removed=removed, token_truncated=token_truncated)

    def must_hold(self) -> bool:
        """Whether the text so far could still turn into a stop or ends inside a character."""
        joined = b"".join(self.pieces)
        return contains_stop_suffix(joined, self.stops) or incomplete_utf8(joined)

    def seal(self) -> None:
        """Move the pending pieces to the ready text: their valid UTF-8 prefix, with their logprobs.

        A group whose text is empty is dropped, logprobs included, as Ollama sends nothing for it.
        """
        text = decode_valid_prefix(b"".join(self.pieces))
        if text:
            self.ready.append(text)
            self.ready_logprobs.extend(self.logprobs)
        self.pieces = []
        self.logprobs = []

    def take(self) -> tuple[str, list[Logprob]]:
        """The ready text and its logprobs, which leave the output."""
        text, logprobs = "".join(self.ready), self.ready_logprobs
        self.ready = []
        self.ready_logprobs = []
        return text, logprobs
