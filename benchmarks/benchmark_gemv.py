"""Skinny projections: the Triton GEMV (`layers/ops/gemv.py`) against cuBLAS, per launch (CUDA).

For each projection shape of the Llama-3-8B and SmolLM2-135M models and each
row count (1, 8, 16), times one launch inside a CUDA graph with the weight read
from HBM (the graph cycles through enough copies of it, >= 160 MiB, that L2
holds none), for `F.linear` (cuBLAS) and for the GEMV at its default tile and
at every tile of a sweep. Prints the best tile per case and, for each time,
the weight bytes over it as a fraction of the device's copy bandwidth measured
in the same run (`frac_of_copy_bw`: 1.0 is the physical limit).

    python benchmarks/benchmark_gemv.py --out benchmarks/results/gemv.json
    python benchmarks/benchmark_gemv.py --no-sweep          # default tile vs cuBLAS only
    python benchmarks/benchmark_gemv.py --prologue          # fused norm / SiLU, one row

`--prologue` times instead, at one row and the default tile, the GEMV with its
norm or SiLU prologue (`gemv_rms_norm`, `gemv_silu_and_mul`) against the two
launches it replaces (the Triton RMSNorm with the residual add, or SiLU-and-mul,
then the GEMV): `fused_us`, `separate_us` and `saved_us` per projection.
"""

from __future__ import annotations

import argparse
import itertools

from benchmark_decode_primitives import PROJECTIONS, _weights, graph_us
from common import copy_bandwidth_bytes_per_s, emit

from vllm.benchmarks.utils import positive_int

SWEEP = {
    "block_n": (8, 16, 32, 64),
    "block_k": (256, 512, 1024, 2048),
    "num_warps": (4, 8),
    "num_stages": (1, 3),
}


def _case(name: str, k: int, n: int, rows: tuple[int, ...], sweep: bool, bw: float) -> dict:
    import torch
    import torch.nn.functional as F

    from vllm.model_executor.layers.ops.gemv import GemvConfig, default_config, gemv

    ws = _weights(n, k)
    frac = lambda us: round(n * k * 2 / (us * 1e-6) / bw, 3)
    out = {"copies": len(ws)}
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for m in rows:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        ref = F.linear(x, ws[0]).float()
        cublas = graph_us([lambda w=w, x=x: F.linear(x, w) for w in ws])
        cfg = default_config(m, n, k, sms)
        err = (gemv(x, ws[0], config=cfg).float() - ref).abs().max().item()
        dflt = graph_us([lambda w=w, x=x, c=cfg: gemv(x, w, config=c) for w in ws])
        row = {"cublas_us": cublas, "cublas_frac": frac(cublas),
               "default": {**cfg.__dict__, "us": dflt, "frac": frac(dflt)},
               "max_abs_diff_vs_cublas": err}
        if sweep:
            best = None
            for bn, bk, nw, ns in itertools.product(*SWEEP.values()):
                if bk > 16384 // bn * 4 or (m > 1 and bn < 16):
                    continue  # register-spilling tiles; tl.dot needs N >= 16
                c = GemvConfig(bn, bk, nw, ns)
                try:
                    us = graph_us([lambda w=w, x=x, c=c: gemv(x, w, config=c) for w in ws])
                except Exception as e:  # a tile Triton cannot compile
                    print(f"{name} m{m} {c}: {type(e).__name__}", flush=True)
                    continue
                if best is None or us < best["us"]:
                    best = {**c.__dict__, "us": us, "frac": frac(us)}
            row["best"] = best
        out[f"m{m}"] = row
        print(name, m, row, flush=True)
    del ws
    torch.cuda.empty_cache()
    return out


# projection -> its prologue: the norm before qkv / gate_up, SiLU-and-mul before down.
PROLOGUES = {"smollm2_qkv": "norm", "smollm2_gate_up": "norm", "smollm2_down": "silu",
             "llama3_8b_qkv": "norm", "llama3_8b_gate_up": "norm", "llama3_8b_down": "silu"}


def _prologue_case(name: str, k: int, n: int, bw: float) -> dict:
    import torch

    from vllm.model_executor.layers.ops.activation import silu_and_mul
    from vllm.model_executor.layers.ops.gemv import gemv, gemv_rms_norm, gemv_silu_and_mul
    from vllm.model_executor.layers.ops.rms_norm import fused_add_rms_norm

    ws = _weights(n, k)
    dev, dt = "cuda", torch.bfloat16
    if PROLOGUES[name] == "norm":
        x, res = torch.randn(1, k, device=dev, dtype=dt), torch.randn(1, k, device=dev, dtype=dt)
        nw = torch.rand(k, device=dev, dtype=dt) + 0.5
        fused = [lambda w=w: gemv_rms_norm(x, res, nw, 1e-5, w) for w in ws]
        separate = [lambda w=w: gemv(fused_add_rms_norm(x, res, nw, 1e-5)[0], w) for w in ws]
        err = (fused[0]()[0].float() - separate[0]().float()).abs().max().item()
    else:
        x = torch.randn(1, 2 * k, device=dev, dtype=dt)
        fused = [lambda w=w: gemv_silu_and_mul(x, w) for w in ws]
        separate = [lambda w=w: gemv(silu_and_mul(x), w) for w in ws]
        err = (fused[0]().float() - separate[0]().float()).abs().max().item()
    fused_us, separate_us = graph_us(fused), graph_us(separate)
    row = {"prologue": PROLOGUES[name], "copies": len(ws), "fused_us": fused_us,
           "separate_us": separate_us, "saved_us": round(separate_us - fused_us, 3),
           "fused_frac_of_copy_bw": round(n * k * 2 / (fused_us * 1e-6) / bw, 3),
           "max_abs_diff_vs_separate": err}
    print(name, row, flush=True)
    del ws
    torch.cuda.empty_cache()
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shapes", nargs="+", choices=list(PROJECTIONS), default=list(PROJECTIONS),
                        help="projection shapes (model_projection; default: all)")
    parser.add_argument("--rows", nargs="+", type=positive_int, default=[1, 8, 16],
                        help="rows (tokens) per launch, one case each")
    parser.add_argument("--no-sweep", action="store_true", help="default tile and cuBLAS only")
    parser.add_argument("--prologue", action="store_true",
                        help="one row: the fused norm / SiLU prologue against two launches")
    parser.add_argument("--out", default=None, help="also write the JSON here")
    args = parser.parse_args()

    import torch

    if not torch.cuda.is_available():
        raise SystemExit("benchmark_gemv needs a CUDA GPU; nothing measured")
    bw = copy_bandwidth_bytes_per_s()
    if args.prologue:
        cases = {name: _prologue_case(name, *PROJECTIONS[name], bw)
                 for name in args.shapes if name in PROLOGUES}
    else:
        cases = {name: _case(name, *PROJECTIONS[name], tuple(args.rows), not args.no_sweep, bw)
                 for name in args.shapes}
    emit({"device": torch.cuda.get_device_name(), "copy_bw_tb_per_s": round(bw / 1e12, 3),
          "cases": cases}, args.out)


if __name__ == "__main__":
    main()
