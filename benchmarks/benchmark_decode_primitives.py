"""The decode step's building blocks, each timed inside a CUDA graph: what a launch costs (CUDA).

Questions behind issue 10's decode targets, answered per launch with weights
read from HBM (each case cycles through enough copies of its weight, >= 160
MiB, that L2 holds none of them):

  projections     one row (and 8, 32) through F.linear, torch.mv, x @ W.t()
                  and a K-major copy of the weight, for the Llama-3-8B and
                  SmolLM2-135M projection shapes; `tb_per_s_best_m1` = weight
                  bytes / the fastest one-row time
  fused           RMSNorm + projection and SiLU-and-mul + projection
                  (`layers/ops/norm_linear.py`) against cuBLAS plus the
                  separate norm / SiLU launch, SmolLM2 shapes, 1 and 16 rows
  skinny          Llama-3-8B projections at 16 and 32 rows through cuBLAS in
                  other forms: cuBLASLt preferred (`linear_cublaslt`, as the
                  engine calls it), the rows padded to 64, the
                  swapped product W x^T, and split-K by hand (a bmm over K
                  chunks, then a sum); `max_abs_diff` against F.linear
  blas_rows       cuBLAS against cuBLASLt (`linear_cublaslt`) at 1-256
                  rows for every projection and lm_head shape of both models,
                  and the one-row Triton GEMV (`ops/gemv.py`) for the lm_heads
  argmax          greedy argmax over [B, vocab] logits: torch on float32, on
                  the bf16 logits converted first (the sampler's old path) and
                  on bf16 as is; `triton_bf16` / `triton_float32`: the chunked
                  argmax of `vllm/v1/sample/ops/argmax.py`
  graph_launch    host time of one `CUDAGraph.replay()` (median of 30, no
                  profiler) and device time, for graphs of 1-900 nodes of a
                  Triton kernel, a cuBLAS GEMM and a torch elementwise op

Every time is the mean over the nodes of a graph replayed 5 times (us).

    python benchmarks/benchmark_decode_primitives.py --out benchmarks/results/decode_primitives.json
"""

from __future__ import annotations

import argparse
import math
import time

from common import emit

# (in_features K, out_features N) of one rank's projections.
PROJECTIONS = {
    "llama3_8b_qkv": (4096, 6144), "llama3_8b_o": (4096, 4096),
    "llama3_8b_gate_up": (4096, 28672), "llama3_8b_down": (14336, 4096),
    "smollm2_qkv": (576, 960), "smollm2_gate_up": (576, 3072),
    "smollm2_down": (1536, 576), "smollm2_o": (576, 576),
}
LM_HEADS = {"llama3_8b_lm_head": (4096, 128256), "smollm2_lm_head": (576, 49152)}
BLAS_ROWS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 128, 256)
L2_DEFEAT_BYTES = 160 << 20


def graph_us(fns, replays: int = 5) -> float:
    """Mean device microseconds per call of `fns` (one captured graph of all of them,
    replayed `replays` times after one untimed replay)."""
    import torch

    for f in fns[:2]:
        f()  # compile / pick kernels outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for f in fns:
            f()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return round(start.elapsed_time(end) / replays / len(fns) * 1e3, 2)


def _weights(n: int, k: int, budget: int = L2_DEFEAT_BYTES):
    import torch

    copies = max(2, min(200, math.ceil(budget / (n * k * 2))))
    return [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * k**-0.5
            for _ in range(copies)]


def projections() -> dict:
    import torch
    import torch.nn.functional as F

    out = {}
    for name, (k, n) in PROJECTIONS.items():
        ws = _weights(n, k)
        row = {"copies": len(ws)}
        for m in (1, 8, 32):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            row[f"linear_m{m}"] = graph_us([lambda w=w, x=x: F.linear(x, w) for w in ws])
            if m == 1:
                row["mv_m1"] = graph_us([lambda w=w, x=x: torch.mv(w, x[0]) for w in ws])
                row["x_wt_m1"] = graph_us([lambda w=w, x=x: torch.matmul(x, w.t()) for w in ws])
        kmajor = [w.t().contiguous() for w in ws]  # [K, N]
        del ws
        for m in (1, 32):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            row[f"kmajor_m{m}"] = graph_us([lambda w=w, x=x: torch.mm(x, w) for w in kmajor])
        best = min(v for key, v in row.items() if key.endswith("_m1"))
        row["tb_per_s_best_m1"] = round(n * k * 2 / (best * 1e-6) / 1e12, 2)
        out[name] = row
        del kmajor
        torch.cuda.empty_cache()
    return out


def fused() -> dict:
    import torch
    import torch.nn.functional as F

    from vllm.model_executor.layers.ops.activation import silu_and_mul
    from vllm.model_executor.layers.ops.norm_linear import rms_norm_linear, silu_and_mul_linear
    from vllm.model_executor.layers.ops.rms_norm import fused_add_rms_norm

    bf16 = torch.bfloat16
    out = {}
    for name, (k, n) in (("qkv", (576, 960)), ("gate_up", (576, 3072)), ("down", (1536, 576))):
        ws = _weights(n, k)
        for m in (1, 16):
            if name == "down":
                x = torch.randn(m, 2 * k, device="cuda", dtype=bf16)
                row = {
                    "cublas": graph_us([lambda w=w, g=x[:, :k]: F.linear(g, w) for w in ws]),
                    "silu": graph_us([lambda x=x: silu_and_mul(x)] * len(ws)),
                    "fused": graph_us([lambda w=w, x=x: silu_and_mul_linear(x, w) for w in ws]),
                }
                row["unfused"] = round(row["cublas"] + row["silu"], 2)
            else:
                x = torch.randn(m, k, device="cuda", dtype=bf16)
                res = torch.randn(m, k, device="cuda", dtype=bf16)
                nw = torch.randn(k, device="cuda", dtype=bf16)
                row = {
                    "cublas": graph_us([lambda w=w, x=x: F.linear(x, w) for w in ws]),
                    "norm": graph_us([lambda x=x, r=res, nw=nw: fused_add_rms_norm(x, r, nw, 1e-5)]
                                     * len(ws)),
                    "fused": graph_us([lambda w=w, x=x, r=res, nw=nw:
                                       rms_norm_linear(x, r, nw, 1e-5, w) for w in ws]),
                }
                row["unfused"] = round(row["cublas"] + row["norm"], 2)
            row["fused_over_unfused"] = round(row["fused"] / row["unfused"], 3)
            out[f"smollm2_{name}_m{m}"] = row
        del ws
        torch.cuda.empty_cache()
    return out


def skinny() -> dict:
    import torch
    import torch.nn.functional as F

    from vllm.model_executor.layers.linear import linear_cublaslt

    out = {}
    for name in ("llama3_8b_qkv", "llama3_8b_o", "llama3_8b_gate_up", "llama3_8b_down"):
        k, n = PROJECTIONS[name]
        ws = _weights(n, k)
        for m in (16, 32):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            ref = F.linear(x, ws[0]).float()
            row = {"linear": graph_us([lambda w=w, x=x: F.linear(x, w) for w in ws])}
            row["cublaslt"] = graph_us([lambda w=w, x=x: linear_cublaslt(x, w, None) for w in ws])
            x64 = torch.randn(64, k, device="cuda", dtype=torch.bfloat16)
            row["rows_padded_64"] = graph_us([lambda w=w, x=x64: F.linear(x, w) for w in ws])
            row["swapped_w_xt"] = graph_us([lambda w=w, x=x: torch.mm(w, x.t()) for w in ws])
            for s in (2, 4):
                xs = x.view(m, s, k // s).transpose(0, 1)  # [s, M, K/s], no copy

                def split_k(w, xs=xs, s=s, n=n, k=k):
                    return torch.bmm(xs, w.view(n, s, k // s).permute(1, 2, 0)).sum(0)

                row[f"split_k{s}"] = graph_us([lambda w=w: split_k(w) for w in ws])
                row[f"split_k{s}_max_abs_diff"] = round(
                    (split_k(ws[0]).float() - ref).abs().max().item(), 4)
            row["bytes_mb"] = round(n * k * 2 / 1e6, 1)
            out[f"{name}_m{m}"] = row
        del ws
        torch.cuda.empty_cache()
    return out


def blas_rows() -> dict:
    import torch
    import torch.nn.functional as F

    from vllm.model_executor.layers.linear import linear_cublaslt
    from vllm.model_executor.layers.ops.gemv import gemv

    out = {}
    for name, (k, n) in {**PROJECTIONS, **LM_HEADS}.items():
        ws = _weights(n, k)
        row = {}
        for m in BLAS_ROWS:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            cublas = graph_us([lambda w=w, x=x: F.linear(x, w) for w in ws])
            lt = graph_us([lambda w=w, x=x: linear_cublaslt(x, w, None) for w in ws])
            row[f"m{m}"] = {"cublas": cublas, "cublaslt": lt,
                            "lt_over_cublas": round(lt / cublas, 3)}
            if m == 1 and name in LM_HEADS:
                row["m1"]["gemv"] = graph_us([lambda w=w, x=x: gemv(x, w) for w in ws])
        out[name] = row
        del ws
        torch.cuda.empty_cache()
    return out


def argmax() -> dict:
    import torch

    from vllm.v1.sample.ops.argmax import greedy_argmax

    out = {}
    for vocab in (49152, 128256):
        for batch in (1, 32):
            logits = torch.randn(batch, vocab, device="cuda")
            half = logits.to(torch.bfloat16)
            out[f"v{vocab}_b{batch}"] = {
                "float32": graph_us([lambda lg=logits: lg.argmax(dim=-1)] * 50),
                "bf16_to_float32": graph_us([lambda lg=half: lg.float().argmax(dim=-1)] * 50),
                "bf16": graph_us([lambda lg=half: lg.argmax(dim=-1)] * 50),
                "triton_bf16": graph_us([lambda lg=half: greedy_argmax(lg)] * 50),
                "triton_float32": graph_us([lambda lg=logits: greedy_argmax(lg)] * 50),
            }
            assert torch.equal(greedy_argmax(half), half.float().argmax(dim=-1))
    return out


def graph_launch() -> dict:
    import torch
    import torch.nn.functional as F

    from vllm.model_executor.layers.ops.rms_norm import fused_add_rms_norm

    bf16 = torch.bfloat16
    x = torch.randn(1, 576, device="cuda", dtype=bf16)
    r, nw = torch.randn_like(x), torch.ones(576, device="cuda", dtype=bf16)
    w = torch.randn(64, 576, device="cuda", dtype=bf16)
    y = torch.zeros(1024, device="cuda")
    kinds = {"triton_rms_norm": lambda: fused_add_rms_norm(x, r, nw, 1e-5),
             "cublas_linear": lambda: F.linear(x, w), "torch_add_": lambda: y.add_(1.0)}
    out = {}
    for kind, fn in kinds.items():
        for nodes in (1, 30, 300, 900):
            fn()
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                for _ in range(nodes):
                    fn()
            graph.replay()
            torch.cuda.synchronize()
            host = []
            for _ in range(30):
                t0 = time.perf_counter()
                graph.replay()
                host.append(time.perf_counter() - t0)
                torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            graph.replay()
            end.record()
            torch.cuda.synchronize()
            out[f"{kind}_{nodes}"] = {"host_us_median": round(sorted(host)[15] * 1e6, 1),
                                      "device_us": round(start.elapsed_time(end) * 1e3, 1)}
            del graph
    return out


SECTIONS = {"projections": projections, "fused": fused, "skinny": skinny,
            "blas_rows": blas_rows, "argmax": argmax,
            "graph_launch": graph_launch}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sections", nargs="+", choices=list(SECTIONS), default=list(SECTIONS),
                        help="which measurements to run (see above; default: all)")
    parser.add_argument("--out", default=None, help="also write the JSON here")
    args = parser.parse_args()

    import torch

    if not torch.cuda.is_available():
        raise SystemExit("benchmark_decode_primitives needs a CUDA GPU; nothing measured")
    emit({"device": torch.cuda.get_device_name(),
          **{name: SECTIONS[name]() for name in args.sections}}, args.out)


if __name__ == "__main__":
    main()
