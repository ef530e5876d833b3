"""The stream interval: a sequence's tokens sampled within it of its last line go out together (runner/loop.py).

Where decoding is faster than the interval, one line (one write, one wake-up of serve and of the client) carries
several tokens; the text and logprobs a client assembles are the same as with every token sent on its own, the
first token is never held, and no token waits behind a prompt's batch.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator

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
    # the first token; the held text before the second prompt's batch; what went with the second's first token
    # and with its last line (test_a_line_takes_the_other_streams_text_with_it); the rest at the end
    assert len(first.pieces) == 5
    assert first.times[1] <= second.times[0], "the held text went out before the prompt's batch was computed"


def test_a_line_takes_the_other_streams_text_with_it(loaded):
    """A step that sends one sequence's line sends every other sequence's ready text with it: the reader (serve)
    wakes once for all its streams, whose intervals then run in step, and no text is held any longer."""
    runner = Runner(loaded, lambda err: pytest.fail(f"runner failed: {err}"), stream_interval=60.0)
    step = [0]

    @contextlib.contextmanager
    def counted() -> Iterator[None]:  # wraps each step's sampling, where the lines are sent
        step[0] += 1
        yield

    runner.hold_output = counted
    steps: dict[str, list[int]] = {"first": [], "second": []}
    streams = {name: Stream() for name in steps}

    def sink(name: str):
        def record(piece: Piece | None) -> None:
            if piece is not None:
                steps[name].append(step[0])
            streams[name](piece)
        return record

    runner.start()
    try:
        first = runner.new_sequence(PROMPT, SequenceOptions(sampler=Sampler(temperature=0), num_predict=200))
        runner.add(first, sink("first"))
        assert streams["first"].first.wait(60)
        second = runner.new_sequence("Tom had a red ball. One day", SequenceOptions(sampler=Sampler(temperature=0),
                                                                                    num_predict=5))
        runner.add(second, sink("second"))
        assert streams["second"].done.wait(120) and streams["first"].done.wait(120)
    finally:
        runner.close()
    assert len(steps["second"]) == 2  # its first token, then the rest as it ends
    assert set(steps["second"]) <= set(steps["first"]), (steps, "the first's text went with each of the second's lines")


@pytest.mark.parametrize(("value", "seconds"), [(None, envconfig.DEFAULT_STREAM_INTERVAL), ("5ms", 0.005),
                                                ("0", 0.0), ("2", envconfig.MAX_STREAM_INTERVAL),
                                                ("-1", envconfig.MAX_STREAM_INTERVAL),
                                                ("soon", envconfig.DEFAULT_STREAM_INTERVAL)])
def test_the_interval_from_the_environment(value, seconds):
    env = {} if value is None else {"OLLAMA_ENGINE_STREAM_INTERVAL": value}
    assert envconfig.stream_interval(env) == pytest.approx(seconds)
