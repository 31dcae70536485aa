"""One `vllm serve` on the bundled model for the whole session (started on first use),
and the offline `LLM` as the greedy reference."""

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


@pytest.fixture(scope="session")
def offline_llm(bundled_llm):
    """The offline engine on the same model and context length (the greedy reference)."""
    return bundled_llm
