"""The serving benchmarks' client (`vllm.benchmarks.serve_client`) against a stand-in
SSE server (raw asyncio, so the test decides where the bytes split): events cut across
TCP reads, a chunk carrying several tokens timed per token, an error status, many
streams at once; and benchmark_serving.py's offline peer at the server's batch, and its
refusal to start a server on a port something already listens on."""

from __future__ import annotations

import asyncio
import json

import pytest

from vllm.benchmarks.serve_client import client_session, one_request, run_level

_HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"


def _event(text: str, completion_tokens: int, finish: str | None = None) -> bytes:
    body = {"id": "cmpl-1", "object": "text_completion", "model": "m",
            "choices": [{"index": 0, "text": text, "finish_reason": finish}],
            "usage": {"prompt_tokens": 5, "completion_tokens": completion_tokens,
                      "total_tokens": 5 + completion_tokens}}
    return b"data: " + json.dumps(body).encode() + b"\n\n"


def _chunked(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


async def _read_request(reader: asyncio.StreamReader) -> dict:
    head = await reader.readuntil(b"\r\n\r\n")
    length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                  if line.lower().startswith(b"content-length:"))
    return json.loads(await reader.readexactly(length))


async def _split_stream(reader, writer) -> None:
    """One token, 60 ms, then two tokens in one event whose bytes arrive in two TCP
    writes 40 ms apart, a finish-reason event of no token, [DONE]."""
    await _read_request(reader)
    writer.write(_HEAD + _chunked(_event(" a", 1)))
    await writer.drain()
    await asyncio.sleep(0.06)
    second = _chunked(_event(" b c", 3))
    writer.write(second[:40])
    await writer.drain()
    await asyncio.sleep(0.04)
    writer.write(second[40:] + _chunked(_event("", 3, "length"))
                 + _chunked(b"data: [DONE]\n\n") + b"0\r\n\r\n")
    await writer.drain()
    writer.close()


async def _serve(handler, coro):
    server = await asyncio.start_server(handler, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    async with server:
        return await coro(f"http://127.0.0.1:{port}")


def test_an_event_cut_across_reads_is_whole_and_its_tokens_share_the_gap():
    async def go(url):
        async with client_session(1) as session:
            return await one_request(session, url + "/v1/completions", "m", "hi", 3, True)

    result = asyncio.run(_serve(_split_stream, go))
    assert result.ok, result.error
    assert result.text == " a b c"
    assert (result.output_tokens, result.prompt_tokens, result.num_chunks) == (3, 5, 2)
    # The second chunk arrived >= 100 ms after the first and carries 2 tokens: 2 ITLs
    # of half the gap each (the finish-reason event carries none).
    assert len(result.itl_s) == 2
    assert result.itl_s[0] == result.itl_s[1] >= 0.05
    assert result.e2e_s >= result.ttft_s + 0.1


def test_an_error_status_is_reported_with_the_servers_message():
    async def refuse(reader, writer):
        await _read_request(reader)
        body = json.dumps({"error": {"message": "max_tokens is too large", "type": "x"}})
        writer.write(b"HTTP/1.1 400 Bad Request\r\ncontent-type: application/json\r\n"
                     b"content-length: %d\r\n\r\n%s" % (len(body), body.encode()))
        await writer.drain()
        writer.close()

    async def go(url):
        async with client_session(1) as session:
            return await one_request(session, url + "/v1/completions", "m", "hi", 3, True)

    result = asyncio.run(_serve(refuse, go))
    assert not result.ok
    assert result.error == "HTTP 400: max_tokens is too large"


def test_a_level_of_many_streams_reuses_connections_and_counts_every_token():
    connections = []

    async def streams(reader, writer):
        connections.append(writer)
        while not reader.at_eof():
            try:
                body = await _read_request(reader)
            except asyncio.IncompleteReadError:
                break
            writer.write(_HEAD)
            for i in range(1, body["max_tokens"] + 1):
                writer.write(_chunked(_event(f" t{i}", i)))
                await asyncio.sleep(0)
            writer.write(_chunked(b"data: [DONE]\n\n") + b"0\r\n\r\n")
            await writer.drain()
        writer.close()

    level = asyncio.run(_serve(streams, lambda url: run_level(
        url, "m", 8, [f"p{i}" for i in range(32)], 5, True, {})))
    assert level["failed"] == 0, level["errors"]
    assert level["total_output_tokens"] == 32 * 5
    assert len(connections) <= 8  # at most C open, kept alive between requests


@pytest.mark.parametrize(("flags", "concurrency", "batch"), [
    ([], 128, None),  # the device's default max_num_seqs (64 on the CPU), at most 128
    ([], 16, 16),
    (["--max-num-seqs", "32"], 128, 32),
    (["--max-num-seqs", "512"], 128, 128),
])
def test_the_offline_peer_runs_the_servers_batch(flags, concurrency, batch):
    from benchmarks.benchmark_serving import server_batch
    from vllm.config.scheduler import default_limits
    from vllm.platforms import current_platform

    default_seqs = default_limits(current_platform.device_type)[0]
    expected = min(concurrency, default_seqs) if batch is None else batch
    assert server_batch(["--model", "m", *flags], concurrency) == expected


def test_a_taken_port_stops_the_benchmark_before_it_starts_a_server(capsys):
    """A server already listening at --base-url: the launched one could not bind and the
    levels would measure the old one; the script says so and starts nothing."""
    import socket

    from benchmarks.benchmark_serving import main

    with socket.create_server(("127.0.0.1", 0)) as taken:
        url = f"http://127.0.0.1:{taken.getsockname()[1]}"
        assert main(["--base-url", url, "--engine-args", "--model m"]) == 2
    err = capsys.readouterr().err
    assert err.strip() == (f"benchmark_serving.py: error: something already listens at {url}; "
                           "stop it or give --base-url another port")
