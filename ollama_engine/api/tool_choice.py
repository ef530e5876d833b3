"""`tool_choice` enforced: which tools a request renders, and the JSON schema its output must match.

Ollama's OpenAI and Anthropic layers read `tool_choice` and ignore it. Here a choice that demands a call
becomes a constraint for the structured-output machinery (`format` → llguidance, sample/grammar_text.py):
the model can only write one bare JSON call `{"name": ..., "arguments": {...}}` whose arguments match the
tool's own JSON schema, so the call parses (template/toolcalls.py reads bare JSON calls for every model
family) and validates by construction. Use:

    plan = plan_tools(tools, *openai_choice(body.get("tool_choice")))   # or anthropic_choice(...)
    native["tools"] = plan.tools            # None for "none": nothing rendered, nothing parsed
    if plan.format is not None:
        native["format"] = plan.format      # replaces any response format: the call is the answer

Modes: "auto" (the model decides; nothing constrained), "none" (tools left out of the prompt and no call is
parsed), "required" (exactly one call to any offered tool), "function" (exactly one call to `name`).
A forced call is one call even where parallel calls are allowed: a small model held to "one or more" has
no reason to stop, and one call is what a forced choice asks for. Tools may be given in OpenAI chat form
(`{"type": "function", "function": {...}}`), Responses form (`{"type": "function", "name", "parameters"}`)
or Anthropic form (`{"name", "input_schema"}`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

MODES = ("auto", "none", "required", "function")


class ToolChoiceError(ValueError):
    """A tool_choice that cannot be honoured (unknown mode, a function the request does not offer)."""


@dataclass(frozen=True)
class ToolPlan:
    """What a request runs with: the tools to render and parse, and the output's schema (None: free)."""

    tools: list[dict[str, Any]] | None
    format: dict[str, Any] | None
    mode: str
    name: str | None = None

    @property
    def forced(self) -> bool:
        return self.format is not None


def tool_function(tool: Mapping[str, Any]) -> Mapping[str, Any]:
    """The part of a tool that has its name and schema, whichever API's shape it has."""
    inner = tool.get("function")
    return inner if isinstance(inner, Mapping) else tool


def tool_name(tool: Mapping[str, Any]) -> str:
    name = tool_function(tool).get("name")
    return name if isinstance(name, str) else ""


def tool_parameters(tool: Mapping[str, Any]) -> dict[str, Any]:
    """The tool's JSON schema for its arguments; a tool without one takes any object."""
    function = tool_function(tool)
    schema = function.get("parameters", function.get("input_schema"))
    if not isinstance(schema, Mapping) or not schema:
        return {"type": "object"}
    return dict(schema)


def call_schema(tool: Mapping[str, Any]) -> dict[str, Any]:
    """The JSON schema of one call to `tool`: its name, then arguments matching its parameters."""
    return {"type": "object",
            "properties": {"name": {"const": tool_name(tool)}, "arguments": tool_parameters(tool)},
            "required": ["name", "arguments"]}


def plan_tools(tools: Sequence[Mapping[str, Any]] | None, mode: str = "auto", name: str | None = None) -> ToolPlan:
    """The plan for `tools` under a choice `mode` ("auto", "none", "required", "function" with `name`)."""
    if mode not in MODES:
        raise ToolChoiceError(f"invalid tool_choice mode: {mode!r} (must be one of {', '.join(MODES)})")
    offered = [dict(t) for t in tools or [] if isinstance(t, Mapping)]
    if mode == "none" or not offered:
        if mode in ("required", "function"):
            raise ToolChoiceError("tool_choice requires a tool call but the request has no tools")
        return ToolPlan(None, None, mode)
    if mode == "auto":
        return ToolPlan(offered, None, mode)
    if mode == "function":
        chosen = [t for t in offered if tool_name(t) == name]
        if not chosen:
            raise ToolChoiceError(f"tool_choice names function {name!r}, which is not among the request's tools")
        return ToolPlan(offered, call_schema(chosen[0]), mode, name)
    schemas = [call_schema(t) for t in offered]
    return ToolPlan(offered, schemas[0] if len(schemas) == 1 else {"anyOf": schemas}, mode)


def openai_choice(value: Any) -> tuple[str, str | None]:
    """OpenAI's tool_choice (chat completions or Responses) as (mode, name); absent is "auto"."""
    if value is None:
        return "auto", None
    if isinstance(value, str):
        if value in ("auto", "none", "required"):
            return value, None
        raise ToolChoiceError(f"invalid tool_choice: {value!r} (must be 'none', 'auto', 'required' or a function)")
    if isinstance(value, Mapping) and value.get("type") == "function":
        name = tool_function(value).get("name")
        if isinstance(name, str) and name:
            return "function", name
    raise ToolChoiceError("invalid tool_choice: expected {\"type\": \"function\", \"function\": {\"name\": ...}}")


def anthropic_choice(value: Any) -> tuple[str, str | None]:
    """Anthropic's tool_choice ({"type": "auto" | "any" | "tool" | "none"}) as (mode, name)."""
    if value is None:
        return "auto", None
    kind = value.get("type") if isinstance(value, Mapping) else None
    if kind in ("auto", "none"):
        return kind, None
    if kind == "any":
        return "required", None
    if kind == "tool" and isinstance(value.get("name"), str) and value["name"]:
        return "function", value["name"]
    raise ToolChoiceError("tool_choice.type must be one of 'auto', 'any', 'tool' (with a name) or 'none'")
