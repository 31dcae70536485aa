"""`kv_transfer_params` checks (400 with param "kv_transfer_params") and parsing."""

from __future__ import annotations

import pytest

from vllm.distributed.kv_transfer.kv_transfer_params import (
    RemotePrefill,
    check_kv_transfer_params,
    check_kv_transfer_request,
    parse_kv_transfer_params,
)
from vllm.exceptions import VLLMValidationError

GOOD = {"do_remote_prefill": True, "do_remote_decode": False, "remote_block_ids": [3, 4],
        "remote_engine_id": "e1", "remote_host": "10.0.0.5", "remote_port": 5600,
        "remote_request_id": "cmpl-1"}


@pytest.mark.parametrize("params, connector, message", [
    ({"do_remote_decode": True}, None, "needs a server started with --kv-transfer-config"),
    ([1], "NixlConnector", "must be an object, got list"),
    ({"do_remote_decode": True, "x": 1}, "NixlConnector", r"unknown keys \['x'\]"),
    ({"do_remote_decode": "yes"}, "NixlConnector", "do_remote_decode must be a boolean"),
    ({**GOOD, "remote_port": "5600"}, "NixlConnector", "remote_port must be a int"),
    ({**GOOD, "remote_block_ids": [1, -2]}, "NixlConnector", "non-negative ints"),
    ({**GOOD, "remote_engine_id": None}, "NixlConnector", "remote_engine_id must be a str"),
    ({**GOOD, "remote_epoch": "0"}, "NixlConnector", "remote_epoch must be a number"),
    ({**GOOD, "remote_port": -1}, "NixlConnector", r"remote_port must be a TCP port \(1-65535\)"),
    ({**GOOD, "remote_expires_at": True}, "NixlConnector", "remote_expires_at must be a number"),
])
def test_bad_params_name_the_field(params, connector, message):
    with pytest.raises(VLLMValidationError, match=message) as e:
        check_kv_transfer_params(params, connector)
    assert e.value.parameter == "kv_transfer_params"


def test_good_params_parse():
    check_kv_transfer_params(GOOD, "NixlConnector")
    check_kv_transfer_params({"do_remote_decode": True}, "NixlConnector")
    check_kv_transfer_params(None, None)
    assert parse_kv_transfer_params({"kv_transfer_params": GOOD}) == RemotePrefill(
        [3, 4], "e1", "10.0.0.5", 5600, "cmpl-1")
    assert parse_kv_transfer_params({"kv_transfer_params": {"do_remote_decode": True}}) is None
    assert parse_kv_transfer_params(None) is None


@pytest.mark.parametrize("params, num_prompt_tokens, n, message", [
    ({**GOOD, "remote_block_ids": [3]}, 33, 1,
     r"remote_block_ids holds 1 block\(s\); this prompt's 33 tokens need 2 of 16"),
    ({**GOOD, "remote_block_ids": []}, 20, 1, "holds 0 block"),
    (GOOD, 10, 2, "kv_transfer_params needs n=1"),
    ({"do_remote_decode": True}, 10, 3, "kv_transfer_params needs n=1"),
])
def test_params_that_do_not_fit_the_request(params, num_prompt_tokens, n, message):
    """One transfer feeds one sequence, from as many remote blocks as the prompt's tokens
    but its last fill (16 a block here); anything else would read the wrong KV."""
    with pytest.raises(VLLMValidationError, match=message) as e:
        check_kv_transfer_request(params, num_prompt_tokens, 16, n)
    assert e.value.parameter == "kv_transfer_params"


def test_params_that_fit_the_request():
    check_kv_transfer_request(GOOD, 33, 16, 1)  # 32 tokens to read: 2 blocks
    check_kv_transfer_request(None, 10, 16, 4)
    check_kv_transfer_request({"do_remote_decode": True}, 10, 16, 1)
