"""Decode step time of a JSON-schema-constrained batch against the same batch unconstrained.

A batch of `--batch-size` short prompts decodes `--output-len` tokens (greedy,
ignore_eos) twice on one engine: without a constraint and with a JSON schema
(an array of objects with enum, integer, boolean and string fields, at least
`--output-len` items long, so the grammar is active on every token). Reports
the wall time per engine step of each (best of `--repeats` runs after a
warm-up run that also compiles the grammar) and their ratio: the issue's
target is <= 1.10 on the Llama-3-8B shape at batch 32. Also reports how long
the one compile took in the pool (`cold_first_run_s` against `wall_s`) and that
the measured runs compiled nothing (the grammar cache answered).

    python benchmarks/benchmark_structured_outputs.py --shape llama3_8b --batch-size 32 \
        --out benchmarks/results/structured_outputs_h100.json

`--backend guidance` measures llguidance instead of xgrammar (the engine's
`--structured-outputs-config` backend).

Random weights (`load_format="dummy"`): the mask decides the structure, the
model picks among what it allows.
"""

from __future__ import annotations

import argparse
import json
import random
import time

from common import SHAPES, emit, model_dir_for

from vllm.benchmarks.utils import positive_int


def schema(min_items: int) -> dict:
    item = {"type": "object", "properties": {
        "kind": {"enum": ["alpha", "beta", "gamma"]}, "count": {"type": "integer"},
        "ok": {"type": "boolean"}, "note": {"type": "string", "maxLength": 12}},
        "required": ["kind", "count", "ok", "note"]}
    return {"type": "array", "items": item, "minItems": min_items}


def run(llm, prompts, params, repeats: int) -> dict:
    scheduler = llm.llm_engine.engine_core.scheduler
    steps = [0]
    schedule = scheduler.schedule

    def counting_schedule():
        steps[0] += 1
        return schedule()

    scheduler.schedule = counting_schedule
    runs = []
    try:
        for _ in range(repeats + 1):  # the first run warms up (and compiles the grammar)
            steps[0] = 0
            start = time.perf_counter()
            outputs = llm.generate(prompts, params, use_tqdm=False)
            runs.append({"steps": steps[0], "wall_s": time.perf_counter() - start})
    finally:
        scheduler.schedule = schedule
    best = min(runs[1:] or runs, key=lambda r: r["wall_s"] / r["steps"])
    return {"steps": best["steps"], "wall_s": best["wall_s"],
            "ms_per_step": 1e3 * best["wall_s"] / best["steps"],
            "cold_first_run_s": runs[0]["wall_s"],
            "output_tokens": sum(len(o.outputs[0].token_ids) for o in outputs),
            "sample_output": outputs[0].outputs[0].text[:160]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", default="llama3_8b", choices=list(SHAPES),
                        help="model shape, random weights")
    parser.add_argument("--batch-size", type=positive_int, default=32,
                        help="requests decoding together")
    parser.add_argument("--input-len", type=positive_int, default=16, help="prompt tokens")
    parser.add_argument("--output-len", type=positive_int, default=128, help="output tokens")
    parser.add_argument("--repeats", type=positive_int, default=3,
                        help="measured runs each; the best is reported")
    parser.add_argument("--backend", default="xgrammar", choices=["xgrammar", "guidance"],
                        help="structured-output backend (guidance = llguidance)")
    parser.add_argument("--out", default=None, help="also write the JSON here")
    args = parser.parse_args()

    from vllm import LLM, SamplingParams
    from vllm.sampling_params import StructuredOutputsParams

    llm = LLM(model_dir_for(args.shape), load_format="dummy",
              max_model_len=args.input_len + args.output_len + 16,
              max_num_seqs=args.batch_size,
              structured_outputs_config={"backend": args.backend})
    vocab = llm.llm_engine.vllm_config.model_config.get_vocab_size()
    rng = random.Random(0)
    prompts = [{"prompt_token_ids": [rng.randrange(3, vocab) for _ in range(args.input_len)]}
               for _ in range(args.batch_size)]
    plain = SamplingParams(max_tokens=args.output_len, temperature=0, ignore_eos=True)
    constrained = SamplingParams(
        max_tokens=args.output_len, temperature=0, ignore_eos=True,
        # Compact: a random model would otherwise stay in the whitespace before the
        # first value, never exercising the structure.
        structured_outputs=StructuredOutputsParams(json=json.dumps(schema(args.output_len)),
                                                   disable_any_whitespace=True))
    compiler = llm.llm_engine.engine_core.grammar_compiler
    unconstrained = run(llm, prompts, plain, args.repeats)
    compiles_before = compiler.num_compiles
    grammar = run(llm, prompts, constrained, args.repeats)
    report = {
        "shape": args.shape, "backend": args.backend, "batch_size": args.batch_size,
        "input_len": args.input_len,
        "output_len": args.output_len, "unconstrained": unconstrained, "json_schema": grammar,
        "step_ratio_constrained_to_unconstrained":
            grammar["ms_per_step"] / unconstrained["ms_per_step"],
        "target_ratio": 1.10,
        # One compile (the warm-up run's); the measured runs took the cached grammar.
        "grammar_compiles": compiler.num_compiles - compiles_before,
    }
    llm.llm_engine.shutdown()
    emit(report, args.out)


if __name__ == "__main__":
    main()
