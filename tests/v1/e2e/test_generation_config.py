"""A checkpoint's generation config, as vLLM uses it (issue 16, items 4 and 5).

- `--generation-config auto|vllm|PATH`: its EOS ids stop generation, its
  temperature / top_p / top_k / min_p / repetition_penalty become the defaults
  (`LLM.get_default_sampling_params()`), "vllm" drops those defaults.
- A GGUF file's BOS / EOS / EOT ids and chat template come from its metadata
  (read with `gguf`'s key names), not from whatever the installed transformers
  makes of them.
- The bundled model's greedy token ids for a fixed prompt set are pinned: the
  same on the CPU and on CUDA in fp32 (the `cuda` test runs them there).
"""

from __future__ import annotations

import gc
import json
from pathlib import Path

import gguf
import numpy as np
import pytest

from tests.entrypoints.openai.utils import ENGINE_KWARGS
from vllm import LLM, SamplingParams
from vllm.config.model import ModelConfig
from vllm.engine.arg_utils import EngineArgs
from vllm.transformers_utils.config import get_bundled_model_path, try_get_generation_config
from vllm.transformers_utils.gguf_metadata import (
    get_gguf_tokenizer_metadata,
    read_gguf_metadata,
)

# ---------------------------------------------------------------- GGUF metadata


def _write_gguf(path: Path, big_endian: bool = False) -> None:
    """A small GGUF with a vocabulary array (to skip), special ids and a chat template."""
    endian = gguf.GGUFEndian.BIG if big_endian else gguf.GGUFEndian.LITTLE
    writer = gguf.GGUFWriter(str(path), "llama", endianess=endian)
    writer.add_token_list([f"tok{i}".encode() for i in range(300)])
    writer.add_token_scores([0.5] * 300)
    writer.add_bos_token_id(7)
    writer.add_eos_token_id(8)
    writer.add_eot_token_id(9)
    writer.add_chat_template("{{ messages[0]['content'] }}")
    writer.add_float32("general.some_float", 1.5)
    writer.add_tensor("w", np.zeros((4, 4), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize("big_endian", [False, True], ids=["little", "big"])
def test_gguf_metadata_read_past_arrays(tmp_path, big_endian):
    path = tmp_path / "m.gguf"
    _write_gguf(path, big_endian)
    meta = get_gguf_tokenizer_metadata(path)
    assert (meta.bos_token_id, meta.eos_token_id, meta.eot_token_id, meta.eom_token_id) == (
        7, 8, 9, None)
    assert meta.chat_template == "{{ messages[0]['content'] }}"
    assert meta.generation_config() == {"bos_token_id": 7, "eos_token_id": [8, 9]}
    assert read_gguf_metadata(path, {"general.some_float"}) == {"general.some_float": 1.5}
    assert try_get_generation_config(path) == {"bos_token_id": 7, "eos_token_id": [8, 9]}


def test_gguf_metadata_rejects_other_files(tmp_path):
    path = tmp_path / "x.gguf"
    path.write_bytes(b"NOTAGGUF" + bytes(32))
    with pytest.raises(ValueError, match="not a GGUF file"):
        read_gguf_metadata(path, {"a"})


def test_bundled_gguf_metadata():
    meta = get_gguf_tokenizer_metadata(get_bundled_model_path())
    assert (meta.bos_token_id, meta.eos_token_id) == (1, 2)  # <|im_start|>, <|im_end|>
    assert meta.chat_template.startswith("{% for message in messages %}")


def test_gguf_tokenizer_eos_does_not_depend_on_transformers(monkeypatch):
    """transformers 5.17 converted the bundled GGUF's EOS to another token than 5.24 did;
    the tokenizer must take BOS, EOS and the chat template from the file either way."""
    import transformers

    from vllm.transformers_utils import tokenizer as tokenizer_module

    real = transformers.AutoTokenizer.from_pretrained

    def like_an_older_transformers(*args, **kwargs):
        tok = real(*args, **kwargs)
        tok.eos_token, tok.bos_token = "<|endoftext|>", "<|endoftext|>"
        tok.chat_template = "{{ 'another template' }}"
        return tok

    monkeypatch.setattr(tokenizer_module.AutoTokenizer, "from_pretrained",
                        like_an_older_transformers)
    tok = tokenizer_module.load_tokenizer(get_bundled_model_path())
    assert (tok.eos_token_id, tok.eos_token, tok.bos_token_id) == (2, "<|im_end|>", 1)
    assert tok.chat_template == get_gguf_tokenizer_metadata(get_bundled_model_path()
                                                            ).chat_template


# ---------------------------------------------------------------- generation_config.json
DEFAULTS = {"temperature": 0.6, "top_p": 0.9, "top_k": 7, "min_p": 0.05,
            "repetition_penalty": 1.1}
SMALL = dict(max_model_len=64, max_num_seqs=4, max_num_batched_tokens=64,
             kv_cache_memory_bytes=4 * 2**20)
PROMPT_IDS = [5, 17, 42, 99]


def _greedy_reference(model_dir: Path, n: int) -> list[int]:
    """transformers' greedy continuation of PROMPT_IDS (n tokens, no EOS handling)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = list(PROMPT_IDS)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(PROMPT_IDS):]


@pytest.fixture(scope="module")
def llama3_like(tiny_dir, tmp_path_factory):
    """The tiny model with a Llama-3-Instruct-like generation config: an EOS list whose
    second id is not the tokenizer's EOS (the third greedy token here), plus defaults."""
    greedy = _greedy_reference(tiny_dir, 8)
    stop_at = next(k for k in range(1, 8) if greedy[k] not in (0, *greedy[:k]))
    config_dir = tmp_path_factory.mktemp("gen-config")
    (config_dir / "generation_config.json").write_text(
        json.dumps({"bos_token_id": 0, "eos_token_id": [0, greedy[stop_at]], **DEFAULTS}))
    llm = LLM(str(tiny_dir), generation_config=str(config_dir), **SMALL)
    yield llm, greedy, stop_at, config_dir
    llm.llm_engine.shutdown()
    gc.collect()


def test_generation_config_eos_ids_stop_generation(llama3_like):
    llm, greedy, stop_at, _ = llama3_like
    out = llm.generate({"prompt_token_ids": PROMPT_IDS},
                       SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)[0].outputs[0]
    assert list(out.token_ids) == greedy[: stop_at + 1]
    assert out.finish_reason == "stop"
    ignoring = llm.generate({"prompt_token_ids": PROMPT_IDS},
                            SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                            use_tqdm=False)[0].outputs[0]
    assert list(ignoring.token_ids) == greedy and ignoring.finish_reason == "length"


def test_generation_config_sampling_values_are_the_defaults(llama3_like):
    llm = llama3_like[0]
    params = llm.get_default_sampling_params()
    assert {name: getattr(params, name) for name in DEFAULTS} == DEFAULTS
    assert params.max_tokens == SamplingParams().max_tokens  # untouched fields: vLLM's
    assert llm.llm_engine.vllm_config.model_config.get_diff_sampling_param() == DEFAULTS


def test_generation_config_modes(tiny_dir, llama3_like):
    """auto reads the model's own file, vllm drops its sampling values, PATH reads that."""
    config_dir = llama3_like[3]
    (tiny_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": 0,
                                                                 "top_k": 3}))
    auto = ModelConfig(model=str(tiny_dir))
    assert auto.get_diff_sampling_param() == {"top_k": 3}
    vllm_mode = ModelConfig(model=str(tiny_dir), generation_config="vllm")
    assert vllm_mode.get_diff_sampling_param() == {}
    assert vllm_mode.try_get_generation_config()["eos_token_id"] == 0  # EOS still counts
    path = ModelConfig(model=str(tiny_dir), generation_config=str(config_dir))
    assert path.get_diff_sampling_param() == DEFAULTS
    bundled = ModelConfig()  # a GGUF: ids from its metadata, no sampling values
    assert bundled.try_get_generation_config() == {"bos_token_id": 1, "eos_token_id": 2}
    assert bundled.get_diff_sampling_param() == {}


def test_missing_generation_config_path_is_a_flag_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="generation_config .* must be 'auto', 'vllm'"):
        EngineArgs(generation_config=str(tmp_path / "nowhere")).validate()


# ---------------------------------------------------------------- pinned greedy ids
# The bundled model's greedy ids (fp32) for four chat turns (each ends with <|im_end|>,
# id 2, the file's EOS) and four plain prompts. Taken on the CPU; CUDA must match.
CHATS = ["What is the capital of France?", "Name three colors of the rainbow.",
         "Say hello in French.", "What is 2+2?"]
PLAIN = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small",
         "List three colors:"]
PINNED = [
    [504, 3575, 282, 4649, 314, 7042, 30, 2],
    [504, 24594, 5956, 282, 1296, 3003, 4683, 42, 2382, 28, 4461, 28, 284, 2654, 30, 2],
    [30904, 24583, 281, 3432, 30, 11948, 24583, 314, 253, 3953, 1789, 30, 339, 5248, 1535,
     288, 724, 346, 351, 469, 3432, 1789, 1954, 30, 1812, 506, 469, 11737, 47, 2],
    [504, 2988, 288, 451, 8170, 4119, 1732, 314, 216, 36, 30, 2],
    [7042, 30, 198, 198, 504, 2988, 314, 42, 216, 34, 32, 33, 40, 29, 32, 33, 29, 34, 34,
     216, 33, 34, 42, 33, 34, 42, 37, 35, 30, 2],
    [472, 585, 304, 1758, 216, 32, 42, 448, 1003, 216, 33, 472, 1003, 304, 1672, 3987,
     46477, 24, 94, 731, 216, 33, 25, 198, 198, 19, 4246, 260, 1517, 198, 3272, 24],
    [3102, 28, 665, 436, 253, 9077, 9191, 338, 5454, 4320, 282, 260, 7685, 282, 655, 30,
     378, 9191, 436, 3365, 476, 7487, 21306, 18, 284, 436, 1137, 288, 325, 1730, 288, 1485],
    [2382, 28, 4461, 28, 284, 2654, 30, 198, 198, 504, 1732, 314, 338, 260, 2798, 1398, 282,
     4683, 314, 441, 253, 1398, 282, 8639, 28, 564, 253, 1398, 282, 8639, 837, 971],
]


@pytest.fixture(scope="module")
def fp32_llm(request):
    """The bundled model in fp32: the shared engine on the CPU, an own one on CUDA."""
    import torch

    from vllm.platforms import current_platform

    if current_platform.device_type == "cpu":
        llm = request.getfixturevalue("bundled_llm")
        assert llm.llm_engine.vllm_config.model_config.dtype == torch.float32
        yield llm
        return
    llm = LLM(**ENGINE_KWARGS, dtype="float32")
    yield llm
    llm.llm_engine.shutdown()
    gc.collect()


def _check_pinned(llm: LLM) -> None:
    tok = llm.get_tokenizer()
    prompts = [tok.apply_chat_template([{"role": "user", "content": c}], tokenize=False,
                                       add_generation_prompt=True) for c in CHATS] + PLAIN
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=32),
                           use_tqdm=False)
    got = [list(o.outputs[0].token_ids) for o in outputs]
    assert got == PINNED
    assert [o.outputs[0].finish_reason for o in outputs] == ["stop"] * 5 + ["length"] * 3
    assert outputs[0].outputs[0].text == "The capital of France is Paris."


def test_pinned_greedy_ids(fp32_llm):
    _check_pinned(fp32_llm)


@pytest.mark.cuda
def test_pinned_greedy_ids_cuda_fp32(fp32_llm):
    """The same ids on the GPU: the run that proves CPU and CUDA agree."""
    import torch

    config = fp32_llm.llm_engine.vllm_config
    assert config.device_config.device_type == "cuda"
    assert config.model_config.dtype == torch.float32
    _check_pinned(fp32_llm)
