"""Tools on chat: OpenAI's `tools` and `tool_choice`, tool calls and tool results in the history, and
`tool_calls` in the answer (whole or streamed).

The prompt is hermes-style (the format Qwen and NousResearch chat models are trained on, and what vLLM's
`hermes` tool-call parser reads): the tools' JSON in the system message, each call as
`<tool_call>{"name": ..., "arguments": ...}</tool_call>`, each result as `<tool_response>...</tool_response>`.
It is rendered into plain messages, so any chat template (or none: the demo tokenizer has none) carries it.

`tool_choice` "required" or a named function is guaranteed valid through structured output: the reply is
constrained to a JSON array of calls whose arguments match the tools' parameter schemas (as vLLM does), so it
always parses. "auto" leaves the reply free and a tool-call parser (hermes: the `<tool_call>` blocks) finds
the calls in it. "none" calls nothing.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel

from specmesh.sampling import StructuredSpec

MAX_TOOLS = 128
_TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


class ToolInputError(ValueError):
    """A malformed tools or tool_choice parameter: `param` names it."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


class FunctionCall(BaseModel):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(BaseModel):
    id: str
    type: str = "function"
    function: FunctionCall


class DeltaFunctionCall(BaseModel):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(BaseModel):
    index: int
    id: str | None = None
    type: str | None = None
    function: DeltaFunctionCall


@dataclass(frozen=True)
class ToolPlan:
    """What a chat request's tools ask for: the functions, how the reply may call them, and the parser."""

    functions: dict[str, dict] = field(default_factory=dict)  # name -> parameters schema
    choice: str = "auto"  # none, auto, required or named
    named: str | None = None
    parallel: bool = True
    parser: str = "hermes"
    tools: tuple[dict, ...] = ()  # as sent (for the prompt)

    @property
    def forced(self) -> bool:
        return self.choice in ("required", "named")

    @property
    def parses(self) -> bool:
        return bool(self.functions) and self.choice != "none"

    def structured(self) -> StructuredSpec | None:
        """The grammar of a forced reply: a JSON array of calls, each {"name", "arguments"} with the arguments
        matching that function's parameters."""
        if not self.forced:
            return None
        names = [self.named] if self.choice == "named" and self.named is not None else list(self.functions)
        calls = [
            {
                "type": "object",
                "properties": {
                    "name": {"const": name},
                    "arguments": self.functions[name] or {"type": "object"},
                },
                "required": ["name", "arguments"],
                "additionalProperties": False,
            }
            for name in names
        ]
        item = calls[0] if len(calls) == 1 else {"anyOf": calls}
        schema: dict[str, Any] = {"type": "array", "items": item, "minItems": 1}
        if not self.parallel:
            schema["maxItems"] = 1
        return StructuredSpec("json_schema", json.dumps(schema), "tools")


def plan(tools: Any, tool_choice: Any, parallel: bool, parser: str = "hermes") -> ToolPlan | None:
    """The request's ToolPlan (None without tools); ToolInputError naming the parameter when malformed."""
    if tools is None or tools == []:
        if tool_choice not in (None, "none", "auto"):
            raise ToolInputError("tool_choice", "'tool_choice' needs 'tools'")
        return None
    if not isinstance(tools, list) or len(tools) > MAX_TOOLS:
        raise ToolInputError("tools", f"'tools' must be a list of at most {MAX_TOOLS} tools")
    functions: dict[str, dict] = {}
    for t in tools:
        fn = t.get("function") if isinstance(t, dict) and t.get("type", "function") == "function" else None
        name = fn.get("name") if isinstance(fn, dict) else None
        if not isinstance(fn, dict) or not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_.-]{1,64}", name):
            raise ToolInputError("tools", "each tool must be {'type': 'function', 'function': {'name': ...}}")
        params = fn.get("parameters") or {}
        if not isinstance(params, dict):
            raise ToolInputError("tools", f"'tools': the parameters of {name} must be a JSON schema object")
        functions[name] = params
    choice, named = "auto", None
    if tool_choice is None or tool_choice in ("auto", "none", "required"):
        choice = tool_choice or "auto"
    elif isinstance(tool_choice, dict) and isinstance(tool_choice.get("function"), dict):
        named = tool_choice["function"].get("name")
        if named not in functions:
            raise ToolInputError("tool_choice", f"'tool_choice' names {named!r}, which is not among the tools")
        choice = "named"
    else:
        raise ToolInputError("tool_choice", "'tool_choice' must be none, auto, required or a named function")
    return ToolPlan(functions, choice, named, parallel, parser, tuple(tools))


def system_prompt(tools: tuple[dict, ...]) -> str:
    listed = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    return (
        "You may call one or more functions to assist with the user query.\n"
        f"Function signatures are within <tools></tools> XML tags:\n<tools>\n{listed}\n</tools>\n"
        "For each function call, return a json object with the function name and arguments within "
        '<tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}'
        "\n</tool_call>"
    )


def render_messages(messages: list[dict], tool_plan: ToolPlan | None) -> list[dict]:
    """Plain {role, content} messages, hermes-style: the tools in the system message, assistant tool calls
    as <tool_call> blocks, tool results as <tool_response> blocks in a user turn."""
    out: list[dict] = []
    for m in messages:
        role, content = m["role"], m.get("content") or ""
        if role == "assistant" and m.get("tool_calls"):
            blocks = []
            for call in m["tool_calls"]:
                fn = call.get("function", {}) if isinstance(call, dict) else {}
                try:
                    args = json.loads(fn.get("arguments") or "{}")
                except ValueError:
                    args = fn.get("arguments")
                blocks.append(
                    "<tool_call>\n" + json.dumps({"name": fn.get("name"), "arguments": args}) + "\n</tool_call>"
                )
            content = (content + "\n" if content else "") + "\n".join(blocks)
        elif role == "tool":
            role, content = "user", f"<tool_response>\n{content}\n</tool_response>"
        out.append({"role": role, "content": content})
    if tool_plan is not None and tool_plan.choice != "none":
        prompt = system_prompt(tool_plan.tools)
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": out[0]["content"] + "\n\n" + prompt}
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out


def _call(obj: Any) -> ToolCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    return ToolCall(
        id=f"call_{uuid.uuid4().hex[:24]}",
        function=FunctionCall(name=obj["name"], arguments=json.dumps(args, ensure_ascii=False)),
    )


def parse_reply(text: str, tool_plan: ToolPlan) -> tuple[str | None, list[ToolCall]]:
    """(content, tool calls) of a reply. A forced reply is the JSON array of calls; an auto reply is read by
    the plan's parser (hermes: the <tool_call> blocks, the text around them as content)."""
    if tool_plan.forced:
        try:
            calls = [c for c in (_call(o) for o in json.loads(text)) if c is not None]
        except (ValueError, TypeError):  # cut short by max_tokens: the calls it finished, else the text
            calls = [c for c in (_call(o) for o in _whole_items(text)) if c is not None]
            return (None, calls) if calls else (text, [])
        return None, calls
    return TOOL_CALL_PARSERS[tool_plan.parser](text)


def _whole_items(text: str) -> list[Any]:
    """The items of a JSON array cut short, up to the last one that closed (a forced reply that ran into
    max_tokens: its finished calls are valid, the one it was writing is not)."""
    decoder = json.JSONDecoder()
    items: list[Any] = []
    i = text.find("[") + 1
    if i == 0:
        return items
    while True:
        while i < len(text) and text[i] in " \t\r\n,":
            i += 1
        try:
            item, i = decoder.raw_decode(text, i)
        except ValueError:
            return items
        items.append(item)


def parse_hermes(text: str) -> tuple[str | None, list[ToolCall]]:
    """Hermes-style calls: each a <tool_call>{"name", "arguments"}</tool_call> block; the rest is content."""
    calls: list[ToolCall] = []
    for block in _TOOL_CALL.findall(text):
        try:
            call = _call(json.loads(block))
        except ValueError:
            call = None
        if call is not None:
            calls.append(call)
    if not calls:
        return text, []
    content = _TOOL_CALL.sub("", text).strip()
    return content or None, calls


# --tool-call-parser: how a reply with tool_choice auto is read.
TOOL_CALL_PARSERS = {"hermes": parse_hermes}


def delta_calls(calls: list[ToolCall]) -> list[DeltaToolCall]:
    """Stream deltas of whole calls: each with its index, id, name and all of its arguments."""
    return [
        DeltaToolCall(
            index=i,
            id=c.id,
            type="function",
            function=DeltaFunctionCall(name=c.function.name, arguments=c.function.arguments),
        )
        for i, c in enumerate(calls)
    ]
