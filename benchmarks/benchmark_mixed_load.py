"""Ten minutes of mixed, hostile load on `vllm serve` (CPU or GPU), then a SIGTERM.

The "done when" of issue 17: concurrent streams, disconnects, malformed and
hostile bodies, long prompts and sleep/wake cycles against one server over
loopback (the load itself: tests/entrypoints/openai/mixed_load.py), then a
SIGTERM with requests in flight. It prints (and with --out writes) JSON:

    {"config": {...}, "statuses": {"kind status": count}, "violations": [...],
     "tracebacks": [...], "sleep_cycles": n, "shutdown": {"returncode", "exit_s"},
     "memory": {"rss_minus_vmm_mib_first", "..._last", "..._max", "..._min",
                "rss_minus_vmm_growth_ratio", "rss_mib_first", "rss_mib_last"},
     "samples": [{"t", "rss_mib", "vmm_resident_mib"}, ...]}

Pass: no violations (no 500, every body well formed, every stream ends with
[DONE]), no tracebacks, shutdown returncode 0, and RSS minus the resident bytes
of the VMM reservations (KV pages touched so far, the weight arena) flat after
the first minute: rss_minus_vmm_growth_ratio close to 1 while raw RSS may rise
as new KV blocks are first written.

Example:
    python benchmarks/benchmark_mixed_load.py --duration 600 --out $OUT/mixed_load.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.entrypoints.openai.mixed_load import MixedLoad
from tests.entrypoints.openai.utils import MODEL_NAME, RemoteServer
from vllm.benchmarks.utils import positive_int


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--duration", type=float, default=600.0, help="Seconds of load.")
    p.add_argument("--max-model-len", type=positive_int, default=2048,
                   help="The server's --max-model-len (default: %(default)s).")
    p.add_argument("--kv-cache-memory", default="1GiB",
                   help="The server's --kv-cache-memory-bytes (default: %(default)s).")
    p.add_argument("--sleep-period", type=float, default=60.0,
                   help="Seconds between sleep / wake_up cycles.")
    p.add_argument("--streamers", type=positive_int, default=8,
                   help="Clients streaming completions at once (default: %(default)s).")
    p.add_argument("--seed", type=int, default=0,
                   help="Seed of the load's choices (default: %(default)s).")
    p.add_argument("--server-arg", action="append", default=[],
                   help="Extra `vllm serve` argument (repeatable).")
    p.add_argument("--out", type=Path, default=None, help="Also write the JSON to this file.")
    args = p.parse_args(argv)
    server = RemoteServer(["--max-model-len", str(args.max_model_len), "--kv-cache-memory-bytes",
                           args.kv_cache_memory, "--enable-sleep-mode", "--shutdown-timeout", "2",
                           "--uvicorn-log-level", "warning", *args.server_arg])
    try:
        load = MixedLoad(server, MODEL_NAME, max_model_len=args.max_model_len,
                         sleep_period_s=args.sleep_period, seed=args.seed)
        report = asyncio.run(load.run(args.duration, streamers=args.streamers))
        asyncio.run(load.sigterm_with_requests_in_flight())
        load.collect_tracebacks()
    finally:
        server.stop(30)  # SIGTERM was sent above; SIGKILL when it hangs or the load failed
    result = {
        "config": {k: v for k, v in vars(args).items() if k != "out"},
        "statuses": dict(sorted(report.statuses.items())),
        "violations": report.violations,
        "tracebacks": report.tracebacks,
        "sleep_cycles": report.sleep_cycles,
        "shutdown": report.shutdown,
        "memory": report.leak_figures(),
        "samples": report.samples,
    }
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")
    server.close()  # removes its log
    return 0 if not report.violations and not report.tracebacks else 1


if __name__ == "__main__":
    sys.exit(main())
