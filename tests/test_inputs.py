"""The Unicode check shared by the offline engine and the OpenAI server."""

from __future__ import annotations

import pytest

from vllm.inputs import InvalidUnicodeError, check_unicode_text, check_unicode_values


def test_text_check_names_field_code_point_and_offset():
    check_unicode_text("ascii", "prompt")
    check_unicode_text("naïve 😀 文字", "prompt")
    with pytest.raises(InvalidUnicodeError) as e:
        check_unicode_text("ab\udc80", "stop.1")
    assert isinstance(e.value, ValueError) and e.value.parameter == "stop.1"
    assert str(e.value).startswith(
        "stop.1 contains a lone UTF-16 surrogate U+DC80 at character 2")


@pytest.mark.parametrize(("value", "field", "starts"), [
    ({"model": "\ud800"}, "model", "model contains"),
    ({"messages": [{"role": "user", "content": "ok"},
                   {"role": "user", "content": [{"type": "text", "text": "x\ud800"}]}]},
     "messages.1.content.0.text", "messages.1.content.0.text contains"),
    ({"logit_bias": {"\udc00": 1}}, "logit_bias", "a key of logit_bias contains"),
    ({"\udc00": 1}, None, "a key contains"),
    (["\ud800"], "0", "0 contains"),
])
def test_values_check_walks_dicts_lists_and_keys(value, field, starts):
    with pytest.raises(InvalidUnicodeError) as e:
        check_unicode_values(value)
    assert e.value.parameter == field
    assert str(e.value).startswith(starts)


def test_values_check_accepts_valid_and_non_string_values():
    """Valid text and non-string leaves pass, and the walk visits every one of them:
    swapping any string leaf for a lone surrogate makes the same value fail, naming it."""
    value = {"prompt": ["a", "é"], "n": 2, "stop": None, "x": {"y": [1.5, True, "ok"]}}
    assert check_unicode_values(value) is None
    leaves = {"prompt.0": ("prompt", 0), "prompt.1": ("prompt", 1), "x.y.2": ("x", "y", 2)}
    for field, path in leaves.items():
        bad = {"prompt": ["a", "é"], "n": 2, "stop": None, "x": {"y": [1.5, True, "ok"]}}
        parent = bad
        for key in path[:-1]:
            parent = parent[key]
        parent[path[-1]] = "\udfff"
        with pytest.raises(InvalidUnicodeError) as e:
            check_unicode_values(bad)
        assert e.value.parameter == field


def test_deep_nesting_does_not_recurse():
    value: object = "\ud800"
    for _ in range(5000):
        value = [value]
    with pytest.raises(InvalidUnicodeError):
        check_unicode_values(value)
