"""A thinking budget, enforced: at most `budget` tokens of thinking, then the answer.

Two runs on the same runner (its prompt cache makes the second one cheap): the first generates with
num_predict = budget and `</think>` as an extra stop; if the output is still inside its thinking part
after that, `</think>` is appended and the second run continues the answer from prompt + thinking, with
what is left of max_tokens. The lines of both runs form one stream, as if one run had produced them, so
chat.py's ThinkingSplitter separates thinking from the answer as usual. This covers models that think in
`<think>...</think>` (the splitter's format); a template that opens `<think>` itself (the prompt ends
with it) gets the tag put back at the start of the stream, so that the splitter sees it.
"""

from __future__ import annotations

from contextlib import aclosing
from dataclasses import replace
from typing import Any

from ollama_engine.sched import Scheduler

from .completion import Chunks, Job, runner_chunks
from .prompt import ThinkingSplitter

OPEN, CLOSE = ThinkingSplitter.OPEN, ThinkingSplitter.CLOSE
LENGTH = 1  # the runner's done_reason for num_predict reached


async def budgeted_lines(scheduler: Scheduler, job: Job, budget: int, max_tokens: int) -> Chunks:
    """The runner lines of `job` with at most `budget` tokens of thinking and `max_tokens` in all."""
    watch = ThinkingSplitter(True)
    if job.prompt.rstrip().endswith(OPEN):
        watch.feed(OPEN)
        yield {"content": OPEN, "done": False}
    first = _run(job, num_predict=min(budget, max_tokens), stop=[*job.sampling.get("stop", []), CLOSE])
    thought: list[str] = []
    final: dict[str, Any] = {}
    async with aclosing(runner_chunks(scheduler, first)) as lines:
        async for line in lines:
            if line.get("done"):
                final = line
                break
            thought.append(line.get("content", ""))
            watch.feed(line.get("content", ""))
            yield line
    job.load_duration = first.load_duration
    used = final.get("eval_count", 0)
    thinking = watch.state == "thinking"
    if not thinking and final.get("done_reason") != LENGTH:
        yield final  # the answer ended within the budget
        return
    left = max_tokens - used
    close = ("" if "".join(thought).endswith("\n") else "\n") + CLOSE + "\n\n" if thinking else ""
    if close:
        yield {"content": CLOSE, "done": False}  # the stream only needs the tag; the prompt gets the turn
    if left <= 0:
        yield {**final, "done_reason": LENGTH}
        return
    second = _run(job, num_predict=left, prompt=job.prompt + "".join(thought) + close)
    async with aclosing(runner_chunks(scheduler, second)) as lines:
        async for line in lines:
            if line.get("done"):
                yield {**line, "prompt_eval_count": final.get("prompt_eval_count", 0),
                       "prompt_eval_duration": final.get("prompt_eval_duration", 0)
                       + line.get("prompt_eval_duration", 0),
                       "eval_count": used + line.get("eval_count", 0),
                       "eval_duration": final.get("eval_duration", 0) + line.get("eval_duration", 0)}
                return
            yield line


def _run(job: Job, *, num_predict: int, prompt: str | None = None, stop: list[str] | None = None) -> Job:
    """A copy of `job` for one of the two runs (its own sampling dict: runner_chunks may change it)."""
    sampling = {**job.sampling, "num_predict": num_predict}
    if stop is not None:
        sampling["stop"] = stop
    return replace(job, prompt=job.prompt if prompt is None else prompt, sampling=sampling)
