"""Speculative decoding (ngram) vs none: accepted tokens per step and batch-1 decode speed-up.

    python benchmarks/benchmark_spec_decode.py --model /tmp/smollm2.gguf \
        --out benchmarks/results/spec.json

The bundled SmolLM2-135M-Instruct (real text), greedy, one request at a time,
on prompts that quote their input (a code edit, a summary with quotations, a
list continued): the case prompt lookup is for. Each mode runs in a fresh
process: `base` with async scheduling as the engine resolves it (on a GPU: on),
`spec` with it turned off (the synchronous spec path: drafts proposed on the
host), `spec_async` with it on (the default on a GPU since 2026-12-07: drafts
proposed, verified and fed on the device; see `resolve_async_scheduling`), so
that one run compares both spec paths; with `--async-scheduling` every mode
asks for it and `spec_async` is not run. Each mode reports which it got. Per
prompt: a warm-up generate (Triton compiles at a new prompt length are not
decode), then the prefill alone (max_tokens=1) and the whole generation;
decode tokens/s = (tokens - 1) / (t_all - t_prefill). Reported: decode
tokens/s for both, the speed-up (issue 50's target: >= 2x), the mean
acceptance length (tokens per verify step, vLLM's figure), decode tokens per
engine step (verify steps and steps without a draft), whether greedy outputs
were equal and what equality is guaranteed (`greedy_equality_guarantee`:
speculative decoding equals plain decoding up to numerics; exactly only in
fp32, see docs/design.md, "Speculative decoding and async scheduling",
and the speed-ups per prompt and over the prompts whose outputs every mode
shares (`speedup_on_equal_outputs`): in bf16 a near-tie may send one mode's
text elsewhere, and a longer or less quotable continuation then weighs on
that mode's figure alone.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

from common import emit

from vllm.benchmarks.utils import positive_int

CODE = '''def total_price(items, tax_rate):
    subtotal = 0
    for item in items:
        subtotal += item.price * item.quantity
    tax = subtotal * tax_rate
    return subtotal + tax


def total_weight(items):
    weight = 0
    for item in items:
        weight += item.weight * item.quantity
    return weight
'''
PASSAGE = (
    "The committee met on Tuesday to review the budget. The committee approved the budget "
    "for the new library, the budget for road repairs, and the budget for the summer "
    "festival. The committee rejected the budget for the new stadium."
)
MESSAGES = [
    f"Rename the variable `subtotal` to `net` in this code and return the whole code:\n\n{CODE}",
    f"Copy this text exactly, then add one sentence at the end:\n\n{PASSAGE}",
    f"Repeat the following code exactly, adding a docstring to each function:\n\n{CODE}",
    "Continue the list in the same format up to 20:\n1. apple\n2. banana\n3. cherry\n"
    "4. date\n5. elderberry\n6. fig",
]


def run_mode(model: str | None, k: int, max_tokens: int, spec: bool,
             async_scheduling: bool | None) -> dict:
    from vllm import LLM, SamplingParams

    cfg = {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": 2,
           "prompt_lookup_max": 5} if spec else None
    llm = LLM(model, max_model_len=2048, max_num_seqs=8, speculative_config=cfg,
              async_scheduling=async_scheduling)
    engine = llm.llm_engine
    step = engine.step
    counter = {"steps": 0}

    def counted_step():  # engine steps of the timed generations (tokens per step)
        counter["steps"] += 1
        return step()

    engine.step = counted_step
    prompts = [llm.render_chat([{"role": "user", "content": m}]) for m in MESSAGES]
    full = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    first = SamplingParams(temperature=0.0, max_tokens=1)
    per_prompt, outputs = [], []
    decode_tokens = decode_s = 0.0
    decode_steps = 0
    for prompt in prompts:
        llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)
        t0 = time.perf_counter()
        llm.generate(prompt, first, use_tqdm=False)
        t_prefill = time.perf_counter() - t0
        before = _spec(engine)
        steps = counter["steps"]
        t0 = time.perf_counter()
        out = llm.generate(prompt, full, use_tqdm=False)[0].outputs[0]
        t_all = time.perf_counter() - t0
        decode_steps += counter["steps"] - steps - 1  # the first step is the prefill
        after = _spec(engine)
        n = len(out.token_ids)
        outputs.append(list(out.token_ids))
        row = {"output_tokens": n, "decode_tokens_per_s": (n - 1) / max(t_all - t_prefill, 1e-9)}
        if after is not None:
            delta = after.minus(before)
            row["mean_acceptance_length"] = delta.mean_acceptance_length
            row["acceptance_rate"] = delta.acceptance_rate
            row["num_drafts"] = delta.num_drafts
        per_prompt.append(row)
        decode_tokens += n - 1
        decode_s += t_all - t_prefill
    config = engine.vllm_config
    result = {"spec": spec, "per_prompt": per_prompt, "outputs": outputs,
              "decode_tokens_per_s": decode_tokens / decode_s,
              "async_scheduling": bool(config.scheduler_config.async_scheduling),
              "dtype": str(config.model_config.dtype)}
    stats = _spec(engine)
    if stats is not None:
        result["mean_acceptance_length"] = stats.mean_acceptance_length
        result["num_accepted_tokens_per_pos"] = stats.num_accepted_tokens_per_pos
    result["decode_tokens_per_step"] = decode_tokens / max(decode_steps, 1)
    runner = engine.engine_core.worker.model_runner  # in-process (uni): graph replay counts
    result["decode_graph_replays"] = runner.cuda_graphs.num_replays
    verify = runner.verify_rows  # None without speculative decoding
    result["verify_graph_replays"] = verify.graphs.num_replays if verify is not None else 0
    engine.shutdown()
    return result


def _equality_guarantee(dtype: str) -> str:
    """What greedy equality between the two modes is promised in `dtype` (docs/design.md)."""
    if "float32" in dtype:
        return "exact (float32; tests/v1/spec_decode/test_spec_decode_cuda.py)"
    return (f"up to numerics in {dtype}: a token verified in a row of k + 1 is computed "
            "with other kernel shapes and reduction orders than decoded alone, so a near-tie "
            "of the top two logits may resolve differently; exact in float32")


def _spec(engine):
    stats = engine.get_scheduler_stats().spec_decoding_stats
    return None if stats is None else stats.copy()


def _compare(report: dict, modes: tuple[str, ...]) -> dict:
    """Speed-ups over `base`, over all prompts and over the prompts whose greedy outputs
    every mode shares (in bf16 a near-tie can turn one mode's text elsewhere, and a
    longer or less quotable continuation then weighs on its figure alone)."""
    base = report["base"]
    same = [i for i in range(len(base["outputs"]))
            if all(report[m]["outputs"][i] == base["outputs"][i] for m in modes)]

    def rate(mode: str, prompts: list[int]) -> float:
        rows = [report[mode]["per_prompt"][i] for i in prompts]
        tokens = sum(r["output_tokens"] - 1 for r in rows)
        seconds = sum((r["output_tokens"] - 1) / r["decode_tokens_per_s"] for r in rows)
        return tokens / max(seconds, 1e-9)

    spec = report["spec"]
    speedup = spec["decode_tokens_per_s"] / base["decode_tokens_per_s"]
    out = {
        "decode_speedup_batch1": speedup,
        "base_decode_tokens_per_s": base["decode_tokens_per_s"],
        "spec_decode_tokens_per_s": spec["decode_tokens_per_s"],
        "base_async_scheduling": base["async_scheduling"],
        "spec_async_scheduling": spec["async_scheduling"],
        "mean_acceptance_length": spec.get("mean_acceptance_length"),
        "spec_decode_tokens_per_step": spec["decode_tokens_per_step"],
        "greedy_outputs_equal": base["outputs"] == spec["outputs"],
        "greedy_equality_guarantee": _equality_guarantee(spec["dtype"]),
        "prompts_with_equal_outputs": same,
        "per_prompt_speedup": {m: [report[m]["per_prompt"][i]["decode_tokens_per_s"]
                                   / base["per_prompt"][i]["decode_tokens_per_s"]
                                   for i in range(len(base["outputs"]))] for m in modes[1:]},
        "targets": {"speedup_at_least_2x": speedup >= 2.0},
    }
    if same:
        out["speedup_on_equal_outputs"] = {m: rate(m, same) / rate("base", same)
                                           for m in modes[1:]}
    if "spec_async" in modes:
        fast = report["spec_async"]
        out["spec_async_decode_tokens_per_s"] = fast["decode_tokens_per_s"]
        out["spec_async_speedup"] = fast["decode_tokens_per_s"] / base["decode_tokens_per_s"]
        out["spec_async_greedy_outputs_equal"] = base["outputs"] == fast["outputs"]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="GGUF / HF dir (default: the bundled one)")
    parser.add_argument("--num-speculative-tokens", type=positive_int, default=4,
                        help="drafts per step of the spec mode (ngram prompt lookup)")
    parser.add_argument("--max-tokens", type=positive_int, default=256,
                        help="output tokens per prompt")
    parser.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction,
                        default=None,
                        help="ask every mode for async scheduling (then spec_async is not "
                             "run); by default base runs as the engine resolves it, spec "
                             "without it and spec_async with it")
    parser.add_argument("--out", default=None, help="also write the JSON here")
    parser.add_argument("--child", choices=["base", "spec"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        result = run_mode(args.model, args.num_speculative_tokens, args.max_tokens,
                          args.child == "spec", args.async_scheduling)
        print("RESULT " + json.dumps(result))
        return

    import torch

    report: dict = {
        "model": args.model or "bundled SmolLM2-135M-Instruct",
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "num_speculative_tokens": args.num_speculative_tokens,
        "max_tokens": args.max_tokens,
    }
    # "spec" turns async scheduling off (the synchronous spec path), "spec_async" asks
    # for it (the GPU default): both spec paths in one run. With --async-scheduling
    # every mode asks for it.
    modes = ("base", "spec") if args.async_scheduling else ("base", "spec", "spec_async")
    for mode in modes:
        cmd = [sys.executable, __file__, "--child", mode.split("_")[0],
               "--max-tokens", str(args.max_tokens),
               "--num-speculative-tokens", str(args.num_speculative_tokens)]
        if args.model:
            cmd += ["--model", args.model]
        if args.async_scheduling or mode == "spec_async":
            cmd.append("--async-scheduling")
        elif mode == "spec":  # the synchronous spec path (async is the GPU default)
            cmd.append("--no-async-scheduling")
        proc = subprocess.run(cmd, capture_output=True, text=True)
        lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
        if proc.returncode != 0 or not lines:
            report[mode] = {"crashed": True, "returncode": proc.returncode,
                            "stderr_tail": proc.stderr[-3000:]}
            continue
        report[mode] = json.loads(lines[-1][len("RESULT "):])
        sys.stderr.write(
            "\n".join(line for line in proc.stderr.splitlines() if "SpecDecoding" in line) + "\n"
        )
    if not any(report[mode].get("crashed") for mode in modes):
        report["comparison"] = _compare(report, modes)
    for mode in modes:
        report[mode].pop("outputs", None)
    emit(report, args.out)


if __name__ == "__main__":
    main()
