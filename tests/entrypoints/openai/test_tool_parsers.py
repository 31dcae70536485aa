"""Tool-call parsers on text (hermes, llama3_json, the required / named choices' JSON),
whole and streamed in every cut, and the checks and schema of `tool_choice`."""

from __future__ import annotations

import json
from types import SimpleNamespace

import jsonschema
import pytest

from vllm.entrypoints.openai.errors import APIError
from vllm.entrypoints.openai.tool_parsers import ToolParserManager
from vllm.entrypoints.openai.tool_parsers.tool_call_stream import ToolCallStream
from vllm.entrypoints.openai.tool_parsers.tool_choice import (
    NamedToolParser,
    RequiredToolParser,
    ToolChoice,
    resolve_tool_choice,
    tool_choice_schema,
)

HERMES = ToolParserManager.get_tool_parser("hermes")()
LLAMA = ToolParserManager.get_tool_parser("llama3_json")()
CITY = {"city": "Paris", "days": [1, 2.5], "units": {"t": "celsius", "rain": True}}

# parser, reply -> (content, [(name, arguments)])
CASES = [
    (HERMES, 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": '
             f'{json.dumps(CITY)}}}\n</tool_call>', ("Let me check.\n",
                                                     [("get_weather", CITY)])),
    (HERMES, '<tool_call>{"name": "a", "arguments": {}}</tool_call>\n<tool_call>{"name": "b", '
             '"arguments": {"x": "y\\"z"}}</tool_call>', (None, [("a", {}), ("b", {"x": 'y"z'})])),
    (HERMES, "no call here, 1 < 2", ("no call here, 1 < 2", [])),
    (HERMES, '<tool_call>{"name": "a", "arguments": {broken</tool_call>',
     ('<tool_call>{"name": "a", "arguments": {broken</tool_call>', [])),
    (HERMES, '<tool_call>{"name": "é", "arguments": {"q": "ünï"}}', (None, [("é", {"q": "ünï"})])),
    (LLAMA, '{"name": "get_weather", "parameters": ' f"{json.dumps(CITY)}}}",
     (None, [("get_weather", CITY)])),
    (LLAMA, '<|python_tag|>{"name": "a", "parameters": {"n": -1.5e3}}; {"name": "b", '
            '"arguments": {}}', (None, [("a", {"n": -1.5e3}), ("b", {})])),
    (LLAMA, "Paris is the capital.", ("Paris is the capital.", [])),
    (LLAMA, '{"not": "a call"}', ('{"not": "a call"}', [])),
    (RequiredToolParser(), '[{"name": "get_weather", "parameters": ' f"{json.dumps(CITY)}}}, "
                           '{"name": "b", "parameters": {"k": null}}]',
     (None, [("get_weather", CITY), ("b", {"k": None})])),
    (NamedToolParser("get_weather"), json.dumps(CITY), (None, [("get_weather", CITY)])),
]


def _calls(tool_calls):
    return [(c.function.name, json.loads(c.function.arguments)) for c in tool_calls]


@pytest.mark.parametrize(("parser", "reply", "expected"), CASES)
def test_whole_reply(parser, reply, expected):
    info = parser.extract_tool_calls(reply)
    assert (info.content, _calls(info.tool_calls)) == expected
    assert info.tools_called == bool(expected[1])
    assert all(c.id.startswith("chatcmpl-tool-") and c.type == "function"
               for c in info.tool_calls)


# A call whose JSON breaks after its name was streamed cannot be taken back (vLLM's
# streams neither): the malformed case is whole-reply only.
STREAMABLE = [case for case in CASES if "broken" not in case[1]]


@pytest.mark.parametrize(("parser", "reply", "expected"), STREAMABLE)
def test_streamed_deltas_join_to_the_whole_reply(parser, reply, expected):
    whole = parser.extract_tool_calls(reply)
    for size in (1, 3, 8):
        stream = ToolCallStream(parser)
        content, calls = "", {}
        pieces = [reply[i:i + size] for i in range(0, len(reply), size)]
        for k, piece in enumerate(pieces):
            text, deltas = stream.feed(piece, final=k == len(pieces) - 1)
            content += text
            for delta in deltas:
                if delta.index not in calls:  # the first delta: id, type and name
                    assert delta.id.startswith("chatcmpl-tool-") and delta.type == "function"
                    assert delta.function.name is not None
                    calls[delta.index] = [delta.function.name, ""]
                else:
                    assert delta.id is None and delta.function.name is None
                    assert delta.function.arguments
                calls[delta.index][1] += delta.function.arguments or ""
        assert stream.tools_called == bool(expected[1])
        assert (content or None) == (whole.content if whole.tools_called else reply)
        assert [(n, a) for n, a in calls.values()] == [
            (c.function.name, c.function.arguments) for c in whole.tool_calls]


LLAMA_TWO_CALLS = CASES[6][1]  # <|python_tag|>{"name": "a", ...}; {"name": "b", ...}


@pytest.mark.parametrize(("parser", "reply"), [
    (HERMES, CASES[0][1][:-30]),  # cut inside the arguments, as max_tokens cuts
    (RequiredToolParser(), CASES[-2][1][:60]),
    (HERMES, '<tool_call>{"name": "a", "arguments": {broken</tool_call>'),
    (LLAMA, CASES[5][1][:-20]),  # cut inside the arguments
    (LLAMA, LLAMA_TWO_CALLS[:-5]),  # the first call whole, the second cut
])
def test_a_stream_cut_inside_a_sent_call_sends_no_raw_json_as_content(parser, reply):
    stream = ToolCallStream(parser)
    content = ""
    for i in range(0, len(reply), 4):
        text, _ = stream.feed(reply[i:i + 4], final=i + 4 >= len(reply))
        content += text
    assert stream.tools_called
    assert "{" not in content, content  # before: the call's raw JSON came again at the end


@pytest.mark.parametrize(("parser", "reply", "before"), [
    (HERMES, 'Let me check.\n<tool_call>\n{"name": "get_we', "Let me check.\n"),
    (LLAMA, '{"name": "get_we', ""),
    (LLAMA, '<|python_tag|>{"name": "a", "para', ""),
    (NamedToolParser("f"), '{"city": "Par', ""),
])
def test_a_stream_cut_before_a_calls_name_is_whole_sends_no_raw_json(parser, reply, before):
    """The parser says the reply ends inside an unfinished call (max_tokens): that
    call's text is never content, whether or not its name went out; the whole reply
    (not streamed) is all content, as in vLLM."""
    reply_state = parser.parse(reply, final=True)
    assert reply_state.unfinished_call and not reply_state.calls
    stream = ToolCallStream(parser)
    content = ""
    for i in range(0, len(reply), 3):
        text, _ = stream.feed(reply[i:i + 3], final=i + 3 >= len(reply))
        content += text
    assert content == before
    assert parser.extract_tool_calls(reply).content == reply


def test_a_reply_that_is_no_call_is_not_an_unfinished_call():
    for parser, reply in [(HERMES, "1 < 2"), (LLAMA, '{"not": "a call"}'), (LLAMA, "Paris.")]:
        parsed = parser.parse(reply, final=True)
        assert (parsed.content, parsed.calls, parsed.unfinished_call) == (reply, [], False)


def test_arguments_stream_as_they_are_written():
    """Character by character, a call's arguments arrive in many pieces, not at the end."""
    reply = CASES[0][1]
    stream = ToolCallStream(HERMES)
    pieces = []
    for i, char in enumerate(reply):
        _, deltas = stream.feed(char, final=i == len(reply) - 1)
        pieces += [d.function.arguments for d in deltas if d.function.arguments]
    assert len(pieces) > 10, pieces
    assert json.loads("".join(pieces)) == CITY


def test_parallel_tool_calls_false_keeps_the_first_call():
    reply = CASES[1][1]
    stream = ToolCallStream(HERMES, max_calls=1)
    _, deltas = stream.feed(reply, final=True)
    assert {d.index for d in deltas} == {0}


TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"$ref": "#/$defs/City"}}, "required": ["city"],
    "$defs": {"City": {"type": "string", "enum": ["Paris", "Rome"]}}}}},
         {"type": "function", "function": {"name": "now"}}]


def _request(**fields):
    base = dict(tools=TOOLS, tool_choice=None, response_format=None, structured_outputs=None,
                guided_json=None, guided_regex=None, guided_choice=None, guided_grammar=None)
    return SimpleNamespace(**{**base, **fields})


def test_tool_choice_resolution():
    assert resolve_tool_choice(_request(), auto_tools=True) == ToolChoice("auto")
    assert resolve_tool_choice(_request(tools=None), auto_tools=False) == ToolChoice("none")
    assert resolve_tool_choice(_request(tool_choice="none"), False) == ToolChoice("none")
    assert resolve_tool_choice(_request(tool_choice="required"), False) == ToolChoice(
        "required")
    named = {"type": "function", "function": {"name": "now"}}
    assert resolve_tool_choice(_request(tool_choice=named), False) == ToolChoice("named", "now")


@pytest.mark.parametrize(("fields", "param", "message"), [
    ({}, "tool_choice", "requires --enable-auto-tool-choice and --tool-call-parser"),
    ({"tool_choice": "auto"}, "tool_choice", "requires --enable-auto-tool-choice"),
    ({"tools": None, "tool_choice": "required"}, "tool_choice", "tool_choice needs tools"),
    ({"tool_choice": "sometimes"}, "tool_choice", "must be 'none', 'auto', 'required'"),
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice.function.name", "'nope', which is not one of the tools (get_weather, now)"),
    ({"tools": [{"type": "function", "function": {"name": ""}}], "tool_choice": "none"},
     "tools.0.function.name", "must be a non-empty string"),
    ({"tools": [{"type": "retrieval"}], "tool_choice": "none"}, "tools.0.type", "'function'"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": []}}],
      "tool_choice": "none"}, "tools.0.function.parameters", "JSON schema object"),
    ({"tool_choice": "required", "response_format": {"type": "json_object"}},
     "response_format", "leave response_format out"),
])
def test_tool_choice_errors_name_the_field(fields, param, message):
    with pytest.raises(APIError) as info:
        resolve_tool_choice(_request(**fields), auto_tools=False)
    assert info.value.status == 400 and info.value.param == param
    assert message in info.value.message


def test_required_schema_accepts_calls_of_the_tools_only():
    schema = tool_choice_schema(TOOLS, ToolChoice("required"), None)
    good = [{"name": "get_weather", "parameters": {"city": "Rome"}},
            {"name": "now", "parameters": {}}]
    jsonschema.validate(good, schema)
    for bad in ([], [{"name": "other", "parameters": {}}],
                [{"name": "get_weather", "parameters": {"city": "Oslo"}}],
                [{"name": "now"}]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    single = tool_choice_schema(TOOLS, ToolChoice("required"), False)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(good, single)
    assert tool_choice_schema(TOOLS, ToolChoice("named", "get_weather"), None) == (
        TOOLS[0]["function"]["parameters"])
    assert tool_choice_schema(TOOLS, ToolChoice("named", "now"), None) == {
        "type": "object", "properties": {}}
    assert tool_choice_schema(TOOLS, ToolChoice("auto"), None) is None
