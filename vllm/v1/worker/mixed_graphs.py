"""`MixedBatchGraphs`: whole-step CUDA graphs for steps with prefill chunks, bucketed by tokens.

A decode step replays a decode graph (cuda_graph.py); a step with any prefill
chunk (a short prompt alone, or prompts beside decodes) used to run eagerly:
~200 kernel launches from Python on the SmolLM2 shape, 15 ms for a 7-token
prompt against a 0.63 ms decode step (issue 50). Such a step of n tokens over
r requests now replays the graph of the smallest token bucket T >= n, which
holds R = min(T, max_num_reqs) requests (r <= n <= T, so every step of n
tokens fits). Above the largest bucket, it runs eagerly.

    flat tokens     | r0: 7 tokens | r1: 1 | r2: 1 | pad ... pad |        n = 9, T = 16
                    pad: id 0, position 0, slot -1 (writes no KV)
    query_start_loc [0, 7, 8, 9, 9, 9, ..., 9]   (R + 1 entries: padded requests
                                                  own no token)
    seq_lens        [s0, s1, s2, 0, ..., 0]      (padded requests read no key)
    block_table     rows r..R unused (their seq_len is 0)
    hidden          replay(T)[:n]; the padded rows' hidden states are dropped

Full graphs, attention inside: the unified attention kernel takes its grid
and tiles from shapes and the host bounds max_query_len / max_seq_len, which a
capture fixes at (T, max_model_len), and reads query_start_loc, seq_lens, the
block table and the slot mapping from the runner's persistent buffers; rows
past query_start_loc[num_reqs] are zeroed, requests with seq_len 0 do nothing.
So one captured launch serves any varlen layout of the bucket (rejected: a
piecewise split with attention eager between captured layer pieces, which
keeps a launch and a Python call per layer, the cost we remove). A replay
always runs unified attention (the fresh-prompt kernel `prefill_attention`
is chosen on host values and starts at 128-token prompts, where launch
overhead matters less).

The graphs address the KV cache through the per-layer views, whose base
pointers never move: the extensible cache grows under them, no re-capture.
Capture runs inside the worker's measured warmup (`RunnerWarmup.capture_model`),
so the KV sizing sees the graphs' pool. Off with `--enforce-eager` or
`compilation_config={"cudagraph_mode": "FULL_DECODE_ONLY"}`.

Without CUDA graphs (`use_graphs` False) a step that fits is padded the same
way and run eagerly: what the CPU tests check (same tokens as the unpadded
step, padded rows write no KV).
"""

from __future__ import annotations

import bisect
from collections.abc import Callable

import torch

from vllm.v1.worker.cuda_graph import CUDAGraphManager


class MixedBatchGraphs:
    """The mixed-batch graphs and the bucket a step pads to.

    Args:
        capture_sizes: token buckets T; those above `max_num_tokens` are dropped;
            None: no buckets.
        max_num_reqs: most requests of a step (bucket T holds min(T, this)).
        max_num_tokens: the token buffers' length.
        forward: (R, max_query_len, T) -> hidden states [T, hidden_size] of R
            requests and T flat tokens of the persistent buffers (the runner's
            `_graph_forward`; called with max_query_len = T; the capture target:
            `RunnerWarmup` fills the buffers before capture, a step before a replay).
        use_graphs: capture and replay (CUDA); False pads and runs eagerly.
    """

    def __init__(self, capture_sizes: list[int] | None, max_num_reqs: int, max_num_tokens: int,
                 forward: Callable[[int, int, int], torch.Tensor], use_graphs: bool) -> None:
        self.sizes = sorted({s for s in capture_sizes or [] if 1 <= s <= max_num_tokens})
        self.max_num_reqs = max_num_reqs
        self.use_graphs = use_graphs
        self._forward = forward
        self.graphs = CUDAGraphManager(
            self.sizes if use_graphs else [],
            lambda t: forward(self.num_reqs(t), t, t),
            kind="mixed steps, sizes in tokens",
        )
        self.num_padded_steps = 0  # steps run through a bucket (replayed or eager); tests read it

    def num_reqs(self, num_tokens: int) -> int:
        """R: the requests bucket `num_tokens` holds."""
        return min(num_tokens, self.max_num_reqs)

    def bucket(self, num_tokens: int) -> int | None:
        """The bucket T a step of `num_tokens` tokens pads to, or None (eager: above the
        largest bucket, no buckets, or graphs not captured yet)."""
        if not self.sizes or (self.use_graphs and not self.graphs.captured):
            return None
        i = bisect.bisect_left(self.sizes, num_tokens)
        return self.sizes[i] if i < len(self.sizes) else None

    def run(self, size: int) -> torch.Tensor:
        """Hidden states [size, hidden_size] of the padded step in the buffers (a view of the
        graph's static output, rewritten by its next replay)."""
        self.num_padded_steps += 1
        if self.use_graphs:
            return self.graphs.replay(size)
        return self._forward(self.num_reqs(size), size, size)
