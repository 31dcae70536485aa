"""The model runner: persistent device state and the six steps of a step.

    execute_model(scheduler_output)
      1. update states      new / resumed / finished requests -> rows of InputBatch
      2. prepare inputs     flat input ids, positions, slot mapping (numpy, one H2D copy
                            each into the StepBuffers, step_buffers.py)
      3. attention metadata query_start_loc, seq_lens, block table
      4. forward            CUDA graph for decode-only batches (with the sampling head),
                            verify rows (verify_rows.py) for spec-decode batches that
                            fit, a mixed-batch graph (mixed_graphs.py) for other steps
                            of up to 256 tokens, eager otherwise
      5. sample             rows whose prompt is complete; rows with drafts are
                            verified and the next drafts proposed (SpecDecoder,
                            spec_decode.py; async: AsyncSpecState, async_spec.py)
      6. outputs            ModelRunnerOutput (token ids as Python lists), prompt
                            logprobs; or with async scheduling an AsyncRunnerOutput
                            whose ids are still on their way to the host (async_output.py)

Start-up passes (dummy runs for the profile and warmup, kernel warm-up, CUDA
graph capture) are the runner's `warmup` component (warmup.py), which the
Worker drives. The runner decides nothing: which requests run, and how many
tokens each, is the scheduler's; how much memory the KV cache gets is the
worker's. Works on any torch device (CUDA graphs only on CUDA).
"""

from __future__ import annotations

import numpy as np
import torch

from vllm.forward_context import set_forward_context
from vllm.logger import init_logger
from vllm.sampling_params import SamplingParams
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
from vllm.v1.worker.async_spec import AsyncSpecState
from vllm.v1.worker.cuda_graph import CUDAGraphManager, DecodeGraphOutput
from vllm.v1.worker.draft_model import DraftModelProposer, attention_layers
from vllm.v1.worker.grammar_bitmask import GrammarBitmask
from vllm.v1.worker.input_batch import CachedRequestState, InputBatch
from vllm.v1.worker.kv_cache import copy_kv_blocks
from vllm.v1.worker.mixed_graphs import MixedBatchGraphs
from vllm.v1.worker.mm_runner import MultiModalRunner
from vllm.v1.worker.spec_decode import SpecDecoder
from vllm.v1.worker.step_buffers import StepBuffers
from vllm.v1.worker.verify_rows import VerifyRows
from vllm.v1.worker.warmup import RunnerWarmup

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
        mixed_capture_sizes: token buckets of the mixed-batch graphs (steps with a
            prefill chunk; `MixedBatchGraphs`), captured with the decode graphs; on a
            device without CUDA graphs the steps that fit are padded and run
            eagerly (the CPU tests). None of them for a multimodal model.
        spec_decoder: speculative decoding (drafts, verification), or None.
            With one, verify batches where every request has k drafts are
            captured too, at the capture sizes whose B x (k + 1) tokens fit
            max_num_tokens (`verify_rows`).
        async_scheduling: return `AsyncRunnerOutput`s and take the previous
            step's sampled ids from the device (`AsyncStepState`); the caller
            must call `get_output()` of step N before step N+2. With n-gram
            drafts these are proposed and fed on the device (`AsyncSpecState`).
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
        mixed_capture_sizes: list[int] | None = None,
        spec_decoder: SpecDecoder | None = None,
        async_scheduling: bool = False,
    ) -> None:
        self.model, self.device, self.dtype = model, device, dtype
        self.vocab_size = vocab_size
        self.max_num_reqs = max_num_reqs
        self.max_model_len = max_model_len
        self.block_size = block_size
        self.use_cuda_graph = device.type == "cuda" and bool(cudagraph_capture_sizes)
        capture_sizes = [s for s in cudagraph_capture_sizes if s <= max_num_reqs]
        self.max_num_tokens = max(max_num_tokens, max(capture_sizes, default=0))
        on_cuda = device.type == "cuda"  # pinned host twins, mixed graphs
        self.requests: dict[str, CachedRequestState] = {}
        self.input_batch = InputBatch(max_num_reqs, max_model_len, block_size, device, on_cuda)
        self.sampler = Sampler()
        # Every per-step input: CUDA graphs replay fixed addresses.
        self.buffers = StepBuffers(self.max_num_tokens, max_num_reqs, device, on_cuda)
        # The decode graphs' logits, rows [:size] of each (see _decode_graph_forward).
        self._decode_logits: torch.Tensor | None = None
        self.async_state = AsyncStepState(max_num_reqs, device, max_model_len) if (
            async_scheduling) else None
        self.spec_decoder = spec_decoder
        self.async_spec = AsyncSpecState.of(spec_decoder, async_scheduling, max_num_reqs,
                                            max_model_len, block_size, vocab_size, device)
        # Structured outputs: one grammar matcher per constrained request, the step's bitmask.
        k = spec_decoder.k if spec_decoder is not None else 0
        self.grammar = GrammarBitmask(max_num_reqs * (k + 1), vocab_size, device)
        # Images (a multimodal model): encoder cache, M-RoPE positions, image rows.
        self.mm = MultiModalRunner(model, device, dtype, model.config.hidden_size) if getattr(
            model, "is_multimodal", False) else None
        self.cuda_graphs = CUDAGraphManager(capture_sizes, self._decode_graph_forward)
        self.mixed = MixedBatchGraphs(mixed_capture_sizes if self.mm is None else None,
                                      max_num_reqs, self.max_num_tokens, self._graph_forward,
                                      use_graphs=on_cuda)
        # Verify batches: B requests x (k + 1) tokens each (short drafts padded), own graphs.
        self.verify_rows = None if spec_decoder is None else VerifyRows(
            self.buffers, spec_decoder.k + 1, capture_sizes, self._graph_forward,
            max_model_len, spec_decoder.draft is not None, device, on_cuda,
        )
        # layer name -> view [num_blocks, 2, block_size, num_kv_heads, head_size]
        self.kv_caches: dict[str, torch.Tensor] = {}
        self.warmup = RunnerWarmup(
            model, self._draft(), self.buffers, self.input_batch.block_table, self.sampler,
            self.cuda_graphs, self.verify_rows, self.mixed, device=device, vocab_size=vocab_size,
            block_size=block_size, max_model_len=max_model_len,
            max_num_tokens=self.max_num_tokens, use_cuda_graph=self.use_cuda_graph,
        )

    # --------------------------------------------------------------- KV cache
    def get_kv_cache_specs(self, dtype: torch.dtype) -> dict[str, KVCacheSpec]:
        """Attention layer name -> what one of its KV blocks holds, in layer order.

        With a draft model its layers (`draft.` names) follow the target's: one
        layout, one block id space, one sizing for both.
        """
        return {
            name: layer.get_kv_cache_spec(self.block_size, dtype)
            for name, layer in attention_layers(self.model, self._draft()).items()
        }

    def _draft(self) -> DraftModelProposer | None:
        return self.spec_decoder.draft if self.spec_decoder is not None else None

    def bind_kv_cache(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Point every attention layer at its view (after allocation and after each growth).

        An empty dict unbinds them (shutdown).

        Raises:
            ValueError: layers and views differ (see `kv_cache_interface.bind_kv_cache`).
        """
        layers = attention_layers(self.model, self._draft())
        if not kv_caches:
            for layer in layers.values():
                layer.kv_cache = None
            self.kv_caches = {}
            return
        bind_kv_cache(kv_caches, layers)
        self.kv_caches = dict(kv_caches)

    def move_kv_blocks(self, src: list[int], dst: list[int]) -> None:
        """Copy KV blocks src[i] -> dst[i] in every layer (on the stream, after the step in
        flight) and give the requests the new ids (the elastic cache empties its tail)."""
        copy_kv_blocks(self.kv_caches, src, dst)
        if self.async_state is not None:  # the step in flight's block-table upload is done
            self.async_state.wait_inputs_copied()
        self.input_batch.rename_blocks(self.requests.values(), dict(zip(src, dst, strict=True)))

    # ------------------------------------------------------------------ state
    def _update_states(self, so: SchedulerOutput) -> None:
        batch = self.input_batch
        # Finished first: an id can be reused by a new request in the same output.
        for req_id in so.finished_req_ids:
            self.requests.pop(req_id, None)
        self.grammar.remove(so.finished_req_ids)
        if self.mm is not None:
            self.mm.remove(so.finished_req_ids)
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
            if new.mm_features:
                self.mm.add_request(new.req_id, state.prompt_token_ids, new.mm_features)
            batch.add(state)
            if new.grammar is not None:
                self.grammar.add(new.req_id, new.grammar, state.prompt_token_ids)

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
        """Fill the persistent buffers for this step (steps 2 and 3).

        Returns the attention metadata, the per-row scheduled token counts and
        the rows that sample (their last token's flat index is in
        `buffers.logits_indices`, in the same order).
        """
        batch, buf = self.input_batch, self.buffers
        num_reqs = batch.num_reqs
        computed = batch.num_computed_tokens[:num_reqs].astype(np.int64)
        one_token_each = self._all_single_token(so, num_reqs)
        if one_token_each:
            # Row i is flat token i at position computed[i].
            num_sched = buf.ones[:num_reqs]
            total = num_reqs
            cu = buf.arange[1 : num_reqs + 1]
            req_indices, positions = buf.arange[:num_reqs], computed
        else:
            num_sched, total, cu, req_indices, positions = self._flat_tokens(so, computed)

        token_ids = batch.token_ids[req_indices, positions]
        slots = batch.block_table.slot_mapping(req_indices, positions)
        if self.mm is not None:  # the positions the model sees (M-RoPE), image rows
            positions = self.mm.prepare(batch.req_ids, req_indices, positions, num_sched,
                                        computed)
        # A decode batch that replays a graph of `size` > num_reqs requests gets its
        # padding (harmless requests: id 0, no KV slot, no keys) in the same copies;
        # so does a step with prefill chunks that fits a mixed-batch graph's bucket.
        end, end_reqs = self._graph_padding(num_reqs, total)
        seq_lens = computed + num_sched
        buf.upload(num_reqs, total, end, token_ids, positions, slots, cu, seq_lens, end_reqs)
        block_table = batch.block_table.copy_to_device(num_reqs)
        if self.async_state is not None:
            self.async_state.feed(buf.input_ids, batch, num_sched, computed, cu)
        # A row samples when its chunk reaches its last known token; a
        # partial prefill samples nothing (and must not advance its seeded
        # generator, or the output would depend on the chunk size).
        rows = np.nonzero(seq_lens >= batch.num_tokens[:num_reqs])[0]
        n_rows = len(rows)
        # else: hidden[:n]; but the sampler may get a subset (async spec's device rows)
        if n_rows and not (one_token_each and n_rows == num_reqs and not self.async_spec):
            buf.logits_indices_np[:n_rows] = cu[rows] - 1
            buf.logits_indices[:n_rows].copy_(buf.logits_indices_cpu[:n_rows], non_blocking=True)

        head = buf.head
        metadata = AttentionMetadata(
            num_actual_tokens=total,
            max_query_len=1 if one_token_each else int(num_sched.max()),
            query_start_loc=head(buf.query_start_loc, num_reqs + 1),
            max_seq_len=int(seq_lens.max()),
            seq_lens=head(buf.seq_lens, num_reqs),
            block_table=block_table,
            slot_mapping=head(buf.slot_mapping, total),
            query_start_loc_cpu=head(buf.query_start_loc_cpu, num_reqs + 1),
            seq_lens_cpu=head(buf.seq_lens_cpu, num_reqs),
            no_cached_context=not computed.any(),
        )
        return metadata, num_sched, rows

    def _flat_tokens(self, so: SchedulerOutput, computed: np.ndarray
                     ) -> tuple[np.ndarray, int, np.ndarray, np.ndarray, np.ndarray]:
        """The general layout of a step's flat tokens (rows of any length): [num_reqs]
        tokens scheduled per row, their total, their cumsum, and [total] each flat
        token's row and position (`computed`: [num_reqs] int64 computed tokens)."""
        num_sched = np.array([so.num_scheduled_tokens[r] for r in self.input_batch.req_ids],
                             dtype=np.int64)
        total = int(num_sched.sum())
        cu = np.cumsum(num_sched)
        req_indices, offsets = self.buffers.token_rows(num_sched, cu, total)
        return num_sched, total, cu, req_indices, computed[req_indices] + offsets

    @staticmethod
    def _all_single_token(so: SchedulerOutput, num_reqs: int) -> bool:
        """Whether every row runs exactly one token (a decode step: each scheduled row
        has >= 1, which `StepPlan.add` enforces, so a total of num_reqs means one
        each); `_prepare_inputs` then skips the general per-token bookkeeping."""
        return so.total_num_scheduled_tokens == num_reqs

    def _graph_padding(self, num_reqs: int, total: int) -> tuple[int, int | None]:
        """(tokens, requests) the step's buffers are padded to (`StepBuffers.upload`'s
        end, end_reqs): a decode graph's size (requests None: one token each), a mixed
        bucket's T and R, or (total, None) for an eager step."""
        size = self._decode_graph_size(num_reqs, total)
        mixed = self.mixed.bucket(total) if size is None else None
        if mixed is not None:
            return mixed, self.mixed.num_reqs(mixed)
        return size or total, None

    def _decode_graph_size(self, num_reqs: int, total: int) -> int | None:
        """The captured decode graph an all-decode batch replays (its padded size), or None."""
        if not self.use_cuda_graph or total != num_reqs or (
                self.mm is not None and self.mm.step_image_rows is not None):
            return None
        return self.cuda_graphs.padded_size(num_reqs)

    # ---------------------------------------------------------------- forward
    def _forward(self, metadata: AttentionMetadata, num_sched: np.ndarray
                 ) -> tuple[torch.Tensor, DecodeGraphOutput | None]:
        """Hidden states [total, hidden] of the step's flat tokens: a graph replay when
        the batch is all decodes, fits rows of k + 1 tokens (spec decode) or a mixed
        bucket (padded by _prepare_inputs); else eager.
        A decode graph's replay also returns its sampling head's outputs (its first
        `total` rows), None otherwise."""
        num_reqs = len(num_sched)
        total = metadata.num_actual_tokens
        size = self._decode_graph_size(num_reqs, total)  # padded by _prepare_inputs
        verify = None
        if self.use_cuda_graph and total != num_reqs and self.verify_rows is not None:
            verify = self.verify_rows.prepare(num_sched, total)  # laid out and padded
        if self.async_state is not None:
            self.async_state.record_inputs_copied()
        if size is not None:
            head = self.cuda_graphs.replay(size).rows(total)
            return head.hidden, head
        if verify is not None:
            return self.verify_rows.replay(verify, total), None
        mixed = self.mixed.bucket(total)
        if mixed is not None:
            return self.mixed.run(mixed)[:total], None
        buf = self.buffers
        with set_forward_context(metadata):
            if self.mm is not None:
                ids = buf.input_ids[:total]
                return self.model(ids, *self.mm.forward_args(ids)), None
            return self.model(buf.input_ids[:total], buf.positions[:total]), None

    def _graph_forward(self, size: int, query_len: int = 1, num_tokens: int | None = None
                       ) -> torch.Tensor:
        """Forward of `size` requests of up to `query_len` tokens, `num_tokens` in all
        (default size x query_len), from the buffers (a capture target).

        query_len 1 is a decode batch; k + 1 a verify batch (rows of k + 1 tokens);
        a mixed batch has query_len = num_tokens (any layout of its tokens).
        """
        tokens = size * query_len if num_tokens is None else num_tokens
        buf = self.buffers
        metadata = AttentionMetadata(
            num_actual_tokens=tokens,
            max_query_len=query_len,
            query_start_loc=buf.query_start_loc[: size + 1],
            max_seq_len=self.max_model_len,
            seq_lens=buf.seq_lens[:size],
            block_table=self.input_batch.block_table.device_tensor[:size],
            slot_mapping=buf.slot_mapping[:tokens],
            query_start_loc_cpu=buf.query_start_loc_cpu[: size + 1],
            seq_lens_cpu=buf.seq_lens_cpu[:size],
        )
        with set_forward_context(metadata):
            return self.model(buf.input_ids[:tokens], buf.positions[:tokens])

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

    # ------------------------------------------------------------------ step
    @torch.inference_mode()
    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput | AsyncRunnerOutput:
        """One step: the scheduled tokens through the model; the sampled (and verified)
        tokens, the next drafts and the logprobs back."""
        async_state, spec = self.async_state, self.spec_decoder
        if async_state is not None:
            async_state.wait_inputs_copied()  # the pinned buffers are free to rewrite
        # 1. update states (and the step's images through the vision encoder)
        self._update_states(so)
        if self.mm is not None:
            self.mm.execute_encoder(so)
        if so.total_num_scheduled_tokens == 0:
            return EMPTY_MODEL_RUNNER_OUTPUT
        batch = self.input_batch
        drafts = so.scheduled_spec_decode_tokens
        if drafts and self.async_spec is None:
            SpecDecoder.write_drafts(batch, drafts)
        # 2. prepare inputs, 3. attention metadata
        metadata, num_sched, sampling_rows = self._prepare_inputs(so)
        if self.async_spec is not None:  # the device rows' inputs from the device
            self.async_spec.prepare(batch, drafts, num_sched, self.buffers)
        # 4. forward (the draft model's after the target's)
        hidden, head = self._forward(metadata, num_sched)
        if spec is not None:
            spec.forward_draft(so, self.buffers.input_ids, self.buffers.positions, metadata)

        # 5. sample: rows with drafts verify them, the others go to the sampler
        num_reqs = batch.num_reqs
        output = ModelRunnerOutput(
            req_ids=list(batch.req_ids),
            req_id_to_index=dict(batch.req_id_to_index),
            sampled_token_ids=[[] for _ in range(num_reqs)],
        )
        rows, is_verify = sampling_rows, None
        if self.async_spec is not None:
            rows, is_verify = self.async_spec.verify(self.model, hidden, batch, rows)
        elif drafts:
            rows, is_verify = spec.verify_step(self.model, hidden, batch, sampling_rows,
                                               num_sched, drafts, output, self.grammar)
        sampler_output = self._sample(hidden, head, so, len(sampling_rows), rows, is_verify)
        if sampler_output is not None and async_state is None:
            self._append_sampled(output, rows, sampler_output)
        if spec is not None and self.async_spec is None:
            output.spec_token_ids = spec.propose(batch, sampling_rows.tolist(),
                                                 self.max_model_len)

        # 6. outputs
        output.prompt_logprobs_dict = self._prompt_logprobs(hidden, num_sched)
        # Advance the runner's view of computed tokens; the scheduler sends
        # the authoritative count next step.
        batch.num_computed_tokens[:num_reqs] += num_sched.astype(np.int32)
        for row in range(num_reqs):
            batch.states[row].num_computed_tokens = int(batch.num_computed_tokens[row])
        if async_state is None:
            return output
        out = async_state.output(output, rows, sampler_output, batch)
        if self.async_spec is not None:  # the device rows' tokens join it (async_spec.py)
            out = self.async_spec.output(out, output, batch, rows, sampler_output)
        return out

    def _sample(self, hidden: torch.Tensor, head: DecodeGraphOutput | None,
                so: SchedulerOutput, n: int, rows: np.ndarray, is_verify: np.ndarray | None
                ) -> SamplerOutput | None:
        """The sampler over `rows` (the step's `n` sampling rows but the verify rows
        `is_verify` marks), or None when no row is left.

        The logits come from the decode graph's head when it ran (its argmax too,
        for the sampler's all-greedy case), else from an eager lm_head.
        """
        if not len(rows):
            return None
        batch = self.input_batch
        greedy = None
        if n == batch.num_reqs == len(rows) and self._all_single_token(so, n):
            # Row i samples flat token i (no verify row: those carry drafts), so
            # the logits indices are 0 .. n-1: a view, no index copy, no gather.
            if head is not None:
                logits, greedy = head.logits, head.greedy
            else:
                logits = self.model.compute_logits(hidden[:n])
        else:
            idx = self.buffers.logits_indices[:n]
            if is_verify is not None and is_verify.any():
                idx = idx[torch.from_numpy(np.nonzero(~is_verify)[0]).to(self.device)]
            logits = self.model.compute_logits(hidden[idx])
        states = [batch.states[r] for r in rows]
        return self.sampler(logits, self._sampling_metadata(states), greedy=greedy)

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
        if pending is not None and (any(_uses_output_ids(s.sampling_params) for s in states)
                                    or self.grammar.has_any(states)):
            # Penalties and grammars read the output ids: wait for the last step's (the
            # forward of this step runs meanwhile; the next one is launched after it).
            pending.get_output()
        generators = {i: s.generator for i, s in enumerate(states) if s.generator is not None}
        metadata = build_sampling_metadata(
            [s.sampling_params for s in states],
            [s.prompt_token_ids for s in states],
            [s.output_token_ids for s in states],
            generators,
            self.vocab_size,
            self.device,
        )
        metadata.grammar_bitmask = self.grammar.bitmask(states)
        return metadata

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
                result[state.req_id] = LogprobsLists.concat(parts)
            start += n
        return result


def _uses_output_ids(params: SamplingParams) -> bool:
    """Whether sampling reads the values of the request's output ids (the penalties)."""
    return (
        params.presence_penalty != 0.0
        or params.frequency_penalty != 0.0
        or params.repetition_penalty != 1.0
        or bool(params.bad_words)
    )

