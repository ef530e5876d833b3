"""Modelfiles: parsing (Ollama's parser/parser.go state machine), printing, and the create request.

One instruction per line, case-insensitive: FROM, PARAMETER k v, TEMPLATE, SYSTEM, ADAPTER, LICENSE,
MESSAGE role text, REQUIRES, RENDERER, PARSER, DRAFT. `#` starts a comment. Values are plain, "quoted"
or \"\"\"multi-line\"\"\". Without FROM a Modelfile is an error.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ollama_engine.store.disk import file_digest
from ollama_engine.store.params import DEPRECATED_PARAMETERS, merge_param

COMMANDS = ("from", "license", "template", "system", "adapter", "draft", "renderer", "parser", "parameter",
            "message", "requires")
ROLES = ("system", "user", "assistant")


class ModelfileError(ValueError):
    """A Modelfile that does not parse; the message names the line where Ollama's parser would."""


@dataclass
class Command:
    name: str  # "model" for FROM, a parameter's name for PARAMETER, else the lower-cased instruction
    args: str

    def __str__(self) -> str:
        if self.name == "model":
            return f"FROM {self.args}"
        if self.name in ("license", "template", "system", "adapter", "renderer", "parser", "requires", "draft"):
            return f"{self.name.upper()} {quote(self.args)}"
        if self.name == "message":
            role, _, message = self.args.partition(": ")
            return f"MESSAGE {role} {quote(message)}"
        return f"PARAMETER {self.name} {quote(self.args)}"


@dataclass
class Modelfile:
    commands: list[Command] = field(default_factory=list)

    def __str__(self) -> str:
        return "".join(f"{c}\n" for c in self.commands)

    def create_request(self, relative_dir: str | os.PathLike[str] = ".") -> tuple[dict[str, Any], dict[str, Path]]:
        """The /api/create body for this Modelfile, and the local files to upload first (digest -> path).

        As Ollama's CLI: a FROM path that exists is hashed and sent as `files` ({file name: digest}); one
        that does not exist is a model name, sent as `from`. PARAMETERs are typed; stop accumulates.
        """
        request: dict[str, Any] = {}
        uploads: dict[str, Path] = {}
        params: dict[str, Any] = {}
        messages: list[dict[str, str]] = []
        licenses: list[str] = []
        for c in self.commands:
            if c.name in ("model", "adapter", "draft"):
                path = expand_path(c.args, relative_dir)
                if not path.exists():
                    if c.name != "model":
                        raise ModelfileError(f"{c.name} {c.args}: no such file")
                    request["from"] = c.args
                    continue
                if path.is_dir():
                    raise ModelfileError(f"{c.args}: is a directory (only GGUF files are supported)")
                digest = file_digest(path)
                uploads[digest] = path
                field = {"model": "files", "adapter": "adapters", "draft": "draft_files"}[c.name]
                request.setdefault(field, {})[path.name] = digest
            elif c.name in ("template", "system", "renderer", "parser"):
                request[c.name] = c.args
            elif c.name == "requires":
                request["requires"] = _semver(c.args)
            elif c.name == "license":
                licenses.append(c.args)
            elif c.name == "message":
                role, _, content = c.args.partition(": ")
                messages.append({"role": role, "content": content})
            elif c.name not in DEPRECATED_PARAMETERS:
                merge_param(params, c.name, c.args)
        if params:
            request["parameters"] = params
        if messages:
            request["messages"] = messages
        if licenses:
            request["license"] = licenses
        return request, uploads


def quote(s: str) -> str:
    """Ollama's quote: values with newlines or edge spaces get quotes (triple if they hold a quote)."""
    if "\n" in s or s.startswith(" ") or s.endswith(" "):
        return f'"""{s}"""' if '"' in s else f'"{s}"'
    return s


def unquote(s: str) -> tuple[str, bool]:
    if s.startswith('"""'):
        return (s[3:-3], True) if len(s) >= 6 and s.endswith('"""') else ("", False)
    if s.startswith('"'):
        return (s[1:-1], True) if len(s) >= 2 and s.endswith('"') else ("", False)
    return s, True


_NIL, _NAME, _VALUE, _PARAMETER, _MESSAGE, _COMMENT = range(6)


def _next_state(ch: str, state: int) -> tuple[int, str, str | None]:
    """(next state, the character to keep or "", error) for one character (parseRuneForState)."""
    space, newline = ch in " \t", ch in "\r\n"
    if state == _NIL:
        if ch == "#":
            return _COMMENT, "", None
        if space or newline:
            return _NIL, "", None
        return _NAME, ch, None
    if state == _NAME:
        if ch.isascii() and ch.isalpha():
            return _NAME, ch, None
        if space:
            return _VALUE, "", None
        return _NIL, "", "invalid"
    if state == _VALUE:
        return (_NIL, ch, None) if space or newline else (_VALUE, ch, None)
    if state == _PARAMETER:
        if ch.isascii() and (ch.isalnum() or ch == "_"):
            return _PARAMETER, ch, None
        return (_VALUE, "", None) if space else (_NIL, "", "eof")
    if state == _MESSAGE:
        if ch.isascii() and ch.isalpha():
            return _MESSAGE, ch, None
        return (_VALUE, "", None) if space else (_NIL, "", "eof")
    return (_NIL, "", None) if newline else (_COMMENT, "", None)


def parse_modelfile(text: str | bytes) -> Modelfile:
    """Parse a Modelfile (a UTF-8 or UTF-16 BOM is accepted); ModelfileError on bad input or no FROM."""
    if isinstance(text, bytes):
        text = _decode(text)
    text = text.lstrip("\ufeff")
    commands: list[Command] = []
    name, role, state, line = "", "", _NIL, 1
    buf: list[str] = []

    def error(message: str) -> ModelfileError:
        return ModelfileError(f"(line {line}): {message}")

    for ch in text:
        if ch in "\r\n":
            line += 1
        nxt, keep, problem = _next_state(ch, state)
        if problem == "eof":
            raise ModelfileError(f"unexpected EOF: {''.join(buf)}")
        if problem:
            raise error('command must be one of "from", "license", "template", "system", "adapter", "draft", '
                        '"renderer", "parser", "parameter", "message", or "requires"')
        if nxt != state:
            word = "".join(buf)
            if state == _NAME:
                lower = word.lower()
                if lower not in COMMANDS:
                    raise error('command must be one of "from", "license", "template", "system", "adapter", '
                                '"draft", "renderer", "parser", "parameter", "message", or "requires"')
                if lower == "from":
                    name = "model"
                elif lower == "parameter":
                    nxt = _PARAMETER
                else:
                    name = lower
                    if lower == "message":
                        nxt = _MESSAGE
            elif state == _PARAMETER:
                name = word
            elif state == _MESSAGE:
                if word not in ROLES:
                    raise error('message role must be one of "system", "user", or "assistant"')
                role = word
            elif state == _VALUE:
                value, ok = unquote(word.strip())
                if not ok or ch in " \t":  # inside quotes, or a space within the value: keep reading
                    buf.append(ch)
                    continue
                commands.append(Command(name, f"{role}: {value}" if role else value))
                role = ""
            buf = []
            state = nxt
        if keep and keep.isprintable():
            buf.append(keep)
    if state == _VALUE:
        value, ok = unquote("".join(buf).strip())
        if not ok:
            raise ModelfileError("unexpected EOF")
        commands.append(Command(name, f"{role}: {value}" if role else value))
    elif state not in (_NIL, _COMMENT):
        raise ModelfileError("unexpected EOF")
    if not any(c.name == "model" for c in commands):
        raise ModelfileError("no FROM line")
    return Modelfile(commands)


def expand_path(path: str, relative_dir: str | os.PathLike[str]) -> Path:
    """FROM / ADAPTER paths: absolute as is, `~` and `~user` expanded, others relative to the Modelfile."""
    if path.startswith("~"):
        return Path(os.path.expanduser(path)).resolve()
    p = Path(path)
    return (p if p.is_absolute() else Path(relative_dir) / p).resolve()


_SEMVER = re.compile(r"^v?(0|[1-9]\d*)(\.(0|[1-9]\d*))?(\.(0|[1-9]\d*))?(-[0-9A-Za-z.-]+)?(\+[0-9A-Za-z.-]+)?$")


def _semver(value: str) -> str:
    if not _SEMVER.match(value):
        raise ModelfileError("requires must be a valid semver (e.g. 0.14.0)")
    return value[1:] if value.startswith("v") else value


def _decode(data: bytes) -> str:
    if data.startswith((b"\xff\xfe", b"\xfe\xff")):
        return data.decode("utf-16")
    return data.decode("utf-8-sig")
