"""A tiny Llama checkpoint whose greedy output is a script: tool calls, reasoning, answers.

The bundled model never emits a tool call by itself, so the tool-calling and
reasoning tests serve this one. Its weights make the next token a function of the
current token alone: the embedding is one-hot (hidden size = vocabulary size),
attention and MLP write nothing into the residual stream (`o_proj` and
`down_proj` are zero), and `lm_head` maps each scripted token to its successors
with falling logits (`SUCCESSORS`). Greedy decoding follows the first successor;
when structured outputs forbid it (tool_choice "required" or a named function),
the grammar leaves the second or third, so the same model also writes the JSON
those choices ask for. Which script runs is set by the last token of the prompt,
which the chat template (`TEMPLATE`, Qwen3-style: `<tool_call>`, `<think>`,
`enable_thinking`) chooses from the conversation.
"""

from __future__ import annotations

import json
from pathlib import Path

from tests.model_dirs import llama_config, write_tokenizer

VOCAB_SIZE = 512
EOS = "<|endoftext|>"  # id 0

# Scripted pieces, added to the byte-level tokenizer as (non-special) tokens.
TOOL_TURN, ANSWER_TURN, THINK_TURN = "<|tool_turn|>", "<|answer_turn|>", "<|think_turn|>"
CALL_NAME = '{"name": "get_weather", "arguments": '
REQUIRED_NAME = '[{"name": "get_weather", "parameters": '
CITY = '{"city": '
PIECES = [TOOL_TURN, ANSWER_TURN, THINK_TURN, "<tool_call>", "</tool_call>", "<think>",
          "</think>", CALL_NAME, REQUIRED_NAME, CITY, '"Par', 'is"}', "It is", " sunny",
          " in Paris.", " The user", " asks about the weather."]

# token -> successors, most likely first ("}" and "]" are the tokenizer's own bytes).
SUCCESSORS: dict[str, list[str]] = {
    # tool_choice auto: a hermes call; "required" (grammar: a JSON array) and a named
    # function (grammar: its parameters object) fall through to the 2nd / 3rd successor.
    TOOL_TURN: ["<tool_call>", REQUIRED_NAME, CITY],
    "<tool_call>": [CALL_NAME],
    CALL_NAME: [CITY],
    REQUIRED_NAME: [CITY],
    CITY: ['"Par'],
    '"Par': ['is"}'],
    'is"}': ["}", EOS],
    "}": ["</tool_call>", "]"],
    "</tool_call>": [EOS],
    "]": [EOS],
    # after a tool result, and after reasoning: the answer
    ANSWER_TURN: ["It is"],
    "It is": [" sunny"],
    " sunny": [" in Paris."],
    " in Paris.": [EOS],
    # thinking on: the model opens <think> itself (Qwen3); off: the prompt closes it
    THINK_TURN: ["<think>"],
    "<think>": [" The user"],
    " The user": [" asks about the weather."],
    " asks about the weather.": ["</think>"],
    "</think>": ["It is"],
}
# The first successor's logit; each later one is this much lower.
TOP_LOGIT, LOGIT_STEP = 30.0, 10.0

TEMPLATE = (
    "{%- if tools %}<|im_start|>system\n# Tools\n"
    "{%- for tool in tools %}\n{{ tool | tojson }}{%- endfor %}<|im_end|>\n{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'tool' %}<|im_start|>user\n<tool_response>"
    "{{ message.content }}</tool_response><|im_end|>\n"
    "{%- elif message.role == 'assistant' and message.tool_calls %}<|im_start|>assistant\n"
    "{%- for call in message.tool_calls %}<tool_call>"
    '{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}}'
    "</tool_call>{%- endfor %}<|im_end|>\n"
    "{%- else %}<|im_start|>{{ message.role }}\n{{ message.content or '' }}<|im_end|>\n"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n"
    "{%- if messages[-1].role == 'tool' %}<|answer_turn|>"
    "{%- elif tools %}<|tool_turn|>"
    "{%- elif enable_thinking is defined and not enable_thinking %}<think></think>"
    "{%- else %}<|think_turn|>{%- endif %}{%- endif %}"
)


def build_scripted_model(directory: Path) -> Path:
    """Write the checkpoint (config, safetensors, tokenizer with `TEMPLATE`) to `directory`."""
    import torch
    from transformers import AddedToken, AutoTokenizer, LlamaForCausalLM

    directory.mkdir(parents=True, exist_ok=True)
    write_tokenizer(directory)
    tokenizer = AutoTokenizer.from_pretrained(directory)
    tokenizer.add_tokens([AddedToken(p, normalized=False, special=False) for p in PIECES])
    tokenizer.add_tokens([f" w{i}" for i in range(len(tokenizer), VOCAB_SIZE)])
    tokenizer.chat_template = TEMPLATE
    tokenizer.save_pretrained(directory)

    config = llama_config(vocab_size=VOCAB_SIZE, hidden_size=VOCAB_SIZE,
                          num_attention_heads=8, num_key_value_heads=8,
                          intermediate_size=64, num_hidden_layers=1)
    config.bos_token_id = config.eos_token_id = 0
    model = LlamaForCausalLM(config).eval()
    ids = {p: tokenizer.convert_tokens_to_ids(p) for p in [*SUCCESSORS, EOS]}
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.fill_(1.0)
            elif "o_proj" in name or "down_proj" in name:
                param.zero_()
            else:
                param.normal_(0.0, 0.02)
        model.model.embed_tokens.weight.copy_(torch.eye(VOCAB_SIZE))
        lm_head = torch.zeros(VOCAB_SIZE, VOCAB_SIZE)
        scale = VOCAB_SIZE ** 0.5  # the final RMSNorm scales the one-hot state to this
        for token, successors in SUCCESSORS.items():
            for rank, successor in enumerate(successors):
                lm_head[ids[successor], ids[token]] = (TOP_LOGIT - rank * LOGIT_STEP) / scale
        model.lm_head.weight.copy_(lm_head)
    model.save_pretrained(directory)
    (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": 0}))
    return directory
