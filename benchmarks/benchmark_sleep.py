"""Sleep / wake latency and memory freed, against deleting the engine and building a new one.

    python benchmarks/benchmark_sleep.py --shape llama3_8b --out benchmarks/results/sleep.json

Reports, for levels 1 and 2: seconds to sleep and to wake (level 2 includes
reloading the weights), device memory freed while asleep, and whether greedy
output after waking equals output before; and for the peer a user would
otherwise pick (shut the engine down, build a new one): teardown and start-up
seconds, measured in the same run.
"""

from __future__ import annotations

import argparse
import gc
import time

from common import SHAPES, emit, model_dir_for


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", default="llama3_8b", choices=list(SHAPES),
                        help="model shape (random weights)")
    parser.add_argument("--out", default=None, help="also write the JSON here")
    args = parser.parse_args()

    import torch

    from vllm import LLM, SamplingParams

    if not torch.cuda.is_available():
        raise SystemExit("benchmark_sleep needs a CUDA GPU")
    model_dir = model_dir_for(args.shape)
    kwargs = dict(load_format="dummy", dtype="bfloat16", max_model_len=4096, enable_sleep_mode=True)
    prompts = [{"prompt_token_ids": list(range(3, 3 + n))} for n in (16, 200, 1000)]
    params = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)

    def tokens(llm):
        return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]

    free_start, total = torch.cuda.mem_get_info()
    t0 = time.perf_counter()
    llm = LLM(model_dir, **kwargs)
    startup_s = time.perf_counter() - t0
    reference = tokens(llm)
    report: dict = {"shape": args.shape, "device": torch.cuda.get_device_name(), "levels": {}}
    for level in (1, 2):
        torch.cuda.synchronize()
        free_awake = torch.cuda.mem_get_info()[0]
        t0 = time.perf_counter()
        llm.sleep(level=level)
        torch.cuda.synchronize()
        sleep_s = time.perf_counter() - t0
        free_asleep = torch.cuda.mem_get_info()[0]
        t0 = time.perf_counter()
        llm.wake_up()
        if level == 2:
            llm.reload_weights()
        torch.cuda.synchronize()
        wake_s = time.perf_counter() - t0
        report["levels"][level] = {
            "sleep_s": sleep_s,
            "wake_s": wake_s,
            "freed_bytes": free_asleep - free_awake,
            "held_while_asleep_bytes": free_start - free_asleep,
            "outputs_identical_after_wake": tokens(llm) == reference,
        }
    t0 = time.perf_counter()
    llm.llm_engine.shutdown()
    del llm
    gc.collect()
    torch.cuda.empty_cache()
    teardown_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    rebuilt = LLM(model_dir, **kwargs)
    rebuild_s = time.perf_counter() - t0
    report["rebuilt_outputs_identical"] = tokens(rebuilt) == reference
    report["peer_delete_and_rebuild"] = {
        "teardown_s": teardown_s,
        "startup_s": rebuild_s,
        "first_startup_s": startup_s,
        "total_s": teardown_s + rebuild_s,
    }
    report["ratio_wake1_to_rebuild"] = report["levels"][1]["wake_s"] / rebuild_s
    report["total_bytes"] = total
    emit(report, args.out)


if __name__ == "__main__":
    main()
