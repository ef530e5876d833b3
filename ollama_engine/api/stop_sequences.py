"""Stop sequences matched by the API rather than the runner, so that the answer can say which one ended it.

The runner reports only stop or length; Anthropic's `stop_reason: "stop_sequence"` names the sequence.
So the route keeps its stop sequences from the runner and cuts the runner's lines here: text that could
still begin a stop sequence is held back, the first one found (the earliest in the text) ends the stream
with a final line of our own, and closing the runner's stream ends the generation. The lines carry one
logprob entry per generated token (the route asks the runner for them), so the final line still counts
exactly the tokens generated up to and including the one that completed the stop.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import aclosing
from dataclasses import dataclass

from .completion import Chunks


@dataclass
class Outcome:
    """What the chat chunks do not say: the stop sequence that ended the output, if one did."""

    stop_sequence: str | None = None


def _held(text: str, stops: Sequence[str]) -> int:
    """How many trailing characters of `text` could begin a stop sequence (held back until known)."""
    return max((n for stop in stops for n in range(1, len(stop)) if text.endswith(stop[:n])), default=0)


async def stopped_lines(lines: Chunks, stops: Sequence[str], input_tokens: int, outcome: Outcome) -> Chunks:
    """Runner lines cut at the first of `stops` (then ended with a final line of our own, done_reason stop).

    The lines carry one logprob entry per generated token (asked for by the route), so the cut knows
    exactly how many tokens were generated up to and including the one that completed the stop."""
    pending, tokens = "", 0
    async with aclosing(lines) as source:
        async for line in source:
            if line.get("done"):
                if pending:
                    yield {"content": pending, "done": False}
                yield line
                return
            text = line.get("content", "")
            entries = line.get("logprobs") or []
            combined = pending + text
            found = [(combined.find(stop), stop) for stop in stops if stop in combined]
            if found:
                at, stop = min(found)  # the earliest in the text
                before = pending
                for entry in entries:  # the tokens up to the one that completes the stop
                    tokens += 1
                    before += str(entry.get("token", ""))
                    if stop in before:
                        break
                if combined[:at]:
                    yield {"content": combined[:at], "done": False}
                outcome.stop_sequence = stop
                yield {"content": "", "done": True, "done_reason": 0, "prompt_eval_count": input_tokens,
                       "prompt_eval_duration": 0, "eval_count": tokens, "eval_duration": 0}
                return
            tokens += len(entries)
            keep = _held(combined, stops)
            pending = combined[len(combined) - keep:] if keep else ""
            if combined[: len(combined) - keep]:
                yield {"content": combined[: len(combined) - keep], "done": False}
