"""Async scheduling with n-gram speculative decoding (CPU, async_scheduling=True forced):
the same greedy tokens as the synchronous spec path and as no speculation.

The drafts are proposed and the next step's inputs written on the device
(vllm/v1/worker/async_spec.py); the scheduler schedules 1 + k' slots before the
acceptance is known and rolls back afterwards (v1/core/sched/spec_decode.py).
"""

import gc

import pytest

from tests.entrypoints.openai.utils import ENGINE_KWARGS
from tests.model_dirs import llama_config, make_model_dir
from tests.v1.core.fake_runner import make_request, make_scheduler
from vllm import LLM, SamplingParams
from vllm.v1.outputs import ModelRunnerOutput

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2,
         "prompt_lookup_max": 4}
PROMPTS = [
    "Repeat exactly: the quick brown fox jumps over the lazy dog. the quick brown fox "
    "jumps over the lazy dog. the quick brown fox",
    "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):",
    "Copy this list: 1. red 2. green 3. blue 4. red 5. green 6. blue 7.",
    "Zebra quantum violin?",  # nothing to quote: drafts rarely or never match
]


@pytest.fixture(scope="module")
def async_spec_llm():
    engine = LLM(speculative_config=NGRAM, async_scheduling=True, **ENGINE_KWARGS)
    assert engine.llm_engine.vllm_config.scheduler_config.async_scheduling is True
    yield engine
    engine.llm_engine.shutdown()
    gc.collect()


@pytest.fixture(scope="module")
def sync_spec_llm():
    engine = LLM(speculative_config=NGRAM, **ENGINE_KWARGS)
    assert engine.llm_engine.vllm_config.scheduler_config.async_scheduling is False
    yield engine
    engine.llm_engine.shutdown()
    gc.collect()


def _ids(outputs):
    return [o.outputs[0].token_ids for o in outputs]


def _stats(llm):
    return llm.llm_engine.get_scheduler_stats().spec_decoding_stats.copy()


def test_greedy_equal_to_sync_spec_and_no_spec(async_spec_llm, sync_spec_llm, bundled_llm):
    # Batch 1, then a batch of 4 finishing at different steps (max_tokens 9 .. 30).
    one = SamplingParams(temperature=0.0, max_tokens=24)
    many = [SamplingParams(temperature=0.0, max_tokens=n) for n in (30, 9, 17, 13)]
    before = _stats(async_spec_llm)
    got = [_ids(async_spec_llm.generate(p, one, use_tqdm=False))[0] for p in PROMPTS]
    got_batch = _ids(async_spec_llm.generate(PROMPTS, many, use_tqdm=False))
    for llm in (sync_spec_llm, bundled_llm):
        assert [_ids(llm.generate(p, one, use_tqdm=False))[0] for p in PROMPTS] == got
        assert _ids(llm.generate(PROMPTS, many, use_tqdm=False)) == got_batch
    assert [len(t) for t in got_batch] == [30, 9, 17, 13]
    delta = _stats(async_spec_llm).minus(before)
    assert delta.num_drafts > 0 and 0 < delta.num_accepted_tokens <= delta.num_draft_tokens
    assert delta.num_draft_tokens <= 4 * delta.num_drafts
    # Fewer engine steps than tokens: accepted drafts came in runs.
    assert delta.num_drafts + delta.num_accepted_tokens <= sum(len(t) for t in got_batch) + 24 * 4


@pytest.mark.parametrize("max_tokens", [3, 6, 11])
def test_stop_string_and_max_tokens_inside_accepted_runs(async_spec_llm, bundled_llm, max_tokens):
    prompt = PROMPTS[0]
    ref = bundled_llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=40),
                               use_tqdm=False)[0].outputs[0]
    stop_word = ref.text.split()[4]  # a word inside the quoted run
    params = [SamplingParams(temperature=0.0, max_tokens=max_tokens),
              SamplingParams(temperature=0.0, max_tokens=40, stop=[stop_word])]
    for p in params:
        want = bundled_llm.generate(prompt, p, use_tqdm=False)[0].outputs[0]
        got = async_spec_llm.generate(prompt, p, use_tqdm=False)[0].outputs[0]
        assert (got.token_ids, got.text, got.finish_reason) == (
            want.token_ids, want.text, want.finish_reason)


def test_plain_rows_and_seeded_sampling_beside_device_rows(async_spec_llm, bundled_llm):
    """Requests that take no drafts (a penalty, logprobs) run as plain rows in the same
    batches; seeded sampling through the verification is reproducible."""
    greedy = SamplingParams(temperature=0.0, max_tokens=20)
    penalty = SamplingParams(temperature=0.0, max_tokens=20, repetition_penalty=1.3)
    logprobs = SamplingParams(temperature=0.0, max_tokens=12, logprobs=2)
    params = [greedy, penalty, logprobs, greedy]
    want = bundled_llm.generate(PROMPTS, params, use_tqdm=False)
    got = async_spec_llm.generate(PROMPTS, params, use_tqdm=False)
    assert _ids(got) == _ids(want)
    assert len(got[2].outputs[0].logprobs) == 12
    seeded = SamplingParams(temperature=0.8, seed=7, max_tokens=20)
    first = _ids(async_spec_llm.generate(PROMPTS[:2], seeded, use_tqdm=False))
    assert _ids(async_spec_llm.generate(PROMPTS[:2], seeded, use_tqdm=False)) == first


def test_abort_mid_stream_leaves_the_others_exact(async_spec_llm, bundled_llm):
    engine = async_spec_llm.llm_engine
    params = SamplingParams(temperature=0.0, max_tokens=24)
    for i, prompt in enumerate(PROMPTS[:3]):
        engine.add_request(f"abort-{i}", prompt, params)
    finished = {}
    for step in range(200):
        if step == 3:
            engine.abort_request(["abort-1"])
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out.outputs[0].token_ids
        if not engine.has_unfinished_requests():
            break
    want = _ids(bundled_llm.generate([PROMPTS[0], PROMPTS[2]], params, use_tqdm=False))
    assert [finished["abort-0"], finished["abort-2"]] == want
    assert len(finished.get("abort-1", [])) < 24


def test_preemption_with_steps_in_flight(tmp_path_factory):
    """A KV cache of 10 blocks for 3 requests of up to 5 blocks: requests are preempted
    (and recomputed) while drafts and optimistic slots are in flight; prefix caching on."""
    model_dir = make_model_dir(
        tmp_path_factory.mktemp("async_spec_llama"), llama_config(vocab_size=256), weights=True)
    # max_model_len 144: what 9 usable blocks hold (longer fails the start-up, as in vLLM).
    kwargs = dict(max_model_len=144, max_num_seqs=4, max_num_batched_tokens=64,
                  kv_cache_memory_bytes=10 * 8192, enable_prefix_caching=True)
    prompts = [{"prompt_token_ids": [5, 6, 7, 8, 9, 10] * 4 + [5, 6]},
               {"prompt_token_ids": [30, 31, 32, 30, 31, 32, 30] * 3},
               {"prompt_token_ids": [40, 41, 42, 43] * 6}]
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    outs = []
    for spec, asynchronous in ((None, False), (NGRAM, True)):
        engine = LLM(str(model_dir), speculative_config=spec, async_scheduling=asynchronous,
                     **kwargs)
        outs.append(_ids(engine.generate(prompts, params, use_tqdm=False)))
        stats = engine.llm_engine.get_scheduler_stats()
        assert stats.num_preemptions > 0
        if spec:
            assert stats.spec_decoding_stats.num_drafts > 0
        engine.llm_engine.shutdown()
    assert outs[0] == outs[1]


def test_scheduler_schedules_placeholders_and_rolls_back():
    """Async: 1 + k slots before the acceptance is known, corrected when it arrives."""
    sched = make_scheduler(num_speculative_tokens=3, async_scheduling=True)
    req = make_request("a", 8, max_tokens=30)
    sched.add_request(req)

    def output(so, tokens, num_drafts=None):
        ids = list(so.num_scheduled_tokens)
        return ModelRunnerOutput(req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                                 sampled_token_ids=[tokens], num_draft_tokens=num_drafts)

    prefill = sched.schedule()
    assert prefill.num_scheduled_tokens == {"a": 8} and req.num_output_placeholders == 1
    # Step 1 is scheduled before the prefill's token arrived: 1 + 3 placeholder slots.
    step1 = sched.schedule()
    assert step1.num_scheduled_tokens == {"a": 4}
    assert step1.scheduled_spec_decode_tokens == {"a": [-1, -1, -1]}
    assert req.num_computed_tokens == 12 and req.num_output_placeholders == 5
    sched.update_from_output(prefill, output(prefill, [50]))
    step2 = sched.schedule()  # optimistic again: as if step 1 accepted all 3
    assert step2.num_scheduled_tokens == {"a": 4} and req.num_computed_tokens == 16
    # Step 1 accepted 1 of 3 drafts: 2 tokens; the 2 rejected slots are rolled back.
    sched.update_from_output(step1, output(step1, [51, 52], [3]))
    assert req.num_tokens == 11 and req.num_computed_tokens == 14
    assert req.num_output_placeholders == 4  # step 2's 1 + 3
    stats = sched.get_stats().spec_decoding_stats
    assert (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens) == (1, 3, 1)
    # Step 2 found no draft on the device: 1 token, nothing counted, 3 slots rolled back.
    sched.update_from_output(step2, output(step2, [53], [0]))
    assert req.num_tokens == 12 and req.num_computed_tokens == 11
    assert req.num_output_placeholders == 0 and stats.num_drafts == 1


def test_structured_outputs_run_as_plain_rows_beside_drafts(async_spec_llm, bundled_llm):
    """A request with a grammar takes no drafts under async scheduling (its bitmask is per
    draft position, on the host): its replies validate, the others stay exact."""
    import json

    import jsonschema

    from tests.v1.structured_output.schemas import MAX_TOKENS, PROMPT, SCHEMA
    from vllm.sampling_params import StructuredOutputsParams

    so = StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True)
    json_params = [SamplingParams(temperature=1.0, seed=i, max_tokens=MAX_TOKENS,
                                  structured_outputs=so) for i in range(4)]
    greedy = SamplingParams(temperature=0.0, max_tokens=24)
    prompts = [PROMPT] * 4 + PROMPTS[:2]
    got = async_spec_llm.generate(prompts, json_params + [greedy, greedy], use_tqdm=False)
    for out in got[:4]:
        jsonschema.validate(json.loads(out.outputs[0].text), SCHEMA)
    assert _ids(got[4:]) == _ids(bundled_llm.generate(PROMPTS[:2], greedy, use_tqdm=False))


def test_one_token_step_with_device_and_plain_rows(async_spec_llm, bundled_llm):
    """A step where every row runs one token, device rows without drafts (max_tokens leaves
    no room) beside a plain row (a penalty): the sampler gets a subset of the rows and
    must find their logits (the flat indices, not the first rows)."""
    params = [SamplingParams(temperature=0.0, max_tokens=2),
              SamplingParams(temperature=0.0, max_tokens=2, repetition_penalty=1.2)]
    want = bundled_llm.generate(PROMPTS[:2], params, use_tqdm=False)
    assert _ids(async_spec_llm.generate(PROMPTS[:2], params, use_tqdm=False)) == _ids(want)


def test_histories_crossing_the_proposal_width(async_spec_llm, bundled_llm):
    """The proposal reads each step's histories up to a host bound rounded to 256 tokens:
    a request growing across 256 keeps its tokens, and its drafts are still accepted (a
    bound below a history's length would not change tokens, only make drafts wrong)."""
    tokenizer = bundled_llm.get_tokenizer()
    ids = tokenizer.encode(PROMPTS[0])
    prompt = {"prompt_token_ids": (ids * (240 // len(ids) + 1))[:236]}
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    want = bundled_llm.generate(prompt, params, use_tqdm=False)
    before = _stats(async_spec_llm)
    got = async_spec_llm.generate(prompt, params, use_tqdm=False)
    assert _ids(got) == _ids(want)
    delta = _stats(async_spec_llm).minus(before)
    assert delta.num_accepted_tokens >= delta.num_drafts > 0  # the prompt repeats itself


# max_model_len 144: what 9 usable blocks hold (longer fails the start-up, as in vLLM).
TINY_KWARGS = dict(max_model_len=144, max_num_seqs=4, max_num_batched_tokens=64,
                   kv_cache_memory_bytes=10 * 8192, enable_prefix_caching=True)
TINY_PROMPTS = [[5, 6, 7, 8, 9, 10] * 4 + [5, 6], [30, 31, 32, 30, 31, 32, 30] * 3,
                [40, 41, 42, 43] * 6, [50, 51, 52, 53] * 5]


def _tiny_run(model_dir: str) -> dict:
    """Async ngram spec decode of the tiny model: greedy device rows, a plain row (a
    penalty), a seeded random device row, with preemptions (10 KV blocks)."""
    engine = LLM(model_dir, speculative_config=NGRAM, async_scheduling=True, **TINY_KWARGS)
    greedy = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    params = [greedy, SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True,
                                     repetition_penalty=1.2),
              greedy, SamplingParams(temperature=0.9, seed=3, max_tokens=30, ignore_eos=True)]
    prompts = [{"prompt_token_ids": p} for p in TINY_PROMPTS]
    ids = _ids(engine.generate(prompts, params, use_tqdm=False))
    stats = engine.llm_engine.get_scheduler_stats()
    kernels = engine.llm_engine.engine_core.worker.model_runner.async_spec.ops is not None
    engine.llm_engine.shutdown()
    return {"ids": [list(t) for t in ids], "kernels": kernels,
            "num_drafts": stats.spec_decoding_stats.num_drafts,
            "num_preemptions": stats.num_preemptions}


def test_device_row_kernels_give_the_torch_path_tokens(tmp_path_factory):
    """The device rows' Triton kernels (vllm/v1/worker/async_spec_ops.py), interpreted on
    the CPU in a subprocess (TRITON_INTERPRET=1), give the same tokens as the torch path
    run here, through preemptions, plain rows and seeded random rows."""
    import json
    import os
    import subprocess
    import sys

    from tests.triton_interpreter import HAS_TRITON, REPO_ROOT

    if not HAS_TRITON:
        pytest.skip("triton is not installed")
    model_dir = str(make_model_dir(tmp_path_factory.mktemp("async_spec_kernels"),
                                   llama_config(vocab_size=256), weights=True))
    code = ("import json, tests.v1.spec_decode.test_async_spec_decode as t; "
            f"print('RUN=' + json.dumps(t._tiny_run({model_dir!r})))")
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(REPO_ROOT))
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RUN=")]
    assert lines, proc.stderr[-3000:]
    got = json.loads(lines[-1][len("RUN="):])
    want = _tiny_run(model_dir)
    assert got["kernels"] and not want["kernels"]
    assert got["num_drafts"] > 0 and got["num_preemptions"] > 0
    assert got["ids"] == want["ids"]
