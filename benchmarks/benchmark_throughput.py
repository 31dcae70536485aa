"""Offline generation throughput against transformers' generate() in the same run.

For each model shape (random weights, so no checkpoint is needed) and batch
size, on `LLM`'s engine stepped one step at a time (`vllm.benchmarks.timing`):
TTFT (until every request of the batch has its first token) and the steady
decode (median step, decode tokens/s) apart, plus the whole run's output
tokens/s against `transformers` `generate()` on the same shape, dtype and
device. Each timed batch follows a warm-up of the same batch size, prompt and
output length (every shape it launches was seen before; `warmup_ttft_s` is
that first batch's TTFT); both use fresh random tokens, so prefix caching
finds nothing (`prefix_cache_hit_tokens` is 0). The decode step is compared
with the bandwidth limit: (weight bytes + the KV bytes the batch reads) /
measured device copy bandwidth.

    python benchmarks/benchmark_throughput.py --shapes smollm2 llama3_8b \
        --batch-sizes 1 32 --out benchmarks/results/throughput.json

`--scheduling sync async` runs every shape twice, without and with async
scheduling (the engine's default is async on CUDA), and reports the decode
step of each and `async_step_speedup` (sync step / async step). `ours` is the
first mode's result. `--gemv on plain off` likewise runs each mode with the
one-row Triton GEMV as the engine runs it (`on`: `layers/linear.py`, with the
norm / SiLU fused in as its prologue for small weights, `layers/fused_linear.py`),
with the GEMV but the norm and SiLU launched apart (`plain`), and with cuBLAS
for every projection (`off`), reported under `by_gemv`.

Targets on the H200 (issues 4 and 10): >= 10x the peer at batch 32 for both
shapes; 8B decode >= 0.85 of the limit at batch 1, >= 0.80 at batch 32.
"""

from __future__ import annotations

import argparse
import gc
import time

from common import SHAPES, copy_bandwidth_bytes_per_s, emit, model_dir_for

from vllm.benchmarks.utils import positive_int

# --scheduling choice -> LLM(async_scheduling=...); None = the engine's default.
SCHEDULING = {"default": None, "sync": False, "async": True}


def _prompts(batch: int, input_len: int, vocab: int, seed: int = 0) -> list[dict]:
    from vllm.benchmarks.timing import random_token_prompts

    return random_token_prompts(batch, input_len, vocab, seed)


def kv_bytes_per_token(hf_config, dtype_bytes: int = 2) -> int:
    """K and V of one token over every layer: 2 x layers x kv heads x head dim x dtype bytes."""
    heads = hf_config.num_attention_heads
    kv_heads = getattr(hf_config, "num_key_value_heads", None) or heads
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads
    return 2 * hf_config.num_hidden_layers * kv_heads * head_dim * dtype_bytes


def bench_ours(
    model_dir: str, batches: list[int], input_len: int, output_len: int,
    async_scheduling: bool | None = None,
) -> dict:
    """TTFT and steady decode of each batch, timed after a warm-up of the same shape.

    The warm-up runs the same batch size, prompt length and output length as
    the timed run (so every prefill and decode shape it launches was seen
    before), on different random tokens; the timed prompts are fresh as well,
    so prefix caching finds nothing (`prefix_cache_hit_tokens` says so) and
    the timed prefill is the whole prompt.
    """
    import torch

    from vllm import LLM, SamplingParams
    from vllm.benchmarks.timing import time_batch

    extra = {"max_num_seqs": max(batches)} if max(batches) > 256 else {}  # default: 256
    llm = LLM(
        model_dir, load_format="dummy", dtype="bfloat16",
        max_model_len=input_len + output_len + 16, async_scheduling=async_scheduling, **extra,
    )
    scheduling = "async" if llm.llm_engine.vllm_config.scheduler_config.async_scheduling else "sync"
    config = llm.llm_engine.vllm_config.model_config
    vocab = config.get_vocab_size()
    weight_bytes = llm.llm_engine.engine_core.worker.weights_bytes
    params = SamplingParams(max_tokens=output_len, temperature=0, ignore_eos=True)
    results = {}
    for index, batch in enumerate(batches):
        warm = time_batch(llm, _prompts(batch, input_len, vocab, seed=2 * index + 1), params)
        timed = time_batch(llm, _prompts(batch, input_len, vocab, seed=2 * index + 2), params)
        results[batch] = {
            **timed.to_dict(),
            # Whole run (prefill included), comparable with transformers' figure.
            "tokens_per_s": timed.output_tokens / timed.total_s,
            "seconds": timed.total_s,
            "warmup_ttft_s": warm.ttft_s,  # the first batch of this shape (compiles show here)
        }
    llm.llm_engine.shutdown()
    del llm
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return {"batches": results, "weight_bytes": weight_bytes, "scheduling": scheduling,
            "kv_bytes_per_token": kv_bytes_per_token(config.hf_config)}


def decode_limits(ours: dict, bandwidth: float, input_len: int, output_len: int) -> dict:
    """Each batch's decode step against the bandwidth limit of the bytes it must read.

    limit_ms = (weight bytes + KV bytes read) / copy bandwidth, where a step of
    batch B reads B x (mean context = input_len + output_len / 2) tokens of KV.
    """
    out = {}
    for batch, r in ours["batches"].items():
        kv = batch * (input_len + output_len / 2) * ours["kv_bytes_per_token"]
        limit_ms = 1e3 * (ours["weight_bytes"] + kv) / bandwidth
        step = r["decode_step_ms_median"]
        out[batch] = {"limit_step_ms": limit_ms, "decode_step_ms": step,
                      "ratio_to_limit": limit_ms / step if step else 0.0}
    return out


def bench_transformers(model_dir: str, batches: list[int], input_len: int, output_len: int) -> dict:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_dir)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    results = {}
    for batch in batches:
        ids = torch.tensor(
            [p["prompt_token_ids"] for p in _prompts(batch, input_len, config.vocab_size)],
            device="cuda",
        )
        model.generate(ids[:1], max_new_tokens=4, do_sample=False)  # warm
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = model.generate(
            ids, max_new_tokens=output_len, min_new_tokens=output_len, do_sample=False
        )
        torch.cuda.synchronize()
        seconds = time.perf_counter() - t0
        tokens = (out.shape[1] - input_len) * batch
        results[batch] = {
            "seconds": seconds,
            "output_tokens": tokens,
            "tokens_per_s": tokens / seconds,
        }
    del model
    gc.collect()
    torch.cuda.empty_cache()
    return {"batches": results}


def _summary(ours: dict, bandwidth: float, args) -> dict:
    """One scheduling mode's decode step, tokens/s, TTFT and ratio to the limit, per batch."""
    limits = decode_limits(ours, bandwidth, args.input_len, args.output_len)
    return {
        "scheduling": ours["scheduling"],
        "batches": {
            b: {"decode_step_ms_median": r["decode_step_ms_median"],
                "decode_tokens_per_s": r["decode_tokens_per_s"], "ttft_s": r["ttft_s"],
                "ratio_to_limit": limits[b]["ratio_to_limit"]}
            for b, r in ours["batches"].items()
        },
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shapes", nargs="+", default=["smollm2", "llama3_8b"],
                        choices=list(SHAPES), help="model shapes (random weights, bf16)")
    parser.add_argument("--batch-sizes", nargs="+", type=positive_int, default=[1, 32],
                        help="prompts generated together, one timed batch each")
    parser.add_argument("--input-len", type=positive_int, default=128,
                        help="prompt tokens (random ids)")
    parser.add_argument("--output-len", type=positive_int, default=128,
                        help="output tokens per prompt (EOS ignored)")
    parser.add_argument("--no-peer", action="store_true", help="skip transformers")
    parser.add_argument("--scheduling", nargs="+", choices=list(SCHEDULING), default=["default"],
                        help="engine runs per shape: the default, sync (--no-async-scheduling) "
                             "and/or async (--async-scheduling)")
    parser.add_argument("--gemv", nargs="+", choices=["on", "plain", "off"], default=["on"],
                        help="one-row projections through the Triton GEMV as the engine runs "
                             "them (on), without the fused norm / SiLU prologue (plain), "
                             "and/or cuBLAS (off); one engine run each")
    parser.add_argument("--out", default=None, help="also write the JSON here")
    args = parser.parse_args()

    import torch

    from vllm.model_executor.layers import fused_linear, linear

    if not torch.cuda.is_available():
        raise SystemExit("benchmark_throughput needs a CUDA GPU")
    bandwidth = copy_bandwidth_bytes_per_s()
    report = {
        "device": torch.cuda.get_device_name(),
        "input_len": args.input_len,
        "output_len": args.output_len,
        "copy_bandwidth_bytes_per_s": bandwidth,
        "shapes": {},
    }
    for shape in args.shapes:
        model_dir = model_dir_for(shape)
        default_rows = linear.GEMV_MAX_ROWS
        default_fused = fused_linear.FUSED_GEMV_MAX_WEIGHT_BYTES
        by_gemv = {}
        for gemv in args.gemv:
            linear.GEMV_MAX_ROWS = default_rows if gemv != "off" else 0
            fused_linear.FUSED_GEMV_MAX_WEIGHT_BYTES = default_fused if gemv == "on" else 0
            by_gemv[gemv] = {
                mode: bench_ours(model_dir, args.batch_sizes, args.input_len, args.output_len,
                                 SCHEDULING[mode])
                for mode in args.scheduling
            }
        linear.GEMV_MAX_ROWS = default_rows
        fused_linear.FUSED_GEMV_MAX_WEIGHT_BYTES = default_fused
        runs = by_gemv[args.gemv[0]]
        ours = runs[args.scheduling[0]]
        entry = {"ours": ours}
        if len(by_gemv) > 1:
            entry["by_gemv"] = {
                g: {m: _summary(r, bandwidth, args) for m, r in mode_runs.items()}
                for g, mode_runs in by_gemv.items()
            }
        if len(runs) > 1:
            entry["by_scheduling"] = {m: _summary(r, bandwidth, args) for m, r in runs.items()}
        if "sync" in runs and "async" in runs:
            entry["async_step_speedup"] = {
                b: runs["sync"]["batches"][b]["decode_step_ms_median"]
                / runs["async"]["batches"][b]["decode_step_ms_median"]
                for b in args.batch_sizes
            }
        limit_s = ours["weight_bytes"] / bandwidth
        entry["bandwidth_limit_tokens_per_s_batch1"] = 1 / limit_s
        entry["decode_vs_bandwidth_limit"] = decode_limits(
            ours, bandwidth, args.input_len, args.output_len
        )
        if 1 in ours["batches"]:
            entry["batch1_ratio_to_bandwidth_limit"] = ours["batches"][1]["tokens_per_s"] * limit_s
        if not args.no_peer:
            peer = bench_transformers(model_dir, args.batch_sizes, args.input_len, args.output_len)
            entry["transformers"] = peer
            entry["ratio_to_transformers"] = {
                b: ours["batches"][b]["tokens_per_s"] / peer["batches"][b]["tokens_per_s"]
                for b in args.batch_sizes
            }
        report["shapes"][shape] = entry
    emit(report, args.out)


if __name__ == "__main__":
    main()
