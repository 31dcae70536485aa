"""`vllm bench serve`: load a running OpenAI-compatible server, print vLLM's result block.

    vllm serve MODEL &
    vllm bench serve --num-prompts 200 --max-concurrency 32 --random-input-len 128 \
        --random-output-len 128 --ignore-eos --save-result --result-dir results

As vLLM's `vllm bench serve`: requests from a dataset (`datasets.py`: random
token ids by default, ShareGPT, or a JSONL file) stream through
`--endpoint` (`--backend openai`/`vllm`: /v1/completions, `openai-chat`:
/v1/chat/completions) with at most `--max-concurrency` in flight, arriving at
`--request-rate` requests/s (gamma-distributed gaps of shape `--burstiness`;
inf: all at once), greedy unless `--temperature` says otherwise, stopping at
EOS unless `--ignore-eos`. One test request goes first (a wrong model name or
endpoint stops here with one line, exit 2), then `--num-warmups` untimed
requests. Token counts are the server's (the usage chunk of every stream).

The result block and the JSON keys are vLLM's (`duration`, `completed`,
`mean_ttft_ms`, `p99_itl_ms`, ...; per-request lists only with
`--save-detailed`); `--save-result` writes
`{label}-{rate}qps[-concurrency{C}]-{model}-{date}.json` (or `--result-filename`)
into `--result-dir`, `--output-json PATH` writes the same JSON to PATH. Every
output path and flag is checked before the first request; a flag that would
have no effect (another dataset's, --result-dir without --save-result, --port
with --base-url) is an error too. Failed requests are counted and their first
errors printed under the block; the exit status stays 0, as in vLLM. Input
token counts are the server's: with openai-chat they include the chat
template (vLLM's client counts the bare prompt).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import sys
from dataclasses import dataclass, replace
from datetime import datetime
from pathlib import Path

import numpy as np

from vllm.benchmarks.datasets import add_dataset_args, validate_dataset_args
from vllm.benchmarks.utils import (
    check_output_path,
    non_negative_int,
    positive_float,
    positive_int,
    write_json,
)

# --backend -> (default endpoint, chat API)
BACKENDS = {"openai": ("/v1/completions", False), "vllm": ("/v1/completions", False),
            "openai-chat": ("/v1/chat/completions", True)}
METRICS = {"ttft": ("TTFT", "Time to First Token"),
           "tpot": ("TPOT", "Time per Output Token (excl. 1st token)"),
           "itl": ("ITL", "Inter-token Latency"),
           "e2el": ("E2EL", "End-to-end Latency")}
GOODPUT_METRICS = ("ttft", "tpot", "e2el")
# Per-request lists: in the saved JSON only with --save-detailed (as vLLM).
DETAILED_KEYS = ("input_lens", "output_lens", "ttfts", "itls", "latencies", "start_times",
                 "generated_texts", "errors")
MAX_ERRORS_SHOWN = 10
# Sampling flags (--top-p, ...) -> request fields of that name, sent when given.
SAMPLING_FIELDS = (("temperature", float), ("top_p", float), ("top_k", int), ("min_p", float),
                   ("frequency_penalty", float), ("presence_penalty", float),
                   ("repetition_penalty", float))
LONG_ARRIVAL_SPAN_S = 3600.0  # a request rate this slow gets a warning before the run


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    add_dataset_args(parser)
    _add_server_args(parser)
    _add_traffic_args(parser)
    _add_result_args(parser)
    _add_sampling_args(parser)


def _add_server_args(parser: argparse.ArgumentParser) -> None:
    """Where the requests go: the API, the server, its headers, the model and tokenizer."""
    parser.add_argument("--backend", choices=list(BACKENDS), default="openai",
                        help="API to load: openai / vllm (completions) or openai-chat.")
    parser.add_argument("--label", default=None,
                        help="Prefix of the result file name (default: the backend).")
    parser.add_argument("--base-url", default=None,
                        help="Server root URL (default: http://HOST:PORT).")
    parser.add_argument("--host", default=None, help="Server host (default: 127.0.0.1).")
    parser.add_argument("--port", type=_port, default=None, help="Server port (default: 8000).")
    parser.add_argument("--endpoint", default=None,
                        help="API path (default: /v1/completions, or /v1/chat/completions "
                             "for openai-chat).")
    parser.add_argument("--header", metavar="KEY=VALUE", nargs="*", default=None,
                        help="Extra HTTP headers for every request.")
    parser.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"),
                        help="Bearer key, if the server needs one (default: $OPENAI_API_KEY).")
    parser.add_argument("--model", default=None,
                        help="Model name in requests (default: the server's first model).")
    parser.add_argument("--served-model-name", default=None,
                        help="Name in requests when --model names the tokenizer's path.")
    parser.add_argument("--tokenizer", default=None,
                        help="Tokenizer path (default: --model when it is a path, else the "
                             "served model's root).")


def _add_traffic_args(parser: argparse.ArgumentParser) -> None:
    """How many requests, how fast, how many at once, and the warm-up before them."""
    parser.add_argument("--num-prompts", type=positive_int, default=1000,
                        help="Requests to send.")
    parser.add_argument("--max-concurrency", type=positive_int, default=None,
                        help="Most requests in flight (default: no limit).")
    parser.add_argument("--request-rate", type=positive_float, default=float("inf"),
                        help="Requests per second (inf: all at once).")
    parser.add_argument("--burstiness", type=positive_float, default=1.0,
                        help="Shape of the gamma-distributed arrival gaps when the rate is "
                             "finite: 1 is a Poisson process, < 1 burstier, > 1 more uniform.")
    parser.add_argument("--num-warmups", type=non_negative_int, default=0,
                        help="Untimed requests before the timed ones.")
    parser.add_argument("--ignore-eos", action="store_true",
                        help="Generate exactly the output length (the server ignores EOS).")
    parser.add_argument("--seed", type=int, default=0, help="Seed of prompts and arrivals.")
    parser.add_argument("--disable-tqdm", action="store_true", help="No progress bar.")


def _add_result_args(parser: argparse.ArgumentParser) -> None:
    """What the result reports (metrics, percentiles, goodput), the wait for the server's
    health before the run, and where the result JSON is written."""
    parser.add_argument("--percentile-metrics", default="ttft,tpot,itl",
                        help="Comma-separated metrics to report: " + ", ".join(METRICS) + ".")
    parser.add_argument("--metric-percentiles", default="99",
                        help="Comma-separated percentiles to report, e.g. 25,50,99.")
    parser.add_argument("--goodput", nargs="+", metavar="KEY:VALUE", default=None,
                        help="Service-level objectives in ms (ttft, tpot, e2el); requests "
                             "meeting all of them count towards 'Request goodput'.")
    parser.add_argument("--ready-check-timeout-sec", type=non_negative_int, default=0,
                        help="Wait this long for /health to answer first (0: no wait).")
    parser.add_argument("--save-result", action="store_true",
                        help="Write the result JSON into --result-dir.")
    parser.add_argument("--save-detailed", action="store_true",
                        help="Include per-request lists (lengths, TTFTs, ITLs, texts, errors).")
    parser.add_argument("--append-result", action="store_true",
                        help="Append the result to the file as one JSON line.")
    parser.add_argument("--metadata", metavar="KEY=VALUE", nargs="*", default=None,
                        help="Extra fields for the result JSON.")
    parser.add_argument("--result-dir", default=None,
                        help="Directory of the result file (default: the current one).")
    parser.add_argument("--result-filename", default=None,
                        help="Result file name (default: "
                             "{label}-{rate}qps[-concurrency{C}]-{model}-{date}.json).")
    parser.add_argument("--output-json", default=None,
                        help="Also write the result JSON to this path.")


def _add_sampling_args(parser: argparse.ArgumentParser) -> None:
    """Sampling parameters of every request (greedy by default) and extra body fields."""
    sampling = parser.add_argument_group("sampling parameters (default: greedy)")
    for name, kind in SAMPLING_FIELDS:
        sampling.add_argument("--" + name.replace("_", "-"), type=kind, default=None)
    parser.add_argument("--extra-body", type=_json_object, default=None,
                        help="A JSON object merged into every request body.")


def _port(text: str) -> int:
    value = positive_int(text)
    if value > 65535:
        raise argparse.ArgumentTypeError(f"must be a port number <= 65535, got {value}")
    return value


def _json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"must be a JSON object: {e}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("must be a JSON object")
    return value


def _key_values(items: list[str] | None, flag: str, sep: str = "=") -> dict[str, str]:
    out = {}
    for item in items or []:
        key, found, value = item.partition(sep)
        if not found or not key:
            raise ValueError(f"{flag} expects KEY{sep}VALUE, got {item!r}")
        out[key] = value
    return out


@dataclass
class Plan:
    """What the flags ask for, checked before any request is sent."""

    base_url: str  # the server's root, no trailing slash
    url: str  # the endpoint's
    chat: bool
    headers: dict[str, str]
    metrics: list[str]
    percentiles: list[float]
    goodput: dict[str, float]
    metadata: dict[str, str]
    body_extra: dict


def _base_url(args: argparse.Namespace) -> str:
    """The server's root URL from --base-url or --host/--port; ValueError if unusable."""
    import httpx

    if args.base_url is not None and (args.host is not None or args.port is not None):
        raise ValueError("--base-url names the server: --host and --port would be unused")
    url = args.base_url or f"http://{args.host or '127.0.0.1'}:{args.port or 8000}"
    try:
        parsed = httpx.URL(url)
    except httpx.InvalidURL as e:
        raise ValueError(f"server URL {url!r} is not valid ({e})") from None
    if parsed.scheme not in ("http", "https") or not parsed.host:
        raise ValueError(f"server URL {url!r} is not an http:// or https:// URL with a host")
    return url.rstrip("/")


def make_plan(args: argparse.Namespace) -> Plan:
    """Check every flag that argparse cannot check alone; raises ValueError (one line)."""
    base_url = _base_url(args)
    endpoint, chat = _endpoint(args)
    validate_dataset_args(args)
    metrics, percentiles = _reported_metrics(args)
    goodput = _goodput(args)
    headers = _headers(args)
    body_extra = {name: getattr(args, name) for name, _ in SAMPLING_FIELDS
                  if getattr(args, name) is not None}
    body_extra.update(args.extra_body or {})
    _check_result_flags(args)
    return Plan(base_url=base_url, url=base_url + "/" + endpoint.lstrip("/"), chat=chat,
                headers=headers, metrics=metrics, percentiles=percentiles, goodput=goodput,
                metadata=_key_values(args.metadata, "--metadata"), body_extra=body_extra)


def _endpoint(args: argparse.Namespace) -> tuple[str, bool]:
    """(the API path, whether it is the chat API) from --backend and --endpoint."""
    default_endpoint, chat = BACKENDS[args.backend]
    endpoint = args.endpoint or default_endpoint
    if chat != endpoint.rstrip("/").endswith("chat/completions"):
        raise ValueError(f"--backend {args.backend} needs an endpoint ending in "
                         f"{'chat/completions' if chat else 'completions'}, got {endpoint!r}")
    return endpoint, chat


def _reported_metrics(args: argparse.Namespace) -> tuple[list[str], list[float]]:
    """--percentile-metrics and --metric-percentiles, parsed and checked."""
    metrics = [m.strip() for m in args.percentile_metrics.split(",") if m.strip()]
    unknown = [m for m in metrics if m not in METRICS]
    if unknown or not metrics:
        raise ValueError(f"--percentile-metrics: unknown metric {','.join(unknown) or '(none)'};"
                         f" choose from {', '.join(METRICS)}")
    try:
        percentiles = [float(p) for p in args.metric_percentiles.split(",")]
    except ValueError:
        raise ValueError("--metric-percentiles expects numbers such as 25,50,99, got "
                         f"{args.metric_percentiles!r}") from None
    if not all(0 < p <= 100 for p in percentiles):
        raise ValueError(f"--metric-percentiles must lie in (0, 100], got "
                         f"{args.metric_percentiles}")
    return metrics, percentiles


def _goodput(args: argparse.Namespace) -> dict[str, float]:
    """--goodput's service-level objectives: metric -> milliseconds (> 0)."""
    goodput = {}
    for key, value in _key_values(args.goodput, "--goodput", ":").items():
        if key not in GOODPUT_METRICS:
            raise ValueError(f"--goodput: unknown metric {key!r}; choose from "
                             f"{', '.join(GOODPUT_METRICS)}")
        try:
            goodput[key] = float(value)
        except ValueError:
            raise ValueError(f"--goodput {key}: expected milliseconds, got {value!r}") from None
        if not goodput[key] > 0:
            raise ValueError(f"--goodput {key}: must be > 0 ms, got {value}")
    return goodput


def _headers(args: argparse.Namespace) -> dict[str, str]:
    """--header's fields plus the bearer key of --api-key (ASCII only, as HTTP needs)."""
    headers = _key_values(args.header, "--header")
    for key, value in headers.items():
        if not (key + value).isascii():
            raise ValueError(f"--header {key}: HTTP headers take ASCII characters only")
    if args.api_key:
        if not args.api_key.isascii():
            raise ValueError("--api-key: HTTP headers take ASCII characters only")
        headers.setdefault("Authorization", f"Bearer {args.api_key}")
    return headers


def _check_result_flags(args: argparse.Namespace) -> None:
    """Refuse result flags that would have no effect, and output paths that could not be
    written after the run."""
    saving = args.save_result or args.append_result
    writing = saving or args.output_json is not None
    for flag, used, needed in (("--result-dir", args.result_dir, "save"),
                               ("--result-filename", args.result_filename, "save"),
                               ("--save-detailed", args.save_detailed, "write"),
                               ("--label", args.label, "write"),
                               ("--metadata", args.metadata, "write")):
        if used and not (saving if needed == "save" else writing):
            outputs = "--save-result or --append-result" if needed == "save" else (
                "--save-result, --append-result or --output-json")
            raise ValueError(f"{flag} has no effect without {outputs}")
    check_output_path(args.output_json)
    if args.result_dir is not None:
        check_output_path(str(Path(args.result_dir) / "result.json"))
    if args.result_filename is not None:
        check_output_path(str(Path(args.result_dir or ".") / args.result_filename))


def calculate_metrics(results: list, duration: float, samples: list, percentiles: list[float],
                      goodput: dict[str, float], start: float) -> dict:
    """vLLM's aggregate figures (ms for latencies) of one run's `RequestResult`s.

    TPOT of a request = (latency - TTFT) / (output tokens - 1); ITL per token
    (a chunk of k tokens counts k gaps of gap / k, `serve_client`); an empty
    statistic is 0 (as vLLM). The peak output throughput is the most output
    tokens in one 1-second window from `start` (each request's tokens spread
    over its token times), and
    `max_concurrent_requests` the most requests in flight at one instant (vLLM
    counts the requests active during any part of a second, which can exceed
    --max-concurrency).
    """
    ok = [r for r in results if r.ok]
    input_tokens = sum(r.prompt_tokens or s.prompt_len for r, s in zip(
        results, samples, strict=True) if r.ok)
    output_tokens = sum(r.output_tokens for r in ok)
    per_metric = {
        "ttft": [r.ttft_s for r in ok],
        "tpot": [(r.e2e_s - r.ttft_s) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1],
        "itl": [gap for r in ok for gap in r.itl_s],
        "e2el": [r.e2e_s for r in ok],
    }
    out = {
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "request_throughput": len(ok) / duration,
        "request_goodput": (sum(_meets(r, goodput) for r in ok) / duration) if goodput else None,
        "output_throughput": output_tokens / duration,
        "total_token_throughput": (input_tokens + output_tokens) / duration,
        **_peak(ok, start),
    }
    for name, values in per_metric.items():
        ms = np.asarray(values or [0.0]) * 1000.0
        out[f"mean_{name}_ms"] = float(ms.mean())
        out[f"median_{name}_ms"] = float(np.median(ms))
        out[f"std_{name}_ms"] = float(ms.std())
        for p in percentiles:
            out[f"p{_pct_word(p)}_{name}_ms"] = float(np.percentile(ms, p))
    return out


def _meets(r, slo: dict[str, float]) -> bool:
    tpot = (r.e2e_s - r.ttft_s) / (r.output_tokens - 1) if r.output_tokens > 1 else 0.0
    got = {"ttft": r.ttft_s, "tpot": tpot, "e2el": r.e2e_s}
    return all(1000.0 * got[key] <= limit for key, limit in slo.items())


def _peak(ok: list, start: float) -> dict:
    if not ok:
        return {"max_output_tokens_per_s": 0.0, "max_concurrent_requests": 0}
    per_second: dict[int, float] = {}
    for r in ok:
        times = r.token_times()
        weight = r.output_tokens / len(times) if r.output_tokens else 1.0
        for t in times:
            second = int(t - start)
            per_second[second] = per_second.get(second, 0.0) + weight
    # Most requests in flight at one instant: +1 at each send, -1 at each end (ends first
    # on ties, so back-to-back requests under --max-concurrency C never count C + 1).
    events = sorted([(r.start_s, 1) for r in ok] + [(r.start_s + r.e2e_s, -1) for r in ok],
                    key=lambda e: (e[0], e[1]))
    in_flight = peak = 0
    for _, step in events:
        in_flight += step
        peak = max(peak, in_flight)
    return {"max_output_tokens_per_s": max(per_second.values()), "max_concurrent_requests": peak}


def _pct_word(p: float) -> str:
    return str(int(p)) if int(p) == p else str(p)


def print_summary(result: dict, plan: Plan, args: argparse.Namespace) -> None:
    """vLLM's `vllm bench serve` result block (and the first errors, if any failed)."""
    def line(name: str, value, fmt: str = "") -> None:
        print(f"{name:<40} {value:<10{fmt}}")

    print("{s:{c}^{n}}".format(s=" Serving Benchmark Result ", n=50, c="="))
    line("Successful requests:", result["completed"])
    line("Failed requests:", result["failed"])
    if args.max_concurrency is not None:
        line("Maximum request concurrency:", args.max_concurrency)
    if args.request_rate != float("inf"):
        line("Request rate configured (RPS):", args.request_rate, ".2f")
    line("Benchmark duration (s):", result["duration"], ".2f")
    line("Total input tokens:", result["total_input_tokens"])
    line("Total generated tokens:", result["total_output_tokens"])
    line("Request throughput (req/s):", result["request_throughput"], ".2f")
    if plan.goodput:
        line("Request goodput (req/s):", result["request_goodput"], ".2f")
    line("Output token throughput (tok/s):", result["output_throughput"], ".2f")
    line("Peak output token throughput (tok/s):", result["max_output_tokens_per_s"], ".2f")
    line("Peak concurrent requests:", float(result["max_concurrent_requests"]), ".2f")
    line("Total token throughput (tok/s):", result["total_token_throughput"], ".2f")
    for name in plan.metrics:
        short, title = METRICS[name]
        print("{s:{c}^{n}}".format(s=title, n=50, c="-"))
        line(f"Mean {short} (ms):", result[f"mean_{name}_ms"], ".2f")
        line(f"Median {short} (ms):", result[f"median_{name}_ms"], ".2f")
        for p in plan.percentiles:
            line(f"P{_pct_word(p)} {short} (ms):", result[f"p{_pct_word(p)}_{name}_ms"], ".2f")
    print("=" * 50)
    errors = [e for e in result["errors"] if e]
    if errors:
        print(f"Failed requests during benchmark run detected (capping to {MAX_ERRORS_SHOWN}):")
        for i, error in enumerate(errors[:MAX_ERRORS_SHOWN]):
            print(f"Error {i}: {error}")


def result_filename(args: argparse.Namespace, model_id: str, date: str) -> str | None:
    """Where --save-result / --append-result write (None when neither is asked)."""
    if not (args.save_result or args.append_result):
        return None
    concurrency = f"-concurrency{args.max_concurrency}" if args.max_concurrency else ""
    name = args.result_filename or (
        f"{args.label or args.backend}-{args.request_rate}qps{concurrency}-"
        f"{model_id.rstrip('/').split('/')[-1]}-{date}.json")
    return os.path.join(args.result_dir, name) if args.result_dir else name


def _load_tokenizer(args: argparse.Namespace, root: str | None):
    from vllm.transformers_utils.tokenizer import get_tokenizer

    source = args.tokenizer or (args.model if args.model and Path(args.model).exists()
                                else root)
    if source is None:
        raise ValueError("the server names no model path to load a tokenizer from; "
                         "pass --tokenizer PATH")
    try:
        return source, get_tokenizer(source)
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot load the tokenizer from {source!r} "
                         f"({' '.join(str(e).split())}); pass --tokenizer PATH") from None


def main(args: argparse.Namespace) -> int:
    """Run the benchmark; returns the exit status. Raises ValueError for bad flag values
    (the `vllm` CLI prints it as one line, exit 2)."""
    import httpx

    from vllm.benchmarks.serve_client import served_models, wait_for_health

    plan = make_plan(args)
    base_url = plan.base_url
    try:
        if args.ready_check_timeout_sec:
            wait_for_health(base_url, args.ready_check_timeout_sec, None)
        models = served_models(base_url, plan.headers)
    except httpx.HTTPStatusError as e:
        code = e.response.status_code
        why = "the API key was refused; pass --api-key" if code in (401, 403) else str(e)
        print(f"vllm bench serve: error: {base_url}/v1/models answered HTTP {code} ({why})",
              file=sys.stderr)
        return 2
    except (httpx.HTTPError, TimeoutError, RuntimeError, ValueError) as e:
        print(f"vllm bench serve: error: no server answers at {base_url} "
              f"({' '.join(str(e).split())})", file=sys.stderr)
        return 2
    first = models[0] if models else {}
    model = args.served_model_name or args.model or first.get("id")
    if model is None:
        raise ValueError(f"the server at {base_url} serves no model")
    tokenizer_id, tokenizer = _load_tokenizer(args, first.get("root"))
    from vllm.benchmarks.datasets import get_samples

    samples = get_samples(args, tokenizer)
    if plan.chat:  # the chat API takes text
        samples = [replace(s, prompt=tokenizer.decode(s.prompt)) if isinstance(s.prompt, list)
                   else s for s in samples]
    span = len(samples) / args.request_rate
    if span > LONG_ARRIVAL_SPAN_S:
        print(f"WARNING: at {args.request_rate:g} requests/s the {len(samples)} requests "
              f"arrive over about {span:.3g} s")
    return asyncio.run(_run(args, plan, base_url, model, tokenizer_id, samples))


async def _run(args, plan: Plan, base_url: str, model: str, tokenizer_id: str,
               samples: list) -> int:
    from tqdm.auto import tqdm

    from vllm.benchmarks.serve_client import run_requests

    def send(batch: list, concurrency: int, **kw):
        return run_requests(plan.url, model, concurrency, [s.prompt for s in batch],
                            [s.expected_output_len for s in batch], args.ignore_eos,
                            plan.headers, chat=plan.chat, body_extra=plan.body_extra, **kw)

    await _test_and_warm_up(args, send, samples)
    print(f"Traffic request rate: {args.request_rate}")
    print(f"Burstiness factor: {args.burstiness}"
          f"{' (Poisson process)' if args.burstiness == 1.0 else ''}")
    print(f"Maximum request concurrency: {args.max_concurrency}")
    with tqdm(total=len(samples), disable=args.disable_tqdm, desc="Requests") as bar:
        results, start, duration = await send(samples, args.max_concurrency or len(samples),
                                       request_rate=args.request_rate,
                                       burstiness=args.burstiness, progress=bar, seed=args.seed)
    date = datetime.now().strftime("%Y%m%d-%H%M%S")
    result = {
        "date": date, "endpoint_type": args.backend, "backend": args.backend,
        "label": args.label, "model_id": model, "tokenizer_id": tokenizer_id,
        "num_prompts": len(samples), **plan.metadata,
        "request_rate": args.request_rate if args.request_rate < float("inf") else "inf",
        "burstiness": args.burstiness, "max_concurrency": args.max_concurrency,
        "duration": duration,
        **calculate_metrics(results, duration, samples, plan.percentiles, plan.goodput, start),
        **_per_request_lists(results, samples, start),
    }
    print_summary(result, plan, args)
    _save_result(args, result, model, date)
    return 0  # as vLLM, failed requests are reported, not an exit status


async def _test_and_warm_up(args: argparse.Namespace, send, samples: list) -> None:
    """One test request (ValueError when it fails: a wrong model, endpoint or dataset),
    then --num-warmups untimed ones."""
    print("Starting initial single prompt test run...")
    (test,), _, _ = await send(samples[:1], 1)
    if not test.ok:
        raise ValueError(f"the initial test request failed ({test.error}); check --model, "
                         "--endpoint, --backend and the dataset flags")
    print("Initial test run completed. Starting main benchmark run...")
    if args.num_warmups:
        print(f"Warming up with {args.num_warmups} requests...")
        await send([samples[i % len(samples)] for i in range(args.num_warmups)],
                   args.max_concurrency or args.num_warmups)
        print("Warmup run completed.")


def _per_request_lists(results: list, samples: list, start: float) -> dict:
    """The result's per-request lists (`DETAILED_KEYS`), in prompt order."""
    return {
        "input_lens": [r.prompt_tokens or s.prompt_len for r, s in zip(results, samples,
                                                                        strict=True)],
        "output_lens": [r.output_tokens for r in results],
        "ttfts": [r.ttft_s for r in results],
        "itls": [r.itl_s for r in results],
        "latencies": [r.e2e_s for r in results],
        "start_times": [r.start_s - start for r in results],
        "generated_texts": [r.text for r in results],
        "errors": [r.error for r in results],
    }


def _save_result(args: argparse.Namespace, result: dict, model: str, date: str) -> None:
    """Write the result where --output-json / --save-result / --append-result ask: without
    the per-request lists unless --save-detailed, non-finite numbers as 0."""
    saved = result if args.save_detailed else {
        k: v for k, v in result.items() if k not in DETAILED_KEYS}
    saved = {k: (0.0 if isinstance(v, float) and not math.isfinite(v) else v)
             for k, v in saved.items()}
    if args.output_json:
        write_json(args.output_json, saved)
    path = result_filename(args, model, date)
    if path is not None and args.append_result:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "a") as f:
            f.write(json.dumps(saved, allow_nan=False) + "\n")
    elif path is not None:
        write_json(path, saved)
