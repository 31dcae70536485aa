"""Offline decode speed on the CPU: vLLM's thread rules vs torch's default thread count.

Issue 17 saw the offline `LLM` on a loaded 2-core machine take 5-9 s for 8
tokens with torch's default threads and 0.6-0.8 s with OMP_NUM_THREADS=1.
This script runs the same generation in fresh processes, alternating:

    rules:  VLLM_CPU_OMP_THREADS_BIND=auto (the default: a team of one thread
            per physical core the process may use, as many computing as other
            processes leave idle; before issue 48: one core reserved)
    peer:   VLLM_CPU_OMP_THREADS_BIND=nobind (torch's default count)

and prints JSON {"rules": {"threads", "seconds": [...], "median_s"}, "peer": {...},
"speedup": peer median / rules median}. Run it on a quiet machine and again
beside a load (e.g. `--load 2` starts two busy processes) to see both cases.

Example:
    python benchmarks/benchmark_cpu_threads.py --reps 3 --load 2 --out $OUT/cpu_threads.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

from common import ROOT, emit

from vllm.benchmarks.utils import non_negative_int, positive_int

_CHILD = """
import json, time, torch
from vllm import LLM, SamplingParams
llm = LLM(max_model_len=256, max_num_seqs=4, max_num_batched_tokens=256,
          kv_cache_memory_bytes=64 << 20)
params = SamplingParams(max_tokens={tokens}, temperature=0, ignore_eos=True)
llm.generate(["Warm up"], SamplingParams(max_tokens=2), use_tqdm=False)
start = time.perf_counter()
llm.generate(["The capital of France is"], params, use_tqdm=False)
print(json.dumps({{"threads": torch.get_num_threads(), "seconds": time.perf_counter() - start}}))
"""
_BUSY = "while True: pass"


def _run(bind: str, tokens: int) -> dict:
    env = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": bind}
    env.pop("OMP_NUM_THREADS", None)
    out = subprocess.run([sys.executable, "-c", _CHILD.format(tokens=tokens)], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=900, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=positive_int, default=8,
                   help="Tokens each timed generation decodes (default: %(default)s).")
    p.add_argument("--reps", type=positive_int, default=3,
                   help="Fresh processes per setting, alternating; the median is reported "
                        "(default: %(default)s).")
    p.add_argument("--load", type=non_negative_int, default=0,
                   help="Busy-looping processes to run beside (default: %(default)s).")
    p.add_argument("--out", type=Path, default=None, help="Also write the JSON to this file.")
    args = p.parse_args(argv)
    load = [subprocess.Popen([sys.executable, "-c", _BUSY]) for _ in range(args.load)]
    runs: dict[str, list[dict]] = {"rules": [], "peer": []}
    try:
        for _ in range(args.reps):
            runs["rules"].append(_run("auto", args.tokens))
            runs["peer"].append(_run("nobind", args.tokens))
    finally:
        for proc in load:
            proc.kill()
            proc.wait()
    result: dict = {"config": {k: v for k, v in vars(args).items() if k != "out"},
                    "cpus_allowed": len(os.sched_getaffinity(0))}
    for name, items in runs.items():
        seconds = [r["seconds"] for r in items]
        result[name] = {"threads": items[0]["threads"], "seconds": seconds,
                        "median_s": statistics.median(seconds)}
    result["speedup"] = result["peer"]["median_s"] / result["rules"]["median_s"]
    emit(result, args.out, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
