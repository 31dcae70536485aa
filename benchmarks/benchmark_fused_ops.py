"""What the fused elementwise kernels save at the Llama-3-8B shape, measured in one run.

Question: a bf16 Llama-3-8B decode step at batch 1 replays its graph in 6.2 ms
against a 3.8 ms weight-bandwidth limit; the gap is ~30 small elementwise
kernels per layer. How long do RMSNorm (+ residual), rotary embedding and
SiLU-and-mul take fused (one Triton launch each) against the torch code they
replace, at T = 1, 32 and 8192 tokens, and how close do the fused kernels come
to the device's copy bandwidth?

    python benchmarks/benchmark_fused_ops.py [--out FILE] [--dtype bfloat16]
    TRITON_INTERPRET=1 python benchmarks/benchmark_fused_ops.py --smoke   # CPU: code path only

Shape: hidden 4096, 32 query heads, 8 KV heads, head 128, intermediate 14336,
llama3 rope (theta 5e5, max position 131072); query/key are slices of one qkv
row as in the model.

Prints one JSON document (and writes it to --out):
  copy_bandwidth     bytes_per_s of dst.copy_(src) of a 1 GiB buffer, bytes = 2 x size
                     (read + write; common.copy_bandwidth, the convention of
                     benchmark_attention too), mean of 20 copies between CUDA events
  ops[op][T]         fused_us, torch_us (per call), speedup = torch / fused,
                     bytes = what the op must read and write once:
                       rms_norm (with residual)  4 x T x hidden x s + hidden x s
                       rotary                    2 x T x (32 + 8) x 128 x s + T x 128 x 4 + T x 8
                       silu_and_mul              3 x T x 14336 x s        (s = dtype bytes)
                     fused_bytes_per_s, fused_ratio_to_copy
  decode_t1_model    T = 1 summed over 32 layers x (2 rms_norm + rotary + silu_and_mul):
                     fused_ms, torch_ms, saved_ms
Times: one CUDA graph holding CALLS back-to-back calls (what a decode replay
runs), replayed REPLAYS times between CUDA events, divided by the calls. Inputs
stay in L2 for the small T, as activations mostly do between nodes of a step;
at T = 1 the time is the per-node cost, not bandwidth.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass

import torch
from common import (  # puts the checkout on sys.path
    add_smoke_flag,
    copy_bandwidth_bytes_per_s,
    emit,
    no_gpu_message,
    smoke_env_problem,
)

from vllm.model_executor.layers.activation import SiluAndMul
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.layers.rotary_embedding import get_rope

LLAMA3_SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


@dataclass(frozen=True)
class Plan:
    """What to measure; SMOKE runs the same code on tiny shapes under the interpreter."""

    device: str
    hidden: int
    heads: tuple[int, int, int]  # num_heads, num_kv_heads, head_size
    intermediate: int
    max_position: int
    tokens: tuple[int, ...]
    num_layers: int
    calls: int  # back-to-back calls captured in one graph
    replays: int


GPU = Plan("cuda", 4096, (32, 8, 128), 14336, 131072, (1, 32, 8192), 32, 20, 10)
SMOKE = Plan("cpu", 64, (4, 2, 16), 96, 256, (1, 3), 2, 1, 1)


def time_per_call_us(fn, plan: Plan) -> float:
    """Mean microseconds per fn() call, measured as described in the module docstring."""
    if plan.device == "cpu":
        fn()
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e6
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):  # compile and warm the allocator outside the capture
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(plan.calls):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(plan.replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    us = start.elapsed_time(end) * 1e3 / (plan.replays * plan.calls)
    del graph
    torch.cuda.empty_cache()
    return us


def op_cases(plan: Plan, dtype: torch.dtype, num_tokens: int) -> dict:
    """op -> (fused fn, torch fn, bytes moved) on fresh inputs of T = num_tokens."""
    device, hidden = plan.device, plan.hidden
    num_heads, num_kv_heads, head_size = plan.heads
    size = dtype.itemsize
    gen = torch.Generator(device=device).manual_seed(num_tokens)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, device=device).to(dtype)

    norm = RMSNorm(hidden, 1e-5).to(dtype).to(device)
    x, residual = randn(num_tokens, hidden), randn(num_tokens, hidden)
    rope = get_rope(head_size, head_size, plan.max_position, 5e5, LLAMA3_SCALING).to(device)
    q_size, kv_size = num_heads * head_size, num_kv_heads * head_size
    qkv = randn(num_tokens, q_size + 2 * kv_size)
    query, key, _ = qkv.split([q_size, kv_size, kv_size], dim=-1)
    positions = torch.randint(0, plan.max_position, (num_tokens,), generator=gen, device=device)
    act, gate_up = SiluAndMul(), randn(num_tokens, 2 * plan.intermediate)
    rope_bytes = 2 * (q_size + kv_size) * size + head_size * 4 + 8
    return {
        "rms_norm": (
            lambda: norm.forward_cuda(x, residual),
            lambda: norm.forward_native(x, residual),
            4 * num_tokens * hidden * size + hidden * size,
        ),
        "rotary": (
            lambda: rope.forward_cuda(positions, query, key),
            lambda: rope.forward_native(positions, query, key),
            num_tokens * rope_bytes,
        ),
        "silu_and_mul": (
            lambda: act.forward_cuda(gate_up),
            lambda: act.forward_native(gate_up),
            3 * num_tokens * plan.intermediate * size,
        ),
    }


def measure(plan: Plan, dtype: torch.dtype) -> dict:
    copy_bps = copy_bandwidth_bytes_per_s() if plan.device == "cuda" else None
    ops: dict[str, dict[str, dict]] = {}
    for num_tokens in plan.tokens:
        for op, (fused, reference, nbytes) in op_cases(plan, dtype, num_tokens).items():
            fused_us = time_per_call_us(fused, plan)
            torch_us = time_per_call_us(reference, plan)
            bps = nbytes / (fused_us * 1e-6)
            ops.setdefault(op, {})[str(num_tokens)] = {
                "fused_us": round(fused_us, 3),
                "torch_us": round(torch_us, 3),
                "speedup": round(torch_us / fused_us, 2),
                "bytes": nbytes,
                "fused_bytes_per_s": bps,
                "fused_ratio_to_copy": None if copy_bps is None else round(bps / copy_bps, 3),
            }
    first = str(plan.tokens[0])

    def per_model_ms(key: str) -> float:
        layer_us = 2 * ops["rms_norm"][first][key] + sum(
            ops[op][first][key] for op in ("rotary", "silu_and_mul")
        )
        return round(plan.num_layers * layer_us / 1e3, 3)

    fused_ms, torch_ms = per_model_ms("fused_us"), per_model_ms("torch_us")
    return {
        "device": torch.cuda.get_device_name() if plan.device == "cuda" else "cpu",
        "dtype": str(dtype).removeprefix("torch."),
        "shape": {
            "hidden": plan.hidden,
            "heads": list(plan.heads),
            "intermediate": plan.intermediate,
            "tokens": list(plan.tokens),
        },
        "copy_bandwidth": {"bytes_per_s": copy_bps},
        "ops": ops,
        f"decode_t{first}_model": {
            "num_layers": plan.num_layers,
            "fused_ms": fused_ms,
            "torch_ms": torch_ms,
            "saved_ms": round(torch_ms - fused_ms, 3),
        },
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", help="also write the JSON here")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"],
                        help="dtype of the activations and weights (default: %(default)s)")
    add_smoke_flag(parser)
    args = parser.parse_args(argv)
    if args.smoke:
        problem = smoke_env_problem("benchmark_fused_ops")
        if problem is not None:
            print(problem, file=sys.stderr)
            return 2
        plan = SMOKE
    elif not torch.cuda.is_available():
        print(no_gpu_message("benchmark_fused_ops"))
        return 0
    else:
        plan = GPU
    result = measure(plan, getattr(torch, args.dtype))
    if args.smoke:
        result["smoke"] = "tiny shapes on the CPU interpreter: the numbers mean nothing"
    emit(result, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
