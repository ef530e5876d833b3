"""One request as the batch loop sees it: its inputs, its sampler, its pending output and its metrics.

Everything here except `quit` is touched only with the runner's lock held: by the request handler when
the sequence starts, and by the batch loop afterwards. Output leaves through `sink`, a thread-safe
callable the server provides: it receives a `Piece` per chunk of text and `None` once the sequence has
ended (its `done_reason` and metrics are final by then).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import IntEnum

from ollama_engine.runner.images import ImageStats
from ollama_engine.runner.inputs import Input, group_boundary, kept_together
from ollama_engine.runner.prompt_cache import InputCacheSlot
from ollama_engine.runner.speculate import Speculator
from ollama_engine.runner.text import PendingOutput
from ollama_engine.sample import GrammarMatcher, Logprob, Sampler


class DoneReason(IntEnum):
    """Why a sequence ended; sent as an integer (Ollama's llm.DoneReason)."""

    STOP = 0
    LENGTH = 1
    CONNECTION_CLOSED = 2


class InputTooLongError(ValueError):
    """The prompt does not fit the context and the request forbids truncating it."""

    def __init__(self) -> None:
        super().__init__("the input length exceeds the context length")


@dataclass(frozen=True)
class Piece:
    """A chunk of generated text ready for the client, with the logprobs of its tokens."""

    text: str
    logprobs: list[Logprob]


def capped_num_predict(num_predict: int, num_ctx: int | None) -> int:
    """Ollama's hard limit of 10 × num_ctx generated tokens, so that no request generates without end (-1,
    and 0 that the runner reads as no limit, get the cap). Serve applies it as Ollama's parent does; the
    runner applies it again to whatever a parent sends."""
    limit = 10 * (num_ctx or 0)
    return limit if limit and not 0 < num_predict <= limit else num_predict


@dataclass
class SequenceOptions:
    """The parts of a completion request the batch loop acts on."""

    sampler: Sampler
    num_predict: int = -1  # <= 0: no limit
    num_keep: int = 0  # < 0: keep the whole prompt on a context shift
    stop: list[str] = field(default_factory=list)
    shift: bool = True  # shift the context when full, instead of ending with DoneReason.LENGTH
    truncate: bool = True  # cut an overlong prompt, instead of rejecting it
    logprobs: bool = False
    top_logprobs: int = 0
    spec_ngram: bool = False  # draft from the sequence's own text (runner/speculate.py)
    draft_num_predict: int = 0  # most tokens drafted per step; 0: the default


@dataclass(eq=False)
class Sequence:
    inputs: list[Input]
    """Inputs not yet put in a batch: the prompt, then a placeholder for each token to be sampled."""
    options: SequenceOptions
    num_keep: int
    """Inputs at the start of the context that a shift never discards."""
    num_prompt_inputs: int
    sink: Callable[[Piece | None], None] = lambda item: None
    pending_inputs: list[Input] = field(default_factory=list)
    """Inputs in the batch being built or computed, not yet recorded in the slot."""
    output: PendingOutput = field(init=False)
    slot: InputCacheSlot | None = None
    batch_row: int = 0
    """Row of this sequence's logits in the current batch's output."""
    quit: threading.Event = field(default_factory=threading.Event)
    """Set by the server when the client has gone away."""
    done_reason: DoneReason | None = None
    grammar: GrammarMatcher | None = None
    """Constrains the sampled tokens (the request's Grammar); None: unconstrained."""
    error: str | None = None
    """Why the sequence failed part-way (its grammar reached an error); the stream ends without a result."""
    spec: Speculator | None = None
    """Its n-gram speculation, if the request asked for it and the model allows it exactly."""

    sent_at: float = 0.0
    """When its text last went to the sink (time.monotonic()): tokens sampled within the runner's stream interval
    after it are held and go together."""

    # metrics, from time.monotonic()
    started_at: float | None = None
    last_updated_at: float = 0.0
    processing_duration: float = 0.0
    sampling_duration: float = 0.0
    num_predicted: int = 0
    images: ImageStats = field(default_factory=ImageStats)
    """Its prompt's images: how many the vision tower encoded (the others came from the cache), in what time."""

    def __post_init__(self) -> None:
        self.output = PendingOutput.for_stops(self.options.stop)

    def eval_duration(self) -> float:
        """Seconds spent generating after the first token, sampling excluded."""
        if self.started_at is None or self.num_predicted == 0:
            return 0.0
        return self.last_updated_at - self.started_at - self.sampling_duration

    def mark_started(self) -> None:
        if self.started_at is None:
            self.started_at = time.monotonic()


def fit_prompt(inputs: list[Input], num_ctx: int, num_keep: int, truncate: bool) -> tuple[list[Input], int]:
    """The prompt cut to the context (keeping its first num_keep inputs), and the num_keep to use.

    A negative num_keep keeps the whole prompt; num_keep is at most num_ctx - 1 so that a shift can
    always discard something. Cutting never splits a same-batch group (e.g. an image): a num_keep that would
    end inside one ends before it, so that truncation and every later shift keep the group whole or drop it
    whole (Ollama refused such a prompt when it had to be truncated, and its shift cut the image).
    """
    if not inputs:
        raise ValueError("no input provided")
    if num_keep < 0:
        num_keep = len(inputs)
    num_keep = group_boundary(inputs, min(num_keep, num_ctx - 1))
    if len(inputs) <= num_ctx:
        return inputs, num_keep
    if not truncate:
        raise InputTooLongError()

    prompt_start = num_keep + len(inputs) - num_ctx
    group_left = 0
    for i in range(len(inputs)):
        if group_left > 0:
            group_left -= 1
            if prompt_start == i:
                prompt_start += 1  # never start inside a group
        elif prompt_start == i:
            break
        span = kept_together(inputs, i)
        if span:
            if i < num_keep:
                raise ValueError(f"SameBatch may not be specified within numKeep (index: {i} numKeep: {num_keep})")
            group_left = span
    if prompt_start >= len(inputs):
        raise ValueError("entire prompt removed by truncation")
    return inputs[:num_keep] + inputs[prompt_start:], num_keep

