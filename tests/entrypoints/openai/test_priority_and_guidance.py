"""Issue 47's engine options over HTTP, on one scripted-model server (one start-up):
`priority` (completions and chat) with `--scheduling-policy priority`, and its 400
under the default fcfs policy (vLLM refuses it there too); structured outputs with
`--structured-outputs-config '{"backend": "llguidance"}'` (streaming or not, a request
naming another backend is a 400 as in vLLM V1)."""

from __future__ import annotations

import asyncio
import json
import re
import time
import unicodedata

import httpx
import jsonschema
import pytest

from tests.entrypoints.openai.scripted_model import build_scripted_model
from tests.entrypoints.openai.utils import RemoteServer
from tests.v1.structured_output.schemas import SCHEMA

pytestmark = pytest.mark.slow  # real engines
MODEL = "scripted"
_GAUGE = r"^vllm:num_requests_{}\{{[^}}]*\}} (\S+)$"


@pytest.fixture(scope="module")
def priority_server(tmp_path_factory):
    model_dir = build_scripted_model(tmp_path_factory.mktemp("scripted"))
    args = [str(model_dir), "--served-model-name", MODEL, "--max-model-len", "512",
            "--max-num-seqs", "1", "--max-num-batched-tokens", "128",
            "--kv-cache-memory-bytes", "16MiB", "--uvicorn-log-level", "warning",
            "--disable-log-stats", "--scheduling-policy", "priority",
            "--structured-outputs-config",
            '{"backend": "llguidance", "disable_any_whitespace": true}']
    with RemoteServer(args) as remote:
        yield remote


def _gauge(client: httpx.Client, name: str) -> float:
    """/metrics' vllm:num_requests_{name} (waiting, running)."""
    return float(re.search(_GAUGE.format(name), client.get("/metrics").text, re.M).group(1))


def _num_waiting(client: httpx.Client) -> float:
    return _gauge(client, "waiting")


def _running(client: httpx.Client) -> float:
    return _gauge(client, "running")


def test_lower_priority_value_is_served_first(priority_server):
    """One seat, held by a long request; a completion (priority 5) and then a chat
    (priority -1) queue behind it. The chat gets the seat first, though it came later.

    The order is read from when each stream's first token arrives (a request's first
    token comes out of its first engine step), not from when whole replies arrive: the
    blocker's 480-token reply and a short reply's few steps race in the frontend."""
    url = priority_server.url_for("v1")
    blocker = {"model": MODEL, "prompt": "Hello", "max_tokens": 480, "ignore_eos": True}
    late_urgent = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}],
                   "max_tokens": 32, "ignore_eos": True, "priority": -1}
    early_lax = {"model": MODEL, "prompt": "Paris", "max_tokens": 32, "ignore_eos": True,
                 "priority": 5}
    started: list[str] = []

    async def post(client, path, body, name):
        async with client.stream("POST", f"{url}/{path}", json={**body, "stream": True},
                                 timeout=120) as response:
            assert response.status_code == 200, await response.aread()
            async for line in response.aiter_lines():
                if not line.startswith("data: {") or name in started:
                    continue
                choice = json.loads(line[6:])["choices"][0]
                if choice.get("text") or (choice.get("delta") or {}).get("content"):
                    started.append(name)  # its first token

    async def main():
        async with httpx.AsyncClient() as client:
            first = asyncio.create_task(post(client, "completions", blocker, "blocker"))
            with httpx.Client(base_url=priority_server.url) as sync:
                deadline = time.monotonic() + 60
                while _num_waiting(sync) or not _running(sync):  # the blocker holds the seat
                    assert time.monotonic() < deadline
                    await asyncio.sleep(0.01)
                lax = asyncio.create_task(post(client, "completions", early_lax, "early_lax"))
                while _num_waiting(sync) < 1:
                    await asyncio.sleep(0.005)
                urgent = asyncio.create_task(
                    post(client, "chat/completions", late_urgent, "late_urgent"))
                while _num_waiting(sync) < 2:
                    await asyncio.sleep(0.005)
                assert not first.done(), "the blocker finished before both others queued"
            await asyncio.gather(first, lax, urgent)

    asyncio.run(main())
    assert started == ["blocker", "late_urgent", "early_lax"]


def test_nonzero_priority_is_a_400_under_fcfs(server):
    for path, body in [("completions", {"prompt": "Hi"}),
                       ("chat/completions", {"messages": [{"role": "user", "content": "Hi"}]})]:
        response = httpx.post(server.url_for("v1", path), timeout=60,
                              json={"model": server.get_client().models.list().data[0].id,
                                    "max_tokens": 2, "priority": 3, **body})
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["param"] == "priority"
        assert "--scheduling-policy priority" in error["message"]
    bad = httpx.post(server.url_for("v1", "completions"), timeout=60,
                     json={"prompt": "Hi", "max_tokens": 2, "priority": "high"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "priority", bad.text


def test_llguidance_backend_over_http(priority_server):
    """JSON schema (chat, streamed and not) and regex (completions) replies conform;
    a constraint only llguidance parses is served; naming xgrammar per request is a 400."""
    client = priority_server.get_client()
    response_format = {"type": "json_schema", "json_schema": {"name": "pet", "schema": SCHEMA}}
    messages = [{"role": "user", "content": "A pet"}]
    reply = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=60,
                                           response_format=response_format, temperature=0)
    jsonschema.validate(json.loads(reply.choices[0].message.content), SCHEMA)
    stream = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=60,
                                            response_format=response_format, stream=True,
                                            temperature=0)
    text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    assert json.loads(text) == json.loads(reply.choices[0].message.content)  # greedy
    texts = [client.completions.create(
        model=MODEL, prompt="Code:", max_tokens=12,
        extra_body={"structured_outputs": {"regex": regex}}).choices[0].text
        for regex in (r"[0-9]{3}-[a-z]{2}", r"\p{Lu}{2}")]  # the second: not xgrammar's syntax
    assert re.fullmatch(r"[0-9]{3}-[a-z]{2}", texts[0]), texts[0]
    assert len(texts[1]) == 2 and all(unicodedata.category(c) == "Lu" for c in texts[1])
    url = priority_server.url_for("v1", "completions")
    for backend, status in [("guidance", 200), ("xgrammar", 400)]:
        response = httpx.post(url, timeout=60, json={
            "model": MODEL, "prompt": "Code:", "max_tokens": 8, "guided_regex": "[0-9]+",
            "guided_decoding_backend": backend})
        assert response.status_code == status, response.text
    assert response.json()["error"]["param"] == "guided_decoding_backend"
