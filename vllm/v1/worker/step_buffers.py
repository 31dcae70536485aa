"""`StepBuffers`: the runner's persistent per-step inputs, on the device and as host twins.

CUDA graphs replay fixed addresses, so every per-step input lives in one of
these buffers and is overwritten in place. A step writes the host twins
(through numpy views made once; pinned on CUDA) and sends each to the device
with one asynchronous copy (`upload`); no device op builds or pads an input.

    req_lens [lens_at + r] int32 (one buffer, one copy a step; r = max_num_reqs)
    +---------------------------+-----------+---------------------------+
    | query_start_loc [r + 1]   |  unused   | seq_lens [r]              |
    +---------------------------+-----------+---------------------------+
    0                           r + 1       lens_at = ceil((r + 1) / 32) x 32

`seq_lens` starts 128 bytes into the buffer: Triton specialises on a pointer's
16-byte alignment, and warmup compiled the kernels for aligned ones.
"""

from __future__ import annotations

import numpy as np
import torch


class StepBuffers:
    """The flat token inputs, per-request lengths and logits indices of one step.

    Args:
        max_num_tokens: most flat tokens of a step (the token buffers' length).
        max_num_reqs: most requests of a step.
        device: the model's device.
        pin_memory: pin the host twins, so the copies to the device are asynchronous.
    """

    def __init__(self, max_num_tokens: int, max_num_reqs: int, device: torch.device,
                 pin_memory: bool) -> None:
        n, r, pin = max_num_tokens, max_num_reqs, pin_memory
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=device)  # [max_num_tokens]
        self.positions = torch.zeros(n, dtype=torch.int64, device=device)  # [max_num_tokens]
        # [max_num_tokens] int64; -1: no KV slot (padding writes nothing).
        self.slot_mapping = torch.full((n,), -1, dtype=torch.int64, device=device)
        lens_at = -(-(r + 1) // 32) * 32  # see the module docstring
        self.req_lens = torch.zeros(lens_at + r, dtype=torch.int32, device=device)
        self.query_start_loc = self.req_lens[: r + 1]  # [max_num_reqs + 1] int32
        self.seq_lens = self.req_lens[lens_at:]  # [max_num_reqs] int32
        # Host staging twins (pinned on CUDA) for one asynchronous copy each.
        self.input_ids_cpu = torch.zeros(n, dtype=torch.int64, pin_memory=pin)
        self.positions_cpu = torch.zeros(n, dtype=torch.int64, pin_memory=pin)
        self.slot_mapping_cpu = torch.full((n,), -1, dtype=torch.int64, pin_memory=pin)
        self.req_lens_cpu = torch.zeros(lens_at + r, dtype=torch.int32, pin_memory=pin)
        self.query_start_loc_cpu = self.req_lens_cpu[: r + 1]
        self.seq_lens_cpu = self.req_lens_cpu[lens_at:]
        self.arange = np.arange(max(n, r) + 1, dtype=np.int64)
        self.arange.flags.writeable = False  # shared by every step's views
        self.ones = np.ones(r, dtype=np.int64)  # num_sched of an all-decode step (read-only)
        self.ones.flags.writeable = False
        # numpy views of the host twins, made once (each .numpy() costs microseconds).
        self.input_ids_np = self.input_ids_cpu.numpy()
        self.positions_np = self.positions_cpu.numpy()
        self.slot_mapping_np = self.slot_mapping_cpu.numpy()
        self.query_start_loc_np = self.query_start_loc_cpu.numpy()
        self.seq_lens_np = self.seq_lens_cpu.numpy()
        # Flat index of each sampling row's last token, for the logits.
        self.logits_indices = torch.zeros(r, dtype=torch.int64, device=device)  # [max_num_reqs]
        self.logits_indices_cpu = torch.zeros(r, dtype=torch.int64, pin_memory=pin)
        self.logits_indices_np = self.logits_indices_cpu.numpy()
        # (id(buffer), n) -> buffer[:n] for the buffers above, n <= max_num_reqs + 1.
        self._heads: dict[tuple[int, int], torch.Tensor] = {}
        self._max_kept_head = r + 1

    def head(self, buffer: torch.Tensor, n: int) -> torch.Tensor:
        """`buffer[:n]` of one of these buffers, made once for small n.

        A torch slice costs a few microseconds of host time and a decode step takes
        a dozen; for n <= max_num_reqs + 1 (the decode sizes) the view is kept, keyed
        by the buffer's id (the buffers live as long as the runner, so ids are not reused).
        """
        key = (id(buffer), n)
        view = self._heads.get(key)
        if view is None:
            view = buffer[:n]
            if n <= self._max_kept_head:
                self._heads[key] = view
        return view

    def upload(self, num_reqs: int, total: int, end: int, token_ids: np.ndarray,
               positions: np.ndarray, slots: np.ndarray, cu: np.ndarray,
               seq_lens: np.ndarray, end_reqs: int | None = None) -> None:
        """Write a step's inputs into the host twins and copy them to the device.

        Args:
            num_reqs, total: the step's requests and flat tokens.
            end: tokens of the graph the step replays, >= total; tokens total..end
                are padding (id 0, position 0, slot -1), written here so the same
                copies carry them and no device op pads.
            end_reqs: None for a decode graph (`end` requests, num_reqs..end padded
                ones of one padding token each, query_start_loc continued); else the
                requests of a mixed-batch graph (mixed_graphs.py), num_reqs..end_reqs
                padded ones owning no token (query_start_loc stays at `total`).
                Padded requests have seq_len 0.
            token_ids, positions, slots: [total] the flat tokens' ids, positions, KV slots.
            cu: [num_reqs] cumsum of the scheduled tokens per request.
            seq_lens: [num_reqs] each request's length after this step.
        """
        ids, pos, sl = self.input_ids_np, self.positions_np, self.slot_mapping_np
        ids[:total] = token_ids
        pos[:total] = positions
        sl[:total] = slots
        qsl, lens = self.query_start_loc_np, self.seq_lens_np
        qsl[0] = 0
        qsl[1 : num_reqs + 1] = cu
        lens[:num_reqs] = seq_lens
        if end > total:
            ids[total:end] = pos[total:end] = 0
            sl[total:end] = -1
        if end_reqs is not None:
            qsl[num_reqs + 1 : end_reqs + 1] = total
            lens[num_reqs:end_reqs] = 0
        elif end > total:
            qsl[num_reqs + 1 : end + 1] = self.arange[num_reqs + 1 : end + 1]
            lens[num_reqs:end] = 0
        head = self.head
        head(self.input_ids, end).copy_(head(self.input_ids_cpu, end), non_blocking=True)
        head(self.positions, end).copy_(head(self.positions_cpu, end), non_blocking=True)
        head(self.slot_mapping, end).copy_(head(self.slot_mapping_cpu, end), non_blocking=True)
        # Entries past `end` requests are stale on both sides and read by no kernel.
        self.req_lens.copy_(self.req_lens_cpu, non_blocking=True)

    def token_rows(self, num_sched: np.ndarray, cu: np.ndarray, total: int
                   ) -> tuple[np.ndarray, np.ndarray]:
        """[total] row of each flat token and [total] its offset inside its row's chunk
        (`cu` = cumsum(num_sched), `total` = its sum)."""
        rows = np.repeat(self.arange[: len(num_sched)], num_sched)
        offsets = self.arange[:total] - np.repeat(cu - num_sched, num_sched)
        return rows, offsets
