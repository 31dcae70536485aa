"""Chat template variables: tools and chat_template_kwargs reach the template; reserved
names are refused naming the key."""

from __future__ import annotations

import pytest

from tests.model_dirs import write_tokenizer
from vllm.exceptions import VLLMValidationError
from vllm.transformers_utils.chat_templates import (
    check_chat_template_kwargs,
    render_chat_template,
)

TEMPLATE = (
    "{% if tools %}[{% for t in tools %}{{ t.function.name }};{% endfor %}]{% endif %}"
    "{% for m in messages %}{{ m.role }}:{{ m.content }}|{% endfor %}"
    "{% if enable_thinking is defined and not enable_thinking %}NO_THINK{% endif %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)
MESSAGES = [{"role": "user", "content": "hi"}]
TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {}}}


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer

    directory = tmp_path_factory.mktemp("tok")
    write_tokenizer(directory)
    return AutoTokenizer.from_pretrained(directory)


def test_tools_and_kwargs_reach_the_template(tokenizer):
    plain = render_chat_template(tokenizer, MESSAGES, chat_template=TEMPLATE)
    assert plain == "user:hi|assistant:"
    text = render_chat_template(tokenizer, MESSAGES, chat_template=TEMPLATE, tools=[TOOL],
                                chat_template_kwargs={"enable_thinking": False})
    assert text == "[get_weather;]user:hi|NO_THINK" + "assistant:"
    # An empty tool list renders as no tools (the template's `if tools` is false).
    assert render_chat_template(tokenizer, MESSAGES, chat_template=TEMPLATE, tools=[]) == plain


@pytest.mark.parametrize("key", ["tokenize", "tools", "chat_template", "add_generation_prompt",
                                 "return_dict"])
def test_reserved_kwargs_are_refused_naming_the_key(tokenizer, key):
    with pytest.raises(VLLMValidationError) as info:
        render_chat_template(tokenizer, MESSAGES, chat_template=TEMPLATE,
                             chat_template_kwargs={key: True})
    assert info.value.parameter == f"chat_template_kwargs.{key}"


def test_check_chat_template_kwargs():
    assert check_chat_template_kwargs(None) == {}
    kwargs = {"enable_thinking": True}
    checked = check_chat_template_kwargs(kwargs)
    assert checked == kwargs and checked is not kwargs
    with pytest.raises(VLLMValidationError, match="must be an object") as info:
        check_chat_template_kwargs([1], "--default-chat-template-kwargs")
    assert info.value.parameter == "--default-chat-template-kwargs"


def test_continue_final_message_needs_add_generation_prompt_off(tokenizer):
    # Offline LLM.chat too (the server answers 400 before this): both true was a silent
    # drop of the generation prompt; transformers refuses the pair, so do we.
    partial = [*MESSAGES, {"role": "assistant", "content": "Hel"}]
    with pytest.raises(VLLMValidationError) as info:
        render_chat_template(tokenizer, partial, chat_template=TEMPLATE,
                             continue_final_message=True)
    assert info.value.parameter == "continue_final_message"
    text = render_chat_template(tokenizer, partial, chat_template=TEMPLATE,
                                add_generation_prompt=False, continue_final_message=True)
    assert text.endswith("assistant:Hel") and not text.endswith("assistant:")
