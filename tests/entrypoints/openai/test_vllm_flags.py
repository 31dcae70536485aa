"""vLLM's flags as launch scripts pass them: those that map onto this engine work
(a model id from a local Hugging Face cache, offline; HTTPS; a root path; ...), those
that do not are refused in one line that says so and what this fork does instead, and
configuration conflicts are refused before any process starts."""

from __future__ import annotations

import logging
import ssl
from pathlib import Path

import httpx
import openai
import pytest

from tests.entrypoints.openai.utils import DEFAULT_SERVER_ARGS, RemoteServer
from vllm.engine.arg_utils import EngineArgs
from vllm.entrypoints.cli.main import main
from vllm.transformers_utils.model_path import get_bundled_model_path, resolve_model

MODEL_ID = "SmolOrg/SmolLM2-135M-Instruct-GGUF"
COMMIT = "0123456789abcdef0123456789abcdef01234567"


def make_hf_cache(root: Path) -> Path:
    """A Hugging Face hub cache holding MODEL_ID at COMMIT (refs/main -> COMMIT), its one
    file being the bundled GGUF: the layout `huggingface_hub` writes."""
    repo = root / f"models--{MODEL_ID.replace('/', '--')}"
    snapshot = repo / "snapshots" / COMMIT
    snapshot.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    gguf = Path(get_bundled_model_path())
    (snapshot / gguf.name).symlink_to(gguf)
    return root


@pytest.fixture(scope="module")
def hf_cache(tmp_path_factory) -> Path:
    return make_hf_cache(tmp_path_factory.mktemp("hf-cache"))


@pytest.fixture
def offline(monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)


# ------------------------------------------------------------------ model ids
def test_a_model_id_resolves_from_the_local_cache_offline(hf_cache, offline):
    expected = str(hf_cache / f"models--{MODEL_ID.replace('/', '--')}" / "snapshots" / COMMIT
                   / Path(get_bundled_model_path()).name)
    assert resolve_model(MODEL_ID, None, str(hf_cache)) == expected
    assert resolve_model(MODEL_ID, "main", str(hf_cache)) == expected
    assert resolve_model(MODEL_ID, COMMIT, str(hf_cache)) == expected


def test_a_model_id_not_in_the_cache_is_one_line_offline(hf_cache, offline):
    with pytest.raises(FileNotFoundError, match=r"^model 'SmolOrg/SmolLM2-135M-Instruct-GGUF' "
                       r"\(revision v2\) is neither a local path nor in .* \(HF_HUB_OFFLINE is "
                       r"set: the local cache only\)$"):
        resolve_model(MODEL_ID, "v2", str(hf_cache))


def test_a_revision_with_a_local_path_is_refused(tmp_path):
    with pytest.raises(ValueError, match="applies to a Hugging Face model id"):
        resolve_model(get_bundled_model_path(), "main")
    with pytest.raises(ValueError, match="the bundled model"):
        EngineArgs(revision="main").validate()


def test_trust_remote_code_loads_a_repository_config_class(tmp_path):
    """A config class shipped in the model directory (`auto_map`) loads only with
    --trust-remote-code, as in vLLM; the architecture itself is one this fork has."""
    from tests.model_dirs import llama_config
    from vllm.transformers_utils.config import get_hf_config

    config = llama_config().to_dict()
    config.update(model_type="my_llama", architectures=["LlamaForCausalLM"],
                  auto_map={"AutoConfig": "configuration_my_llama.MyLlamaConfig"})
    import json

    (tmp_path / "config.json").write_text(json.dumps(config))
    (tmp_path / "configuration_my_llama.py").write_text(
        "from transformers import LlamaConfig\n\n\n"
        "class MyLlamaConfig(LlamaConfig):\n    model_type = 'my_llama'\n")
    with pytest.raises(ValueError, match="trust_remote_code"):
        get_hf_config(str(tmp_path))
    loaded = get_hf_config(str(tmp_path), trust_remote_code=True)
    assert type(loaded).__name__ == "MyLlamaConfig"
    assert loaded.hidden_size == config["hidden_size"]


# ------------------------------------------------------------------ accepted for one way
def test_kv_cache_dtype_auto_or_the_model_dtype(caplog):
    config = EngineArgs(kv_cache_dtype="float32", max_model_len=128).create_engine_config()
    assert str(config.model_config.dtype) == "torch.float32"  # CPU
    with pytest.raises(ValueError, match=r"^--kv-cache-dtype bfloat16 is not supported by this "
                       r"fork: the KV cache is kept in the model's dtype \(float32 here"):
        EngineArgs(kv_cache_dtype="bfloat16", max_model_len=128).create_engine_config()


def test_swap_space_is_accepted_with_a_warning(caplog):
    with caplog.at_level(logging.WARNING, logger="vllm"):
        EngineArgs(swap_space=4, max_model_len=128).create_engine_config()
    assert any("--swap-space 4 is accepted and has no effect" in r.getMessage()
               for r in caplog.records), caplog.text


def test_image_flags_on_a_text_only_model_are_accepted_with_a_warning(caplog, tmp_path):
    """--limit-mm-per-prompt / --allowed-local-media-path on the (text-only) bundled model:
    vLLM accepts them; they were accepted silently, now one warning says they do nothing."""
    with caplog.at_level(logging.WARNING, logger="vllm"):
        EngineArgs(limit_mm_per_prompt={"image": 2}, allowed_local_media_path=str(tmp_path),
                   max_model_len=128).create_engine_config()
    (warning,) = [r.getMessage() for r in caplog.records if "no effect" in r.getMessage()]
    assert warning == ("--limit-mm-per-prompt, --allowed-local-media-path are accepted and "
                       "have no effect: the model (LlamaForCausalLM) is text-only and takes "
                       "no images")
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="vllm"):
        EngineArgs(max_model_len=128).create_engine_config()
    assert not [r for r in caplog.records if "no effect" in r.getMessage()]


# ------------------------------------------------------------------ refused
REFUSED = [
    (["--quantization", "awq"], "--quantization awq is not supported by this fork: it loads "
                                "HF safetensors"),
    (["--enable-lora"], "--enable-lora is not supported by this fork: it serves one set"),
    (["--no-enable-chunked-prefill"], "--no-enable-chunked-prefill is not supported by this "
                                      "fork: prefills are always chunked"),
    (["--kv-cache-dtype", "fp8"], "--kv-cache-dtype fp8 is not supported by this fork"),
    (["--enable-log-requests", "--disable-log-requests"],
     "--enable-log-requests and --disable-log-requests contradict each other"),
    (["--ssl-keyfile", "k.pem"], "HTTPS needs both --ssl-keyfile and --ssl-certfile"),
    (["--ssl-keyfile", "/no/key.pem", "--ssl-certfile", "/no/cert.pem"],
     "--ssl-keyfile '/no/key.pem' is not a file"),
    (["--root-path", "llm"], "--root-path must start with '/'"),
    # It started, and every file:// image then failed with "cannot read" (vLLM refuses it).
    (["--allowed-local-media-path", "/no/such/dir"],
     "allowed_local_media_path '/no/such/dir' is not a directory"),
    # A configuration conflict: refused from the flags alone (it took ~6 s, after the
    # engine core process had started).
    (["--kv-transfer-config", '{"kv_connector": "OffloadingConnector", "kv_role": "kv_both", '
      '"kv_connector_extra_config": {"num_cpu_blocks": 8}}', "--enable-elastic-kv-cache"],
     "kv_transfer_config (OffloadingConnector) cannot be combined with enable_elastic"),
]


@pytest.mark.parametrize(("args", "message"), REFUSED, ids=lambda v: " ".join(v)[:40]
                         if isinstance(v, list) else None)
def test_refused_flags_are_one_line_before_any_process_starts(args, message, capsys,
                                                              monkeypatch):
    from vllm.v1.engine import core_launcher

    monkeypatch.setattr(core_launcher, "prestart_engine_core",
                        lambda: pytest.fail("a process was started"))
    assert main(["serve", *args, "--port", "0"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"vllm serve: error: {message}"), err
    assert err.count("\n") == 1, err


def test_quantization_gguf_needs_a_gguf_file(tmp_path, capsys):
    (tmp_path / "config.json").write_text("{}")
    assert main(["serve", "--quantization", "gguf", str(tmp_path), "--port", "0"]) == 2
    assert capsys.readouterr().err.startswith(
        "vllm serve: error: --quantization gguf needs a .gguf model file")
    EngineArgs(quantization="gguf").validate()  # the bundled model is one


# ------------------------------------------------------------------ one server, every flag
@pytest.fixture(scope="module")
def tls(tmp_path_factory):
    import trustme

    directory = tmp_path_factory.mktemp("tls")
    ca = trustme.CA()
    cert = ca.issue_cert("127.0.0.1", "localhost")
    cert.private_key_pem.write_to_path(str(directory / "key.pem"))
    cert.cert_chain_pems[0].write_to_path(str(directory / "cert.pem"))
    context = ssl.create_default_context()
    ca.configure_trust(context)
    return directory, context


@pytest.fixture(scope="module")
def flags_server(hf_cache, tls):
    directory, context = tls
    server = RemoteServer(
        [MODEL_ID, "--download-dir", str(hf_cache), "--revision", "main",
         "--trust-remote-code", "--enable-chunked-prefill", "--kv-cache-dtype", "auto",
         "--swap-space", "4", "--disable-log-requests", "--root-path", "/llm",
         "--ssl-keyfile", str(directory / "key.pem"),
         "--ssl-certfile", str(directory / "cert.pem"), *DEFAULT_SERVER_ARGS],
        env={"HF_HUB_OFFLINE": "1"}, verify=context)
    try:
        yield server
    finally:
        server.close()


def test_a_model_id_in_the_local_cache_is_served_offline_over_https(flags_server, tls):
    _, context = tls
    assert flags_server.url.startswith("https://")
    client = openai.OpenAI(base_url=flags_server.url_for("v1"), api_key="EMPTY",
                           http_client=httpx.Client(verify=context), max_retries=0)
    assert [m.id for m in client.models.list().data] == [MODEL_ID]
    completion = client.completions.create(model=MODEL_ID, prompt="The capital of France is",
                                           max_tokens=3, temperature=0)
    assert completion.choices[0].text.startswith(" Paris")
    with pytest.raises(httpx.HTTPError):  # plain HTTP is not served
        httpx.get(flags_server.url.replace("https://", "http://") + "/health", timeout=5)


def test_root_path_serves_the_api_under_the_proxy_prefix(flags_server, tls):
    _, context = tls
    spec = httpx.get(flags_server.url_for("openapi.json"), verify=context, timeout=30).json()
    assert spec["servers"] == [{"url": "/llm"}]
    # The proxy strips the prefix (uvicorn's root_path semantics): /v1/models arrives.
    response = httpx.get(flags_server.url_for("v1/models"), verify=context, timeout=30)
    assert response.status_code == 200, response.text


def test_the_accepted_flags_are_logged_not_ignored(flags_server):
    log = flags_server.startup_log
    assert "--swap-space 4 is accepted and has no effect" in log
    assert "'revision': 'main'" in log and "'trust_remote_code': True" in log


def test_sleep_mode_help_says_the_weights_are_offloaded_too():
    from vllm.entrypoints.cli.main import make_parser

    serve = next(a for a in make_parser()._actions if a.dest == "subcommand").choices["serve"]
    (action,) = [a for a in serve._actions if "--enable-sleep-mode" in a.option_strings]
    assert "offloads the weights to host memory" in action.help
    assert "level 2 discards both" in action.help
