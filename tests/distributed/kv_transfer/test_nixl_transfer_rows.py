"""The descriptor rows a NIXL READ is built from: one per run of consecutive blocks."""

import pytest

from vllm.distributed.kv_transfer.kv_connector.v1.nixl_connector import (
    block_runs,
    transfer_rows,
)

PAGE = 64 << 10  # one block of one layer, bytes


def test_runs_follow_both_sides():
    assert block_runs([4, 5, 6, 9, 10], [0, 1, 2, 3, 4]) == [(4, 0, 3), (9, 3, 2)]
    assert block_runs([1, 2, 3], [7, 9, 10]) == [(1, 7, 1), (2, 9, 2)]
    assert block_runs([], []) == []


def test_packed_layers_get_one_row_per_run_and_layer():
    local = {"l0": (0x1000_0000, PAGE, PAGE), "l1": (0x2000_0000, PAGE, PAGE)}
    remote = {"l0": (0x9000_0000, PAGE, PAGE), "l1": (0xA000_0000, PAGE, PAGE)}
    lrows, rrows = transfer_rows(local, remote, [4, 5, 6, 9], [0, 1, 2, 3], 0, 1)
    assert lrows == [(0x1000_0000 + 4 * PAGE, 3 * PAGE, 0), (0x1000_0000 + 9 * PAGE, PAGE, 0),
                     (0x2000_0000 + 4 * PAGE, 3 * PAGE, 0), (0x2000_0000 + 9 * PAGE, PAGE, 0)]
    assert rrows == [(0x9000_0000, 3 * PAGE, 1), (0x9000_0000 + 3 * PAGE, PAGE, 1),
                     (0xA000_0000, 3 * PAGE, 1), (0xA000_0000 + 3 * PAGE, PAGE, 1)]


def test_strided_blocks_get_one_row_each():
    # The remote side keeps a gap after each block: runs cannot span it.
    local = {"l0": (0x1000, PAGE, PAGE)}
    remote = {"l0": (0x8000_0000, 2 * PAGE, PAGE)}
    lrows, rrows = transfer_rows(local, remote, [1, 2], [5, 6], 0, 0)
    assert lrows == [(0x1000 + PAGE, PAGE, 0), (0x1000 + 2 * PAGE, PAGE, 0)]
    assert rrows == [(0x8000_0000 + 10 * PAGE, PAGE, 0), (0x8000_0000 + 12 * PAGE, PAGE, 0)]


def test_other_block_bytes_are_refused():
    with pytest.raises(ValueError, match="remote blocks are"):
        transfer_rows({"l0": (0, PAGE, PAGE)}, {"l0": (0, 2 * PAGE, 2 * PAGE)}, [0], [0], 0, 0)
