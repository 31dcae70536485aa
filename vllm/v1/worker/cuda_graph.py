"""Full CUDA graphs for decode-only batches (and verify and mixed batches: their owners).

One graph per capture size B (a decode batch of B requests, one token each;
the runner's second manager: B requests of k + 1 tokens each).
A decode batch of n <= max(B) requests is padded to the next captured size;
padded requests have seq_len 0 and slot -1, so they read and write nothing.
Mixed batches (any prefill) replay a third kind, captured per token bucket
(`MixedBatchGraphs`, mixed_graphs.py), or run eagerly above its largest bucket.

A decode graph also runs the sampling head on its B rows: `compute_logits`
and the greedy argmax (`DecodeGraphOutput`). When every row of the step
samples (a decode step; a one-token prefill chunk that does not sample sends
the runner to the eager lm_head), the step's logits need no eager lm_head
launch, and an all-greedy batch takes its ids from the graph (SmolLM2 shape on
the H200: the step's host work halves, docs/benchmarks.md, issue 10). Padded
rows' logits are computed and ignored.

The graphs read every per-step value from persistent buffers (input ids,
positions, slot mapping, sequence lengths, block table) and address the KV
cache through the per-layer views, whose base pointers never move: the
extensible cache grows under the same addresses, so graphs captured against
a small committed prefix stay valid after the growth and are never
re-captured. `CUDAGraphManager.num_captures` counts captures so tests can
prove that.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from tqdm.auto import tqdm

from vllm.logger import init_logger

logger = init_logger(__name__)


@dataclass(frozen=True)
class DecodeGraphOutput:
    """What a decode graph of B rows leaves in its static buffers (rewritten by its next
    replay: copy what must outlive the step)."""

    hidden: torch.Tensor  # [B, hidden_size] the last layer's hidden states
    logits: torch.Tensor  # [B, vocab_size] compute_logits of every row, the model's dtype
    greedy: torch.Tensor  # [B] int64 the argmax of each row of `logits`

    def rows(self, n: int) -> DecodeGraphOutput:
        """The first n rows (views)."""
        return DecodeGraphOutput(self.hidden[:n], self.logits[:n], self.greedy[:n])


class CUDAGraphManager:
    """Captures and replays the model forward at fixed decode batch sizes.

    Args:
        capture_sizes: batch sizes (requests = tokens) to capture.
        forward: runs the model on the first B rows of the persistent buffers
            under a forward context whose metadata also covers B rows, and
            returns what `replay` gives back: hidden states [B x tokens per
            row, hidden_size] (verify graphs) or a `DecodeGraphOutput`.
        kind: what a row is, for the progress bar and the log ("decode",
            "verify, k + 1 = 5 tokens per request").
    """

    # Total graphs captured in this process; tests read it.
    num_captures: int = 0

    def __init__(self, capture_sizes: list[int], forward: Callable[[int], Any],
                 kind: str = "decode") -> None:
        self.capture_sizes = sorted(set(capture_sizes))
        self.kind = kind
        self._forward = forward
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._outputs: dict[int, Any] = {}
        self.pool_bytes = 0
        self.num_replays = 0  # of this manager's graphs; tests read it

    @property
    def captured(self) -> bool:
        return bool(self._graphs)

    def padded_size(self, num_reqs: int) -> int | None:
        """The captured size a decode batch of `num_reqs` pads to, or None."""
        if not self._graphs:
            return None
        i = bisect.bisect_left(self.capture_sizes, num_reqs)
        return self.capture_sizes[i] if i < len(self.capture_sizes) else None

    def capture(self) -> None:
        """Capture every size, largest first, sharing one memory pool.

        Raises:
            RuntimeError: if graphs were already captured (they never need
                re-capturing; capturing twice would leak the first pool).
        """
        if self._graphs:
            raise RuntimeError("CUDA graphs are already captured")
        free_before = torch.cuda.mem_get_info()[0]
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream()
        # A bar, as vLLM shows one: capture takes seconds to minutes on big models.
        sizes = tqdm(list(reversed(self.capture_sizes)), unit="size",
                     desc=f"Capturing CUDA graphs ({self.kind})")
        for size in sizes:
            # Warm up once outside the graph so lazy initialisation (Triton
            # compilation, cuBLAS workspaces) is not captured.
            self._forward(size)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool, stream=stream):
                out = self._forward(size)
            self._graphs[size] = graph
            self._outputs[size] = out
            CUDAGraphManager.num_captures += 1
        # A graph not uploaded explicitly is uploaded to the device at its first
        # launch: launch each once here, on the capture's inputs (rows address
        # block 1, slot -1: nothing is written to the cache), so that no request
        # pays it (issue 10: no one-time cost on the request path).
        for graph in self._graphs.values():
            graph.replay()
        torch.cuda.synchronize()
        self.pool_bytes = max(0, free_before - torch.cuda.mem_get_info()[0])
        logger.info(
            "Captured %d CUDA graphs (%s) for batch sizes %s (%.2f GiB)",
            len(self._graphs),
            self.kind,
            self.capture_sizes,
            self.pool_bytes / 2**30,
        )

    def replay(self, size: int) -> Any:
        """Replay the graph of `size`; returns its static outputs (see `forward`)."""
        self._graphs[size].replay()
        self.num_replays += 1
        return self._outputs[size]
