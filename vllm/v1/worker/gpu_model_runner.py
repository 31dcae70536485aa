"""The model runner: persistent device state and the six steps of a step.

    execute_model(scheduler_output)
      1. update states      new / resumed / finished requests -> rows of InputBatch
      2. prepare inputs     flat input ids, positions, slot mapping (numpy, one H2D copy)
      3. attention metadata query_start_loc, seq_lens, block table
      4. forward            CUDA graph for decode-only batches, eager otherwise
      5. sample             rows whose prompt is complete; prompt logprobs; rows
                            with drafts are verified (spec_decode.py) and propose
      6. outputs            ModelRunnerOutput (token ids as Python lists), or with
                            async scheduling an AsyncRunnerOutput whose ids are still
                            on their way to the host (async_output.py)

The runner decides nothing: which requests run, and how many tokens each, is
the scheduler's; how much memory the KV cache gets is the worker's. Works on
any torch device (CUDA graphs only on CUDA).
"""

from __future__ import annotations

import numpy as np
import torch

from vllm.forward_context import set_forward_context
from vllm.logger import init_logger
from vllm.model_executor.models.utils import get_attention_layers
from vllm.sampling_params import MAX_LOGPROBS, SamplingParams
from vllm.v1.attention.backends.abstract import AttentionMetadata
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.kv_cache_interface import KVCacheSpec, bind_kv_cache
from vllm.v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT, LogprobsLists, ModelRunnerOutput
from vllm.v1.sample.metadata import (
    SamplingMetadata,
    build_sampling_metadata,
    make_request_generator,
)
from vllm.v1.sample.sampler import (
    Sampler,
    SamplerOutput,
    argmax_rows,
    compute_token_logprobs,
)
from vllm.v1.worker.async_output import AsyncRunnerOutput, AsyncStepState, scatter_logprobs
from vllm.v1.worker.cuda_graph import CUDAGraphManager, DecodeGraphOutput
from vllm.v1.worker.input_batch import CachedRequestState, InputBatch
from vllm.v1.worker.spec_decode import SpecDecoder

logger = init_logger(__name__)


class GPUModelRunner:
    """Runs scheduled batches through the model on one device.

    Args:
        model: a model with forward(input_ids, positions), compute_logits(hidden).
        device: the model's device.
        dtype: the model's dtype (also the KV cache dtype).
        vocab_size: logits width.
        max_num_reqs: most requests in one step (max_num_seqs).
        max_num_tokens: most tokens in one step (max_num_batched_tokens).
        max_model_len: most tokens per request.
        block_size: tokens per KV block.
        cudagraph_capture_sizes: decode batch sizes to capture; empty = eager only.
        spec_decoder: speculative decoding (drafts, verification), or None.
            With one, verify batches where every request has k drafts are
            captured too, at the capture sizes whose B x (k + 1) tokens fit
            max_num_tokens.
        async_scheduling: return `AsyncRunnerOutput`s and take the previous
            step's sampled ids from the device (`AsyncStepState`); the caller
            must call `get_output()` of step N before step N+2. Not with
            speculative decoding (the config refuses the combination).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        device: torch.device,
        dtype: torch.dtype,
        vocab_size: int,
        max_num_reqs: int,
        max_num_tokens: int,
        max_model_len: int,
        block_size: int,
        cudagraph_capture_sizes: list[int],
        spec_decoder: SpecDecoder | None = None,
        async_scheduling: bool = False,
    ) -> None:
        self.model = model
        self.device = device
        self.dtype = dtype
        self.vocab_size = vocab_size
        self.max_num_reqs = max_num_reqs
        self.max_model_len = max_model_len
        self.block_size = block_size
        self.use_cuda_graph = device.type == "cuda" and bool(cudagraph_capture_sizes)
        capture_sizes = [s for s in cudagraph_capture_sizes if s <= max_num_reqs]
        self.max_num_tokens = max(max_num_tokens, max(capture_sizes, default=0))
        pin = device.type == "cuda"

        self.requests: dict[str, CachedRequestState] = {}
        self.input_batch = InputBatch(max_num_reqs, max_model_len, block_size, device, pin)
        self.sampler = Sampler()

        n, r = self.max_num_tokens, max_num_reqs
        # Persistent buffers: CUDA graphs replay fixed addresses, so every
        # per-step input lives in one of these and is overwritten in place.
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=device)  # [max_num_tokens]
        self.positions = torch.zeros(n, dtype=torch.int64, device=device)  # [max_num_tokens]
        self.slot_mapping = torch.full((n,), -1, dtype=torch.int64, device=device)
        # query_start_loc [r + 1] and seq_lens [r] are views of one int32 buffer
        # (and so are their host twins): a step sends both in one copy. seq_lens
        # starts 128-byte aligned: Triton specialises on a pointer's 16-byte
        # alignment, and warmup compiled the kernels for aligned ones.
        lens_at = -(-(r + 1) // 32) * 32
        self._req_lens = torch.zeros(lens_at + r, dtype=torch.int32, device=device)
        self.query_start_loc = self._req_lens[: r + 1]
        self.seq_lens = self._req_lens[lens_at:]
        # Host staging twins (pinned on CUDA) for one asynchronous copy each.
        self.input_ids_cpu = torch.zeros(n, dtype=torch.int64, pin_memory=pin)
        self.positions_cpu = torch.zeros(n, dtype=torch.int64, pin_memory=pin)
        self.slot_mapping_cpu = torch.full((n,), -1, dtype=torch.int64, pin_memory=pin)
        self._req_lens_cpu = torch.zeros(lens_at + r, dtype=torch.int32, pin_memory=pin)
        self.query_start_loc_cpu = self._req_lens_cpu[: r + 1]
        self.seq_lens_cpu = self._req_lens_cpu[lens_at:]
        self._arange = np.arange(max(n, r) + 1, dtype=np.int64)
        self._arange.flags.writeable = False  # shared by every step's views
        self._ones = np.ones(r, dtype=np.int64)  # num_sched of an all-decode step (read-only)
        self._ones.flags.writeable = False
        # numpy views of the host twins, made once (each .numpy() costs microseconds).
        self._input_ids_np = self.input_ids_cpu.numpy()
        self._positions_np = self.positions_cpu.numpy()
        self._slot_mapping_np = self.slot_mapping_cpu.numpy()
        self._query_start_loc_np = self.query_start_loc_cpu.numpy()
        self._seq_lens_np = self.seq_lens_cpu.numpy()
        # Flat index of each sampling row's last token, for the logits.
        self.logits_indices = torch.zeros(r, dtype=torch.int64, device=device)  # [max_num_reqs]
        self.logits_indices_cpu = torch.zeros(r, dtype=torch.int64, pin_memory=pin)
        self._logits_indices_np = self.logits_indices_cpu.numpy()
        # The decode graphs' logits, rows [:size] of each (see _decode_graph_forward).
        self._decode_logits: torch.Tensor | None = None
        # (id(buffer), n) -> buffer[:n] for the persistent buffers above, n <= r + 1.
        self._heads: dict[tuple[int, int], torch.Tensor] = {}
        self.async_state = (
            AsyncStepState(r, device, max_model_len) if async_scheduling else None
        )

        self.spec_decoder = spec_decoder
        self.cuda_graphs = CUDAGraphManager(capture_sizes, self._decode_graph_forward)
        # Verify batches: B requests x q = k + 1 tokens each (short drafts padded), own graphs.
        self.verify_query_len = spec_decoder.k + 1 if spec_decoder else 0
        verify_sizes = [
            b for b in capture_sizes if spec_decoder and b * self.verify_query_len <= n
        ]
        self.verify_graphs = CUDAGraphManager(
            verify_sizes, lambda b: self._graph_forward(b, self.verify_query_len),
            kind=f"verify, {self.verify_query_len} tokens per request",
        )
        # Flat token -> its place in a batch laid out as rows of k + 1 (short drafts).
        self.verify_index = torch.zeros(n if spec_decoder else 0, dtype=torch.int64,
                                        device=device)
        self.verify_index_cpu = torch.zeros(n if spec_decoder else 0, dtype=torch.int64,
                                            pin_memory=pin)
        # layer name -> view [num_blocks, 2, block_size, num_kv_heads, head_size]
        self.kv_caches: dict[str, torch.Tensor] = {}

    # --------------------------------------------------------------- KV cache
    def get_kv_cache_specs(self, dtype: torch.dtype) -> dict[str, KVCacheSpec]:
        """Attention layer name -> what one of its KV blocks holds, in layer order.

        With a draft model its layers (`draft.` names) follow the target's: one
        layout, one block id space, one sizing for both.
        """
        return {
            name: layer.get_kv_cache_spec(self.block_size, dtype)
            for name, layer in self._attention_layers().items()
        }

    def _attention_layers(self) -> dict:
        layers = get_attention_layers(self.model)
        draft = self.spec_decoder.draft if self.spec_decoder is not None else None
        if draft is not None:
            layers.update(get_attention_layers(draft.model))
        return layers

    def bind_kv_cache(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Point every attention layer at its view (after allocation and after each growth).

        An empty dict unbinds them (shutdown).

        Raises:
            ValueError: layers and views differ (see `kv_cache_interface.bind_kv_cache`).
        """
        layers = self._attention_layers()
        if not kv_caches:
            for layer in layers.values():
                layer.kv_cache = None
            self.kv_caches = {}
            return
        bind_kv_cache(kv_caches, layers)
        self.kv_caches = dict(kv_caches)

    # ------------------------------------------------------------------ state
    def _update_states(self, so: SchedulerOutput) -> None:
        batch = self.input_batch
        # Finished first: an id can be reused by a new request in the same output.
        for req_id in so.finished_req_ids:
            self.requests.pop(req_id, None)
        batch.remove(so.finished_req_ids)
        # Rows are rebuilt around what runs this step: drop finished and
        # unscheduled (incl. preempted) requests; their state stays in
        # self.requests until they finish.
        scheduled = so.num_scheduled_tokens
        batch.remove({r for r in batch.req_ids if r not in scheduled})

        for new in so.scheduled_new_reqs:
            params = new.sampling_params
            generator = None
            if params.seed is not None:
                generator = make_request_generator(params.seed, self.device)
            state = CachedRequestState(
                req_id=new.req_id,
                prompt_token_ids=list(new.prompt_token_ids),
                sampling_params=params,
                generator=generator,
                block_ids=list(new.block_ids),
                num_computed_tokens=new.num_computed_tokens,
            )
            self.requests[new.req_id] = state
            batch.add(state)

        cached = so.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            state = self.requests[req_id]
            state.num_computed_tokens = cached.num_computed_tokens[i]
            if cached.resumed_from_preemption[i]:
                state.block_ids = list(cached.new_block_ids[i])
            else:
                state.block_ids.extend(cached.new_block_ids[i])
            row = batch.req_id_to_index.get(req_id)
            if row is None or cached.resumed_from_preemption[i]:
                if row is not None:
                    batch.remove({req_id})
                batch.add(state)
            else:
                batch.num_computed_tokens[row] = state.num_computed_tokens
                batch.block_table.append_row(row, cached.new_block_ids[i])

    # ----------------------------------------------------------------- inputs
    def _prepare_inputs(
        self, so: SchedulerOutput
    ) -> tuple[AttentionMetadata, np.ndarray, np.ndarray]:
        """Fill the persistent buffers for this step.

        Returns the attention metadata, the per-row scheduled token counts and
        the rows that sample (their last token's flat index is in
        `logits_indices`, in the same order).
        """
        batch = self.input_batch
        num_reqs = batch.num_reqs
        computed = batch.num_computed_tokens[:num_reqs].astype(np.int64)
        one_token_each = self._all_single_token(so, num_reqs)
        if one_token_each:
            # Row i is flat token i at position computed[i].
            num_sched = self._ones[:num_reqs]
            total = num_reqs
            cu = self._arange[1 : num_reqs + 1]
            req_indices, positions = self._arange[:num_reqs], computed
        else:
            num_sched = np.array([so.num_scheduled_tokens[r] for r in batch.req_ids],
                                 dtype=np.int64)
            total = int(num_sched.sum())
            cu = np.cumsum(num_sched)
            req_indices, offsets = self._token_rows(num_sched, cu, total)
            positions = computed[req_indices] + offsets

        token_ids = batch.token_ids[req_indices, positions]
        # A decode batch that replays a graph of `size` > num_reqs requests gets its
        # padding (harmless requests: id 0, no KV slot, no keys) here, in the same copies.
        size = self._decode_graph_size(num_reqs, total)
        end = total if size is None else size
        ids, pos, slots = self._input_ids_np, self._positions_np, self._slot_mapping_np
        ids[:total] = token_ids
        pos[:total] = positions
        slots[:total] = batch.block_table.slot_mapping(req_indices, positions)
        qsl, lens = self._query_start_loc_np, self._seq_lens_np
        qsl[0] = 0
        qsl[1 : num_reqs + 1] = cu
        seq_lens = computed + num_sched
        lens[:num_reqs] = seq_lens
        if end > total:
            ids[total:end] = pos[total:end] = 0
            slots[total:end] = -1
            qsl[num_reqs + 1 : end + 1] = self._arange[num_reqs + 1 : end + 1]
            lens[num_reqs:end] = 0

        head = self._head
        head(self.input_ids, end).copy_(head(self.input_ids_cpu, end), non_blocking=True)
        head(self.positions, end).copy_(head(self.positions_cpu, end), non_blocking=True)
        head(self.slot_mapping, end).copy_(head(self.slot_mapping_cpu, end), non_blocking=True)
        # Entries past `end` requests are stale on both sides and read by no kernel.
        self._req_lens.copy_(self._req_lens_cpu, non_blocking=True)
        block_table = batch.block_table.copy_to_device(num_reqs)
        if self.async_state is not None:
            self.async_state.feed(self.input_ids, batch, num_sched, computed, cu)
        # A row samples when its chunk reaches its last known token; a
        # partial prefill samples nothing (and must not advance its seeded
        # generator, or the output would depend on the chunk size).
        rows = np.nonzero(seq_lens >= batch.num_tokens[:num_reqs])[0]
        n_rows = len(rows)
        if n_rows and not (one_token_each and n_rows == num_reqs):  # else: hidden[:n]
            self._logits_indices_np[:n_rows] = cu[rows] - 1
            self.logits_indices[:n_rows].copy_(
                self.logits_indices_cpu[:n_rows], non_blocking=True
            )

        metadata = AttentionMetadata(
            num_actual_tokens=total,
            max_query_len=1 if one_token_each else int(num_sched.max()),
            query_start_loc=head(self.query_start_loc, num_reqs + 1),
            max_seq_len=int(seq_lens.max()),
            seq_lens=head(self.seq_lens, num_reqs),
            block_table=block_table,
            slot_mapping=head(self.slot_mapping, total),
            query_start_loc_cpu=head(self.query_start_loc_cpu, num_reqs + 1),
            seq_lens_cpu=head(self.seq_lens_cpu, num_reqs),
            no_cached_context=not computed.any(),
        )
        return metadata, num_sched, rows

    def _head(self, buffer: torch.Tensor, n: int) -> torch.Tensor:
        """`buffer[:n]` of one of the runner's persistent buffers, made once for small n.

        A torch slice costs a few microseconds of host time and a decode step takes
        a dozen; for n <= max_num_reqs + 1 (the decode sizes) the view is kept, keyed
        by the buffer's id (the buffers live as long as the runner, so ids are not reused).
        """
        key = (id(buffer), n)
        view = self._heads.get(key)
        if view is None:
            view = buffer[:n]
            if n <= self.input_batch.max_num_reqs + 1:
                self._heads[key] = view
        return view

    @staticmethod
    def _all_single_token(so: SchedulerOutput, num_reqs: int) -> bool:
        """Whether every row runs exactly one token (a decode step: each scheduled row
        has >= 1, which `StepPlan.add` enforces, so a total of num_reqs means one
        each); `_prepare_inputs` then skips the general per-token bookkeeping."""
        return so.total_num_scheduled_tokens == num_reqs

    # ---------------------------------------------------------------- forward
    def _graph_forward(self, size: int, query_len: int = 1) -> torch.Tensor:
        """Forward of `size` requests x `query_len` tokens from the buffers (capture target).

        query_len 1 is a decode batch; k + 1 a verify batch (rows of k + 1 tokens).
        """
        tokens = size * query_len
        metadata = AttentionMetadata(
            num_actual_tokens=tokens,
            max_query_len=query_len,
            query_start_loc=self.query_start_loc[: size + 1],
            max_seq_len=self.max_model_len,
            seq_lens=self.seq_lens[:size],
            block_table=self.input_batch.block_table.device_tensor[:size],
            slot_mapping=self.slot_mapping[:tokens],
            query_start_loc_cpu=self.query_start_loc_cpu[: size + 1],
            seq_lens_cpu=self.seq_lens_cpu[:size],
        )
        with set_forward_context(metadata):
            return self.model(self.input_ids[:tokens], self.positions[:tokens])

    def _decode_graph_forward(self, size: int) -> DecodeGraphOutput:
        """A decode graph's body: `size` one-token rows through the model, then the
        sampling head every decode row needs (lm_head, greedy argmax).

        Every size writes its logits into the first rows of one shared buffer
        [largest size, vocab_size] (allocated by the first, eager warm-up call of
        the largest size): a graph's own logits tensor would stay allocated per
        captured size (Llama-3-8B at 256 sizes: ~1 GiB, taken from the KV cache),
        while the lm_head's temporary goes back to the graphs' shared pool. One
        graph runs at a time and the step reads its rows before the next replay
        on the same stream, so sharing is safe.
        """
        hidden = self._graph_forward(size)
        logits = self.model.compute_logits(hidden)
        shared = self._decode_logits
        if shared is None:
            rows = max(max(self.cuda_graphs.capture_sizes, default=size), size)
            shared = self._decode_logits = logits.new_empty((rows, logits.shape[1]))
        elif (shared.shape[0] < size or shared.shape[1:] != logits.shape[1:]
              or shared.dtype != logits.dtype):
            # Graphs captured before hold its address: it must never be reallocated.
            raise RuntimeError(
                f"decode graph logits {tuple(logits.shape)} {logits.dtype} do not fit the "
                f"shared buffer {tuple(shared.shape)} {shared.dtype}")
        out = shared[:size]
        out.copy_(logits)
        return DecodeGraphOutput(hidden, out, argmax_rows(out))

    def _decode_graph_size(self, num_reqs: int, total: int) -> int | None:
        """The captured decode graph an all-decode batch replays (its padded size), or None."""
        if not self.use_cuda_graph or total != num_reqs:
            return None
        return self.cuda_graphs.padded_size(num_reqs)

    def _pad_batch(self, num_reqs: int, size: int, query_len: int) -> None:
        """Make requests num_reqs..size of the buffers harmless padded requests (verify
        batches; a decode batch is padded on the host by `_prepare_inputs`)."""
        lo, hi = num_reqs * query_len, size * query_len
        self.input_ids[lo:hi].zero_()
        self.positions[lo:hi].zero_()
        self.slot_mapping[lo:hi].fill_(-1)
        self.seq_lens[num_reqs:size].zero_()
        qsl = self.query_start_loc_cpu.numpy()
        qsl[num_reqs + 1 : size + 1] = self._arange[num_reqs + 1 : size + 1] * query_len
        self.query_start_loc[num_reqs + 1 : size + 1].copy_(
            self.query_start_loc_cpu[num_reqs + 1 : size + 1], non_blocking=True
        )

    def _forward(self, metadata: AttentionMetadata, num_sched: np.ndarray
                 ) -> tuple[torch.Tensor, DecodeGraphOutput | None]:
        """Hidden states [total, hidden] of the step's flat tokens: a graph replay when
        the batch is all decodes, or fits rows of k + 1 tokens (spec decode); else eager.
        A decode graph's replay also returns its sampling head's outputs (its first
        `total` rows), None otherwise."""
        num_reqs = len(num_sched)
        total = metadata.num_actual_tokens
        q = self.verify_query_len
        graphs, index, size = None, None, None
        if self.use_cuda_graph and total == num_reqs:
            graphs, q = self.cuda_graphs, 1
            size = self._decode_graph_size(num_reqs, total)  # padded by _prepare_inputs
        elif self.use_cuda_graph and self._fits_verify_rows(num_sched):
            graphs = self.verify_graphs
            size = graphs.padded_size(num_reqs)
            if size is not None:
                if total != num_reqs * q:
                    index = self._lay_out_verify_rows(num_sched)
                self._pad_batch(num_reqs, size, q)
        if self.async_state is not None:
            self.async_state.record_inputs_copied()
        if size is not None and graphs is self.cuda_graphs:
            head = graphs.replay(size).rows(total)
            return head.hidden, head
        if size is not None:
            hidden = graphs.replay(size)
            return (hidden[:total] if index is None else hidden.index_select(0, index)), None
        with set_forward_context(metadata):
            return self.model(self.input_ids[:total], self.positions[:total]), None

    def _token_rows(self, num_sched: np.ndarray, cu: np.ndarray, total: int
                    ) -> tuple[np.ndarray, np.ndarray]:
        """[total] row of each flat token and [total] its offset inside its row's chunk
        (`cu` = cumsum(num_sched), `total` = its sum)."""
        rows = np.repeat(self._arange[: len(num_sched)], num_sched)
        offsets = self._arange[:total] - np.repeat(cu - num_sched, num_sched)
        return rows, offsets

    def _fits_verify_rows(self, num_sched: np.ndarray) -> bool:
        """Whether the batch can run as the verify graph's rows of q = k + 1 tokens.

        Every request brings at most q tokens (a decode with 0..k drafts: ngram
        drafts are short near the end of their match, or absent), and padding each
        to q keeps it within max_model_len (the padded queries' context must stay
        inside the block table). A draft model reads the flat buffers after the
        forward, and its drafts are always k long: its batches use the uniform case.
        """
        q = self.verify_query_len
        if not q or self.spec_decoder.draft is not None or num_sched.max() > q:
            return False
        num_reqs = len(num_sched)
        if int(num_sched.sum()) == num_reqs * q:
            return True
        padded = self.seq_lens_cpu.numpy()[:num_reqs] + (q - num_sched)
        return int(padded.max()) <= self.max_model_len

    def _lay_out_verify_rows(self, num_sched: np.ndarray) -> torch.Tensor:
        """Move the flat tokens of requests with n_i <= q tokens into rows of q.

        Request i's tokens go to [i*q, i*q + n_i); its padding (ids 0, slot -1:
        no KV written) follows them. Its sequence length grows by q - n_i, so
        that a real query j still sees exactly its computed + j + 1 keys (the
        kernels take query j's context as seq_len - query_len + j + 1); padded
        queries see unwritten slots and their outputs are dropped. Exact: no real
        token's inputs or context change. Returns the flat -> row index [total]
        (int64, on the device) that gathers the real hidden states back.
        """
        q = self.verify_query_len
        num_reqs = len(num_sched)
        total = int(num_sched.sum())
        rows, offsets = self._token_rows(num_sched, np.cumsum(num_sched), total)
        self.verify_index_cpu.numpy()[:total] = rows * q + offsets
        index = self.verify_index[:total]
        index.copy_(self.verify_index_cpu[:total], non_blocking=True)
        for buf, pad in ((self.input_ids, 0), (self.positions, 0), (self.slot_mapping, -1)):
            flat = buf[:total].clone()
            buf[: num_reqs * q].fill_(pad)
            buf.index_copy_(0, index, flat)
        self.query_start_loc_cpu.numpy()[: num_reqs + 1] = self._arange[: num_reqs + 1] * q
        self.seq_lens_cpu.numpy()[:num_reqs] += (q - num_sched).astype(np.int32)
        self.query_start_loc[: num_reqs + 1].copy_(
            self.query_start_loc_cpu[: num_reqs + 1], non_blocking=True
        )
        self.seq_lens[:num_reqs].copy_(self.seq_lens_cpu[:num_reqs], non_blocking=True)
        return index

    # ------------------------------------------------------------------ step
    @torch.inference_mode()
    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput | AsyncRunnerOutput:
        if self.async_state is not None:
            self.async_state.wait_inputs_copied()  # the pinned buffers are free to rewrite
        self._update_states(so)
        if so.total_num_scheduled_tokens == 0:
            return EMPTY_MODEL_RUNNER_OUTPUT
        batch = self.input_batch
        if so.scheduled_spec_decode_tokens:
            SpecDecoder.write_drafts(batch, so.scheduled_spec_decode_tokens)
        metadata, num_sched, sampling_rows = self._prepare_inputs(so)
        hidden, head = self._forward(metadata, num_sched)
        draft = self.spec_decoder.draft if self.spec_decoder is not None else None
        if draft is not None:
            draft.forget(so.finished_req_ids | so.preempted_req_ids)
            total = metadata.num_actual_tokens
            draft.forward_same_inputs(self.input_ids[:total], self.positions[:total], metadata)

        num_reqs = batch.num_reqs
        output = ModelRunnerOutput(
            req_ids=list(batch.req_ids),
            req_id_to_index=dict(batch.req_id_to_index),
            sampled_token_ids=[[] for _ in range(num_reqs)],
        )
        spec = so.scheduled_spec_decode_tokens
        is_verify = np.array([batch.req_ids[r] in spec for r in sampling_rows], dtype=bool)
        rows = sampling_rows[~is_verify]
        if is_verify.any():
            verify_rows = sampling_rows[is_verify].tolist()
            emitted = self.spec_decoder.verify(self.model, hidden, batch, verify_rows,
                                               num_sched, spec)
            for row, tokens in zip(verify_rows, emitted, strict=True):
                output.sampled_token_ids[row] = tokens
                batch.states[row].output_token_ids.extend(tokens)
                for tok in tokens:
                    batch.append_token(row, tok)
        sampler_output = None
        if len(rows):
            logits, greedy = self._logits(hidden, head, so, len(sampling_rows), is_verify)
            states = [batch.states[r] for r in rows]
            sampler_output = self.sampler(logits, self._sampling_metadata(states), greedy=greedy)
        if sampler_output is not None and self.async_state is None:
            self._append_sampled(output, rows, sampler_output)
        if self.spec_decoder is not None:
            output.spec_token_ids = self.spec_decoder.propose(
                batch, sampling_rows.tolist(), self.max_model_len
            )
        output.prompt_logprobs_dict = self._prompt_logprobs(hidden, num_sched)
        # Advance the runner's view of computed tokens; the scheduler sends
        # the authoritative count next step.
        batch.num_computed_tokens[:num_reqs] += num_sched.astype(np.int32)
        for row in range(num_reqs):
            batch.states[row].num_computed_tokens = int(batch.num_computed_tokens[row])
        if self.async_state is None:
            return output
        if sampler_output is None:
            self.async_state.prev_sampled = None
            return output
        return self.async_state.output(output, rows, sampler_output, batch)

    def _logits(self, hidden: torch.Tensor, head: DecodeGraphOutput | None,
                so: SchedulerOutput, n: int, is_verify: np.ndarray
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logits [rows, vocab] of the step's sampling rows that are not verify rows,
        and their argmax [rows] int64 when the decode graph computed it (else None)."""
        num_reqs = self.input_batch.num_reqs
        if n == num_reqs and self._all_single_token(so, num_reqs):
            # Row i samples flat token i (no verify row: those carry drafts), so
            # the logits indices are 0 .. n-1: a view, no index copy, no gather.
            if head is not None:
                return head.logits, head.greedy
            return self.model.compute_logits(hidden[:n]), None
        idx = self.logits_indices[:n]
        if is_verify.any():
            idx = idx[torch.from_numpy(np.nonzero(~is_verify)[0]).to(self.device)]
        return self.model.compute_logits(hidden[idx]), None

    def _append_sampled(
        self, output: ModelRunnerOutput, rows: np.ndarray, sampler_output: SamplerOutput
    ) -> None:
        """Synchronous scheduling: the sampled ids to the host, the output and the rows."""
        batch = self.input_batch
        token_ids = sampler_output.sampled_token_ids.tolist()
        for row, tok in zip(rows.tolist(), token_ids, strict=True):
            output.sampled_token_ids[row] = [tok]
            batch.states[row].output_token_ids.append(tok)
            batch.append_token(row, tok)
        if sampler_output.logprobs_tensors is not None:
            output.logprobs = scatter_logprobs(
                sampler_output.logprobs_tensors.tolists(), rows.tolist(), batch.num_reqs
            )

    def _sampling_metadata(self, states: list[CachedRequestState]) -> SamplingMetadata:
        pending = self.async_state.pending if self.async_state is not None else None
        if pending is not None and any(_uses_output_ids(s.sampling_params) for s in states):
            # Penalties read the output ids: wait for the last step's (async
            # scheduling loses its overlap for this step only).
            pending.get_output()
        generators = {i: s.generator for i, s in enumerate(states) if s.generator is not None}
        return build_sampling_metadata(
            [s.sampling_params for s in states],
            [s.prompt_token_ids for s in states],
            [s.output_token_ids for s in states],
            generators,
            self.vocab_size,
            self.device,
        )

    def _prompt_logprobs(
        self, hidden: torch.Tensor, num_sched: np.ndarray
    ) -> dict[str, LogprobsLists]:
        """Logprobs of the next prompt token at each prompt position computed this step.

        Computed in slices of at most max_num_reqs positions, so the logits
        never exceed the [max_num_seqs, vocab] shape the sampler warmup ran
        (a whole 8k-token chunk at once would need tens of GiB more for a
        large vocabulary, memory the KV sizing never held back).
        """
        batch = self.input_batch
        result: dict[str, LogprobsLists] = {}
        start = 0
        for row in range(batch.num_reqs):
            n = int(num_sched[row])
            state = batch.states[row]
            k = state.sampling_params.prompt_logprobs
            computed = int(batch.num_computed_tokens[row])
            # A request resumed after preemption recomputes its prompt: report
            # only positions not reported before.
            first = max(computed, state.num_prompt_logprobs_done)
            # Position p predicts token p + 1; the last prompt position's
            # prediction is the first sampled token, not a prompt logprob.
            last = min(computed + n, state.num_prompt_tokens - 1)
            if k is not None and first < last:
                state.num_prompt_logprobs_done = last
                row_start = start + first - computed  # flat index of position `first`
                targets = torch.from_numpy(
                    batch.token_ids[row, first + 1 : last + 1].astype(np.int64)
                ).to(self.device)
                parts = []
                for lo in range(0, last - first, self.max_num_reqs):
                    hi = min(lo + self.max_num_reqs, last - first)
                    logits = self.model.compute_logits(hidden[row_start + lo : row_start + hi])
                    parts.append(compute_token_logprobs(logits, targets[lo:hi], k).tolists())
                result[state.req_id] = _concat_logprobs(parts)
            start += n
        return result

    # ------------------------------------------------------- warmup helpers
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
        metadata = None
        if with_kv:
            qsl = self.query_start_loc_cpu.numpy()
            qsl[0] = 0
            qsl[1 : num_reqs + 1] = np.cumsum(num_sched)
            self.seq_lens_cpu.numpy()[:num_reqs] = num_sched
            table = self.input_batch.block_table
            self.query_start_loc[: num_reqs + 1].copy_(self.query_start_loc_cpu[: num_reqs + 1])
            self.seq_lens[:num_reqs].copy_(self.seq_lens_cpu[:num_reqs])
            table.device_tensor[:num_reqs].fill_(1)
            self.slot_mapping[:num_tokens].fill_(self.block_size)  # slot 0 of block 1
            metadata = AttentionMetadata(
                num_actual_tokens=num_tokens,
                max_query_len=int(num_sched.max()),
                query_start_loc=self.query_start_loc[: num_reqs + 1],
                max_seq_len=int(num_sched.max()),
                seq_lens=self.seq_lens[:num_reqs],
                block_table=table.device_tensor[:num_reqs],
                slot_mapping=self.slot_mapping[:num_tokens],
                query_start_loc_cpu=self.query_start_loc_cpu[: num_reqs + 1],
                seq_lens_cpu=self.seq_lens_cpu[:num_reqs],
                no_cached_context=True,
            )
        self.input_ids[:num_tokens].zero_()
        self.positions[:num_tokens].copy_(
            torch.from_numpy(self._arange[:num_tokens] % self.max_model_len)
        )
        with torch.inference_mode(), set_forward_context(metadata):
            hidden = self.model(self.input_ids[:num_tokens], self.positions[:num_tokens])
            if self.spec_decoder is not None and self.spec_decoder.draft is not None:
                self.spec_decoder.draft.forward_same_inputs(
                    self.input_ids[:num_tokens], self.positions[:num_tokens], metadata
                )
        if with_kv:
            # Leave the table clean: unused entries point at the null block.
            self.input_batch.block_table.device_tensor[:num_reqs].zero_()
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
        row count is only its grid.
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

    def warm_up_kernels(self) -> int:
        """Compile the attention kernels for every batch a step can hold; returns the launches.

        One layer per distinct shape (heads, cache view, dtype) is enough: the
        compiled variants are shared by every layer of that shape.
        """
        seen: set[tuple] = set()
        launches = 0
        width = self.input_batch.block_table.device_tensor.shape[1]
        for layer in self._attention_layers().values():  # the draft model's too
            cache = layer.kv_cache
            key = (layer.num_heads, tuple(cache.shape[1:]), cache.stride(), cache.dtype)
            if key not in seen:
                seen.add(key)
                launches += layer.warm_up_kernels(self.max_num_tokens, self.max_model_len, width)
        return launches

    def capture_model(self) -> None:
        """Capture decode (and verify) CUDA graphs (CUDA only); rows address block 1."""
        if not self.use_cuda_graph:
            return
        self._capture(self.cuda_graphs, 1)
        if self.verify_graphs.capture_sizes:
            self._capture(self.verify_graphs, self.verify_query_len)

    def _capture(self, graphs: CUDAGraphManager, query_len: int) -> None:
        size = max(graphs.capture_sizes)
        with torch.inference_mode():
            self.seq_lens[:size].fill_(query_len)
            self.slot_mapping[: size * query_len].fill_(-1)
            self.query_start_loc[: size + 1].copy_(
                torch.arange(size + 1, dtype=torch.int32, device=self.device) * query_len
            )
            self.input_batch.block_table.device_tensor[:size].fill_(1)
            graphs.capture()
            self.input_batch.block_table.device_tensor[:size].zero_()
            self.seq_lens[:size].zero_()


def _uses_output_ids(params: SamplingParams) -> bool:
    """Whether sampling reads the values of the request's output ids (the penalties)."""
    return (
        params.presence_penalty != 0.0
        or params.frequency_penalty != 0.0
        or params.repetition_penalty != 1.0
    )


def _concat_logprobs(parts: list[LogprobsLists]) -> LogprobsLists:
    if len(parts) == 1:
        return parts[0]
    return LogprobsLists(
        [row for p in parts for row in p.logprob_token_ids],
        [row for p in parts for row in p.logprobs],
        [r for p in parts for r in p.ranks],
    )
