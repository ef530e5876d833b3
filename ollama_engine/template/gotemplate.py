"""Ollama's TEMPLATE (Go template syntax) rendered the way Ollama's template package renders it.

Facts from ollama/ollama template/template.go (f63eea3d): a template that mentions neither `.Messages`
nor `.Response` gets `{{ .Response }}` appended; one that mentions `.Messages` runs once with System,
Messages, Tools; any other ("legacy") runs once per user/assistant turn with System/Prompt/Response and the
last run is cut right after `{{ .Response }}`; Prompt + Suffix (fill-in-the-middle) runs with those only.
Consecutive messages of one role are merged with a blank line, except tool messages.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ollama_engine.template.goexec import Executor, JSONList, JSONMap, Struct
from ollama_engine.template.gojson import GoStruct
from ollama_engine.template.goparse import (
    Action,
    Branch,
    Command,
    Field,
    Parser,
    Pipe,
    TemplateError,
    Variable,
)
from ollama_engine.template.limits import Budget

DEFAULT_TEMPLATE = "{{ .Prompt }}"
_RESPONSE = Action(Pipe([Command([Field(["Response"])])]))


@dataclass(frozen=True)
class GoTemplate:
    """A parsed TEMPLATE; `render` builds the prompt from chat messages like Ollama's Template.Execute."""

    source: str
    nodes: tuple[object, ...]

    @classmethod
    def parse(cls, source: str) -> GoTemplate:
        nodes = Parser(source).parse()
        names = _identifiers(nodes)
        if "messages" not in names and "response" not in names:
            nodes.append(_RESPONSE)
        return cls(source, tuple(nodes))

    def vars(self) -> list[str]:
        """The lower-cased field and variable names the template uses, sorted (Ollama's Template.Vars)."""
        return sorted(_identifiers(list(self.nodes)))

    def render(self, messages: Sequence[Mapping[str, Any]] = (), *, tools: Sequence[Mapping[str, Any]] | None = None,
               prompt: str = "", suffix: str = "", think: bool = False, think_level: str = "",
               is_think_set: bool = False, force_legacy: bool = False) -> str:
        think_values = {"Think": think, "ThinkLevel": think_level, "IsThinkSet": is_think_set}
        if prompt and suffix:
            return self.execute({"Prompt": prompt, "Suffix": suffix, "Response": "", **think_values})
        system, collated = collate(messages)
        if not force_legacy and "messages" in self.vars():
            return self.execute({"System": system, "Messages": [template_message(m) for m in collated],
                                 "Tools": template_tools(tools), "Response": "", **think_values})
        return self._render_legacy(collated, think_values)

    def execute(self, values: Mapping[str, Any], nodes: Sequence[object] | None = None,
                budget: Budget | None = None) -> str:
        """Run the template once on a map of values (missing keys read as nil), within `budget` (limits.py)."""
        return Executor(dict(values), budget).run(list(self.nodes if nodes is None else nodes))

    def _render_legacy(self, messages: list[dict[str, Any]], think_values: dict[str, Any]) -> str:
        out: list[str] = []
        turn = {"system": "", "prompt": "", "response": ""}
        budget = Budget.for_input(messages)  # one budget for all the turns

        def flush() -> None:
            out.append(self.execute({"System": turn["system"], "Prompt": turn["prompt"],
                                     "Response": turn["response"], **think_values}, budget=budget))
            turn.update(system="", prompt="", response="")

        for m in messages:
            role, content = m.get("role"), m.get("content") or ""
            if role == "system":
                if turn["prompt"] or turn["response"]:
                    flush()
                turn["system"] = content
            elif role == "user":
                if turn["response"]:
                    flush()
                turn["prompt"] = content
            elif role == "assistant":
                turn["response"] = content
        cut = _cut_after_response(list(self.nodes))
        out.append(self.execute({"System": turn["system"], "Prompt": turn["prompt"],
                                 "Response": turn["response"], **think_values}, cut, budget))
        return "".join(out)


def parse(source: str) -> GoTemplate:
    """Parse a TEMPLATE; raises TemplateError (Ollama answers 400 `template error: ...` at create)."""
    return GoTemplate.parse(source)


def collate(messages: Sequence[Mapping[str, Any]]) -> tuple[str, list[dict[str, Any]]]:
    """All system messages joined by a blank line, and the messages with same-role runs merged (not tool)."""
    system: list[str] = []
    merged: list[dict[str, Any]] = []
    for message in messages:
        m = dict(message)
        if m.get("role") == "system":
            system.append(m.get("content") or "")
        if merged and merged[-1].get("role") == m.get("role") and m.get("role") != "tool":
            merged[-1]["content"] = (merged[-1].get("content") or "") + "\n\n" + (m.get("content") or "")
        else:
            merged.append(m)
    return "\n\n".join(system), merged


def template_message(m: Mapping[str, Any]) -> Struct:
    """An API message as Ollama's templateMessage (fields Role, Content, ..., ToolCalls)."""
    calls = []
    for call in m.get("tool_calls") or []:
        function = call.get("function") or {}
        arguments = JSONMap(function.get("arguments") or {})
        calls.append(Struct("templateToolCall", {
            "ID": call.get("id", ""),
            "Function": Struct("templateToolCallFunction", {
                "Index": function.get("index", 0), "Name": function.get("name", ""), "Arguments": arguments,
            }),
        }))
    return Struct("templateMessage", {
        "Role": m.get("role", ""), "Content": m.get("content") or "", "Thinking": m.get("thinking") or "",
        "Images": list(m.get("images") or []), "ToolCalls": calls, "ToolName": m.get("tool_name") or "",
        "ToolCallID": m.get("tool_call_id") or "",
    })


def _property_type(value: Any) -> Struct:
    types = [value] if isinstance(value, str) else list(value or [])

    def text() -> str:
        return types[0] if len(types) == 1 else ("[" + " ".join(types) + "]" if types else "")

    return Struct("PropertyType", {}, json=types[0] if len(types) == 1 else types, text=text)


def tool_property(p: Mapping[str, Any]) -> Struct:
    """A JSON-schema property as Ollama's api.ToolProperty (Type prints as its single type name)."""
    json = GoStruct()
    for key in ("anyOf", "type", "items", "description", "enum", "properties", "required"):
        if p.get(key):
            json[key] = p[key]
    fields = {
        "AnyOf": [tool_property(x) for x in p.get("anyOf") or []],
        "Type": _property_type(p.get("type")),
        "Items": p.get("items"),
        "Description": p.get("description") or "",
        "Enum": list(p.get("enum") or []),
        "Properties": JSONMap({k: tool_property(v) for k, v in (p.get("properties") or {}).items()}),
        "Required": list(p.get("required") or []),
    }
    return Struct("ToolProperty", fields, json=json)


def template_tools(tools: Sequence[Mapping[str, Any]] | None) -> JSONList | None:
    """OpenAI-shaped tools as Ollama's templateTools (prints as JSON; Properties range in key order)."""
    if tools is None:
        return None
    out = JSONList()
    for tool in tools:
        function = tool.get("function") or {}
        params = function.get("parameters") or {}
        props = JSONMap({k: tool_property(v) for k, v in (params.get("properties") or {}).items()})
        params_json = GoStruct(type=params.get("type", ""))
        for key, go_key in (("$defs", "$defs"), ("items", "items"), ("required", "required")):
            if params.get(key):
                params_json[go_key] = params[key]
        params_json["properties"] = props
        parameters = Struct("templateToolFunctionParameters", {
            "Type": params.get("type", ""), "Defs": params.get("$defs"), "Items": params.get("items"),
            "Required": list(params.get("required") or []), "Properties": props,
        }, json=params_json)
        fn = Struct("templateToolFunction", {
            "Name": function.get("name", ""), "Description": function.get("description", ""),
            "Parameters": parameters,
        }, json=GoStruct(name=function.get("name", ""), description=function.get("description", ""),
                         parameters=parameters))
        tool_json = GoStruct(type=tool.get("type", ""))
        if tool.get("items"):
            tool_json["items"] = tool["items"]
        tool_json["function"] = fn
        out.append(Struct("templateTool", {"Type": tool.get("type", ""), "Items": tool.get("items"),
                                           "Function": fn}, json=tool_json))
    return out


# ---- tree helpers ------------------------------------------------------------------------------


def _identifiers(nodes: list[object]) -> set[str]:
    """Field and variable names, as Ollama's Identifiers walk collects them (lower-cased)."""
    names: set[str] = set()

    def pipe(p: Pipe) -> None:
        for cmd in p.cmds:
            for arg in cmd.args:
                operand(arg)

    def operand(node: object) -> None:
        if isinstance(node, Field):
            names.update(i.lower() for i in node.idents)
        elif isinstance(node, Variable):
            names.update(i.lower() for i in [node.name, *node.idents])
        elif isinstance(node, Pipe):
            pipe(node)

    def walk(items: list[object]) -> None:
        for node in items:
            if isinstance(node, Action):
                pipe(node.pipe)
            elif isinstance(node, Branch):
                pipe(node.pipe)
                walk(node.body)
                walk(node.else_body or [])

    walk(nodes)
    return names


def _cut_after_response(nodes: list[object]) -> list[object]:
    """A copy of the tree with everything after the first `.Response` field removed (Ollama's deleteNode).

    Like Ollama, the walk looks into actions' pipelines and into branch bodies, not into the conditions of
    if / range / with; the node that holds `.Response` stays (it prints the empty response).
    """
    cut = False

    def args(values: list[object]) -> list[object]:
        nonlocal cut
        kept = []
        for arg in values:
            if cut:
                continue
            if isinstance(arg, Field) and "Response" in arg.idents:
                cut = True
                kept.append(arg)
            elif isinstance(arg, Pipe):
                inner = pipe(arg)
                if inner is not None:
                    kept.append(inner)
            else:
                kept.append(arg)
        return kept

    def pipe(p: Pipe) -> Pipe | None:
        cmds = []
        for cmd in p.cmds:
            if cut:
                break
            kept = args(cmd.args)
            if not kept:
                return None
            cmds.append(Command(kept))
        return Pipe(cmds, list(p.decl), p.is_assign) if cmds else None

    def walk(items: list[object]) -> list[object]:
        out = []
        for node in items:
            if cut:
                break
            if isinstance(node, Action):
                p = pipe(node.pipe)
                if p is not None:
                    out.append(Action(p))
            elif isinstance(node, Branch):
                body = walk(node.body)
                else_body = None if cut or node.else_body is None else walk(node.else_body)
                out.append(Branch(node.kind, node.pipe, body, else_body))
            else:
                out.append(copy.copy(node))
        return out

    return walk(nodes)


__all__ = ["DEFAULT_TEMPLATE", "GoTemplate", "TemplateError", "collate", "parse", "template_message",
           "template_tools", "tool_property"]
