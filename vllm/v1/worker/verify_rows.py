"""`VerifyRows`: a speculative-decoding batch laid out as rows of q = k + 1 tokens, so that
it replays a CUDA graph captured for B requests x q tokens.

A batch fits when every request brings at most q tokens (a decode with 0..k
drafts: ngram drafts are short near the end of their match, or absent) and the
padding keeps each row within max_model_len. Its flat tokens move into rows of
q (nothing moves when every request has k drafts), then requests num_reqs..B
become harmless padded rows::

    flat (as prepared)    r0: t d0 d1 | r1: t | r2: t d0             n = [3, 1, 2], q = 3
    rows of q             r0: t d0 d1 | r1: t _ _ | r2: t d0 _ | padded rows .. B
                          _ : id 0, position 0, slot -1 (no KV written)
    seq_lens              raised by q - n_i: query j of row i still sees exactly its
                          computed_i + j + 1 keys (the kernels take query j's context
                          as seq_len - q + j + 1); padded queries' outputs are dropped
    hidden                replay(B), gathered back to flat order by the row index

Exact: no real token's inputs or context change. Batches with longer chunks
(prefill) run eagerly, and so does every batch of a draft model, which reads
the flat buffers after the forward. Decode batches are padded on the host by
`StepBuffers.upload`; verify batches here, on the device (`pad`).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from vllm.v1.worker.cuda_graph import CUDAGraphManager
from vllm.v1.worker.step_buffers import StepBuffers


class VerifyRows:
    """The verify graphs and the layout of a batch into their rows.

    Args:
        buffers: the runner's persistent step buffers (rewritten in place).
        query_len: q = k + 1 tokens a row.
        capture_sizes: the runner's decode capture sizes; those whose B x q
            tokens fit the token buffers are captured.
        forward: (B, q) -> hidden states [B x q, hidden_size] of B rows of the
            buffers (the capture target).
        max_model_len: most tokens per request (a padded row must stay inside).
        with_draft: a draft model reads the flat buffers after the forward: its
            batches never run as rows.
        device: the model's device.
        pin_memory: pin the row index's host twin.
    """

    def __init__(self, buffers: StepBuffers, query_len: int, capture_sizes: list[int],
                 forward: Callable[[int, int], torch.Tensor], max_model_len: int,
                 with_draft: bool, device: torch.device, pin_memory: bool) -> None:
        self.buffers = buffers
        self.query_len = query_len
        self.max_model_len = max_model_len
        self.with_draft = with_draft
        n = buffers.input_ids.shape[0]
        self.graphs = CUDAGraphManager(
            [b for b in capture_sizes if b * query_len <= n],
            lambda b: forward(b, query_len),
            kind=f"verify, {query_len} tokens per request",
        )
        # [:total] flat token -> its place in a batch laid out as rows of q; then each
        # request's padding (num_reqs <= total, so 2 x max_num_tokens always fit).
        self.index = torch.zeros(2 * n, dtype=torch.int64, device=device)
        self.index_cpu = torch.zeros(2 * n, dtype=torch.int64, pin_memory=pin_memory)
        self._index_np = self.index_cpu.numpy()

    def prepare(self, num_sched: np.ndarray, total: int
                ) -> tuple[int, torch.Tensor | None] | None:
        """Lay the batch out as rows and pad it to a captured size, when it fits.

        Args:
            num_sched: [num_reqs] tokens scheduled per request; `total` their sum.

        Returns:
            (the captured size to replay, the row index of the flat tokens or
            None when they are already in rows), or None: the batch runs eagerly
            and the buffers are untouched.
        """
        if not self.fits(num_sched):
            return None
        num_reqs = len(num_sched)
        size = self.graphs.padded_size(num_reqs)
        if size is None:
            return None
        index = None
        if total != num_reqs * self.query_len:
            index = self.lay_out(num_sched)
        self.pad(num_reqs, size)
        return size, index

    def replay(self, prepared: tuple[int, torch.Tensor | None], total: int) -> torch.Tensor:
        """Hidden states [total, hidden_size] of the flat tokens, from the graph's replay."""
        size, index = prepared
        hidden = self.graphs.replay(size)
        return hidden[:total] if index is None else hidden.index_select(0, index)

    def fits(self, num_sched: np.ndarray) -> bool:
        """Whether the batch can run as rows of q tokens.

        Every request brings at most q tokens, and padding each to q keeps it
        within max_model_len (the padded queries' context must stay inside the
        block table). Never with a draft model (see `with_draft`).
        """
        q = self.query_len
        if self.with_draft or num_sched.max() > q:
            return False
        num_reqs = len(num_sched)
        if int(num_sched.sum()) == num_reqs * q:
            return True
        padded = self.buffers.seq_lens_np[:num_reqs] + (q - num_sched)
        return int(padded.max()) <= self.max_model_len

    def lay_out(self, num_sched: np.ndarray) -> torch.Tensor:
        """Move the flat tokens of requests with n_i <= q tokens into rows of q.

        Request i's tokens go to [i*q, i*q + n_i); its padding (ids 0, slot -1:
        no KV written) follows them, and its sequence length grows by q - n_i
        (see the module docstring). Returns the flat -> row index [total]
        (int64, on the device) that gathers the real hidden states back.
        """
        buf, q = self.buffers, self.query_len
        num_reqs = len(num_sched)
        total = int(num_sched.sum())
        rows, offsets = buf.token_rows(num_sched, np.cumsum(num_sched), total)
        self._index_np[:total] = rows * q + offsets
        index = self.index[:total]
        index.copy_(self.index_cpu[:total], non_blocking=True)
        for flat_buf, pad in ((buf.input_ids, 0), (buf.positions, 0), (buf.slot_mapping, -1)):
            flat = flat_buf[:total].clone()
            flat_buf[: num_reqs * q].fill_(pad)
            flat_buf.index_copy_(0, index, flat)
        buf.query_start_loc_np[: num_reqs + 1] = buf.arange[: num_reqs + 1] * q
        buf.seq_lens_np[:num_reqs] += (q - num_sched).astype(np.int32)
        buf.query_start_loc[: num_reqs + 1].copy_(
            buf.query_start_loc_cpu[: num_reqs + 1], non_blocking=True
        )
        # Grown on the device, not re-uploaded: async speculative decoding corrected the
        # device's seq_lens already (async_spec.py); the host's are upper bounds there.
        self._index_np[total : total + num_reqs] = q - num_sched
        pad = self.index[total : total + num_reqs]
        pad.copy_(self.index_cpu[total : total + num_reqs], non_blocking=True)
        buf.seq_lens[:num_reqs] += pad.to(buf.seq_lens.dtype)
        return index

    def pad(self, num_reqs: int, size: int) -> None:
        """Make requests num_reqs..size of the buffers harmless padded rows of q tokens."""
        if size == num_reqs:  # nothing to pad (eight calls of host time saved a step)
            return
        buf, q = self.buffers, self.query_len
        lo, hi = num_reqs * q, size * q
        buf.input_ids[lo:hi].zero_()
        buf.positions[lo:hi].zero_()
        buf.slot_mapping[lo:hi].fill_(-1)
        buf.seq_lens[num_reqs:size].zero_()
        buf.query_start_loc_np[num_reqs + 1 : size + 1] = buf.arange[num_reqs + 1 : size + 1] * q
        buf.query_start_loc[num_reqs + 1 : size + 1].copy_(
            buf.query_start_loc_cpu[num_reqs + 1 : size + 1], non_blocking=True
        )
