"""`vllm serve --speculative-config`: the engine-core process verifies drafts, the text is
the greedy text without speculation, and /metrics carries vllm:spec_decode_* counters."""

from __future__ import annotations

import json
import time

import httpx
import pytest

from tests.entrypoints.openai.utils import (
    DEFAULT_SERVER_ARGS,
    MODEL_NAME,
    RemoteServer,
    scrape_metrics,
)
from vllm import SamplingParams

pytestmark = pytest.mark.slow  # a real server on the bundled model

SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2,
        "prompt_lookup_max": 4}
PROMPT = ("Repeat exactly: the quick brown fox jumps over the lazy dog. the quick brown fox "
          "jumps over the lazy dog. the quick brown fox")


@pytest.fixture(scope="module")
def spec_server():
    with RemoteServer([*DEFAULT_SERVER_ARGS, "--speculative-config", json.dumps(SPEC)]) as s:
        yield s


def test_completion_equal_and_counters(spec_server, bundled_llm):
    body = {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 20, "temperature": 0}
    response = httpx.post(spec_server.url_for("v1/completions"), json=body, timeout=120)
    assert response.status_code == 200, response.text
    text = response.json()["choices"][0]["text"]
    ref = bundled_llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=20),
                               use_tqdm=False)[0].outputs[0].text
    assert text == ref
    metrics = {}
    for _ in range(100):  # stats land right after the step that made them
        metrics = scrape_metrics(spec_server)
        if metrics.get("vllm:spec_decode_num_drafts_total"):
            break
        time.sleep(0.05)
    drafts = metrics["vllm:spec_decode_num_drafts_total"]
    draft_tokens = metrics["vllm:spec_decode_num_draft_tokens_total"]
    accepted = metrics["vllm:spec_decode_num_accepted_tokens_total"]
    per_pos = [metrics[f"vllm:spec_decode_num_accepted_tokens_per_pos_total{{position={i}}}"]
               for i in range(3)]
    assert drafts > 0 and 0 < accepted <= draft_tokens <= 3 * drafts
    assert sum(per_pos) == accepted


def test_bad_config_is_rejected_at_start():
    import subprocess
    import sys

    proc = subprocess.run(
        [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", "--speculative-config",
         json.dumps({"method": "draft_model", "num_speculative_tokens": 2})],
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 2
    assert "speculative_config: method 'draft_model' needs a model path" in proc.stderr
