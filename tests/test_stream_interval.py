"""The stream interval: a sequence's tokens sampled within it of its last line go out together (runner/loop.py).

Where decoding is faster than the interval, one line (one write, one wake-up of serve and of the client) carries
several tokens; the text and logprobs a client assembles are the same as with every token sent on its own, the
first token is never held, and no token waits behind a prompt's batch.
"""

from __future__ import annotations

import threading
import time

import pytest

from ollama_engine import envconfig
from ollama_engine.runner.allocate import LoadParams, open_model
from ollama_engine.runner.loop import Runner
from ollama_engine.runner.sequence import Piece, SequenceOptions
from ollama_engine.sample import Sampler

PROMPT = "Once upon a time, there was a little girl named Lily. She"


class Stream:
    """A completion's pieces as the sink receives them, with when each arrived."""

    def __init__(self) -> None:
        self.pieces: list[Piece] = []
        self.times: list[float] = []
        self.done = threading.Event()
        self.first = threading.Event()

    def __call__(self, piece: Piece | None) -> None:
        if piece is None:
            self.done.set()
            return
        self.pieces.append(piece)
        self.times.append(time.monotonic())
        self.first.set()

    @property
    def text(self) -> str:
        return "".join(piece.text for piece in self.pieces)

    @property
    def logprobs(self) -> list:
        return [entry for piece in self.pieces for entry in piece.logprobs]


@pytest.fixture(scope="module")
def loaded(stories_path):
    loaded = open_model(str(stories_path), LoadParams(parallel=2, batch_size=64, kv_size=1024, num_threads=2),
                        allocate=True)
    loaded.model.backend.load()
    yield loaded
    loaded.close()


def complete(runner: Runner, prompt: str, num_predict: int) -> tuple[Stream, object]:
    stream = Stream()
    seq = runner.new_sequence(prompt, SequenceOptions(sampler=Sampler(temperature=0), num_predict=num_predict,
                                                      logprobs=True, top_logprobs=2))
    runner.add(seq, stream)
    return stream, seq


def with_runner(loaded, interval: float):
    runner = Runner(loaded, lambda err: pytest.fail(f"runner failed: {err}"), stream_interval=interval)
    runner.start()
    return runner


def test_tokens_within_the_interval_share_a_line_and_nothing_else_changes(loaded):
    streams = {}
    for interval in (0.0, 60.0):
        runner = with_runner(loaded, interval)
        try:
            stream, seq = complete(runner, PROMPT, 60)
            assert stream.done.wait(120)
        finally:
            runner.close()
        assert seq.num_predicted == 60
        streams[interval] = stream
    each, gathered = streams[0.0], streams[60.0]
    assert len(each.pieces) == 60, "interval 0: one line per token"
    assert len(each.logprobs) == 60
    # 60 s: the first token alone (a client sees its first token as soon as without the interval), the rest in the
    # line the end of the sequence flushes
    assert len(gathered.pieces) == 2 and len(gathered.pieces[0].logprobs) == 1
    assert gathered.text == each.text and gathered.logprobs == each.logprobs


def test_a_prompt_batch_sends_what_the_interval_held(loaded):
    """A batch that computes a prompt's rows may take long: what other sequences hold is sent before it, so no
    token waits longer than the interval and one decode step."""
    runner = with_runner(loaded, 60.0)
    try:
        first, first_seq = complete(runner, PROMPT, 400)
        assert first.first.wait(60)
        second, _ = complete(runner, "Tom had a red ball. One day", 5)
        assert second.done.wait(120) and first.done.wait(120)
    finally:
        runner.close()
    assert first_seq.num_predicted == 400
    # without the flush before the second prompt's batch: 2 lines (the first token, then the rest at the end)
    assert len(first.pieces) == 3
    assert first.times[1] <= second.times[0], "the held text went out before the prompt's batch was computed"


@pytest.mark.parametrize(("value", "seconds"), [(None, envconfig.DEFAULT_STREAM_INTERVAL), ("5ms", 0.005),
                                                ("0", 0.0), ("2", envconfig.MAX_STREAM_INTERVAL),
                                                ("-1", envconfig.MAX_STREAM_INTERVAL), ("soon", 0.010)])
def test_the_interval_from_the_environment(value, seconds):
    env = {} if value is None else {"OLLAMA_ENGINE_STREAM_INTERVAL": value}
    assert envconfig.stream_interval(env) == pytest.approx(seconds)
