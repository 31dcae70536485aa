"""`RunnerWarmup`: the runner's start-up passes, which the Worker drives (gpu_worker.py).

    profile          dummy_run(with_kv=False), dummy_sampler_run     peak activations
    warmup           dummy_run(with_kv=True) of the worst case, the sampler,
                     warm_up_kernels (every attention variant), a one-token
                     dummy_run and warm_up_logits (lm_head at every row count)
    capture_model    the decode graphs, the verify graphs (spec decoding), then the
                     mixed-batch graphs (steps with prefill chunks, by token bucket)

None of them is a step: they run the model on the runner's persistent buffers
with made-up inputs whose rows address only the null block and block 1 (the
only KV blocks committed for sure), and leave the block table clean.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from vllm.forward_context import set_forward_context
from vllm.sampling_params import MAX_LOGPROBS, SamplingParams
from vllm.v1.attention.backends.abstract import AttentionMetadata
from vllm.v1.sample.metadata import build_sampling_metadata
from vllm.v1.sample.ops.bitmask import apply_bitmask
from vllm.v1.sample.sampler import Sampler, argmax_rows
from vllm.v1.worker.cuda_graph import CUDAGraphManager
from vllm.v1.worker.draft_model import attention_layers

if TYPE_CHECKING:
    from vllm.v1.worker.block_table import BlockTable
    from vllm.v1.worker.draft_model import DraftModelProposer
    from vllm.v1.worker.mixed_graphs import MixedBatchGraphs
    from vllm.v1.worker.step_buffers import StepBuffers
    from vllm.v1.worker.verify_rows import VerifyRows


class RunnerWarmup:
    """Dummy forwards, kernel warm-up and graph capture over the runner's state.

    Args:
        model: the target model (forward(input_ids, positions), compute_logits).
        draft: the draft model's proposer (its forward runs beside the target's), or None.
        buffers, block_table: the runner's persistent inputs (rewritten in place).
        sampler: the runner's sampler.
        decode_graphs: the decode graphs; `verify_rows`: the verify graphs, or None;
            `mixed`: the mixed-batch graphs (none captured when it has no sizes).
        device: the model's device.
        vocab_size, block_size, max_model_len, max_num_tokens: as the runner's.
        use_cuda_graph: whether to capture (CUDA with capture sizes).
    """

    def __init__(self, model: torch.nn.Module, draft: DraftModelProposer | None,
                 buffers: StepBuffers, block_table: BlockTable, sampler: Sampler,
                 decode_graphs: CUDAGraphManager, verify_rows: VerifyRows | None,
                 mixed: MixedBatchGraphs, *,
                 device: torch.device, vocab_size: int, block_size: int, max_model_len: int,
                 max_num_tokens: int, use_cuda_graph: bool) -> None:
        self.model = model
        self.draft = draft
        self.buffers = buffers
        self.block_table = block_table
        self.sampler = sampler
        self.decode_graphs = decode_graphs
        self.verify_rows = verify_rows
        self.mixed = mixed
        self.device = device
        self.vocab_size = vocab_size
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.max_num_tokens = max_num_tokens
        self.use_cuda_graph = use_cuda_graph

    def dummy_run(self, num_tokens: int, num_reqs: int, with_kv: bool) -> torch.Tensor:
        """Forward `num_tokens` tokens split over `num_reqs` requests.

        With `with_kv` the requests read and write KV block 1 (only the null
        block and block 1 need to be committed); without, attention is
        skipped (the memory-profiling run before the cache exists).
        Returns hidden states [num_tokens, hidden_size]. Raises ValueError past
        max_model_len tokens a request (keys beyond its block-table row).
        """
        if -(-num_tokens // num_reqs) > self.max_model_len:
            raise ValueError(f"{num_tokens} dummy tokens over {num_reqs} requests exceed "
                             f"max_model_len={self.max_model_len} per request")
        num_sched = np.full(num_reqs, num_tokens // num_reqs, dtype=np.int64)
        num_sched[: num_tokens % num_reqs] += 1
        buf, table = self.buffers, self.block_table.device_tensor
        metadata = None
        if with_kv:
            buf.query_start_loc_np[0] = 0
            buf.query_start_loc_np[1 : num_reqs + 1] = np.cumsum(num_sched)
            buf.seq_lens_np[:num_reqs] = num_sched
            buf.query_start_loc[: num_reqs + 1].copy_(buf.query_start_loc_cpu[: num_reqs + 1])
            buf.seq_lens[:num_reqs].copy_(buf.seq_lens_cpu[:num_reqs])
            table[:num_reqs].fill_(1)
            buf.slot_mapping[:num_tokens].fill_(self.block_size)  # slot 0 of block 1
            metadata = AttentionMetadata(
                num_actual_tokens=num_tokens,
                max_query_len=int(num_sched.max()),
                query_start_loc=buf.query_start_loc[: num_reqs + 1],
                max_seq_len=int(num_sched.max()),
                seq_lens=buf.seq_lens[:num_reqs],
                block_table=table[:num_reqs],
                slot_mapping=buf.slot_mapping[:num_tokens],
                query_start_loc_cpu=buf.query_start_loc_cpu[: num_reqs + 1],
                seq_lens_cpu=buf.seq_lens_cpu[:num_reqs],
                no_cached_context=True,
            )
        buf.input_ids[:num_tokens].zero_()
        buf.positions[:num_tokens].copy_(
            torch.from_numpy(buf.arange[:num_tokens] % self.max_model_len)
        )
        with torch.inference_mode(), set_forward_context(metadata):
            hidden = self.model(buf.input_ids[:num_tokens], buf.positions[:num_tokens])
            if self.draft is not None:
                self.draft.forward_same_inputs(
                    buf.input_ids[:num_tokens], buf.positions[:num_tokens], metadata
                )
        if with_kv:
            table[:num_reqs].zero_()  # leave the table clean: unused entries -> the null block
        return hidden

    @torch.inference_mode()
    def dummy_sampler_run(self, hidden: torch.Tensor, num_reqs: int) -> None:
        """Run compute_logits + the sampler's most memory-hungry path over `num_reqs` rows."""
        idx = torch.arange(num_reqs, device=self.device) % hidden.shape[0]
        logits = self.model.compute_logits(hidden[idx])
        # Random sampling with top-k, top-p and min-p: the sort and softmax
        # temporaries are the sampler's largest allocations.
        params = SamplingParams(
            temperature=1.0, top_k=50, top_p=0.9, min_p=0.05, logprobs=MAX_LOGPROBS
        )
        self.sampler(
            logits,
            build_sampling_metadata(
                [params] * num_reqs,
                [[0]] * num_reqs,
                [[] for _ in range(num_reqs)],
                {},
                self.vocab_size,
                self.device,
            ),
        )

    @torch.inference_mode()
    def warm_up_logits(self, hidden: torch.Tensor, max_rows: int) -> None:
        """The lm_head GEMM and greedy argmax at every row count 1..`max_rows` (CUDA only).

        cuBLAS picks its kernel by the row count, and CUDA loads a kernel's
        module when it is first launched: a step that samples a row count not
        seen before paid that load (3 ms for the first one-row GEMM of the
        SmolLM2 shape on the H200, issue 10). The argmax runs once on the raw
        logits (an all-greedy batch) and once on their float32 copy (the
        sampler's other paths): Triton compiles one variant per dtype, and the
        row count is only its grid. The structured-output bitmask kernel (xgrammar's
        Triton kernel) runs on the float32 logits at 1, 2 and 16 rows: Triton
        specializes integer arguments equal to 1 and divisible by 16.
        `hidden` [>= 1, hidden_size].
        """
        if self.device.type != "cuda":
            return
        idx = torch.arange(max_rows, device=self.device) % hidden.shape[0]
        rows = hidden[idx]
        for n in range(1, max_rows + 1):
            logits = self.model.compute_logits(rows[:n])
            if n == 1:
                argmax_rows(logits)
                argmax_rows(logits.float())
            if n in (1, 2, 16):
                width = -(-logits.shape[1] // 32)
                apply_bitmask(logits.float(), torch.full((n, width), -1, dtype=torch.int32,
                                                         device=self.device))

    def warm_up_kernels(self) -> int:
        """Compile the attention kernels for every batch a step can hold; returns the launches.

        One layer per distinct shape (heads, cache view, dtype) is enough: the
        compiled variants are shared by every layer of that shape.
        """
        seen: set[tuple] = set()
        launches = 0
        width = self.block_table.device_tensor.shape[1]
        for layer in attention_layers(self.model, self.draft).values():  # the draft's too
            cache = layer.kv_cache
            key = (layer.num_heads, tuple(cache.shape[1:]), cache.stride(), cache.dtype)
            if key not in seen:
                seen.add(key)
                launches += layer.warm_up_kernels(self.max_num_tokens, self.max_model_len, width)
        return launches

    def capture_model(self) -> None:
        """Capture decode, verify and mixed-batch CUDA graphs (CUDA only); rows address
        block 1 and write no KV (slot -1)."""
        if not self.use_cuda_graph:
            return
        self._capture(self.decode_graphs, 1)
        verify = self.verify_rows
        if verify is not None and verify.graphs.capture_sizes:
            self._capture(verify.graphs, verify.query_len)
        if self.mixed.graphs.capture_sizes:
            # Bucket T's requests: min(T, R_max) of one token each, the rest padding
            # rows: a layout whose prefix is valid for every smaller bucket too.
            largest = max(self.mixed.graphs.capture_sizes)
            self._capture(self.mixed.graphs, 1, self.mixed.num_reqs(largest))

    def _capture(self, graphs: CUDAGraphManager, query_len: int,
                 num_reqs: int | None = None) -> None:
        """Capture `graphs` over buffers holding `num_reqs` (default: the largest size)
        requests of `query_len` tokens (each size's first rows are its own inputs)."""
        size = max(graphs.capture_sizes)
        reqs = size if num_reqs is None else num_reqs
        buf, table = self.buffers, self.block_table.device_tensor
        with torch.inference_mode():
            buf.seq_lens[:reqs].fill_(query_len)
            buf.slot_mapping[: size * query_len].fill_(-1)
            buf.query_start_loc[: reqs + 1].copy_(
                torch.arange(reqs + 1, dtype=torch.int32, device=self.device) * query_len
            )
            table[:reqs].fill_(1)
            graphs.capture()
            table[:reqs].zero_()
            buf.seq_lens[:reqs].zero_()
