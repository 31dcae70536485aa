"""Offline generation throughput against transformers' generate() in the same run.

For each model shape (random weights, so no checkpoint is needed) and batch
size: output tokens/s of `LLM.generate` (greedy, fixed input and output
lengths, EOS ignored) and of `transformers` `generate()` on the same model
shape, dtype and device. For batch-1 decode also the ratio to the bandwidth
limit: weight bytes / measured device copy bandwidth is the least time a
token can take when every weight is read once per token.

    python benchmarks/benchmark_throughput.py --shapes smollm2 llama3_8b \
        --batch-sizes 1 32 --out results/throughput.json

Targets on the H200 (issue 4): >= 10x the peer at batch 32 for both shapes;
batch-1 decode of the 8B shape >= 0.7 of the bandwidth limit.
"""

from __future__ import annotations

import argparse
import gc
import time

from common import copy_bandwidth_bytes_per_s, emit, model_dir_for


def _prompts(batch: int, input_len: int, vocab: int) -> list[dict]:
    import random

    rng = random.Random(0)
    return [
        {"prompt_token_ids": [rng.randrange(3, vocab) for _ in range(input_len)]}
        for _ in range(batch)
    ]


def bench_ours(model_dir: str, batches: list[int], input_len: int, output_len: int) -> dict:
    import torch

    from vllm import LLM, SamplingParams

    llm = LLM(
        model_dir, load_format="dummy", dtype="bfloat16", max_model_len=input_len + output_len + 16
    )
    vocab = llm.llm_engine.vllm_config.model_config.get_vocab_size()
    weight_bytes = llm.llm_engine.engine_core.worker.weights_bytes
    params = SamplingParams(max_tokens=output_len, temperature=0, ignore_eos=True)
    results = {}
    for batch in batches:
        prompts = _prompts(batch, input_len, vocab)
        llm.generate(prompts[: min(batch, 4)], params, use_tqdm=False)  # warm
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - t0
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        # Time per output token at batch 1 excludes nothing: the prefill of
        # input_len tokens is part of the wall time (it is ~1 % of it).
        results[batch] = {
            "seconds": seconds,
            "output_tokens": tokens,
            "tokens_per_s": tokens / seconds,
        }
    llm.llm_engine.shutdown()
    del llm
    gc.collect()
    torch.cuda.empty_cache()
    return {"batches": results, "weight_bytes": weight_bytes}


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shapes", nargs="+", default=["smollm2", "llama3_8b"])
    parser.add_argument("--batch-sizes", nargs="+", type=int, default=[1, 32])
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--no-peer", action="store_true", help="skip transformers")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    import torch

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
        ours = bench_ours(model_dir, args.batch_sizes, args.input_len, args.output_len)
        entry = {"ours": ours}
        limit_s = ours["weight_bytes"] / bandwidth
        entry["bandwidth_limit_tokens_per_s_batch1"] = 1 / limit_s
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
