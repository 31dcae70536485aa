"""Block hashing and the free block queue."""

import hashlib
import pickle
import struct

import pytest

from tests.v1.core.fake_runner import make_request
from vllm.v1.core.kv_cache_utils import (
    NONE_HASH,
    FreeKVCacheBlockQueue,
    KVCacheBlock,
    hash_block_tokens,
    update_request_block_hashes,
)


def _ids(blocks):
    return [b.block_id for b in blocks]


# ---- hashing ----


def test_hash_matches_documented_byte_layout():
    parent = hash_block_tokens(None, [1, 2, 3, 4])
    expected_first = hashlib.sha256(NONE_HASH + struct.pack("<I4q", 4, 1, 2, 3, 4)).digest()
    assert parent == expected_first
    child = hash_block_tokens(parent, [5, 6, 7, 8], ("salt",))
    payload = parent + struct.pack("<I4q", 4, 5, 6, 7, 8) + pickle.dumps(("salt",), protocol=4)
    assert child == hashlib.sha256(payload).digest()
    assert len(child) == 32


def test_hash_chaining_depends_on_parent_tokens_and_extra_keys():
    a = hash_block_tokens(None, [1, 2, 3, 4])
    b = hash_block_tokens(None, [1, 2, 3, 5])
    assert a != b
    # Same block content after different prefixes hashes differently.
    assert hash_block_tokens(a, [9, 9, 9, 9]) != hash_block_tokens(b, [9, 9, 9, 9])
    # Deterministic.
    assert hash_block_tokens(a, [9, 9, 9, 9]) == hash_block_tokens(a, [9, 9, 9, 9])
    # Extra keys separate otherwise equal blocks, and differ among themselves.
    plain = hash_block_tokens(a, [9, 9, 9, 9])
    salted = hash_block_tokens(a, [9, 9, 9, 9], ("x",))
    assert plain != salted != hash_block_tokens(a, [9, 9, 9, 9], ("y",))
    # None parent is the documented NONE_HASH parent.
    assert hash_block_tokens(NONE_HASH, [1, 2, 3, 4]) == a


def test_hash_length_prefix_keeps_tokens_and_extra_keys_apart():
    # Without the length prefix, tokens [1] + extra bytes could collide with longer token lists.
    assert hash_block_tokens(None, [1, 2]) != hash_block_tokens(None, [1], (2,))
    assert hash_block_tokens(None, []) != hash_block_tokens(None, [0])


def test_request_block_hashes_cover_full_blocks_incrementally():
    req = make_request("r", list(range(10)))
    hashes = update_request_block_hashes(req, block_size=4)
    assert hashes is req.block_hashes
    h0 = hash_block_tokens(None, [0, 1, 2, 3])
    h1 = hash_block_tokens(h0, [4, 5, 6, 7])
    assert req.block_hashes == [h0, h1]  # 2 tokens of block 2 are not hashed
    req.append_output_token_ids([10, 11])
    update_request_block_hashes(req, block_size=4)
    assert req.block_hashes == [h0, h1, hash_block_tokens(h1, [8, 9, 10, 11])]


def test_cache_salt_enters_first_block_and_propagates():
    plain = make_request("a", list(range(8)))
    salted = make_request("b", list(range(8)), cache_salt="tenant-1")
    update_request_block_hashes(plain, 4)
    update_request_block_hashes(salted, 4)
    s0 = hash_block_tokens(None, [0, 1, 2, 3], ("tenant-1",))
    assert salted.block_hashes == [s0, hash_block_tokens(s0, [4, 5, 6, 7])]
    assert not set(plain.block_hashes) & set(salted.block_hashes)


# ---- KVCacheBlock ----


def test_block_hash_set_once_then_reset():
    block = KVCacheBlock(3)
    block.block_hash = hash_block_tokens(None, [1])
    with pytest.raises(ValueError, match="block 3 already has a hash"):
        block.block_hash = hash_block_tokens(None, [2])
    block.reset_hash()
    assert block.block_hash is None
    assert "block_id=3" in repr(block)


# ---- FreeKVCacheBlockQueue ----


def test_free_queue_popleft_append_remove_order():
    blocks = [KVCacheBlock(i) for i in range(6)]
    q = FreeKVCacheBlockQueue(blocks[1:])
    assert len(q) == 5 and _ids(q.get_all_free_blocks()) == [1, 2, 3, 4, 5]
    assert q.popleft() is blocks[1]
    q.remove(blocks[3])  # from the middle
    assert _ids(q.get_all_free_blocks()) == [2, 4, 5]
    assert blocks[3] not in q and blocks[4] in q
    q.append(blocks[3])
    q.append(blocks[1])
    assert _ids(q.get_all_free_blocks()) == [2, 4, 5, 3, 1]
    assert _ids(q.popleft_n(3)) == [2, 4, 5]
    assert q.num_free_blocks == 2
    q.remove(blocks[1])  # the tail
    q.remove(blocks[3])  # the last one
    assert len(q) == 0 and q.get_all_free_blocks() == []
    q.append(blocks[2])
    assert _ids(q.get_all_free_blocks()) == [2]


def test_free_queue_errors():
    blocks = [KVCacheBlock(i) for i in range(3)]
    q = FreeKVCacheBlockQueue(blocks[:2])
    with pytest.raises(ValueError, match="block 0 is already in the free queue"):
        q.append(blocks[0])
    with pytest.raises(ValueError, match="block 2 is not in the free queue"):
        q.remove(blocks[2])
    with pytest.raises(ValueError, match="asked for 3 free blocks but only 2"):
        q.popleft_n(3)
    q.popleft_n(2)
    with pytest.raises(ValueError, match="no free blocks"):
        q.popleft()
