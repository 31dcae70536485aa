"""1P1D (prefill and decode instances over NIXL, behind the proxy) vs one instance: TTFT and ITL.

Runs the same streaming load (`vllm.benchmarks.serve_client.run_level`) against

    single   one `vllm serve` at --gpu-memory-utilization U
    1p1d     a kv_producer and a kv_consumer `vllm serve`, each at U (both on
             the same GPU when there is one: U must leave room for two), and
             `python -m vllm.entrypoints.disagg_proxy` in front of them

one after the other (the single instance is stopped first), and prints JSON:

    {"config": {...}, "single": [level, ...], "disagg": [level, ...],
     "ratio": [{"concurrency": C, "ttft_p50": disagg/single, "itl_p50": disagg/single,
                "output_throughput": disagg/single}, ...]}

The peer is the single instance measured in the same run. On a GPU with
`--shape llama3_8b` the weights are random (`--load-format dummy`); on the CPU
pass `--model` (e.g. the bundled GGUF) and small sizes: it then checks the path,
not the speed.

Example (one H200):
    python benchmarks/benchmark_disagg.py --shape llama3_8b --gpu-memory-utilization 0.4 \\
        --concurrency 1 8 --num-prompts 32 --input-words 512 --output-tokens 128 --out r.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.common import SHAPES, emit, model_dir_for  # noqa: E402
from tests.entrypoints.openai.utils import RemoteServer  # noqa: E402
from vllm.benchmarks.serve_client import make_prompts, run_level  # noqa: E402
from vllm.benchmarks.utils import positive_int  # noqa: E402


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _server_args(args: argparse.Namespace, role: str | None) -> list[str]:
    model = args.model or model_dir_for(args.shape)
    out = ["--model", model, "--max-model-len", str(args.max_model_len),
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


def _sweep(url: str, args: argparse.Namespace, prompts: list[str]) -> list[dict]:
    model = json.loads(_get(f"{url}/v1/models"))["data"][0]["id"]
    results = []
    for c in args.concurrency:
        # One warm-up request per level (first-request compiles are not the point).
        asyncio.run(run_level(url, model, 1, prompts[:1], args.output_tokens, True, {}))
        results.append(asyncio.run(run_level(url, model, c, prompts, args.output_tokens, True,
                                             {})))
    return results


def _get(url: str) -> bytes:
    import httpx

    return httpx.get(url, timeout=60).content


def _start_proxy(prefill: str, decode: str) -> tuple[subprocess.Popen, str]:
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "vllm.entrypoints.disagg_proxy",
                             "--port", str(port), "--prefill", prefill, "--decode", decode],
                            cwd=ROOT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            _get(f"{url}/health")
            return proc, url
        except Exception:
            if proc.poll() is not None:
                raise RuntimeError(f"the proxy exited with {proc.returncode}") from None
            time.sleep(0.3)
    proc.kill()
    raise RuntimeError("the proxy never answered /health")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    prompts = make_prompts(max(args.num_prompts, max(args.concurrency)), args.input_words,
                           args.seed)
    with RemoteServer(_server_args(args, None)) as single:
        single_results = _sweep(single.url, args, prompts)
    with RemoteServer(_server_args(args, "kv_producer")) as prefill, \
            RemoteServer(_server_args(args, "kv_consumer")) as decode:
        proxy, url = _start_proxy(prefill.url, decode.url)
        try:
            disagg_results = _sweep(url, args, prompts)
        finally:
            proxy.kill()
            proxy.wait(30)
    ratio = [{
        "concurrency": s["concurrency"],
        "ttft_p50": d["ttft_ms"]["p50"] / s["ttft_ms"]["p50"],
        "itl_p50": d["itl_ms"]["p50"] / s["itl_ms"]["p50"],
        "output_throughput": d["output_throughput"] / s["output_throughput"],
    } for s, d in zip(single_results, disagg_results, strict=True)]
    config = {k: v for k, v in vars(args).items() if k != "out"}
    emit({"config": config, "single": single_results, "disagg": disagg_results,
          "ratio": ratio}, args.out)
    failed = sum(r["failed"] for r in single_results + disagg_results)
    return 1 if failed else 0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="llama3_8b", choices=list(SHAPES),
                   help="Random-weight shape (GPU).")
    p.add_argument("--model", default=None, help="A real model instead of --shape.")
    p.add_argument("--gpu-memory-utilization", type=float, default=None,
                   help="Each instance's share of the device (required on a GPU: two "
                        "instances share it).")
    p.add_argument("--kv-cache-memory-bytes", default=None, help="e.g. 256MiB (CPU runs).")
    p.add_argument("--max-model-len", type=positive_int, default=4096,
                   help="Both instances' --max-model-len (default: %(default)s).")
    p.add_argument("--concurrency", type=positive_int, nargs="+", default=[1, 8],
                   help="Requests in flight, one level each (default: 1 8).")
    p.add_argument("--num-prompts", type=positive_int, default=32,
                   help="Requests per level (at least the level's concurrency; "
                        "default: %(default)s).")
    p.add_argument("--input-words", type=positive_int, default=512,
                   help="Words per synthetic prompt (default: %(default)s).")
    p.add_argument("--output-tokens", type=positive_int, default=128,
                   help="max_tokens of each request (default: %(default)s).")
    p.add_argument("--seed", type=int, default=0,
                   help="Seed of the synthetic prompts (default: %(default)s).")
    p.add_argument("--server-arg", action="append", default=[],
                   help="Extra `vllm serve` argument (repeatable).")
    p.add_argument("--out", default=None, help="Also write the JSON to this file.")
    return p.parse_args(argv)


if __name__ == "__main__":
    sys.exit(main())
