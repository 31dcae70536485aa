"""Registers, spills, shared memory and K/V buffers of the attention kernel, without a GPU.

Question: what does Triton make of each tile config the engine can select on an
H200 (sm_90) - does a config spill, how many programs fit an SM, did the
pipeliner give the K/V tiles one buffer or two - before device minutes are
spent timing it? Compiles `_unified_attention_kernel` for GPUTarget("cuda", 90,
32) on any machine (Triton's NVIDIA backend ships ptxas), reads the registers
and the stack frame (spills) off the cubin with the `cuobjdump` beside that
ptxas, the shared memory from the compile metadata, and counts the K and V
buffers in the TTGIR's `local_alloc`s of the key tile's shape.

    python benchmarks/kernel_resources.py [--shape llama3_8b] [--out FILE]

Each reachable config (`attention_config.reachable_configs` at max_model_len
8192, 132 SMs) is compiled with the constexprs its launch passes
(`unified_attention.kernel_constexprs`) and pointer / stride arguments marked
16-divisible, as the launcher's real tensors are. Use the device's Triton for
figures to trust (3.6 on the H200: `pip install --target DIR triton==3.6.0`,
then `PYTHONPATH=DIR`): with it 1308477's split decode tile read 124 registers
here, where the H200 reported 122 for 2026-12-02's kernel; Triton 3.9 allocates
far fewer.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
from pathlib import Path

from common import emit

SHAPES = {"llama3_8b": (32, 8, 128), "smollm2": (9, 3, 64)}  # heads, kv heads, head size
SM90_REGISTERS = 65536  # per SM
SM90_SHARED_BYTES = 232448  # per SM, the most a CTA may opt in to (227 KiB)


def _cuobjdump() -> str:
    import triton.backends.nvidia as nvidia

    return str(Path(nvidia.__file__).parent / "bin" / "cuobjdump")


def compile_report(cfg, heads: tuple[int, int, int], block_size: int = 16) -> dict:
    """Compile one config for sm_90 and read its resources (no GPU needed)."""
    import torch
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from vllm.v1.attention.ops.unified_attention import _unified_attention_kernel, kernel_constexprs

    num_heads, num_kv_heads, head_size = heads
    kernel = _unified_attention_kernel
    names = kernel.arg_names
    const = kernel_constexprs(cfg, num_heads // num_kv_heads, head_size, block_size,
                              torch.bfloat16)
    signature = {}
    for name in names:
        if name in const:
            signature[name] = "constexpr"
        elif name.startswith("ws_"):
            signature[name] = "*fp32"
        elif name in ("query_start_loc_ptr", "seq_lens_ptr", "block_table_ptr", "counters_ptr"):
            signature[name] = "*i32"
        elif name.endswith("_ptr"):
            signature[name] = "*bf16"
        else:
            signature[name] = "fp32" if name == "scale_log2" else "i32"
    aligned = [n for n in names if signature[n].startswith("*") or n.startswith("stride")]
    src = ASTSource(
        fn=kernel, signature=signature,
        constexprs={(names.index(k),): v for k, v in const.items()},
        attrs={(names.index(n),): [["tt.divisibility", 16]] for n in aligned},
    )
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": cfg.num_warps, "num_stages": cfg.num_stages})
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        usage = subprocess.run([_cuobjdump(), "--dump-resource-usage", f.name],
                               capture_output=True, text=True, check=True).stdout
    registers = int(re.search(r"REG:(\d+)", usage).group(1))
    stack = int(re.search(r"STACK:(\d+)", usage).group(1))
    shared = compiled.metadata.shared
    key_tile = f"x{cfg.block_n}x{const['HEAD_PAD']}xbf16"
    buffers = re.findall(rf"local_alloc : \(\) -> !ttg.memdesc<(\d+){key_tile}",
                         compiled.asm["ttgir"])
    threads = 32 * cfg.num_warps
    per_sm = min(SM90_REGISTERS // (registers * threads),
                 SM90_SHARED_BYTES // shared if shared else 64)
    return {"registers": registers, "spill_stack_bytes": stack, "shared_bytes": shared,
            "kv_tile_buffers": sorted({int(b) for b in buffers}), "programs_per_sm": per_sm}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=list(SHAPES), default="llama3_8b",
                        help="the model's attention layout: heads, KV heads, head size "
                             "(default: %(default)s)")
    parser.add_argument("--out", help="also write the JSON here")
    args = parser.parse_args(argv)
    import torch
    import triton

    from vllm.v1.attention.ops.attention_config import reachable_configs

    heads = SHAPES[args.shape]
    configs = reachable_configs(
        num_kv_heads=heads[1], queries_per_kv=heads[0] // heads[1], head_size=heads[2],
        dtype=torch.bfloat16, sm_count=132, max_num_tokens=8192, max_model_len=8192,
    )
    rows = []
    for query_len, cfg in configs:
        row = {"query_len": query_len, "config": cfg.__dict__.copy(),
               **compile_report(cfg, heads)}
        rows.append(row)
        print(row, file=sys.stderr, flush=True)
    emit({"triton": triton.__version__, "target": "sm_90", "shape": args.shape,
          "heads": heads, "configs": rows}, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
