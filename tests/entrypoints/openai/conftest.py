"""One `vllm serve` on the bundled model for the whole session (started on first use);
the offline `LLM` greedy reference (`offline_llm`) is in tests/conftest.py."""

from __future__ import annotations

import pytest

from tests.entrypoints.openai.utils import DEFAULT_SERVER_ARGS, RemoteServer


@pytest.fixture(scope="session")
def server():
    with RemoteServer(DEFAULT_SERVER_ARGS) as remote:
        yield remote


@pytest.fixture(scope="session")
def client(server):
    return server.get_client()
