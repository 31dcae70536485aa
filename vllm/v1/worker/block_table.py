"""The block table: for each request row, the ids of the KV blocks holding its tokens.

    row r:  block_ids[r] = [b0, b1, b2, ...]      (logical block i -> physical block)
    token at position p of row r lives in slot
        slot = block_ids[r][p // block_size] * block_size + p % block_size

The host copy is edited incrementally as the scheduler hands out blocks; the
device copy is refreshed once per step (`copy_to_device`: one H2D copy of the
rows in use; named so it cannot be mistaken for the VMM commit of KV pages).
Unused entries hold 0, the null block, so a stray read stays in bounds.
"""

from __future__ import annotations

import numpy as np
import torch


class BlockTable:
    """Per-row block ids, host and device.

    Args:
        max_num_reqs: rows.
        max_num_blocks_per_req: columns, ceil(max_model_len / block_size).
        block_size: tokens per block.
        device: where the device copy lives.
        pin_memory: pin the host copy for asynchronous H2D copies.
    """

    def __init__(
        self,
        max_num_reqs: int,
        max_num_blocks_per_req: int,
        block_size: int,
        device: torch.device,
        pin_memory: bool,
    ) -> None:
        self.block_size = block_size
        self.max_num_blocks_per_req = max_num_blocks_per_req
        self.cpu = torch.zeros(
            (max_num_reqs, max_num_blocks_per_req), dtype=torch.int32, pin_memory=pin_memory
        )
        self.np = self.cpu.numpy()  # [max_num_reqs, max_num_blocks_per_req] int32, aliases cpu
        self.num_blocks_per_row = np.zeros(max_num_reqs, dtype=np.int32)
        self.device_tensor = torch.zeros(
            (max_num_reqs, max_num_blocks_per_req), dtype=torch.int32, device=device
        )
        # num_reqs -> (device rows, host rows): views made once (a slice costs microseconds).
        self._rows: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def set_row(self, row: int, block_ids: list[int]) -> None:
        n = len(block_ids)
        if n > self.max_num_blocks_per_req:
            raise ValueError(
                f"row {row} needs {n} blocks, more than max_num_blocks_per_req "
                f"({self.max_num_blocks_per_req})"
            )
        self.np[row, :n] = block_ids
        self.np[row, n : self.num_blocks_per_row[row]] = 0
        self.num_blocks_per_row[row] = n

    def append_row(self, row: int, block_ids: list[int]) -> None:
        if not block_ids:
            return
        start = int(self.num_blocks_per_row[row])
        end = start + len(block_ids)
        if end > self.max_num_blocks_per_req:
            raise ValueError(
                f"row {row} needs {end} blocks, more than max_num_blocks_per_req "
                f"({self.max_num_blocks_per_req})"
            )
        self.np[row, start:end] = block_ids
        self.num_blocks_per_row[row] = end

    def move_row(self, src: int, dst: int) -> None:
        n = int(max(self.num_blocks_per_row[src], self.num_blocks_per_row[dst]))
        self.np[dst, :n] = self.np[src, :n]
        self.num_blocks_per_row[dst] = self.num_blocks_per_row[src]

    def clear_row(self, row: int) -> None:
        self.np[row, : self.num_blocks_per_row[row]] = 0
        self.num_blocks_per_row[row] = 0

    def slot_mapping(self, req_indices: np.ndarray, positions: np.ndarray) -> np.ndarray:
        """Slots for tokens at `positions` of rows `req_indices` (both [T]); returns [T] int64."""
        block_numbers = self.np[req_indices, positions // self.block_size].astype(np.int64)
        return block_numbers * self.block_size + positions % self.block_size

    def copy_to_device(self, num_reqs: int) -> torch.Tensor:
        """Copy the first `num_reqs` rows to the device; returns the device rows."""
        rows = self._rows.get(num_reqs)
        if rows is None:
            rows = self._rows[num_reqs] = (self.device_tensor[:num_reqs], self.cpu[:num_reqs])
        rows[0].copy_(rows[1], non_blocking=True)
        return rows[0]
