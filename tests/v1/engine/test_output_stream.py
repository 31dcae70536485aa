"""RequestOutputStream coalescing (no engine): outputs the consumer has not read yet are
merged (DELTA) or replaced (CUMULATIVE), errors come after the output before them, and
the completions endpoint's SSE chunks and usage built from merged outputs are right."""

from __future__ import annotations

import asyncio
import json
import threading

from vllm.logprobs import Logprob
from vllm.outputs import CompletionOutput, RequestOutput
from vllm.sampling_params import RequestOutputKind, SamplingParams
from vllm.v1.engine.exceptions import EngineGenerateError
from vllm.v1.engine.output_stream import RequestOutputStream


def _out(index: int, text: str, ids: list[int], finished: bool = False, logprobs: bool = False,
         request_finished: bool | None = None) -> RequestOutput:
    lps = [{t: Logprob(-0.5, 1, str(t))} for t in ids] if logprobs else None
    completion = CompletionOutput(index=index, text=text, token_ids=ids,
                                  cumulative_logprob=-0.5 * ids[-1] if logprobs else None,
                                  logprobs=lps, finish_reason="length" if finished else None)
    done = finished if request_finished is None else request_finished
    return RequestOutput("r", "p", [1, 2, 3], None, [completion], done)


def _stream(delta: bool = True) -> tuple[RequestOutputStream, list[str], list[str]]:
    aborted: list[str] = []
    done: list[str] = []
    stream = RequestOutputStream("r", asyncio.get_running_loop(), aborted.append, done.append,
                                 delta=delta)
    return stream, aborted, done


def test_unread_delta_outputs_are_merged_into_one():
    async def main():
        stream, aborted, done = _stream()
        stream.put_nowait(_out(0, "Hel", [10], logprobs=True))
        stream.put_nowait(_out(0, "lo", [11], logprobs=True))
        first = await stream.get()
        stream.put_nowait(_out(0, " wor", [12], logprobs=True))
        stream.put_nowait(_out(0, "ld", [13, 14], finished=True, logprobs=True))
        return first, [o async for o in stream], aborted, done

    first, rest, aborted, done = asyncio.run(main())
    (a,) = first.outputs
    assert (a.text, list(a.token_ids), not first.finished) == ("Hello", [10, 11], True)
    assert [list(e) for e in a.logprobs] == [[10], [11]] and a.cumulative_logprob == -5.5
    (last,) = rest
    (b,) = last.outputs
    assert (b.text, list(b.token_ids), b.finish_reason) == (" world", [12, 13, 14], "length")
    assert [list(e) for e in b.logprobs] == [[12], [13], [14]]
    assert last.finished and aborted == [] and done == ["r"]


def test_n_greater_than_one_merges_per_choice_index():
    async def main():
        stream, _, _ = _stream()
        stream.put_nowait(_out(0, "a", [1], request_finished=False))
        stream.put_nowait(_out(1, "x", [7], request_finished=False))
        stream.put_nowait(_out(0, "b", [2], finished=True, request_finished=False))
        stream.put_nowait(_out(1, "y", [8], finished=True, request_finished=True))
        return [o async for o in stream]

    (merged,) = asyncio.run(main())
    by_index = {c.index: c for c in merged.outputs}
    assert (by_index[0].text, list(by_index[0].token_ids)) == ("ab", [1, 2])
    assert (by_index[1].text, list(by_index[1].token_ids)) == ("xy", [7, 8])
    assert by_index[0].finish_reason == by_index[1].finish_reason == "length"
    assert merged.finished


def test_cumulative_outputs_are_replaced_by_the_latest():
    async def main():
        stream, _, _ = _stream(delta=False)
        stream.put_nowait(_out(0, "He", [1]))
        stream.put_nowait(_out(0, "Hello", [1, 2], finished=True))
        return [o async for o in stream]

    (only,) = asyncio.run(main())
    assert only.outputs[0].text == "Hello" and list(only.outputs[0].token_ids) == [1, 2]


def test_an_error_comes_after_the_output_before_it_and_ends_the_stream():
    async def main():
        stream, aborted, done = _stream()
        stream.put_nowait(_out(0, "Hi", [1]))
        stream.put_nowait(EngineGenerateError("step failed"))
        stream.put_nowait(_out(0, "!", [2], finished=True))  # after the error: dropped
        got = await stream.get()
        try:
            await stream.get()
        except EngineGenerateError as e:
            return got, str(e), stream.finished, aborted, done
        raise AssertionError("no error")

    got, error, finished, aborted, done = asyncio.run(main())
    assert got.outputs[0].text == "Hi" and error == "step failed" and finished
    assert aborted == [] and done[0] == "r"


def test_a_put_from_another_thread_wakes_the_waiting_consumer():
    async def main():
        stream, _, _ = _stream()
        thread = threading.Thread(target=lambda: stream.put_nowait(
            _out(0, "x", [5], finished=True)))
        getter = asyncio.ensure_future(stream.get())
        await asyncio.sleep(0.01)
        thread.start()
        got = await asyncio.wait_for(getter, 5)
        thread.join()
        return got

    assert asyncio.run(main()).outputs[0].text == "x"


def test_leaving_early_aborts_the_request():
    async def main():
        stream, aborted, _ = _stream()
        stream.put_nowait(_out(0, "a", [1]))
        async for _ in stream:
            break
        await asyncio.sleep(0)
        return aborted

    assert asyncio.run(main()) == ["r"]


def test_completions_sse_of_merged_outputs_carries_every_token_and_right_usage():
    """A consumer that fell behind gets one chunk for several steps: its text is every
    step's text, and the (continuous) usage counts every token."""
    from vllm.entrypoints.openai.serving_completion import OpenAIServingCompletion

    params = SamplingParams(n=2, max_tokens=3, output_kind=RequestOutputKind.DELTA)

    async def main():
        stream, _, _ = _stream()
        for step, (t0, t1) in enumerate([(1, 7), (2, 8), (3, 9)]):
            last = step == 2
            stream.put_nowait(_out(0, f"a{step}", [t0], finished=last, request_finished=False))
            stream.put_nowait(_out(1, f"b{step}", [t1], finished=last, request_finished=last))
        serving = OpenAIServingCompletion.__new__(OpenAIServingCompletion)  # no engine needed
        events = [e async for e in serving._stream("cmpl-1", "m", [stream], params, False,
                                                   True, True)]
        return events

    events = asyncio.run(main())
    assert events[-1] == "data: [DONE]\n\n"
    chunks = [json.loads(e[len("data: "):]) for e in events[:-1]]
    content = [c for c in chunks if c["choices"]]
    assert [(c["choices"][0]["index"], c["choices"][0]["text"]) for c in content] == [
        (0, "a0a1a2"), (1, "b0b1b2")]
    assert [c["choices"][0]["finish_reason"] for c in content] == ["length", "length"]
    assert [c["usage"]["completion_tokens"] for c in content] == [3, 6]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == {
        "prompt_tokens": 3, "completion_tokens": 6, "total_tokens": 9}


def test_a_handler_behind_the_engine_drains_merges_and_still_yields_the_loop():
    """An engine core whose batches are always ready (recv never waits): the handler
    merges several steps into the stream, yet the consumer reads while the engine
    keeps sending (the handler yields at least every HANDLER_TURN_S)."""
    import time

    from vllm.v1.engine.output_processor import OutputProcessor
    from vllm.v1.engine.output_stream import HANDLER_TURN_S, OutputHandler
    from vllm.v1.engine.protocol import EngineCoreOutputs, EngineCoreReplyType
    from vllm.v1.outputs import EngineCoreOutput

    num_steps = 400

    class BusyClient:
        """Every recv returns at once, as pyzmq does for a batch already in the socket."""

        dead_reason = None

        def __init__(self) -> None:
            self.sent = 0

        async def recv(self):
            if self.sent == num_steps:
                await asyncio.sleep(3600)
            self.sent += 1
            time.sleep(HANDLER_TURN_S / 20)  # a step's processing takes a while
            finished = "length" if self.sent == num_steps else None
            out = EngineCoreOutput("r", [self.sent], finish_reason=finished)
            return EngineCoreReplyType.OUTPUTS, EngineCoreOutputs(outputs=[out])

        def send(self, *args) -> None:
            pass

    async def main():
        client = BusyClient()
        processor = OutputProcessor(tokenizer=None)
        handler = OutputHandler(client, processor, [])
        stream, _, _ = _stream()
        params = SamplingParams(max_tokens=num_steps, detokenize=False,
                                output_kind=RequestOutputKind.DELTA)
        processor.add_request("r", None, [1, 2, 3], params, time.monotonic(), queue=stream)
        handler.start()
        reads = []  # (steps the engine had sent, tokens in the output read)
        async for out in stream:
            reads.append((client.sent, len(out.outputs[0].token_ids)))
        handler.stop(1)
        return reads

    reads = asyncio.run(main())
    assert sum(n for _, n in reads) == num_steps  # every token, once
    assert any(n > 1 for _, n in reads)  # steps merged
    assert reads[0][0] < num_steps  # the first read came while the engine still sent
    assert len(reads) > 2
