"""The Jinja sandbox a model's chat template renders in, bounded in steps, sizes and time (limits.py).

jinja2's ImmutableSandboxedEnvironment stops attribute escapes and mutation but bounds only range(): two
nested loops, or `~` doubling a string 28 times, freeze or exhaust serve. Here every loop iteration,
call, filter, `~`, `+`, `*`, `%` takes a step from the render's Budget, and every operation that can build
a large string or list (padding, format widths, joins, replace, concatenation, repetition) checks the
size it will build before building it.
"""

from __future__ import annotations

import functools
import re
import types
from collections.abc import Callable, Iterator, Mapping
from numbers import Number
from typing import Any

import jinja2
import jinja2.nodes as nodes
from jinja2.runtime import LoopContext
from jinja2.sandbox import ImmutableSandboxedEnvironment, SandboxedFormatter
from jinja2.visitor import NodeTransformer

from ollama_engine.template.limits import MAX_INT_BITS, Budget, TemplateLimitError, current, measured, text_size

# %[(key)][flags][width][.precision][length]type: the widths of printf-style formats
_PERCENT = re.compile(r"%(?:\([^)]*\))?[-#0 +]*(\*|\d+)?(?:\.(\*|\d*))?[hlL]?(.)", re.S)
_SPEC_WIDTHS = re.compile(r"\d+")


def check_percent(fmt: str, values: Any, budget: Budget) -> None:
    """Before `fmt % values`: no width or precision over MAX_WIDTH, and the result within the budget."""
    conversions, size = 0, len(fmt)
    for match in _PERCENT.finditer(fmt):
        if match.group(3) == "%":
            continue
        conversions += 1
        for number in match.group(1, 2):
            if number == "*":
                star = [v for v in (values if isinstance(values, tuple) else (values,)) if isinstance(v, int)]
                for width in star:
                    budget.check_width(width, "format width")
                size += max((abs(w) for w in star), default=0)
            elif number:
                budget.check_width(int(number), "format width")
                size += int(number)
        size += 400  # a number's own digits (%f of 1e308 prints 316)
    used = text_size(values, budget.max_value)
    size += used * conversions if isinstance(values, Mapping) else used
    budget.allocate(size, "a formatted string")


class _BoundedFormatter(SandboxedFormatter):
    """str.format in the sandbox, each field's width checked and its text charged before the join."""

    def format_field(self, value: Any, format_spec: str) -> Any:
        budget = current()
        for number in _SPEC_WIDTHS.findall(format_spec):
            budget.check_width(int(number), "format width")
        budget.step()
        budget.allocate(text_size(value, budget.max_value), "a formatted field")
        return measured(super().format_field(value, format_spec), budget, "a formatted field")


def _bounded_iter(iterable: Any) -> Iterator[Any]:
    """A for loop's iterable: each iteration takes a step."""
    budget = current()
    for item in iterable:
        budget.step()
        yield item


def _bounded_concat(items: list[Any]) -> str:
    """`a ~ b`: the joined size is checked before joining."""
    budget = current()
    budget.step()
    budget.allocate(sum(text_size(x, budget.max_value) for x in items), "a concatenation")
    return "".join(str(x) for x in items)


class _BoundLoops(NodeTransformer):
    """Rewrites the parsed template: for-loop iterables and `~` go through the bounded helpers above."""

    def visit_For(self, node: nodes.For) -> nodes.Node:
        node = self.generic_visit(node)
        node.iter = nodes.Filter(node.iter, "_bounded_iter", [], [], None, None, lineno=node.lineno)
        return node

    def visit_Concat(self, node: nodes.Concat) -> nodes.Node:
        node = self.generic_visit(node)
        items = nodes.List(node.nodes, lineno=node.lineno)
        return nodes.Filter(items, "_bounded_concat", [], [], None, None, lineno=node.lineno)


def _materialized(value: Any) -> Any:
    return value if isinstance(value, (str, list, tuple, dict)) else list(value)


def _check_filter(name: str, args: list[Any], kwargs: dict[str, Any], budget: Budget) -> None:
    """Pre-checks for the filters whose output can be far larger than their input."""
    if not args:
        return
    value, rest = args[0], args[1:]

    def arg(position: int, key: str, default: Any) -> Any:
        return rest[position] if len(rest) > position else kwargs.get(key, default)

    if name == "center":
        width = arg(0, "width", 80)
        if isinstance(width, int):
            budget.check_width(width)
            budget.allocate(max(width, len(str(value))), "a padded string")
    elif name == "indent":
        width, text = arg(0, "width", 4), str(value)
        if isinstance(width, int):
            budget.check_width(width, "indent width")
        pad = width if isinstance(width, int) else len(str(width))
        budget.allocate(len(text) + (text.count("\n") + 1) * pad, "an indented string")
    elif name == "format":
        check_percent(str(value), kwargs or tuple(rest), budget)
    elif name == "replace":
        text, old, new = str(value), str(arg(0, "old", "")), str(arg(1, "new", ""))
        budget.allocate(len(text) + (text.count(old) if old else len(text) + 1) * max(len(new) - len(old), 0),
                        "a replaced string")
    elif name == "wordwrap":
        text, width, wrap = str(value), arg(0, "width", 79), arg(3, "wrapstring", None) or "\n"
        lines = len(text) // max(width if isinstance(width, int) else 1, 1) + text.count("\n") + 1
        budget.allocate(len(text) + lines * len(str(wrap)), "a wrapped string")
    elif name in ("batch", "slice"):
        count = arg(0, "linecount" if name == "batch" else "slices", 1)
        if isinstance(count, int) and count > budget.max_value:
            raise TemplateLimitError(f"template |{name}({count}) exceeds {budget.max_value} items")
    elif name in ("tojson", "string", "pprint", "urlize", "xmlattr", "e", "escape", "forceescape", "urlencode"):
        budget.allocate(text_size(value, budget.max_value), f"the text of |{name}")


def _bounded_filter(name: str, func: Callable[..., Any]) -> Callable[..., Any]:
    offset = 1 if getattr(func, "jinja_pass_arg", None) is not None else 0

    @functools.wraps(func)
    def bounded(*args: Any, **kwargs: Any) -> Any:
        budget = current()
        budget.step()
        args_list = list(args)
        if name in ("join", "sum") and len(args_list) > offset:
            args_list[offset] = _materialized(args_list[offset])
            if name == "join":
                items, sep = args_list[offset], args_list[offset + 1] if len(args_list) > offset + 1 else ""
                budget.allocate(text_size(items, budget.max_value) + len(str(sep)) * len(items), "a joined string")
            elif not all(isinstance(x, Number) for x in args_list[offset]):
                return _bounded_sum(args_list[offset], *args_list[offset + 1:], **kwargs)
        else:
            _check_filter(name, args_list[offset:], kwargs, budget)
        return measured(func(*args_list, **kwargs), budget, f"the result of |{name}")

    return bounded


def _bounded_sum(items: list[Any], attribute: Any = None, start: Any = 0) -> Any:
    """|sum over strings or lists: one bounded `+` at a time (the builtin holds the GIL for a quadratic time)."""
    if attribute is not None:
        raise TemplateLimitError("|sum with an attribute over non-numbers is not supported in templates")
    budget, total = current(), start
    for item in items:
        budget.step()
        if isinstance(total, (str, list, tuple)) and isinstance(item, (str, list, tuple)):
            budget.allocate(len(total) + len(item), "a sum")
        total = total + item
    return total


def _bounded_lipsum(n: int = 5, html: bool = True, min: int = 20, max: int = 100) -> str:  # noqa: A002
    budget = current()
    budget.allocate(abs(n) * abs(max) * 12, "lorem ipsum")
    from jinja2.utils import generate_lorem_ipsum

    return generate_lorem_ipsum(n, html, min, max)


def _finalize(value: Any) -> Any:
    """Every `{{ value }}`: a list or dict that would print larger than a value may is refused first."""
    if isinstance(value, (list, tuple, dict)):
        budget = current()
        budget.allocate(text_size(value, budget.max_value), "printed text")
    return value


class BoundedSandbox(ImmutableSandboxedEnvironment):
    """jinja2's immutable sandbox with every step counted and every large result checked before it is built."""

    intercepted_binops = frozenset(["*", "**", "+", "%"])

    def __init__(self, **options: Any) -> None:
        super().__init__(optimized=False, finalize=_finalize, **options)  # no constant folding at compile time
        self.filters = {name: _bounded_filter(name, func) for name, func in self.filters.items()}
        self.filters["_bounded_iter"] = _bounded_iter
        self.filters["_bounded_concat"] = _bounded_concat
        self.globals["lipsum"] = _bounded_lipsum

    def set_filter(self, name: str, func: Callable[..., Any]) -> None:
        """Add a filter, bounded like the built-in ones."""
        self.filters[name] = _bounded_filter(name, func)

    def _parse(self, source: str, name: str | None, filename: str | None) -> nodes.Template:
        return _BoundLoops().visit(super()._parse(source, name, filename))

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        budget = current()
        budget.step()
        if operator == "**":
            if isinstance(left, int) and isinstance(right, int) and right > 0 and \
                    abs(left) > 1 and right * max(abs(left), 2).bit_length() > MAX_INT_BITS:
                raise TemplateLimitError(f"{left} ** {right} is too large for a template")
        elif operator == "*":
            if isinstance(left, (str, list, tuple)) or isinstance(right, (str, list, tuple)):
                sequence, count = (left, right) if isinstance(left, (str, list, tuple)) else (right, left)
                if isinstance(count, int):
                    budget.check_size(len(sequence) * count, "a repeated sequence")
                    budget.allocate(text_size(sequence, budget.max_value) * max(count, 0), "a repeated sequence")
            elif isinstance(left, int) and isinstance(right, int) and \
                    left.bit_length() + right.bit_length() > MAX_INT_BITS:
                raise TemplateLimitError("an integer product is too large for a template")
        elif operator == "+":
            if isinstance(left, (str, list, tuple)) and isinstance(right, (str, list, tuple)):
                budget.allocate(len(left) + len(right), "a concatenation")
        elif operator == "%" and isinstance(left, str):
            check_percent(left, right, budget)
        return measured(super().call_binop(context, operator, left, right), budget, f"the result of {operator}")

    def wrap_str_format(self, value: Any) -> Callable[..., str] | None:
        """str.format / format_map with bounded widths and sizes (jinja2 3.1.5+ wraps them at attribute access)."""
        if not isinstance(value, (types.MethodType, types.BuiltinMethodType)) or \
                value.__name__ not in ("format", "format_map") or not isinstance(value.__self__, str):
            return None
        text, is_map = value.__self__, value.__name__ == "format_map"
        formatter = _BoundedFormatter(self)

        def bounded_format(*args: Any, **kwargs: Any) -> str:
            if is_map:
                if kwargs or len(args) != 1:
                    raise TypeError("format_map() takes exactly one argument")
                args, kwargs = (), args[0]
            return str(formatter.vformat(text, args, kwargs))

        return functools.update_wrapper(bounded_format, value)

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805
        budget = current()
        budget.step()
        if isinstance(__obj, LoopContext) and args:  # a recursive loop's next level: bounded like any loop
            args = (_bounded_iter(args[0]), *args[1:])
        target = getattr(__obj, "__self__", None)
        if isinstance(target, str) and isinstance(__obj, types.BuiltinMethodType):
            wrapped = __self.wrap_str_format(__obj)
            if wrapped is not None:
                __obj = wrapped
            else:
                args = _check_str_method(target, __obj.__name__, args, kwargs, budget)
        return measured(super().call(__context, __obj, *args, **kwargs), budget, "the result of a call")


def _check_str_method(text: str, name: str, args: tuple[Any, ...], kwargs: dict[str, Any],
                      budget: Budget) -> tuple[Any, ...]:
    """Before a str method that can build far more than its input: padding, join, replace, expandtabs (the
    arguments to call it with: a join's iterable read into a list first)."""
    if name in ("ljust", "rjust", "center", "zfill") and args and isinstance(args[0], int):
        budget.check_width(args[0])
        budget.allocate(max(args[0], len(text)), "a padded string")
    elif name == "expandtabs":
        size = args[0] if args else kwargs.get("tabsize", 8)
        if isinstance(size, int):
            budget.check_width(size, "tab size")
            budget.allocate(len(text) + text.count("\t") * max(size, 0), "an expanded string")
    elif name == "replace" and len(args) >= 2:
        old, new = str(args[0]), str(args[1])
        budget.allocate(len(text) + (text.count(old) if old else len(text) + 1) * max(len(new) - len(old), 0),
                        "a replaced string")
    elif name == "join" and args:
        items = _materialized(args[0])
        budget.allocate(text_size(items, budget.max_value) + len(text) * len(items), "a joined string")
        return (items, *args[1:])
    return args


def bounded_render(template: jinja2.Template, budget: Budget, **variables: Any) -> str:
    """Render with `budget` as the current one, counting the output as it is produced."""
    from ollama_engine.template import limits

    token = limits.use(budget)
    try:
        pieces = []
        for piece in template.generate(**variables):
            budget.write(len(piece))
            pieces.append(piece)
        return "".join(pieces)
    finally:
        limits.release(token)


__all__ = ["BoundedSandbox", "TemplateLimitError", "bounded_render", "check_percent"]
