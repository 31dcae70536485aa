"""The qwen3 and deepseek_r1 reasoning parsers: whole replies, and the same replies fed
in every way they can be cut into deltas (tags split included)."""

from __future__ import annotations

import pytest

from vllm.reasoning import ReasoningParserManager

QWEN3 = ReasoningParserManager.get_reasoning_parser("qwen3")()
R1 = ReasoningParserManager.get_reasoning_parser("deepseek_r1")()
USER_TURN = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"

CASES = [
    # parser, prompt, reply -> (reasoning_content, content)
    (QWEN3, USER_TURN, "<think>\nLet me see.\n</think>\n\nIt is 4.", ("\nLet me see.\n",
                                                                       "\n\nIt is 4.")),
    (QWEN3, USER_TURN, "It is 4.", (None, "It is 4.")),  # no thinking: all content
    (QWEN3, USER_TURN, "<think>cut off", ("cut off", None)),
    (QWEN3, USER_TURN, "<think>r</think>", ("r", None)),
    (QWEN3, USER_TURN + "<think>\n\n</think>\n\n", "It is 4.", (None, "It is 4.")),
    (QWEN3, USER_TURN + "<think>\n", "r</think>c", ("r", "c")),  # the template opened it
    (QWEN3, USER_TURN, "<think>a</think>b <think>c</think>", ("a", "b <think>c</think>")),
    (R1, USER_TURN + "<think>\n", "r</think>c", ("r", "c")),
    (R1, USER_TURN, "<think>r</think>c", ("r", "c")),  # the model's own start tag dropped
    (R1, USER_TURN, "still thinking", ("still thinking", None)),
    (R1, USER_TURN + "<think>\n\n</think>", "c", (None, "c")),  # the prompt closed it
    (R1, None, "a < b</think>x <", ("a < b", "x <")),  # "<" that is no tag is kept
]


@pytest.mark.parametrize(("parser", "prompt", "reply", "expected"), CASES)
def test_whole_reply(parser, prompt, reply, expected):
    assert parser.extract_reasoning_content(reply, prompt) == expected


@pytest.mark.parametrize(("parser", "prompt", "reply", "expected"), CASES)
def test_streamed_reply_joins_to_the_whole_split(parser, prompt, reply, expected):
    for size in (1, 2, 3, 7):
        stream = parser.stream(prompt)
        reasoning, content = "", ""
        for i in range(0, len(reply), size):
            delta = stream.feed(reply[i:i + size])
            if "think>" not in (expected[1] or ""):  # no delta carries a piece of a tag
                assert not any(f in delta.reasoning + delta.content
                               for f in ("<th", "</t", "nk>")), delta
            reasoning += delta.reasoning
            content += delta.content
        rest = stream.finish()
        assert (reasoning + rest.reasoning or None, content + rest.content or None) == expected


def test_unknown_parser_names_the_choices():
    with pytest.raises(KeyError, match="choose from deepseek_r1, qwen3"):
        ReasoningParserManager.get_reasoning_parser("nope")


def test_the_engines_reasoning_tags_are_the_parsers():
    """The engine applies grammars after the end tag (REASONING_TAGS, below the frontend):
    the same tags and starting state as the parsers that split the replies."""
    from vllm.v1.structured_output.reasoning import REASONING_TAGS

    assert sorted(REASONING_TAGS) == ReasoningParserManager.names()
    for name, (start, end, starts_inside) in REASONING_TAGS.items():
        parser = ReasoningParserManager.get_reasoning_parser(name)
        assert (parser.start_token, parser.end_token, parser.starts_in_reasoning) == (
            start, end, starts_inside)
