"""A chat request's `tools` and `tool_choice`, checked, and how each choice is answered.

    none        no parsing; the reply is content (the template still sees the tools)
    auto        the model decides; `--enable-auto-tool-choice --tool-call-parser NAME`
                reads its calls (without both flags: 400, as vLLM answers)
    required    structured outputs force a JSON array of {"name", "parameters"}, one
                item per call, each name one of the tools (vLLM's schema)
    {"type": "function", "function": {"name": N}}
                structured outputs force N's parameters object: one call of N

Tools left unset: "auto" when the request has tools, else "none" (vLLM's default).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm.entrypoints.openai.errors import APIError
from vllm.entrypoints.openai.tool_parsers.abstract_tool_parser import PartialCall, ToolParser
from vllm.entrypoints.openai.tool_parsers.partial_json import parse_partial, partial_call

_EMPTY_PARAMETERS = {"type": "object", "properties": {}}


@dataclass(frozen=True)
class ToolChoice:
    """The resolved choice: `mode` one of none / auto / required / named; `name` for named."""

    mode: str
    name: str | None = None


def resolve_tool_choice(request: Any, auto_tools: bool) -> ToolChoice:
    """Check `tools` and `tool_choice` of a chat request.

    Args:
        auto_tools: the server runs with --enable-auto-tool-choice and a parser.

    Raises:
        APIError(400, param = the field): a malformed tool (`tools.0.function.name`),
            a tool_choice without tools, an unknown choice or function name, "auto"
            without the server flags, required/named with another structured output.
    """
    tools = request.tools or []
    names = [_check_tool(tool, i) for i, tool in enumerate(tools)]
    choice = request.tool_choice
    if choice is None:
        choice = "auto" if tools else "none"
    if choice == "none":
        return ToolChoice("none")
    if not tools:
        raise APIError(400, "tool_choice needs tools: set tools, or leave tool_choice out",
                       "tool_choice")
    if choice == "auto":
        if not auto_tools:
            raise APIError(400, '"auto" tool choice requires --enable-auto-tool-choice and '
                           "--tool-call-parser to be set", "tool_choice")
        return ToolChoice("auto")
    if choice == "required":
        resolved = ToolChoice("required")
    elif isinstance(choice, dict) and choice.get("type") == "function":
        name = (choice.get("function") or {}).get("name")
        if name not in names:
            raise APIError(400, f"tool_choice names the function {name!r}, which is not one "
                           f"of the tools ({', '.join(names)})", "tool_choice.function.name")
        resolved = ToolChoice("named", name)
    else:
        raise APIError(400, "tool_choice must be 'none', 'auto', 'required' or "
                       "{\"type\": \"function\", \"function\": {\"name\": ...}}, got "
                       f"{choice!r:.80}", "tool_choice")
    for field in ("response_format", "structured_outputs", "guided_json", "guided_regex",
                  "guided_choice", "guided_grammar"):
        value = getattr(request, field, None)
        if value is not None and not (field == "response_format" and isinstance(value, dict)
                                      and value.get("type") == "text"):
            raise APIError(400, f"tool_choice {resolved.name or resolved.mode!r} is enforced "
                           f"with structured outputs; leave {field} out", field)
    return resolved


def _check_tool(tool: Any, index: int) -> str:
    """The tool's function name. Raises APIError(400) naming the malformed field."""
    where = f"tools.{index}"
    if not isinstance(tool, dict) or tool.get("type") != "function":
        raise APIError(400, f"{where}.type must be 'function'", f"{where}.type")
    function = tool.get("function")
    if not isinstance(function, dict):
        raise APIError(400, f"{where}.function must be an object", f"{where}.function")
    name = function.get("name")
    if not isinstance(name, str) or not name:
        raise APIError(400, f"{where}.function.name must be a non-empty string",
                       f"{where}.function.name")
    parameters = function.get("parameters")
    if parameters is not None and not isinstance(parameters, dict):
        raise APIError(400, f"{where}.function.parameters must be a JSON schema object",
                       f"{where}.function.parameters")
    return name


def tool_choice_schema(tools: list[dict], choice: ToolChoice,
                       parallel_tool_calls: bool | None) -> dict | None:
    """The JSON schema structured outputs enforce for `choice` (None: none / auto).

    required: `{"type": "array", "minItems": 1, "items": {"anyOf": [{"properties":
    {"name": {"enum": [N]}, "parameters": N's schema}, ...}]}}` (`maxItems` 1 when
    parallel_tool_calls is false; each tool's `$defs` lifted to the top, where its
    `#/$defs/...` references point); named: the function's parameters schema.
    """
    functions = {t["function"]["name"]: t["function"] for t in tools}
    if choice.mode == "named":
        return functions[choice.name].get("parameters") or _EMPTY_PARAMETERS
    if choice.mode != "required":
        return None
    defs: dict[str, Any] = {}
    items = []
    for name, function in functions.items():
        parameters = dict(function.get("parameters") or _EMPTY_PARAMETERS)
        defs.update(parameters.pop("$defs", {}))
        items.append({"type": "object",
                      "properties": {"name": {"type": "string", "enum": [name]},
                                     "parameters": parameters},
                      "required": ["name", "parameters"]})
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": items}}
    if parallel_tool_calls is False:
        schema["maxItems"] = 1
    if defs:
        schema["$defs"] = defs
    return schema


class RequiredToolParser(ToolParser):
    """tool_choice "required": the reply is the JSON array the grammar forced."""

    def _parse(self, text: str, final: bool) -> tuple[str, list[PartialCall]]:
        import json

        if final:
            try:
                value = json.loads(text)
            except json.JSONDecodeError:  # cut short: the array is an unfinished call
                return "", [PartialCall()]
            items = value if isinstance(value, list) else []
            calls = [partial_call(json.dumps(v), complete=True) for v in items]
            return "", [c for c in calls if c is not None]
        value = parse_partial(text)
        if not isinstance(value, list):
            return "", []
        # Every item but the last is complete (the array moved past it).
        calls = [_item_call(v, i < len(value) - 1) for i, v in enumerate(value)]
        return "", calls


def _item_call(item: Any, complete: bool) -> PartialCall:
    if not isinstance(item, dict):
        return PartialCall()
    name = item.get("name")
    # A name is whole once a later key (or item) follows it; partial strings may cut it.
    whole = complete or "parameters" in item
    return PartialCall(name if whole and isinstance(name, str) else None,
                       item.get("parameters", item.get("arguments")), complete=complete)


class NamedToolParser(ToolParser):
    """A named tool_choice: the reply is the function's arguments object."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self.name = name

    def _parse(self, text: str, final: bool) -> tuple[str, list[PartialCall]]:
        import json

        if final:
            try:
                return "", [PartialCall(self.name, json.loads(text), complete=True)]
            except json.JSONDecodeError:  # cut short: an unfinished call
                return "", [PartialCall(self.name)]
        return "", [PartialCall(self.name, parse_partial(text))]
