"""The offline `LLM.chat` passes `tools` and `chat_template_kwargs` to the chat template
(the raw text comes back: parsing tool calls and reasoning is the server's); with
`structured_outputs_config={"reasoning_parser": "qwen3"}` a grammar applies after the
reasoning."""

from __future__ import annotations

import pytest

from tests.entrypoints.openai.scripted_model import build_scripted_model
from vllm import SamplingParams
from vllm.exceptions import VLLMValidationError

ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}]
GREEDY = SamplingParams(temperature=0, max_tokens=20)


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    from vllm import LLM

    engine = LLM(model=str(build_scripted_model(tmp_path_factory.mktemp("scripted"))),
                 max_model_len=256, max_num_seqs=4, max_num_batched_tokens=128,
                 kv_cache_memory_bytes=16 * 2**20,
                 structured_outputs_config={"reasoning_parser": "qwen3"})
    yield engine
    engine.llm_engine.shutdown()


def _text(llm, messages=ASK, **kwargs) -> str:
    return llm.chat(messages, GREEDY, use_tqdm=False, **kwargs)[0].outputs[0].text


def test_tools_and_template_kwargs_reach_the_template(llm):
    assert _text(llm) == "<think> The user asks about the weather.</think>It is sunny in Paris."
    assert _text(llm, chat_template_kwargs={"enable_thinking": False}) == (
        "It is sunny in Paris.")
    assert _text(llm, tools=TOOLS) == (
        '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>')
    call = {"id": "c1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    history = [*ASK, {"role": "assistant", "tool_calls": [call]},
               {"role": "tool", "tool_call_id": "c1", "content": "24 C"}]
    prompt = llm.render_chat(history, tools=TOOLS)["prompt"]
    # The call's JSON arguments reach the template as an object (`arguments | tojson`).
    assert '"arguments": {"city": "Paris"}}</tool_call>' in prompt
    assert _text(llm, history, tools=TOOLS) == "It is sunny in Paris."


def test_reserved_template_kwargs_are_refused(llm):
    with pytest.raises(VLLMValidationError) as info:
        _text(llm, chat_template_kwargs={"tokenize": True})
    assert info.value.parameter == "chat_template_kwargs.tokenize"


def test_a_grammar_applies_after_the_reasoning(llm):
    from vllm.sampling_params import StructuredOutputsParams

    params = SamplingParams(temperature=0, max_tokens=30, structured_outputs=(
        StructuredOutputsParams(choice=["It is rainy.", "Cloudy."])))
    thinking, plain = (llm.chat(ASK, params, use_tqdm=False, chat_template_kwargs={
        "enable_thinking": on})[0].outputs[0].text for on in (True, False))
    # Thinking: the reasoning is the model's own, the answer after </think> the grammar's.
    assert thinking == "<think> The user asks about the weather.</think>It is rainy."
    assert plain == "It is rainy."  # the prompt closed <think></think>: from the start
