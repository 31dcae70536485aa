"""`kv_transfer_params` checks (400 with param "kv_transfer_params") and parsing."""

from __future__ import annotations

import pytest

from vllm.distributed.kv_transfer.kv_transfer_params import (
    RemotePrefill,
    check_kv_transfer_params,
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
