"""1P1D (prefill and decode instances over NIXL, behind the proxy) vs one instance: TTFT and ITL.

Runs the same load against

    single   one `vllm serve` at --gpu-memory-utilization U
    disagg   a kv_producer and --decode-instances (1 or 2) kv_consumer `vllm
             serve`s, each at U (all on the same GPU when there is one: U must
             leave room for two or three), and `python -m
             vllm.entrypoints.disagg_proxy` in front of them (1P1D or 1P2D)

one after the other (the single instance is stopped first). Each setup runs

    sweep    (unless --only-mixed) `vllm.benchmarks.serve_client.run_level` at
             each --concurrency level, after one warm-up request per level
    mixed    (with --mixed or --only-mixed) --mixed-streams streaming requests
             (short prompt, --mixed-stream-tokens output tokens, ignore_eos)
             kept in flight for --mixed-duration-s (one that ends is replaced
             at once), plus one long prompt (--mixed-long-words, 16 output
             tokens) every --mixed-long-every-s, after one long and one short
             warm-up request. On one instance each long prefill stalls every
             stream's next token (its ITL p99 spikes); with 1P1D the prefill
             runs on the producer and the decode instance only reads its KV.

and prints JSON:

    {"config": {...args, "prompt_tokens": {"sweep", "mixed_stream", "mixed_long"}},
     "single": [level, ...], "disagg": [level, ...],      # [] with --only-mixed
     "ratio": [{"concurrency": C, "ttft_p50", "ttft_p99", "itl_p50", "itl_p99",
                "output_throughput"}, ...],                # each disagg / single
     "mixed": {"single": M, "disagg": M},                  # with --mixed
     "mixed_ratio": {"streams_itl_p50", "streams_itl_p99", "streams_ttft_p50",
                     "streams_ttft_p99", "long_ttft_p50", "long_ttft_p99",
                     "output_throughput"}}                 # each disagg / single

A level is `run_level`'s dict (ttft_ms / itl_ms / tpot_ms / e2e_ms as {mean,
p50, p99} in ms, output_throughput in tokens/s, failed, errors). M is

    {"duration_s": the measured window (--mixed-duration-s),
     "output_throughput": tokens/s of streams and long requests in the window,
     "streams": G, "long": G}
    G = {"completed", "failed", "errors": up to 5 messages,
         "ttft_ms": {mean, p50, p99} of every request sent in the window,
         "itl_ms": {mean, p50, p99} of the gaps that end inside the window,
         "output_tokens": tokens that arrived inside the window,
         "output_throughput": output_tokens / duration_s}

Streams still running at the window's end finish, but their later tokens are
not counted: after the window no stream is replaced and no long prompt
arrives, so those tokens see a lighter load. A stream that fails is not
replaced (no retry loop against a failing server). prompt_tokens are the largest
prompt of each kind as the model's tokenizer counts it; a prompt that cannot
fit --max-model-len with its output is a one-line error (exit 2) before
anything starts. The synthetic words are ~4.5 tokens each with the
llama3_8b shape's tokenizer (1330 words: ~6,000 tokens) and 1 each with the
bundled SmolLM2.

A ratio is null where the single instance's figure is 0 (nothing measured).
The issue's targets read ratio[].ttft_p50 at concurrency 1 and 8 and
mixed_ratio.streams_itl_p99 (the decode instance's ITL p99 over the single one's).
The peer is the single instance measured in the same run. On a GPU with
`--shape llama3_8b` the weights are random (`--load-format dummy`); on the CPU
pass `--model` (e.g. the bundled GGUF, `vllm.transformers_utils.model_path.
get_bundled_model_path()`) and small sizes: it then checks the path, not the
speed.

Examples (one H100; 0.3 leaves room for three instances of the 8B shape):
    python benchmarks/benchmark_disagg.py --shape llama3_8b --gpu-memory-utilization 0.3 \\
        --concurrency 1 8 --num-prompts 32 --input-words 512 --output-tokens 128 \\
        --mixed --out benchmarks/results/disagg_llama3_8b_h100.json
    python benchmarks/benchmark_disagg.py --shape llama3_8b --gpu-memory-utilization 0.3 \\
        --only-mixed --decode-instances 2 --out benchmarks/results/disagg_1p2d_llama3_8b_h100.json
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.common import (  # noqa: E402
    SHAPES,
    VLLM_SERVE,
    ServeProcess,
    emit,
    model_dir_for,
)
from vllm.benchmarks.serve_client import (  # noqa: E402
    RequestResult,
    _summary_ms,
    client_session,
    make_prompts,
    one_request,
    resolve_model,
    run_level,
)
from vllm.benchmarks.utils import positive_float, positive_int  # noqa: E402

PROXY = (sys.executable, "-m", "vllm.entrypoints.disagg_proxy")
SERVER_START_TIMEOUT_S = 330  # model load + warmup, then /health
PROXY_START_TIMEOUT_S = 60
LONG_OUTPUT_TOKENS = 16  # a long request is all prefill; a few tokens time its decode too
# Prompts per stream slot (cycled); prefix caching is off, so reuse costs nothing.
STREAM_PROMPTS_PER_SLOT = 4


@dataclass(frozen=True)
class MixedLoad:
    """The mixed phase's requests: `num_streams` streams kept in flight for `duration_s`,
    a long prompt every `every_s` seconds (the first `every_s` after the start)."""

    stream_prompts: list[str]  # slot i cycles over stream_prompts[i::num_streams]
    long_prompts: list[str]  # [warm-up, then one per arrival]
    num_streams: int
    stream_tokens: int  # max_tokens of a stream (ignore_eos: it runs that long)
    every_s: float
    duration_s: float

    @staticmethod
    def arrivals(every_s: float, duration_s: float) -> list[float]:
        """Seconds after the start at which the long prompts are sent (all < duration_s)."""
        return [every_s * j for j in range(1, int(duration_s / every_s) + 1)
                if every_s * j < duration_s]

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> MixedLoad:
        n = args.mixed_streams
        num_long = 1 + len(cls.arrivals(args.mixed_long_every_s, args.mixed_duration_s))
        return cls(make_prompts(n * STREAM_PROMPTS_PER_SLOT, args.mixed_stream_words,
                                args.seed + 1),
                   make_prompts(num_long, args.mixed_long_words, args.seed + 2),
                   n, args.mixed_stream_tokens, args.mixed_long_every_s, args.mixed_duration_s)


async def run_mixed(url: str, model: str, load: MixedLoad) -> dict:
    """One mixed phase against `url` (a server or the proxy): the `M` dict of the docstring."""
    endpoint = url.rstrip("/") + "/v1/completions"
    async with client_session(None) as client:

        async def send(prompt: str, max_tokens: int) -> RequestResult:
            return await one_request(client, endpoint, model, prompt, max_tokens, True)

        # Warm-up: the first long prefill and first decode steps compile / allocate.
        await send(load.long_prompts[0], LONG_OUTPUT_TOKENS)
        await send(load.stream_prompts[0], min(load.stream_tokens, LONG_OUTPUT_TOKENS))
        start = time.perf_counter()
        end = start + load.duration_s
        streams: list[RequestResult] = []

        async def stream_slot(slot: int) -> None:
            prompts = itertools.cycle(load.stream_prompts[slot::load.num_streams])
            while time.perf_counter() < end:
                result = await send(next(prompts), load.stream_tokens)
                streams.append(result)
                if not result.ok:
                    return  # no retry loop against a failing server; counted as failed

        async def long_request(at_s: float, prompt: str) -> RequestResult:
            await asyncio.sleep(start + at_s - time.perf_counter())
            return await send(prompt, LONG_OUTPUT_TOKENS)

        arrivals = MixedLoad.arrivals(load.every_s, load.duration_s)
        longs, *_ = await asyncio.gather(
            asyncio.gather(*(long_request(t, p) for t, p in zip(
                arrivals, load.long_prompts[1:], strict=True))),
            *(stream_slot(i) for i in range(load.num_streams)))
    groups = {"streams": _window(streams, end, load.duration_s),
              "long": _window(list(longs), end, load.duration_s)}
    total = sum(g["output_tokens"] for g in groups.values())
    return {"duration_s": load.duration_s, "output_throughput": total / load.duration_s,
            **groups}


def _window(results: list[RequestResult], end: float, duration_s: float) -> dict:
    """A group's figures (`G` in the docstring): tokens and ITL gaps up to `end` only."""
    ok = [r for r in results if r.ok]
    # token_times ascend, so the gaps that end inside the window are the first ones.
    counts = [sum(1 for t in r.token_times() if t <= end) for r in ok]
    tokens = sum(counts)
    return {
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results if not r.ok})[:5],
        "ttft_ms": _summary_ms([r.ttft_s for r in ok]),
        "itl_ms": _summary_ms([g for r, n in zip(ok, counts, strict=True)
                               for g in r.itl_s[:max(n - 1, 0)]]),
        "output_tokens": tokens,
        "output_throughput": tokens / duration_s,
    }


def _server_args(args: argparse.Namespace, role: str | None) -> list[str]:
    out = ["--model", _model_path(args), "--max-model-len", str(args.max_model_len),
           "--uvicorn-log-level", "warning", "--disable-log-stats", "--no-enable-prefix-caching"]
    if args.model is None:
        out += ["--load-format", "dummy"]
    if args.gpu_memory_utilization is not None:
        out += ["--gpu-memory-utilization", str(args.gpu_memory_utilization)]
    if args.kv_cache_memory_bytes is not None:
        out += ["--kv-cache-memory-bytes", args.kv_cache_memory_bytes]
    if role is not None:
        out += ["--kv-transfer-config",
                json.dumps({"kv_connector": "NixlConnector", "kv_role": role})]
    return out + list(args.server_arg)


def _model_path(args: argparse.Namespace) -> str:
    return args.model or model_dir_for(args.shape)


def _measure(url: str, args: argparse.Namespace, prompts: list[str],
             load: MixedLoad | None) -> dict:
    """One setup's {"sweep": [level, ...], "mixed": M or None} against `url`."""
    model = resolve_model(url, {})
    sweep = []
    for c in [] if args.only_mixed else args.concurrency:
        # One warm-up request per level (first-request compiles are not the point).
        asyncio.run(run_level(url, model, 1, prompts[:1], args.output_tokens, True, {}))
        sweep.append(asyncio.run(run_level(url, model, c, prompts, args.output_tokens, True,
                                           {})))
    mixed = asyncio.run(run_mixed(url, model, load)) if load is not None else None
    return {"sweep": sweep, "mixed": mixed}


def _single(args: argparse.Namespace, prompts: list[str], load: MixedLoad | None) -> dict:
    with _serve(_server_args(args, None)) as server:
        return _measure(server.url, args, prompts, load)


def _disagg(args: argparse.Namespace, prompts: list[str], load: MixedLoad | None) -> dict:
    # Started one after the other: on a shared GPU each instance sizes its share
    # from the memory free at its start, which a neighbour still loading changes.
    with contextlib.ExitStack() as stack:
        prefill = stack.enter_context(_serve(_server_args(args, "kv_producer")))
        decodes = [stack.enter_context(_serve(_server_args(args, "kv_consumer")))
                   for _ in range(args.decode_instances)]
        proxy = stack.enter_context(_serve(
            ["--prefill", prefill.url, "--decode", *(d.url for d in decodes)],
            command=PROXY, timeout_s=PROXY_START_TIMEOUT_S))
        return _measure(proxy.url, args, prompts, load)


def _serve(args: list[str], command=VLLM_SERVE,
           timeout_s: float = SERVER_START_TIMEOUT_S) -> ServeProcess:
    """`command ARGS` on a free port, ready (stopped again if it is not)."""
    server = ServeProcess(args, command=command)
    server.wait_ready(timeout_s)
    return server


def _ratio(disagg: float, single: float) -> float | None:
    return disagg / single if single else None


def _sweep_ratio(single: list[dict], disagg: list[dict]) -> list[dict]:
    return [{"concurrency": s["concurrency"],
             **{f"{m}_{p}": _ratio(d[f"{m}_ms"][p], s[f"{m}_ms"][p])
                for m in ("ttft", "itl") for p in ("p50", "p99")},
             "output_throughput": _ratio(d["output_throughput"], s["output_throughput"])}
            for s, d in zip(single, disagg, strict=True)]


def _mixed_ratio(single: dict, disagg: dict) -> dict:
    out = {f"{g}_{m}_{p}": _ratio(disagg[g][f"{m}_ms"][p], single[g][f"{m}_ms"][p])
           for g, m in (("streams", "itl"), ("streams", "ttft"), ("long", "ttft"))
           for p in ("p50", "p99")}
    out["output_throughput"] = _ratio(disagg["output_throughput"], single["output_throughput"])
    return out


def _prompt_tokens(args: argparse.Namespace, prompts: list[str],
                   load: MixedLoad | None) -> dict[str, int]:
    """The largest prompt of each kind in tokens, as the model's tokenizer counts them."""
    from vllm.transformers_utils.tokenizer import get_tokenizer

    tokenizer = get_tokenizer(_model_path(args))
    groups = {} if args.only_mixed else {"sweep": prompts}
    if load is not None:
        groups |= {"mixed_stream": load.stream_prompts, "mixed_long": load.long_prompts}
    return {k: max(len(ids) for ids in tokenizer(v)["input_ids"]) for k, v in groups.items()}


def _fit_problem(args: argparse.Namespace, prompt_tokens: dict[str, int]) -> str | None:
    """Why the load cannot run as asked (one line), or None."""
    flags = {"sweep": ("--input-words", args.input_words, args.output_tokens),
             "mixed_stream": ("--mixed-stream-words", args.mixed_stream_words,
                              args.mixed_stream_tokens),
             "mixed_long": ("--mixed-long-words", args.mixed_long_words, LONG_OUTPUT_TOKENS)}
    for kind, tokens in prompt_tokens.items():
        flag, words, max_tokens = flags[kind]
        if tokens + max_tokens > args.max_model_len:
            return (f"{flag} {words} makes prompts of up to {tokens} tokens; with "
                    f"{max_tokens} output tokens they need --max-model-len >= "
                    f"{tokens + max_tokens} (got {args.max_model_len})")
    if args.mixed and not MixedLoad.arrivals(args.mixed_long_every_s, args.mixed_duration_s):
        return (f"--mixed-long-every-s {args.mixed_long_every_s} sends no long prompt within "
                f"--mixed-duration-s {args.mixed_duration_s}")
    return None


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    prompts = make_prompts(max(args.num_prompts, max(args.concurrency)), args.input_words,
                           args.seed)
    load = MixedLoad.from_args(args) if args.mixed else None
    prompt_tokens = _prompt_tokens(args, prompts, load)
    problem = _fit_problem(args, prompt_tokens)
    if problem is not None:
        print(f"benchmark_disagg.py: {problem}", file=sys.stderr)
        return 2
    single, disagg = _single(args, prompts, load), _disagg(args, prompts, load)
    config = {k: v for k, v in vars(args).items() if k != "out"}
    result = {"config": {**config, "prompt_tokens": prompt_tokens},
              "single": single["sweep"], "disagg": disagg["sweep"],
              "ratio": _sweep_ratio(single["sweep"], disagg["sweep"])}
    failed = sum(r["failed"] for r in single["sweep"] + disagg["sweep"])
    if load is not None:
        result["mixed"] = {"single": single["mixed"], "disagg": disagg["mixed"]}
        result["mixed_ratio"] = _mixed_ratio(single["mixed"], disagg["mixed"])
        failed += sum(m[g]["failed"] for m in result["mixed"].values()
                      for g in ("streams", "long"))
    emit(result, args.out)
    return 1 if failed else 0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="llama3_8b", choices=list(SHAPES),
                   help="Random-weight shape (GPU).")
    p.add_argument("--model", default=None, help="A real model instead of --shape.")
    p.add_argument("--gpu-memory-utilization", type=float, default=None,
                   help="Each instance's share of the device (required on a GPU: two or "
                        "three instances share it).")
    p.add_argument("--kv-cache-memory-bytes", default=None, help="e.g. 256MiB (CPU runs).")
    p.add_argument("--max-model-len", type=positive_int, default=8192,
                   help="Every instance's --max-model-len; must hold the longest prompt plus "
                        "its output (default: %(default)s).")
    p.add_argument("--decode-instances", type=positive_int, choices=(1, 2), default=1,
                   help="kv_consumer instances behind the proxy: 1 (1P1D) or 2 (1P2D) "
                        "(default: %(default)s).")
    _add_sweep_args(p)
    _add_mixed_args(p)
    p.add_argument("--seed", type=int, default=0,
                   help="Seed of the synthetic prompts (default: %(default)s).")
    p.add_argument("--server-arg", action="append", default=[],
                   help="Extra `vllm serve` argument (repeatable).")
    p.add_argument("--out", default=None, help="Also write the JSON to this file.")
    args = p.parse_args(argv)
    args.mixed = args.mixed or args.only_mixed
    return args


def _add_sweep_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--concurrency", type=positive_int, nargs="+", default=[1, 8],
                   help="Requests in flight, one level each (default: 1 8).")
    p.add_argument("--num-prompts", type=positive_int, default=32,
                   help="Requests per level (at least the level's concurrency; "
                        "default: %(default)s).")
    p.add_argument("--input-words", type=positive_int, default=512,
                   help="Words per synthetic prompt (default: %(default)s).")
    p.add_argument("--output-tokens", type=positive_int, default=128,
                   help="max_tokens of each request (default: %(default)s).")


def _seconds(text: str) -> float:
    """argparse type: a finite number of seconds > 0."""
    value = positive_float(text)
    if math.isinf(value):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text}")
    return value


def _add_mixed_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--mixed", action="store_true",
                   help="After the sweep, run the mixed load against each setup.")
    p.add_argument("--only-mixed", action="store_true",
                   help="The mixed load only, no sweep (implies --mixed).")
    p.add_argument("--mixed-streams", type=positive_int, default=8,
                   help="Streaming requests kept in flight (default: %(default)s).")
    p.add_argument("--mixed-stream-words", type=positive_int, default=64,
                   help="Words of a stream's prompt (default: %(default)s).")
    p.add_argument("--mixed-stream-tokens", type=positive_int, default=512,
                   help="Output tokens of a stream, ignore_eos (default: %(default)s).")
    p.add_argument("--mixed-long-words", type=positive_int, default=1330,
                   help="Words of a long prompt (default: %(default)s, ~6,000 tokens with "
                        f"the llama3_8b shape's tokenizer; {LONG_OUTPUT_TOKENS} output tokens).")
    p.add_argument("--mixed-long-every-s", type=_seconds, default=2.0,
                   help="Seconds between long prompts (default: %(default)s).")
    p.add_argument("--mixed-duration-s", type=_seconds, default=30.0,
                   help="Seconds of the measured window (default: %(default)s).")


if __name__ == "__main__":
    sys.exit(main())
