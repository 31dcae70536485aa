"""AsyncLLM over the real engine on the bundled model (CPU): outputs, admission errors,
aborts that free blocks, the engine core's own process, step failures, death and shutdown.

Faults are injected at the device boundary only: the worker's `execute_model`
(`FaultInjectingWorker`, which runs in the engine core's process and reads the
fault file named by $VLLM_TEST_FAULT_FILE before every step).
"""

from __future__ import annotations

import asyncio
import os
import threading

import pytest

from vllm.engine.arg_utils import EngineArgs
from vllm.sampling_params import RequestOutputKind, SamplingParams
from vllm.v1.engine.async_llm import AsyncLLM
from vllm.v1.engine.exceptions import (
    EngineDeadError,
    EngineGenerateError,
    EngineShutdownError,
    SleepModeUnavailableError,
)

pytestmark = pytest.mark.slow  # a real engine on the bundled model

MAX_MODEL_LEN = 256
PROMPT = "The capital of France is"


FAULTY_WORKER = "tests.entrypoints.openai.fault_injection_serve.FaultInjectingWorker"


def _args() -> EngineArgs:
    # A small token budget and KV size keep start-up short on CPU (profiling and warmup
    # run a worst-case batch).
    return EngineArgs(max_model_len=MAX_MODEL_LEN, max_num_seqs=16, max_num_batched_tokens=128,
                      kv_cache_memory_bytes=64 * 2**20, disable_log_stats=True,
                      worker_cls=FAULTY_WORKER)


@pytest.fixture(scope="module")
def fault_file(tmp_path_factory):
    """The file the engine core's worker reads before every step ("step", "cuda")."""
    path = tmp_path_factory.mktemp("faults") / "fault"
    before = os.environ.get("VLLM_TEST_FAULT_FILE")
    os.environ["VLLM_TEST_FAULT_FILE"] = str(path)  # inherited by the engine core process
    yield path
    if before is None:
        del os.environ["VLLM_TEST_FAULT_FILE"]
    else:
        os.environ["VLLM_TEST_FAULT_FILE"] = before


@pytest.fixture(scope="module")
def engine(fault_file):
    llm = AsyncLLM.from_engine_args(_args())
    yield llm
    llm.shutdown()


def _params(kind=RequestOutputKind.FINAL_ONLY, max_tokens=6, **kwargs) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True,
                          output_kind=kind, **kwargs)


async def _collect(engine: AsyncLLM, request_id: str, params: SamplingParams,
                   prompt: str = PROMPT) -> list:
    return [out async for out in engine.generate(prompt, params, request_id)]


def _idle(engine: AsyncLLM) -> bool:
    """In the engine core: nothing running or waiting and no KV block held (the stats
    call is queued behind every abort sent before it)."""
    stats = asyncio.run(engine.get_scheduler_stats())
    return (stats.num_running_reqs == stats.num_waiting_reqs == 0
            and stats.kv_cache_usage == 0)


def test_the_engine_core_steps_in_its_own_process(engine):
    async def main():
        ids = await engine.tokenize(PROMPT)
        text = await engine.detokenize(ids, skip_special_tokens=True)
        return ids, text

    ids, text = asyncio.run(main())
    assert engine.client.process.pid != os.getpid() and engine.client.process.is_alive()
    assert ids and text == PROMPT
    assert engine.max_model_len == MAX_MODEL_LEN  # the plan the core reported


def test_output_kinds_agree(engine):
    async def main():
        final = await _collect(engine, "final", _params())
        delta = await _collect(engine, "delta", _params(RequestOutputKind.DELTA))
        cumulative = await _collect(engine, "cum", _params(RequestOutputKind.CUMULATIVE))
        return final, delta, cumulative

    final, delta, cumulative = asyncio.run(main())
    assert len(final) == 1 and final[0].finished
    answer = final[0].outputs[0]
    assert len(answer.token_ids) == 6 and answer.finish_reason == "length"
    assert "Paris" in answer.text
    assert len(delta) > 1 and delta[-1].finished
    assert "".join(o.outputs[0].text for o in delta) == answer.text
    assert [t for o in delta for t in o.outputs[0].token_ids] == list(answer.token_ids)
    assert cumulative[-1].outputs[0].text == answer.text
    assert _idle(engine)


def test_concurrent_requests_get_their_own_outputs(engine):
    prompts = [PROMPT, "One, two, three,", "The opposite of hot is"] * 3

    async def main():
        return await asyncio.gather(*(
            _collect(engine, f"c{i}", _params(max_tokens=5), prompt=p)
            for i, p in enumerate(prompts)))

    async def alone():
        return {p: (await _collect(engine, f"a{i}", _params(max_tokens=5), prompt=p))[-1]
                for i, p in enumerate(prompts[:3])}

    reference = asyncio.run(alone())
    results = asyncio.run(main())
    for prompt, outputs in zip(prompts, results, strict=True):
        assert outputs[-1].outputs[0].text == reference[prompt].outputs[0].text


def test_validation_error_reaches_caller_before_any_output(engine):
    async def main():
        # A prompt with no room left (prompt + max_tokens past max_model_len is the
        # OpenAI server's refusal, not the engine's: vLLM's engine stops at the length).
        too_long = {"prompt_token_ids": [28] * MAX_MODEL_LEN}
        gen = engine.generate(too_long, _params(max_tokens=4), "too-long")
        with pytest.raises(ValueError, match=f"prompt has {MAX_MODEL_LEN} tokens"):
            await anext(gen)
        with pytest.raises(ValueError, match="request id 'dup' is already running"):
            stream = await engine.add_request("dup", PROMPT, _params(max_tokens=50))
            await engine.add_request("dup", PROMPT, _params())
        engine.abort("dup")
        del stream

    asyncio.run(main())
    assert _idle(engine)


def test_n_beyond_max_num_seqs_and_invalid_text_are_rejected(engine):
    """n is bounded by max_num_seqs (16 here), even a huge n (no OverflowError, no
    per-sample allocation); a lone surrogate is a ValueError, not a tokenizer TypeError."""

    async def main():
        await engine.add_request("n-max", PROMPT, _params(n=16, max_tokens=2))
        for n in (17, 10**20):
            with pytest.raises(ValueError, match=rf"^n \({n}\) must be <= max_num_seqs \(16\)"):
                await engine.add_request(f"n-{n}", PROMPT, _params(n=n))
        with pytest.raises(ValueError, match="^prompt contains a lone UTF-16 surrogate U\\+D800"):
            await engine.add_request("bad-text", "\ud800", _params())
        with pytest.raises(ValueError, match="^prompt contains a lone UTF-16 surrogate"):
            await engine.tokenize("x\udfff")
        engine.abort("n-max")

    asyncio.run(main())
    assert _idle(engine)


def test_closing_the_stream_aborts_and_frees_blocks(engine):
    async def main():
        gen = engine.generate(PROMPT, _params(RequestOutputKind.DELTA, max_tokens=200), "drop")
        first = [await anext(gen), await anext(gen)]
        held = (await engine.get_scheduler_stats()).kv_cache_usage
        await gen.aclose()
        return first, held

    first, held = asyncio.run(main())
    assert not first[-1].finished
    assert held > 0
    assert _idle(engine)


def test_cancelling_the_consumer_aborts(engine):
    async def main():
        started = asyncio.Event()

        async def consume():
            async for _ in engine.generate(
                    PROMPT, _params(RequestOutputKind.DELTA, max_tokens=200), "cancel"):
                started.set()

        task = asyncio.create_task(consume())
        await started.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    assert _idle(engine)


def test_stat_loggers_see_every_step(engine):
    class Recorder:
        def __init__(self):
            self.generation_tokens = 0
            self.finished: list[str] = []

        def record(self, scheduler_stats, iteration_stats, kv_cache_memory):
            assert kv_cache_memory.num_blocks == scheduler_stats.num_blocks
            if iteration_stats is not None:
                self.generation_tokens += iteration_stats.num_generation_tokens
                self.finished += iteration_stats.finished_reasons

        def log(self):
            pass

    recorder = Recorder()
    engine.add_stat_logger(recorder)

    async def main():
        # A step's figures are recorded in the same pass that delivers its outputs.
        await _collect(engine, "stats", _params(max_tokens=7))

    asyncio.run(main())
    assert recorder.generation_tokens == 7
    assert recorder.finished == ["length"]


def test_sleep_needs_sleep_mode(engine):
    async def main():
        with pytest.raises(SleepModeUnavailableError, match="--enable-sleep-mode"):
            await engine.sleep(1)
        return await engine.is_sleeping()

    assert asyncio.run(main()) is False


def test_step_failure_fails_that_step_only(engine, fault_file):
    async def main():
        reference = (await _collect(engine, "before", _params()))[-1].outputs[0].text
        fault_file.write_text("step")
        with pytest.raises(EngineGenerateError, match="injected step failure"):
            await _collect(engine, "failed", _params())
        after = (await _collect(engine, "after", _params()))[-1].outputs[0].text
        return reference, after

    reference, after = asyncio.run(main())
    assert after == reference
    assert not engine.errored
    assert _idle(engine)


def test_a_slow_chat_template_render_holds_no_other_request(engine, monkeypatch):
    """While one conversation's render is stuck (held on an event, standing in for a
    template that loops for seconds), another conversation renders, encodes and
    generates to the end: the slow render holds neither the event loop nor the
    tokenizer thread. Before renders had threads of their own the small request
    queued behind it (the wait_for below would expire: an ordering check, not a
    time limit)."""
    tokenizer = engine._input_tokenizer
    real_render = tokenizer.apply_chat_template
    started, release = threading.Event(), threading.Event()

    def render(messages, **kwargs):
        if messages[0]["content"] == "slow":
            started.set()
            assert release.wait(120)
        return real_render(messages, **kwargs)

    monkeypatch.setattr(tokenizer, "apply_chat_template", render)

    async def main():
        slow = asyncio.ensure_future(
            engine.apply_chat_template([{"role": "user", "content": "slow"}]))
        assert await asyncio.to_thread(started.wait, 60)
        try:
            small = await asyncio.wait_for(
                engine.apply_chat_template([{"role": "user", "content": "Hi"}]), 60)
            outputs = await asyncio.wait_for(_collect(engine, "after-slow", _params(),
                                                      prompt=small), 60)
            assert not slow.done()  # the order: the small request ended first
        finally:
            release.set()
        rendered = await slow
        assert "slow" in rendered["prompt"] and rendered["prompt_token_ids"]
        return small, outputs

    small, outputs = asyncio.run(main())
    assert "Hi" in small["prompt"]
    assert small["prompt_token_ids"] == tokenizer.encode(small["prompt"], add_special_tokens=False)
    assert len(outputs[-1].outputs[0].token_ids) == 6


def test_a_slow_consumer_reads_merged_deltas_equal_to_the_final_output(engine):
    """A DELTA consumer that reads slower than the engine steps gets fewer outputs than
    tokens (several steps merged), and their concatenation (texts, token ids, logprobs,
    for each of n = 2 choices) is the FINAL_ONLY output of the same request."""
    params = dict(max_tokens=12, n=2, logprobs=2)

    async def slow(request_id: str) -> list:
        outputs = []
        async for out in engine.generate(PROMPT, _params(RequestOutputKind.DELTA, **params),
                                         request_id):
            outputs.append(out)
            # Read again only once the engine has finished the request: every later
            # step's output waits in the stream meanwhile (however slow the steps are).
            while any(rid.endswith(request_id) for rid in engine.output_processor.states):
                await asyncio.sleep(0.02)
        return outputs

    async def main():
        (final,) = await _collect(engine, "slow-final", _params(**params))
        return final, await slow("slow-delta")

    final, deltas = asyncio.run(main())
    assert len(deltas) <= 2  # the first read, then everything else merged into one
    assert deltas[-1].finished and not any(o.finished for o in deltas[:-1])
    for choice in final.outputs:
        parts = [c for o in deltas for c in o.outputs if c.index == choice.index]
        assert len(parts) < len(choice.token_ids)  # merged: fewer outputs than tokens
        assert "".join(c.text for c in parts) == choice.text
        assert [t for c in parts for t in c.token_ids] == list(choice.token_ids)
        streamed = [step for c in parts for step in c.logprobs]
        assert [list(step) for step in streamed] == [list(step) for step in choice.logprobs]
        assert [lp.logprob for step in streamed for lp in step.values()] == pytest.approx(
            [lp.logprob for step in choice.logprobs for lp in step.values()], abs=1e-4)
        assert parts[-1].finish_reason == choice.finish_reason == "length"
        assert parts[-1].cumulative_logprob == pytest.approx(choice.cumulative_logprob)
    assert _idle(engine)


def test_shutdown_ends_inflight_requests(engine):
    async def main():
        gen = engine.generate(PROMPT, _params(RequestOutputKind.DELTA, max_tokens=200), "last")
        await anext(gen)
        await asyncio.to_thread(engine.shutdown)
        with pytest.raises(EngineShutdownError):
            async for _ in gen:
                pass
        with pytest.raises(EngineShutdownError):
            await engine.add_request("late", PROMPT, _params())

    asyncio.run(main())
    assert engine.client.process.exitcode == 0  # its weights and KV cache are gone with it
    assert not engine.is_running
    assert not engine.errored


def test_device_error_kills_the_engine(fault_file):
    engine = AsyncLLM.from_engine_args(_args())
    died = threading.Event()
    engine.add_dead_callback(lambda error: died.set())

    async def main():
        fault_file.write_text("cuda")
        with pytest.raises(EngineDeadError, match="CUDA error"):
            await _collect(engine, "doomed", _params())
        with pytest.raises(EngineDeadError):
            await engine.check_health()
        with pytest.raises(EngineDeadError):
            await engine.add_request("after", PROMPT, _params())

    try:
        asyncio.run(main())
        assert died.wait(10)
        assert engine.errored and isinstance(engine.dead_error, EngineDeadError)
        engine.client.process.join(30)
        assert engine.client.process.exitcode == 1  # the core process exited with it
    finally:
        engine.shutdown()


