"""How fast the serving benchmarks' client can read: `serve_client.run_level` against a
stand-in server that costs (almost) nothing.

Question: is `benchmark_serving.py` (and `vllm bench serve`) measuring the server, or
itself? The stand-in (a raw asyncio protocol on uvloop in a process of its own)
answers every streaming completion at once and then writes one SSE chunk per open
stream every `--step-ms` (a tick, as an engine step would), each chunk a real
completion chunk with continuous usage, so the client does all its usual work. It
offers `concurrency / step` tokens/s; the client reads what it can. Prints JSON:

    {"config": {...}, "results": [{"concurrency": C, "offered_tokens_per_s",
      "output_throughput": tok/s read, "vs_offered": ratio, "client_cpu_share",
      "client_cpu_us_per_chunk", "tokens_per_chunk", "ttft_ms", "itl_ms", "failed"}]}

`vs_offered` near 1.0: the client keeps up with a server that fast; well below it
(with `client_cpu_share` near 1.0) the client is the bottleneck, and a server
measured with it reads no faster than `output_throughput` here. (The stand-in's
own loop also has a ceiling: on a 2-core host it writes ~30-60k chunks/s.)

Example (the question of issue 50's frontend item: concurrency 128):
    python benchmarks/benchmark_serve_client.py --concurrency 16 128 --step-ms 2
"""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's vllm

from benchmarks.common import emit
from vllm.benchmarks.serve_client import make_prompts, run_level, wait_for_health
from vllm.benchmarks.utils import positive_float, positive_int

# The stand-in server (argv: PORT STEP_S): GET /health answers 200; POST answers a
# chunked SSE stream, one completion chunk per tick until max_tokens, then [DONE].
STAND_IN = r"""
import asyncio, json, sys
import uvloop

PORT, STEP_S = int(sys.argv[1]), float(sys.argv[2])
streams = []

def event(i, n):
    body = {"id": "cmpl-0", "object": "text_completion", "created": 0, "model": "m",
            "choices": [{"index": 0, "text": " w%d" % i, "logprobs": None,
                         "finish_reason": "length" if i == n else None, "stop_reason": None}],
            "usage": {"prompt_tokens": 16, "completion_tokens": i, "total_tokens": 16 + i}}
    data = b"data: " + json.dumps(body, separators=(",", ":")).encode() + b"\n\n"
    return b"%x\r\n%s\r\n" % (len(data), data)

DONE = b"%x\r\ndata: [DONE]\n\n\r\n0\r\n\r\n" % len(b"data: [DONE]\n\n")

class Stand(asyncio.Protocol):
    def connection_made(self, transport):
        self.transport, self.buf = transport, b""
    def data_received(self, data):
        self.buf += data
        while (end := self.buf.find(b"\r\n\r\n")) >= 0:
            head = self.buf[:end].decode("latin-1").lower().split("\r\n")
            length = next((int(h.split(":")[1]) for h in head
                           if h.startswith("content-length:")), 0)
            if len(self.buf) < end + 4 + length:
                return
            body, self.buf = self.buf[end + 4:end + 4 + length], self.buf[end + 4 + length:]
            if head[0].startswith("get"):
                self.transport.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n{}")
                continue
            self.transport.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                                 b"transfer-encoding: chunked\r\n\r\n")
            streams.append([self.transport, json.loads(body)["max_tokens"], 0])

async def tick():
    while True:
        await asyncio.sleep(STEP_S)
        for s in list(streams):
            s[2] += 1
            out = event(s[2], s[1])
            if s[2] >= s[1]:
                out += DONE
                streams.remove(s)
            if not s[0].is_closing():
                s[0].write(out)

async def main():
    server = await asyncio.get_running_loop().create_server(Stand, "127.0.0.1", PORT,
                                                            backlog=4096)
    asyncio.ensure_future(tick())
    print("listening", flush=True)
    await server.serve_forever()

uvloop.run(main())
"""


async def measure(url: str, concurrency: int, num_prompts: int, output_tokens: int,
                  step_s: float) -> dict:
    """One level against the stand-in: what the client read, and its CPU."""
    prompts = make_prompts(max(num_prompts, concurrency), 16, concurrency)
    level = await run_level(url, "m", concurrency, prompts, output_tokens, True, {})
    cpu = level["client_cpu_share"] * level["duration_s"]
    chunks = level["total_output_tokens"] / max(level["tokens_per_chunk"], 1e-9)
    offered = concurrency / step_s
    return {"concurrency": concurrency, "offered_tokens_per_s": offered,
            "output_throughput": level["output_throughput"],
            "vs_offered": level["output_throughput"] / offered,
            "client_cpu_share": level["client_cpu_share"],
            "client_cpu_us_per_chunk": cpu / max(chunks, 1) * 1e6,
            "tokens_per_chunk": level["tokens_per_chunk"], "ttft_ms": level["ttft_ms"],
            "itl_ms": level["itl_ms"], "failed": level["failed"], "errors": level["errors"]}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--concurrency", type=positive_int, nargs="+", default=[16, 128],
                   help="Streams in flight, one level each.")
    p.add_argument("--num-prompts", type=positive_int, default=512,
                   help="Requests per level (at least the concurrency).")
    p.add_argument("--output-tokens", type=positive_int, default=64,
                   help="Chunks (one token each) per stream.")
    p.add_argument("--step-ms", type=positive_float, default=2.0,
                   help="The stand-in's tick: one chunk per open stream every this many ms.")
    p.add_argument("--port", type=positive_int, default=8399, help="The stand-in's port.")
    p.add_argument("--out", default=None, help="Also write the JSON here.")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    url = f"http://127.0.0.1:{args.port}"
    stand_in = subprocess.Popen([sys.executable, "-c", STAND_IN, str(args.port),
                                 str(args.step_ms / 1000)])
    try:
        wait_for_health(url, 30, stand_in)
        results = [asyncio.run(measure(url, c, args.num_prompts, args.output_tokens,
                                       args.step_ms / 1000)) for c in args.concurrency]
    finally:
        stand_in.terminate()
        stand_in.wait(10)
    for r in results:
        print(f"concurrency {r['concurrency']}: read {r['output_throughput']:.0f} of "
              f"{r['offered_tokens_per_s']:.0f} tokens/s offered ({r['vs_offered']:.2f}), "
              f"client CPU {r['client_cpu_share']:.2f} of a core, "
              f"{r['client_cpu_us_per_chunk']:.0f} us a chunk", file=sys.stderr)
    emit({"config": vars(args), "results": results}, args.out)
    return 0 if all(r["failed"] == 0 for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
