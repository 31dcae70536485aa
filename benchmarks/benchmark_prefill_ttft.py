"""A short chat during a long prefill: its time to first token, one vs several partial prefills.

The question of issue 17: a short request sent while a long prompt is being
prefilled waited for the whole prefill (33.7 s behind a 4000-token prompt on
a 2-core CPU). This script starts `vllm serve` on the bundled model twice,
once with `--max-num-partial-prefills 1` (vLLM's default: the peer) and once
with this project's default (4), and in each, `--reps` times:

  1. sends a completion whose prompt is `--prompt-tokens` random token ids
     (streaming, max_tokens 2), and waits until the engine runs it;
  2. sends a short chat ("What is the capital of France?", streaming) and
     times its first content token (TTFT), and the long prompt's TTFT.

Prints (and with --out writes) JSON:

    {"config": {...}, "peer": {"max_num_partial_prefills": 1, "short_ttft_s": [..],
     "long_ttft_s": [..], "short_ttft_median_s", "long_ttft_median_s"},
     "default": {...}, "short_ttft_ratio": peer median / default median,
     "long_ttft_ratio": default median / peer median}

short_ttft_ratio is the speed-up of the short request; long_ttft_ratio what
sharing costs the long one. On a GPU the default budget (8192 tokens) holds a
4000-token prompt in one step; pass --max-num-batched-tokens 512 (and a longer
--prompt-tokens) to see the same effect there.

Example:
    python benchmarks/benchmark_prefill_ttft.py --out $OUT/prefill_ttft.json
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.entrypoints.openai.utils import RemoteServer, scrape_metrics
from vllm.benchmarks.utils import positive_int

CHAT = [{"role": "user", "content": "What is the capital of France?"}]


def _first_token_s(client: httpx.Client, url: str, body: dict, sent: float) -> float:
    """Seconds from `sent` to the first chunk with generated text (chat or completion)."""
    with client.stream("POST", url, json={**body, "stream": True}) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            choice = (json.loads(line[6:]).get("choices") or [{}])[0]
            text = choice.get("text") or (choice.get("delta") or {}).get("content")
            if text or choice.get("finish_reason"):
                return time.monotonic() - sent
    raise RuntimeError(f"{url} streamed no token")


def _one_rep(server: RemoteServer, prompt_ids: list[int]) -> tuple[float, float]:
    import threading

    client = httpx.Client(timeout=600)
    long_ttft: list[float] = []
    sent = time.monotonic()
    body = {"prompt": prompt_ids, "max_tokens": 2, "temperature": 0}
    thread = threading.Thread(target=lambda: long_ttft.append(
        _first_token_s(client, server.url_for("v1/completions"), body, sent)))
    thread.start()
    deadline = time.monotonic() + 300
    while scrape_metrics(server).get("vllm:num_requests_running", 0) < 1:
        if time.monotonic() > deadline:
            raise RuntimeError("the long request never started running")
        time.sleep(0.05)
    chat = {"messages": CHAT, "max_tokens": 8, "temperature": 0}
    short = _first_token_s(client, server.url_for("v1/chat/completions"), chat,
                           time.monotonic())
    thread.join()
    client.close()
    return short, long_ttft[0]


def measure(partial_prefills: int | None, args: argparse.Namespace) -> dict:
    server_args = ["--max-model-len", str(args.max_model_len), "--kv-cache-memory-bytes",
                   args.kv_cache_memory, "--disable-log-stats", "--uvicorn-log-level",
                   "warning", "--no-enable-prefix-caching", *args.server_arg]
    if partial_prefills is not None:
        server_args += ["--max-num-partial-prefills", str(partial_prefills)]
    if args.max_num_batched_tokens:
        server_args += ["--max-num-batched-tokens", str(args.max_num_batched_tokens)]
    rng = random.Random(args.seed)
    shorts, longs = [], []
    with RemoteServer(server_args) as server:
        for _ in range(args.reps):
            prompt = [rng.randrange(1000, 40000) for _ in range(args.prompt_tokens)]
            short, long = _one_rep(server, prompt)
            shorts.append(short)
            longs.append(long)
    return {"max_num_partial_prefills": partial_prefills or "default",
            "short_ttft_s": shorts, "long_ttft_s": longs,
            "short_ttft_median_s": statistics.median(shorts),
            "long_ttft_median_s": statistics.median(longs)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--prompt-tokens", type=positive_int, default=4000,
                   help="Random token ids of the long prompt (default: %(default)s).")
    p.add_argument("--max-model-len", type=positive_int, default=8192,
                   help="The servers' --max-model-len (default: %(default)s).")
    p.add_argument("--max-num-batched-tokens", type=positive_int, default=None,
                   help="Step budget (default: the device's).")
    p.add_argument("--kv-cache-memory", default="1GiB",
                   help="The servers' --kv-cache-memory-bytes (default: %(default)s).")
    p.add_argument("--reps", type=positive_int, default=3,
                   help="Long prompt + short chat pairs per server (default: %(default)s).")
    p.add_argument("--seed", type=int, default=0,
                   help="Seed of the long prompts' tokens (default: %(default)s).")
    p.add_argument("--server-arg", action="append", default=[],
                   help="Extra `vllm serve` argument (repeatable).")
    p.add_argument("--out", type=Path, default=None, help="Also write the JSON to this file.")
    args = p.parse_args(argv)
    peer = measure(1, args)
    default = measure(None, args)
    result = {
        "config": {k: v for k, v in vars(args).items() if k != "out"},
        "peer": peer,
        "default": default,
        "short_ttft_ratio": peer["short_ttft_median_s"] / default["short_ttft_median_s"],
        "long_ttft_ratio": default["long_ttft_median_s"] / peer["long_ttft_median_s"],
    }
    text = json.dumps(result, indent=2, default=str)
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
