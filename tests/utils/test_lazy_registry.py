"""LazyRegistry: names without imports, the class on first use, an unknown name's error;
and the two parser managers built on it."""

import sys

import pytest

from vllm.entrypoints.openai.tool_parsers import ToolParser, ToolParserManager
from vllm.reasoning import ReasoningParser, ReasoningParserManager
from vllm.utils.lazy_registry import LazyRegistry


def test_names_import_nothing_and_get_imports_the_module(tmp_path, monkeypatch):
    (tmp_path / "lazy_registry_probe_mod.py").write_text("class Thing:\n    pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    registry = LazyRegistry("thing", {"b": "lazy_registry_probe_mod:Thing",
                                      "a": "lazy_registry_probe_mod:Thing"})
    assert registry.names() == ["a", "b"]
    assert "lazy_registry_probe_mod" not in sys.modules
    cls = registry.get("b")
    assert cls.__name__ == "Thing" and cls.__module__ == "lazy_registry_probe_mod"
    monkeypatch.delitem(sys.modules, "lazy_registry_probe_mod")


def test_an_unknown_name_is_a_key_error_that_lists_the_names():
    registry = LazyRegistry("widget", {"x": "json:JSONDecoder", "w": "json:JSONEncoder"})
    with pytest.raises(KeyError, match=r"unknown widget 'y'; choose from w, x"):
        registry.get("y")


def test_the_parser_managers_are_registries_of_their_parsers():
    assert ToolParserManager.names() == ["hermes", "llama3_json"]
    assert ReasoningParserManager.names() == ["deepseek_r1", "qwen3"]
    assert all(issubclass(ToolParserManager.get_tool_parser(n), ToolParser)
               for n in ToolParserManager.names())
    assert all(issubclass(ReasoningParserManager.get_reasoning_parser(n), ReasoningParser)
               for n in ReasoningParserManager.names())
    with pytest.raises(KeyError, match="unknown tool call parser 'nope'; choose from hermes"):
        ToolParserManager.get_tool_parser("nope")
