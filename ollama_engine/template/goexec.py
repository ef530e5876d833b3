"""Executing a parsed Go template: Go's values, truth, printing and built-in functions.

Values are plain Python: dict is a Go map (missing keys give nil, as Ollama's `missingkey=zero`),
`Struct` is a Go struct (a missing field is an error), lists, str, int, float, bool, None (nil).
"""

from __future__ import annotations

import datetime
from collections.abc import Callable
from typing import Any

from ollama_engine.template import limits
from ollama_engine.template.gofmt import sprintf
from ollama_engine.template.gojson import GoStruct, go_float, go_json
from ollama_engine.template.goparse import (
    Action,
    Branch,
    Chain,
    Command,
    Dot,
    Field,
    Ident,
    Literal,
    LoopControl,
    Pipe,
    TemplateError,
    Text,
    Variable,
)

MAX_STEPS = limits.MAX_STEPS  # template nodes one execution may walk (a chat of 1000 messages takes about 50,000)


class Struct:
    """A Go struct in a template: named fields; printed by `text` (a Stringer) or Go's {a b} form."""

    def __init__(self, type_name: str, fields: dict[str, Any], json: Any = None,
                 text: Callable[[], str] | None = None) -> None:
        self.type_name = type_name
        self.fields = fields
        self.json = json  # what `json` marshals (a GoStruct with the JSON field names), if not the fields
        self.text = text

    def __go_json__(self) -> str:
        return go_json(self.json if self.json is not None else GoStruct(self.fields))

    def __repr__(self) -> str:
        return f"Struct({self.type_name}, {self.fields!r})"


class JSONMap(dict):
    """A map that prints as JSON (Ollama's templateArgs / templateProperties String methods)."""


class JSONList(list):
    """A slice that prints as JSON (Ollama's templateTools String method)."""


class _Break(Exception):
    pass


class _Continue(Exception):
    pass


def is_true(value: Any) -> bool:
    """Go template truth: false, 0, nil and empty strings, slices and maps are false; structs are true."""
    if isinstance(value, Struct):
        return True
    return bool(value)


def to_text(value: Any) -> str:
    """fmt.Sprint of a value, as text/template prints it."""
    if isinstance(value, str):
        return value
    if value is None:
        return "<no value>"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return _float_text(value)
    if isinstance(value, (JSONMap, JSONList)):
        return go_json(value)
    if isinstance(value, Struct):
        if value.text is not None:
            return value.text()
        return "{" + " ".join(_inner_text(v) for v in value.fields.values()) + "}"
    return _inner_text(value)


def _inner_text(value: Any) -> str:
    if isinstance(value, list) and not isinstance(value, JSONList):
        return "[" + " ".join(_inner_text(v) for v in value) + "]"
    if isinstance(value, dict) and not isinstance(value, JSONMap):
        return "map[" + " ".join(f"{k}:{_inner_text(v)}" for k, v in sorted(value.items())) + "]"
    if value is None:
        return "<nil>"
    return to_text(value)


def _float_text(x: float) -> str:
    return go_float(x, verb="v")


def _compare_key(a: Any, b: Any) -> tuple[Any, Any]:
    numbers = (int, float)
    if isinstance(a, bool) or isinstance(b, bool):
        if type(a) is not type(b):
            raise TemplateError("incompatible types for comparison")
        return a, b
    if isinstance(a, numbers) and isinstance(b, numbers):
        return a, b
    if type(a) is not type(b) or not isinstance(a, (str, int, float)):
        if a is None or b is None:
            raise TemplateError("invalid type for comparison")
        raise TemplateError("incompatible types for comparison")
    return a, b


def _eq(a: Any, *others: Any) -> bool:
    if not others:
        raise TemplateError("missing argument for comparison")
    for b in others:
        if a is None and b is None:
            return True
        if a is None or b is None:
            continue
        x, y = _compare_key(a, b)
        if x == y:
            return True
    return False


def _ordered(op: Callable[[Any, Any], bool]) -> Callable[[Any, Any], bool]:
    def compare(a: Any, b: Any) -> bool:
        x, y = _compare_key(a, b)
        return op(x, y)
    return compare


def _index(value: Any, *keys: Any) -> Any:
    for key in keys:
        if isinstance(value, dict):
            value = value.get(key)
        elif isinstance(value, (list, str)):
            if not isinstance(key, int) or isinstance(key, bool):
                raise TemplateError(f"cannot index slice/array with type {type(key).__name__}")
            seq = value.encode() if isinstance(value, str) else value
            if not 0 <= key < len(seq):
                raise TemplateError(f"error calling index: index out of range: {key}")
            value = seq[key]
        else:
            raise TemplateError(f"can't index item of type {type(value).__name__}")
    return value


def _slice(value: Any, *bounds: int) -> Any:
    """slice x 1 2 is x[1:2]; slice x 1 is x[1:] (strings by bytes, as Go)."""
    if len(bounds) > 2:
        raise TemplateError("three-index slices are not supported")
    if isinstance(value, (str, list)):
        seq = value.encode() if isinstance(value, str) else value
        lo, hi = (bounds[0] if bounds else 0), (bounds[1] if len(bounds) > 1 else len(seq))
        if not 0 <= lo <= hi <= len(seq):
            raise TemplateError(f"index out of range: {list(bounds)}")
        part = seq[lo:hi]
        return part.decode(errors="replace") if isinstance(part, bytes) else part
    raise TemplateError(f"can't slice item of type {type(value).__name__}")


def _length(value: Any) -> int:
    if isinstance(value, str):
        return len(value.encode())  # Go's len of a string counts bytes
    if isinstance(value, (list, dict)):
        return len(value)
    raise TemplateError(f"error calling len: len of type {type(value).__name__}")


def _sprint(*args: Any) -> str:
    """fmt.Sprint: a space between operands when neither is a string."""
    out = []
    for i, arg in enumerate(args):
        if i > 0 and not isinstance(arg, str) and not isinstance(args[i - 1], str):
            out.append(" ")
        out.append(to_text(arg) if arg is not None else "<nil>")
    return "".join(out)


def _sprintf(fmt: Any, *args: Any) -> str:
    """fmt.Sprintf, with Go's %!verb(...) texts for operands that do not fit (gofmt.py)."""
    if not isinstance(fmt, str):
        raise TemplateError(f"wrong type for value; expected string; got {type(fmt).__name__}")
    return sprintf(fmt, args, to_text)


def _date(days: int) -> Callable[..., str]:
    def date(*_args: str) -> str:
        return (datetime.date.today() + datetime.timedelta(days=days)).isoformat()
    return date


def _to_typescript_type(value: Any) -> str:
    """Ollama's ToolProperty.ToTypeScriptType: the property's JSON-schema type in TypeScript terms."""
    if not isinstance(value, Struct) or value.type_name != "ToolProperty":
        return "any"
    names = {"string": "string", "number": "number", "integer": "number", "boolean": "boolean",
             "array": "any[]", "object": "Record<string, any>", "null": "null"}
    any_of = value.fields.get("AnyOf") or []
    if any_of:
        return " | ".join(_to_typescript_type(p) for p in any_of)
    types = value.fields.get("Type") or []
    if not types:
        return "any"
    return " | ".join(names.get(t, "any") for t in types)


FUNCTIONS: dict[str, Callable[..., Any]] = {
    "not": lambda x: not is_true(x),
    "len": _length,
    "index": _index,
    "slice": _slice,
    "eq": _eq,
    "ne": lambda a, b: not _eq(a, b),
    "lt": _ordered(lambda a, b: a < b),
    "le": _ordered(lambda a, b: a <= b),
    "gt": _ordered(lambda a, b: a > b),
    "ge": _ordered(lambda a, b: a >= b),
    "print": _sprint,
    "println": lambda *a: " ".join(to_text(x) for x in a) + "\n",
    "printf": _sprintf,
    # Ollama's own functions (template/template.go)
    "json": go_json,
    "currentDate": _date(0),
    "yesterdayDate": _date(-1),
    "toTypeScriptType": _to_typescript_type,
}
LAZY = {"and", "or"}  # evaluate their arguments one by one and stop early, as Go 1.18+


def known_function(name: str) -> bool:
    return name in FUNCTIONS or name in LAZY


class Executor:
    """Walks the node tree once with one set of values; collects the output."""

    def __init__(self, root: Any, budget: limits.Budget | None = None) -> None:
        self.root = root
        self.vars: list[tuple[str, Any]] = [("$", root)]
        self.out: list[str] = []
        # a client's TEMPLATE may loop (range 1000000000) or double a string: the budget bounds both
        self.budget = limits.Budget.for_input(root) if budget is None else budget

    def run(self, nodes: list[object]) -> str:
        try:
            self.walk(nodes, self.root)
        except limits.TemplateLimitError as error:
            raise TemplateError(str(error)) from None
        return "".join(self.out)

    def step(self) -> None:
        self.budget.step()

    def write(self, text: str) -> None:
        self.budget.write(len(text))
        self.out.append(text)

    def walk(self, nodes: list[object], dot: Any) -> None:
        for node in nodes:
            self.step()
            if isinstance(node, Text):
                self.write(node.text)
            elif isinstance(node, Action):
                value = self.pipe(node.pipe, dot)
                if not node.pipe.decl:
                    self.write(to_text(value))
            elif isinstance(node, Branch):
                self.branch(node, dot)
            elif isinstance(node, LoopControl):
                raise _Break() if node.kind == "break" else _Continue()

    def branch(self, node: Branch, dot: Any) -> None:
        mark = len(self.vars)
        try:
            if node.kind == "range":
                self.range(node, dot)
                return
            value = self.pipe(node.pipe, dot)
            if is_true(value):
                self.walk(node.body, value if node.kind == "with" else dot)
            elif node.else_body is not None:
                self.walk(node.else_body, dot)
        finally:
            del self.vars[mark:]

    def range(self, node: Branch, dot: Any) -> None:
        value = self.pipe(Pipe(node.pipe.cmds), dot)
        if isinstance(value, dict):
            pairs = [(k, value[k]) for k in sorted(value)]  # Go ranges over a map in key order
        elif isinstance(value, list):
            pairs = list(enumerate(value))
        elif isinstance(value, int) and not isinstance(value, bool):
            if value > MAX_STEPS:
                raise TemplateError(f"range over {value}: template exceeds {MAX_STEPS} steps")
            pairs = [(i, i) for i in range(value)]
        elif value is None:
            pairs = []
        else:
            raise TemplateError(f"range can't iterate over {to_text(value)}")
        if not pairs:
            if node.else_body is not None:
                self.walk(node.else_body, dot)
            return
        decl = node.pipe.decl
        for key, elem in pairs:
            self.step()
            mark = len(self.vars)
            if len(decl) == 1:
                self.set_var(decl[0], elem, node.pipe.is_assign)
            elif len(decl) == 2:
                self.set_var(decl[0], key, node.pipe.is_assign)
                self.set_var(decl[1], elem, node.pipe.is_assign)
            try:
                self.walk(node.body, elem)
            except _Break:
                break
            except _Continue:
                continue
            finally:
                del self.vars[mark:]

    def set_var(self, name: str, value: Any, assign: bool) -> None:
        if assign:
            for i in range(len(self.vars) - 1, -1, -1):
                if self.vars[i][0] == name:
                    self.vars[i] = (name, value)
                    return
            raise TemplateError(f"undefined variable: {name}")
        self.vars.append((name, value))

    def var(self, name: str) -> Any:
        for var_name, value in reversed(self.vars):
            if var_name == name:
                return value
        raise TemplateError(f"undefined variable: {name}")

    def pipe(self, pipe: Pipe, dot: Any) -> Any:
        value: Any = _MISSING
        for cmd in pipe.cmds:
            value = self.command(cmd, dot, value)
        for name in pipe.decl[:1]:
            self.set_var(name, value, pipe.is_assign)
        return value

    def command(self, cmd: Command, dot: Any, final: Any) -> Any:
        first, rest = cmd.args[0], cmd.args[1:]
        if isinstance(first, Ident):
            return self.call(first.name, rest, dot, final)
        if rest or final is not _MISSING:
            raise TemplateError(f"can't give argument to non-function {_describe(first)}")
        return self.arg(first, dot)

    def call(self, name: str, arg_nodes: list[object], dot: Any, final: Any) -> Any:
        nodes = list(arg_nodes)
        if name in LAZY:
            values = [lambda n=n: self.arg(n, dot) for n in nodes]
            if final is not _MISSING:
                values.append(lambda: final)
            if not values:
                raise TemplateError(f"wrong number of args for {name}: want at least 1 got 0")
            result: Any = None
            for get in values:
                result = get()
                if is_true(result) != (name == "and"):
                    return result
            return result
        function = FUNCTIONS.get(name)
        if function is None:
            raise TemplateError(f'function "{name}" not defined')
        args = [self.arg(n, dot) for n in nodes]
        if final is not _MISSING:
            args.append(final)
        self.step()
        try:
            return limits.measured(function(*args), self.budget, f"the result of {name}")
        except TemplateError as error:
            raise TemplateError(f"error calling {name}: {error}") from None
        except TypeError as error:
            raise TemplateError(f"wrong number of args for {name}: {error}") from None
        except (ValueError, ArithmeticError) as error:  # a bad operand is the template's error, not the server's
            raise TemplateError(f"error calling {name}: {error}") from None

    def arg(self, node: object, dot: Any) -> Any:
        if isinstance(node, Literal):
            return node.value
        if isinstance(node, Dot):
            return dot
        if isinstance(node, Field):
            return self.fields(dot, node.idents)
        if isinstance(node, Variable):
            return self.fields(self.var(node.name), node.idents)
        if isinstance(node, Pipe):
            return self.pipe(node, dot)
        if isinstance(node, Chain):
            return self.fields(self.pipe(node.node, dot), node.idents)  # type: ignore[arg-type]
        if isinstance(node, Ident):
            return self.call(node.name, [], dot, _MISSING)
        raise TemplateError(f"can't evaluate {node!r}")

    def fields(self, value: Any, idents: list[str]) -> Any:
        for name in idents:
            if isinstance(value, Struct):
                if name not in value.fields:
                    raise TemplateError(f"can't evaluate field {name} in type {value.type_name}")
                value = value.fields[name]
            elif isinstance(value, dict):
                value = value.get(name)
            elif value is None:
                raise TemplateError(f"nil pointer evaluating interface {{}}.{name}")
            else:
                raise TemplateError(f"can't evaluate field {name} in type {type(value).__name__}")
        return value


_MISSING = object()


def _describe(node: object) -> str:
    if isinstance(node, Field):
        return "." + ".".join(node.idents)
    if isinstance(node, Variable):
        return node.name + "".join("." + i for i in node.idents)
    return type(node).__name__
