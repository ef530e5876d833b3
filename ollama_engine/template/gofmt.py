"""fmt.Sprintf for Go templates' `printf`, as Go's fmt does it: bad verbs and arguments are printed, not raised.

Go writes `%!d(string=abc)` for a verb that does not fit its operand, `%!d(MISSING)` for a missing one,
`%!(EXTRA type=value)` for left-over ones, and refuses (`%!(NOVERB)`) a width or precision whose digits
run past a million: the same numbers bound what a template's printf may build here.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ollama_engine.template.gojson import go_float, go_json

_TOO_LARGE = 1_000_000  # fmt's tooLarge: parsenum stops (and the verb is lost) past this


class _Spec:
    """One verb's flags, width and precision (fmt's fmtFlags)."""

    def __init__(self) -> None:
        self.plus = self.minus = self.sharp = self.space = self.zero = False
        self.width: int | None = None
        self.precision: int | None = None

    def flags(self) -> str:
        return ("-" if self.minus else "") + ("+" if self.plus else "") + (" " if self.space else "") + \
            ("#" if self.sharp else "") + ("0" if self.zero else "")

    def pad(self, text: str, numeric: bool = False) -> str:
        if self.width is None or len(text) >= self.width:
            return text
        if self.minus:
            return text.ljust(self.width)
        if self.zero and numeric:
            sign = text[0] if text[:1] in "+- " else ""
            return sign + text[len(sign):].rjust(self.width - len(sign), "0")
        return text.rjust(self.width)


def _parsenum(fmt: str, i: int) -> tuple[int | None, int]:
    """fmt's parsenum: the number at i and the index after it; (None, len(fmt)) when it is too large."""
    num, start = 0, i
    while i < len(fmt) and fmt[i].isdigit() and fmt[i].isascii():
        if num > _TOO_LARGE:
            return None, len(fmt)
        num = num * 10 + int(fmt[i])
        i += 1
    return (num if i > start else None), i


def go_type(value: Any) -> str:
    """The operand's Go type name, as %!verb(type=value) prints it."""
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, int):
        return "int"
    if isinstance(value, float):
        return "float64"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "[]interface {}"
    if isinstance(value, dict):
        return "map[string]interface {}"
    return getattr(value, "type_name", type(value).__name__)


def _integer(value: int, verb: str, spec: _Spec) -> str | None:
    precision = "" if spec.precision is None else f".{spec.precision}"
    if verb in "dxXo":
        return f"%{spec.flags().replace('0', '')}{precision}{verb}" % value
    if verb == "b":
        return ("-" if value < 0 else ("+" if spec.plus else "")) + format(abs(value), "b")
    if verb == "c":
        return chr(value) if 0 <= value <= 0x10FFFF else "\ufffd"
    if verb == "q":
        return "'" + (chr(value) if 0 <= value <= 0x10FFFF else "\ufffd") + "'"
    if verb == "U":
        return f"U+{value:04X}"
    return None


def _float(value: float, verb: str, spec: _Spec) -> str | None:
    if verb in "vgG" and spec.precision is None:
        text = go_float(value, verb="v")
        text = text.upper() if verb == "G" else text
        return ("+" + text if spec.plus and value >= 0 else text)
    if verb in "eEfFgG":
        precision = 6 if spec.precision is None else spec.precision
        return f"%{spec.flags().replace('0', '')}.{precision}{verb}" % value
    return None


def _string(value: str, verb: str, spec: _Spec) -> str | None:
    if verb in "sv":
        return value if spec.precision is None else value[:spec.precision]
    if verb == "q":
        return go_json(value)
    if verb in "xX":
        text = value.encode().hex()
        return text.upper() if verb == "X" else text
    return None


def _format(value: Any, verb: str, spec: _Spec, to_text: Callable[[Any], str]) -> str:
    """printArg: the operand printed with the verb, or fmt's %!verb(type=value)."""
    numeric = False
    if value is None:
        text = "<nil>" if verb == "v" else None
    elif isinstance(value, bool):
        text = ("true" if value else "false") if verb in "tv" else None
    elif isinstance(value, int):
        text, numeric = (_integer(value, "d" if verb == "v" else verb, spec), True)
    elif isinstance(value, float):
        text, numeric = _float(value, verb, spec), True
    elif isinstance(value, str):
        text = _string(value, verb, spec)
    else:
        text = to_text(value) if verb in "sv" else None
    if text is None:
        shown = "<nil>" if value is None else f"{go_type(value)}={_format(value, 'v', spec, to_text)}"
        return f"%!{verb}({shown})"
    return spec.pad(text, numeric)


def sprintf(fmt: str, args: tuple[Any, ...], to_text: Callable[[Any], str]) -> str:
    """fmt.Sprintf(fmt, args...) for templates (no explicit argument indexes)."""
    out: list[str] = []
    i, arg_num, end = 0, 0, len(fmt)
    while i < end:
        at = fmt.find("%", i)
        if at < 0:
            out.append(fmt[i:])
            break
        out.append(fmt[i:at])
        i = at + 1
        spec = _Spec()
        while i < end and fmt[i] in "#0+- ":
            flag = fmt[i]
            if flag == "#":
                spec.sharp = True
            elif flag == "0":
                spec.zero = not spec.minus
            elif flag == "+":
                spec.plus = True
            elif flag == "-":
                spec.minus, spec.zero = True, False
            else:
                spec.space = True
            i += 1
        if i < end and fmt[i] == "*":
            i += 1
            width = args[arg_num] if arg_num < len(args) else None
            arg_num += 1
            if isinstance(width, int) and not isinstance(width, bool) and abs(width) <= _TOO_LARGE:
                spec.width = abs(width)
                if width < 0:
                    spec.minus, spec.zero = True, False
            else:
                out.append("%!(BADWIDTH)")
        else:
            spec.width, i = _parsenum(fmt, i)
        if i + 1 < end and fmt[i] == ".":
            i += 1
            if fmt[i] == "*":
                i += 1
                precision = args[arg_num] if arg_num < len(args) else None
                arg_num += 1
                if isinstance(precision, int) and not isinstance(precision, bool) and 0 <= precision <= _TOO_LARGE:
                    spec.precision = precision
                else:
                    out.append("%!(BADPREC)")
            else:
                spec.precision, i = _parsenum(fmt, i)
                spec.precision = spec.precision or 0
        if i >= end:
            out.append("%!(NOVERB)")
            break
        verb = fmt[i]
        i += 1
        if verb == "%":
            out.append("%")
        elif arg_num >= len(args):
            out.append(f"%!{verb}(MISSING)")
        else:
            out.append(_format(args[arg_num], verb, spec, to_text))
            arg_num += 1
    if arg_num < len(args):
        extra = ", ".join("<nil>" if a is None else f"{go_type(a)}={_format(a, 'v', _Spec(), to_text)}"
                          for a in args[arg_num:])
        out.append(f"%!(EXTRA {extra})")
    return "".join(out)
