"""The bounds every template render runs under, Jinja and Go alike, and the budget that enforces them.

A chat template comes from a model file and a TEMPLATE from a client: either may loop for ever or build a
string of gigabytes. Every render gets a `Budget`: steps (loop iterations, calls, filters, nodes), the size
of any one value it builds, the characters it builds in all, its output, and a wall-clock deadline. The
size bounds grow with the request's own text (a 20 MB message must still render), so a template can
amplify its input only by a constant factor. Exceeding one is a TemplateLimitError naming the bound.
"""

from __future__ import annotations

import contextvars
import time
from collections.abc import Mapping
from typing import Any

MAX_STEPS = 1_000_000  # loop iterations, calls and nodes one render may take (a 1000-message chat takes ~50,000)
MAX_WIDTH = 1_000_000  # a format or padding width/precision (Go's fmt refuses larger ones too)
MAX_VALUE = 1 << 22  # characters (or items) in any one string or list a render builds, plus the input's size
MAX_OUTPUT = 1 << 24  # characters a render may output, plus OUTPUT_PER_INPUT per character of input
MAX_ALLOCATED = 1 << 26  # characters a render may build in all, plus ALLOCATED_PER_INPUT per character of input
OUTPUT_PER_INPUT = 4
ALLOCATED_PER_INPUT = 16
MAX_INT_BITS = 1 << 14  # the largest integer `*` or `**` may build (str() refuses more than 4300 digits anyway)
RENDER_TIMEOUT = 10.0  # seconds one render may run (checked at every step, and by the caller's wait)


class TemplateLimitError(Exception):
    """A render went past one of the bounds above; the message names it."""


def text_size(value: Any, limit: int = 1 << 62) -> int:
    """About how many characters `value` prints as (containers summed); stops counting past `limit`."""
    total = 0
    stack = [value]
    while stack and total <= limit:
        item = stack.pop()
        if isinstance(item, str):
            total += len(item)
        elif isinstance(item, Mapping):
            total += 2 + 4 * len(item)
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, (list, tuple, set, frozenset)):
            total += 2 + 2 * len(item)
            stack.extend(item)
        elif isinstance(getattr(item, "fields", None), dict):  # a Go template struct
            stack.append(item.fields)
        else:
            total += 24  # numbers, None, booleans and other scalars print short
    return total


class Budget:
    """What one render may still spend; every bounded operation charges it."""

    def __init__(self, input_chars: int = 0, timeout: float | None = None) -> None:
        self.max_value = MAX_VALUE + input_chars
        self.max_output = MAX_OUTPUT + OUTPUT_PER_INPUT * input_chars
        self.max_allocated = MAX_ALLOCATED + ALLOCATED_PER_INPUT * input_chars
        self.timeout = RENDER_TIMEOUT if timeout is None else timeout
        self.deadline = time.monotonic() + self.timeout
        self.steps = 0
        self.allocated = 0
        self.output = 0

    @classmethod
    def for_input(cls, *values: Any) -> Budget:
        return cls(sum(text_size(v) for v in values))

    def step(self, count: int = 1) -> None:
        self.steps += count
        if self.steps > MAX_STEPS:
            raise TemplateLimitError(f"template exceeds {MAX_STEPS} steps")
        if self.steps & 0xFF == 0 and time.monotonic() > self.deadline:
            raise TemplateLimitError(f"template exceeds its time limit of {self.timeout:g} seconds")

    def check_width(self, width: int, what: str = "width") -> None:
        if abs(width) > MAX_WIDTH:
            raise TemplateLimitError(f"template {what} {width} exceeds {MAX_WIDTH}")

    def check_size(self, size: int, what: str = "a value") -> None:
        """Before building `size` characters (or items) in one value."""
        if size > self.max_value:
            raise TemplateLimitError(f"template builds {what} of {size} characters, over the limit of "
                                     f"{self.max_value}")

    def allocate(self, size: int, what: str = "a value") -> None:
        """Before (or just after) building a value of `size`: bounds it and the render's total."""
        self.check_size(size, what)
        self.allocated += size
        if self.allocated > self.max_allocated:
            raise TemplateLimitError(f"template exceeds {self.max_allocated} characters built in all")

    def write(self, size: int) -> None:
        self.output += size
        if self.output > self.max_output:
            raise TemplateLimitError(f"template output exceeds {self.max_output} characters")
        if time.monotonic() > self.deadline:
            raise TemplateLimitError(f"template exceeds its time limit of {self.timeout:g} seconds")


_current: contextvars.ContextVar[Budget | None] = contextvars.ContextVar("template_budget", default=None)


def current() -> Budget:
    """The budget of the render running in this thread (a fresh default one outside any render)."""
    budget = _current.get()
    return Budget() if budget is None else budget


def use(budget: Budget) -> contextvars.Token[Budget | None]:
    return _current.set(budget)


def release(token: contextvars.Token[Budget | None]) -> None:
    _current.reset(token)


def measured(value: Any, budget: Budget, what: str = "a value") -> Any:
    """Charge a value just built (a string, list or dict) to the budget; return it."""
    if isinstance(value, (str, list, tuple, dict)):
        budget.allocate(len(value), what)
    return value
