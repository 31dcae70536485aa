"""Qwen2-VL through `vllm serve`'s chat API: data: URI images give transformers' greedy
tokens (0, 1, 2 images); hostile image parts get 400s naming the part, and the server
keeps serving; http(s) and file:// images follow their rules."""

from __future__ import annotations

import base64
import http.server
import io
import json
import threading
import time

import httpx
import pytest

from tests.entrypoints.openai.utils import RemoteServer, error_of
from tests.multimodal.qwen2_vl_checkpoint import IMAGE_PLACEHOLDER, image

MAX_TOKENS = 8
MAX_IMAGE_BYTES = 100_000
IMAGES = {"small": image(50, 50, 1), "wide": image(90, 50, 2), "large": image(120, 110, 3)}


def _png(img) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


def _data_url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64," + base64.b64encode(data).decode()


class _Media(http.server.BaseHTTPRequestHandler):
    """/ok.png an image, /slow.png one that takes longer than the fetch timeout, else 404."""

    def do_GET(self):  # http.server calls it by this name
        if self.path == "/trickle.png":  # a byte every 0.2 s, each within the read timeout
            self._trickle(_png(IMAGES["small"]))
            return
        if self.path == "/slow.png":
            time.sleep(3)
        if self.path in ("/ok.png", "/slow.png"):
            body = _png(IMAGES["small"])
            self.send_response(200)
            self.send_header("Content-Type", "image/png")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
            return
        self.send_error(404)

    def _trickle(self, body: bytes) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "image/png")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        try:
            for k in range(30):  # 6 s, then the rest: a whole image unless cut off
                self.wfile.write(body[k:k + 1])
                self.wfile.flush()
                time.sleep(0.2)
            self.wfile.write(body[30:])
        except OSError:  # the server gave up and closed the connection
            pass

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def media_server():
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Media)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()


@pytest.fixture(scope="module")
def media_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("media")
    (directory / "small.png").write_bytes(_png(IMAGES["small"]))
    return directory


@pytest.fixture(scope="module")
def vl_server(qwen2_vl_dir, media_dir):
    args = ["--model", str(qwen2_vl_dir), "--dtype", "float32", "--max-model-len", "256",
            "--max-num-seqs", "8", "--max-num-batched-tokens", "64",
            "--kv-cache-memory-bytes", "64MiB", "--limit-mm-per-prompt", '{"image": 2}',
            "--allowed-local-media-path", str(media_dir), "--uvicorn-log-level", "warning",
            "--disable-log-stats"]
    env = {"VLLM_IMAGE_FETCH_TIMEOUT": "1", "VLLM_MAX_IMAGE_BYTES": str(MAX_IMAGE_BYTES)}
    with RemoteServer(args, env=env) as remote:
        yield remote


def _chat(server, content, **extra) -> httpx.Response:
    body = {"model": server.model_name, "messages": [{"role": "user", "content": content}],
            "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True, **extra}
    return httpx.post(server.url_for("v1/chat/completions"), json=body, timeout=120)


@pytest.fixture(scope="module")
def served(vl_server, qwen2_vl_dir):
    vl_server.model_name = str(qwen2_vl_dir)
    return vl_server


def _parts(names: list[str]) -> list[dict]:
    parts: list[dict] = [{"type": "text", "text": "Look: "}]
    for name in names:
        parts.append({"type": "image_url", "image_url": {"url": _data_url(_png(IMAGES[name]))}})
        parts.append({"type": "text", "text": " then"})
    return parts


@pytest.mark.parametrize("names", [[], ["wide"], ["large", "small"]], ids=["0", "1", "2"])
def test_chat_with_data_urls_matches_transformers(served, qwen2_vl_dir, qwen2_vl_reference,
                                                  names):
    from transformers import AutoTokenizer

    response = _chat(served, _parts(names))
    assert response.status_code == 200, response.text
    got = response.json()["choices"][0]["message"]["content"]
    tok = AutoTokenizer.from_pretrained(qwen2_vl_dir)
    text = tok.apply_chat_template(
        [{"role": "user", "content": "Look: " + "".join(f"{IMAGE_PLACEHOLDER} then"
                                                        for _ in names)}],
        add_generation_prompt=True, tokenize=False)
    ids = tok.encode(text, add_special_tokens=False)
    want = qwen2_vl_reference(ids, [IMAGES[n] for n in names], MAX_TOKENS)
    assert got == tok.decode(want)
    expected_prompt = len(ids) + sum({"wide": 6, "large": 16, "small": 4}[n] - 1 for n in names)
    assert response.json()["usage"]["prompt_tokens"] == expected_prompt


def _truncated_png() -> bytes:
    return _png(IMAGES["large"])[:400]


def _too_many_bytes() -> bytes:
    return _png(image(300, 300, 7))  # random pixels do not compress: ~270 kB


@pytest.mark.parametrize("url, param, message", [
    (_data_url(b"this is plain text, not an image"), "messages.0.content.1.image_url.url",
     "not an image"),
    (_data_url(_truncated_png()), "messages.0.content.1.image_url.url", "cannot be decoded"),
    (_data_url(_too_many_bytes()), "messages.0.content.1.image_url.url", "too large"),
    ("data:image/png;base64,@@@not-base64@@@", "messages.0.content.1.image_url.url",
     "not valid base64"),
    ("ftp://example.com/x.png", "messages.0.content.1.image_url.url", "unsupported image URL"),
    ("file:///etc/passwd", "messages.0.content.1.image_url.url",
     "outside --allowed-local-media-path"),
    ("{media}/missing.png", "messages.0.content.1.image_url.url", "HTTP 404"),
    ("{media}/slow.png", "messages.0.content.1.image_url.url", "timed out"),
    # The timeout is for the whole download (it was per read: this took 6 s and decoded).
    ("{media}/trickle.png", "messages.0.content.1.image_url.url", "timed out"),
    ("http://127.0.0.1:9/refused.png", "messages.0.content.1.image_url.url",
     "fetching the image failed"),
], ids=["not-an-image", "truncated", "too-large", "bad-base64", "scheme", "file-outside",
        "http-404", "http-timeout", "http-trickle", "http-refused"])
def test_hostile_image_is_a_400_naming_the_part(served, media_server, url, param, message):
    content = [{"type": "text", "text": "x"},
               {"type": "image_url", "image_url": {"url": url.replace("{media}", media_server)}}]
    response = _chat(served, content)
    assert response.status_code == 400, response.text
    error = error_of(response)
    assert error["param"] == param and message in error["message"], error
    # The engine keeps serving.
    assert _chat(served, _parts(["small"])).status_code == 200


def test_too_many_images_is_a_400(served):
    response = _chat(served, _parts(["small", "small", "small"]))
    assert response.status_code == 400, response.text
    error = error_of(response)
    assert error["param"] == "messages.0.content.5.image_url", error
    assert "more than 2 image(s)" in error["message"]


def test_http_and_allowed_file_urls_load(served, media_server, media_dir):
    by_data = _chat(served, _parts(["small"])).json()["choices"][0]["message"]["content"]
    for url in (f"{media_server}/ok.png", f"file://{media_dir}/small.png"):
        content = [{"type": "text", "text": "Look: "},
                   {"type": "image_url", "image_url": {"url": url}},
                   {"type": "text", "text": " then"}]
        response = _chat(served, content)
        assert response.status_code == 200, response.text
        assert response.json()["choices"][0]["message"]["content"] == by_data


def test_streamed_chat_with_an_image(served):
    whole = _chat(served, _parts(["wide"])).json()["choices"][0]["message"]["content"]
    with httpx.stream("POST", served.url_for("v1/chat/completions"), timeout=120, json={
            "model": served.model_name, "stream": True, "max_tokens": MAX_TOKENS,
            "temperature": 0, "ignore_eos": True,
            "messages": [{"role": "user", "content": _parts(["wide"])}]}) as response:
        lines = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
    chunks = [json.loads(line) for line in lines if line != "[DONE]"]
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert text == whole


def test_tokenize_counts_the_image_tokens_as_the_chat_api_does(served):
    """/tokenize with image parts expands each image's placeholder as the engine does (as
    vLLM's does): its count equals the chat reply's prompt_tokens, the number a client
    checks against max_model_len. It counted one token an image."""
    content = _parts(["wide", "large"])
    tokenized = httpx.post(served.url_for("tokenize"), timeout=120, json={
        "model": served.model_name, "messages": [{"role": "user", "content": content}]})
    assert tokenized.status_code == 200, tokenized.text
    reply = _chat(served, content)
    assert tokenized.json()["count"] == reply.json()["usage"]["prompt_tokens"]
    assert tokenized.json()["tokens"].count(508) == 6 + 16  # <|image_pad|>


def test_an_image_the_processor_rejects_is_a_400_naming_its_part(served):
    """An image that decodes but that transformers' image processor refuses (an aspect
    ratio over 200): the 400 names the chat part, as for an image that does not decode
    (it named multi_modal_data.image.1, a field the request does not have)."""
    content = _parts(["small"]) + [
        {"type": "image_url", "image_url": {"url": _data_url(_png(image(1000, 4, 4)))}}]
    response = _chat(served, content)
    assert response.status_code == 400, response.text
    error = error_of(response)
    assert error["param"] == "messages.0.content.3.image_url.url", error
    assert error["message"].startswith("messages.0.content.3.image_url.url: the image "
                                       "processor rejected the image: absolute aspect ratio")
    assert _chat(served, _parts(["small"])).status_code == 200


def test_placeholder_text_beside_an_image_part_is_a_400_naming_messages(served):
    """A chat text part that writes the image placeholder itself: the prompt then has more
    placeholders than images, and the 400 names messages (it named multi_modal_data)."""
    content = [{"type": "text", "text": IMAGE_PLACEHOLDER}] + _parts(["small"])
    response = _chat(served, content)
    assert response.status_code == 400, response.text
    assert error_of(response)["param"] == "messages"
    assert "2 image placeholder token(s)" in error_of(response)["message"]


def test_an_unsupported_part_type_names_what_is_supported(served):
    """On a multimodal model the 400 said "only 'text' parts are", which image_url is not."""
    response = _chat(served, [{"type": "input_image", "image_url": _data_url(_png(
        IMAGES["small"]))}, {"type": "text", "text": "x"}])
    assert response.status_code == 400, response.text
    error = error_of(response)
    assert error["param"] == "messages.0.content.0.type"
    assert "'image_url' / 'image_pil' with a multimodal model" in error["message"]
