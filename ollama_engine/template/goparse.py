"""Parsing the subset of Go's text/template that Ollama's TEMPLATEs use.

Supported: text, `{{ pipeline }}`, `{{- -}}` trimming, comments, if / else if / else, range (with
`$i, $m :=`, else, break, continue), with / else with, `$x := ...` and `$x = ...`, fields (`.A.B`,
`$x.A`, `(pipe).A`), literals, parentheses, `|` pipes and function calls. Not supported, and rejected at
parse time: define / template / block (Ollama never uses them; its own parser refuses `template`).
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass, field

TRIM_SPACE = " \t\r\n"


class TemplateError(ValueError):
    """A template that does not parse or does not execute; the message says where and why."""


# ---- nodes -------------------------------------------------------------------------------------


@dataclass
class Field:
    idents: list[str]  # .A.B -> ["A", "B"]


@dataclass
class Variable:
    name: str  # "$" or "$x"
    idents: list[str] = field(default_factory=list)  # $x.A.B -> ["A", "B"]


@dataclass
class Dot:
    pass


@dataclass
class Ident:
    name: str  # a function name


@dataclass
class Literal:
    value: object  # str, int, float, bool, None


@dataclass
class Chain:
    node: object  # a parenthesized Pipe
    idents: list[str]


@dataclass
class Command:
    args: list[object]


@dataclass
class Pipe:
    cmds: list[Command]
    decl: list[str] = field(default_factory=list)
    is_assign: bool = False


@dataclass
class Text:
    text: str


@dataclass
class Action:
    pipe: Pipe


@dataclass
class Branch:
    kind: str  # "if", "range", "with"
    pipe: Pipe
    body: list[object]
    else_body: list[object] | None = None


@dataclass
class LoopControl:
    kind: str  # "break" or "continue"


# ---- lexing ------------------------------------------------------------------------------------

_TOKEN = re.compile(r"""
    (?P<space>[ \t\r\n]+)
  | (?P<declare>:=)
  | (?P<assign>=)
  | (?P<field>\.[A-Za-z_][A-Za-z0-9_]*)
  | (?P<var>\$[A-Za-z0-9_]*)
  | (?P<string>"(?:[^"\\\n]|\\.)*")
  | (?P<raw>`[^`]*`)
  | (?P<char>'(?:[^'\\\n]|\\.)+')
  | (?P<number>[+-]?(?:0[xX][0-9a-fA-F_]+|(?:\d[\d_]*\.?\d*(?:[eE][+-]?\d+)?)|\.\d+(?:[eE][+-]?\d+)?))
  | (?P<dot>\.)
  | (?P<ident>[A-Za-z_][A-Za-z0-9_]*)
  | (?P<lparen>\()
  | (?P<rparen>\))
  | (?P<pipe>\|)
  | (?P<comma>,)
""", re.VERBOSE)

_KEYWORDS = {"if", "else", "end", "range", "with", "break", "continue", "define", "template", "block"}


@dataclass
class _Item:
    kind: str  # "text" or "action"
    text: str = ""
    tokens: list[tuple[str, str]] = field(default_factory=list)
    line: int = 1


def _tokenize(source: str, line: int) -> list[tuple[str, str]]:
    tokens, pos = [], 0
    while pos < len(source):
        m = _TOKEN.match(source, pos)
        if m is None:
            raise TemplateError(f"line {line}: unexpected {source[pos]!r} in action")
        kind = m.lastgroup or ""
        tokens.append((kind, m.group()))
        pos = m.end()
    return tokens


def _action_end(source: str, start: int) -> int:
    """Index of the closing `}}` of the action starting at `start`, skipping string literals."""
    i, quote = start, ""
    while i < len(source):
        ch = source[i]
        if quote:
            if ch == "\\" and quote != "`":
                i += 2
                continue
            if ch == quote:
                quote = ""
        elif ch in "\"`'":
            quote = ch
        elif source.startswith("}}", i):
            return i
        i += 1
    return -1


def lex(source: str) -> list[_Item]:
    """Split the template into text and action items, applying the `{{-` and `-}}` trim markers."""
    items: list[_Item] = []
    pos, trim_next = 0, False
    while True:
        start = source.find("{{", pos)
        text = source[pos:] if start < 0 else source[pos:start]
        if trim_next:
            text = text.lstrip(TRIM_SPACE)
        inner_start = start + 2
        if start >= 0 and source.startswith("-", inner_start) and source[inner_start + 1:inner_start + 2] in \
                tuple(TRIM_SPACE):
            text = text.rstrip(TRIM_SPACE)
            inner_start += 2
        if text:
            items.append(_Item("text", text=text))
        if start < 0:
            return items
        line = source.count("\n", 0, start) + 1
        end = _action_end(source, inner_start)
        if end < 0:
            raise TemplateError(f"line {line}: unclosed action")
        inner = source[inner_start:end]
        trim_next = len(inner) >= 2 and inner[-1] == "-" and inner[-2] in TRIM_SPACE
        if trim_next:
            inner = inner[:-2]
        pos = end + 2
        stripped = inner.strip(TRIM_SPACE)
        if stripped.startswith("/*"):
            if not stripped.endswith("*/"):
                raise TemplateError(f"line {line}: comment ends before closing delimiter")
            continue
        items.append(_Item("action", tokens=_tokenize(inner, line), line=line))


# ---- parsing -----------------------------------------------------------------------------------


def _unquote(kind: str, text: str) -> object:
    if kind == "raw":
        return text[1:-1]
    if kind in ("string", "char"):
        value = ast.literal_eval(text if kind == "string" else '"' + text[1:-1] + '"')
        return value if kind == "string" else ord(value)
    clean = text.replace("_", "")
    try:
        return int(clean, 0)
    except ValueError:
        return float(clean)


class _ActionParser:
    """Parses the tokens of one action into a pipeline."""

    def __init__(self, tokens: list[tuple[str, str]], line: int, variables: list[str]) -> None:
        self.tokens = tokens
        self.pos = 0
        self.line = line
        self.variables = variables

    def error(self, message: str) -> TemplateError:
        return TemplateError(f"line {self.line}: {message}")

    def peek(self, skip_space: bool = True) -> tuple[str, str]:
        pos = self.pos
        while skip_space and pos < len(self.tokens) and self.tokens[pos][0] == "space":
            pos += 1
        return self.tokens[pos] if pos < len(self.tokens) else ("eof", "")

    def next(self, skip_space: bool = True) -> tuple[str, str]:
        while skip_space and self.pos < len(self.tokens) and self.tokens[self.pos][0] == "space":
            self.pos += 1
        token = self.tokens[self.pos] if self.pos < len(self.tokens) else ("eof", "")
        self.pos += 1
        return token

    def done(self) -> bool:
        return self.peek()[0] == "eof"

    def pipeline(self, allow_decl: bool, allow_two: bool = False, until: str = "eof") -> Pipe:
        decl, is_assign = self.declaration(allow_decl, allow_two)
        cmds = []
        while True:
            cmds.append(self.command(until))
            kind = self.next()[0]
            if kind == until:
                break
            if kind != "pipe":
                raise self.error("unexpected token in pipeline")
        for name in decl:
            if not is_assign and name not in self.variables:
                self.variables.append(name)
            elif is_assign and name not in self.variables:
                raise self.error(f"undefined variable {name!r}")
        return Pipe(cmds, decl, is_assign)

    def declaration(self, allow_decl: bool, allow_two: bool) -> tuple[list[str], bool]:
        save = self.pos
        names: list[str] = []
        while True:
            kind, text = self.next()
            if kind != "var" or text == "$":
                break
            names.append(text)
            kind, _ = self.next()
            if kind in ("declare", "assign"):
                if not allow_decl:
                    raise self.error("declaration not allowed here")
                if len(names) > (2 if allow_two else 1):
                    raise self.error("too many declarations")
                return names, kind == "assign"
            if kind != "comma" or not allow_two:
                break
        self.pos = save
        return [], False

    def command(self, until: str) -> Command:
        args = []
        while True:
            kind = self.peek()[0]
            if kind in ("eof", "pipe", until):
                break
            args.append(self.operand())
            after = self.peek(skip_space=False)[0]
            if after not in ("space", "eof", "pipe", "rparen", until):
                raise self.error(f"unexpected {self.peek(skip_space=False)[1]!r} in operand")
        if not args:
            raise self.error("missing value for command")
        return Command(args)

    def operand(self) -> object:
        kind, text = self.next()
        node: object
        if kind == "field":
            idents = [text[1:]]
            while self.peek(skip_space=False)[0] == "field":
                idents.append(self.next(skip_space=False)[1][1:])
            return Field(idents)
        if kind == "var":
            if text not in self.variables and text != "$":
                raise self.error(f"undefined variable {text!r}")
            node = Variable(text)
            while self.peek(skip_space=False)[0] == "field":
                node.idents.append(self.next(skip_space=False)[1][1:])
            return node
        if kind == "dot":
            return Dot()
        if kind in ("string", "raw", "char", "number"):
            return Literal(_unquote(kind, text))
        if kind == "ident":
            if text in ("true", "false"):
                return Literal(text == "true")
            if text == "nil":
                return Literal(None)
            if text in _KEYWORDS:
                raise self.error(f"unexpected keyword {text!r} in command")
            return Ident(text)
        if kind == "lparen":
            inner = self.pipeline(allow_decl=False, until="rparen")
            idents = []
            while self.peek(skip_space=False)[0] == "field":
                idents.append(self.next(skip_space=False)[1][1:])
            return Chain(inner, idents) if idents else inner
        raise self.error(f"unexpected {text!r} in operand")


class Parser:
    """Builds the node tree from the lexed items, checking that every variable is declared."""

    def __init__(self, source: str) -> None:
        self.items = lex(source)
        self.pos = 0
        self.variables: list[str] = ["$"]
        self.range_depth = 0

    def parse(self) -> list[object]:
        body, stop = self.list_until(set())
        if stop is not None:
            raise TemplateError(f"line {stop[1]}: unexpected {{{{{stop[0]}}}}}")
        return body

    def list_until(self, stops: set[str]) -> tuple[list[object], tuple[str, int, _ActionParser] | None]:
        nodes: list[object] = []
        while self.pos < len(self.items):
            item = self.items[self.pos]
            self.pos += 1
            if item.kind == "text":
                nodes.append(Text(item.text))
                continue
            p = _ActionParser(item.tokens, item.line, self.variables)
            kind, word = p.peek()
            if kind == "ident" and word in ("end", "else"):
                p.next()
                if word not in stops:
                    raise p.error(f"unexpected {{{{{word}}}}}")
                return nodes, (word, item.line, p)
            if kind == "ident" and word in ("if", "range", "with"):
                p.next()
                nodes.append(self.control(word, p))
            elif kind == "ident" and word in ("break", "continue"):
                p.next()
                if not p.done():
                    raise p.error(f"unexpected token after {word}")
                if not self.range_depth:
                    raise p.error(f"{{{{{word}}}}} outside {{{{range}}}}")
                nodes.append(LoopControl(word))
            elif kind == "ident" and word in ("define", "template", "block"):
                raise p.error(f"undefined template specified: {{{{{word}}}}} is not supported")
            else:
                nodes.append(Action(p.pipeline(allow_decl=True)))
        if stops:
            raise TemplateError("unexpected EOF: missing {{end}}")
        return nodes, None

    def control(self, kind: str, p: _ActionParser) -> Branch:
        mark = len(self.variables)  # variables declared in the pipeline or body end at {{end}}
        try:
            pipe = p.pipeline(allow_decl=True, allow_two=kind == "range")
            self.range_depth += kind == "range"
            try:
                body, stop = self.list_until({"end", "else"})
            finally:
                self.range_depth -= kind == "range"
            else_body = None
            if stop is not None and stop[0] == "else":
                ep = stop[2]
                next_kind, next_word = ep.peek()
                if next_kind == "ident" and next_word == kind and kind in ("if", "with"):
                    # {{else if x}} ... {{end}} means {{else}}{{if x}} ... {{end}}{{end}}
                    ep.next()
                    else_body = [self.control(next_word, ep)]
                else:
                    if not ep.done():
                        raise ep.error("unexpected token after else")
                    else_body, _ = self.list_until({"end"})
            return Branch(kind, pipe, body, else_body)
        finally:
            del self.variables[mark:]
