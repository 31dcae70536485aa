"""The `vllm` CLI: help and version, flag parsing, and one `vllm serve` with --api-key,
--served-model-name and --enable-sleep-mode that ends with SIGTERM."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import math
import os
import re
import socket
import subprocess
import sys
import threading
import time

import httpx
import openai
import psutil
import pytest

from tests.conftest import _cuda_available
from tests.entrypoints.openai.utils import (
    DEFAULT_SERVER_ARGS,
    MAX_MODEL_LEN,
    MODEL_NAME,
    REPO_ROOT,
    RemoteServer,
    error_of,
    port_is_free,
)
from vllm.config import SchedulerConfig
from vllm.engine.arg_utils import AsyncEngineArgs
from vllm.entrypoints.cli.main import make_parser
from vllm.entrypoints.openai.cli_args import validate_parsed_serve_args
from vllm.version import __version__

API_KEY = "test-key-1234"
NAMES = ["my-model", "my-alias"]
# The key server's --shutdown-timeout: 1 s of grace on the CPU, where the SIGTERM test's
# 480-token requests take far longer; on a GPU they could finish within a second, so
# there the requests are failed at once (the same code path, without the wait).
SHUTDOWN_TIMEOUT_S = 0 if _cuda_available() else 1


def _run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "vllm.entrypoints.cli.main", *args],
                          cwd=REPO_ROOT, capture_output=True, text=True, timeout=60)


def _serve_actions():
    parser = make_parser()
    subparsers = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return subparsers.choices["serve"]._actions


def test_help_lists_every_flag():
    top = _run_cli("--help")
    serve = _run_cli("serve", "--help")
    assert top.returncode == 0 and serve.returncode == 0
    flags = [opt for action in _serve_actions() for opt in action.option_strings]
    # Every engine argument has its flag.
    for field in dataclasses.fields(AsyncEngineArgs):
        flag = "--" + field.name.replace("_", "-")
        assert flag in flags, flag
    for required in ("--host", "--port", "--api-key", "--served-model-name",
                     "--uvicorn-log-level", "--model", "--enable-sleep-mode"):
        assert required in flags
    for flag in flags:
        assert flag in serve.stdout, flag
        assert flag in top.stdout, flag
    assert "MODEL" in serve.stdout and "serve" in top.stdout
    for action in _serve_actions():
        assert action.help, action.option_strings  # every flag explains itself


def test_help_states_every_default():
    """The README promises `vllm serve --help` shows every default (issue 16)."""
    missing = [action.option_strings[-1] for action in _serve_actions()
               if action.option_strings and "--help" not in action.option_strings
               and "default" not in (action.help or "").lower()]
    assert not missing, f"no default in the help of {missing}"
    serve = _run_cli("serve", "--help").stdout
    assert "(default: on)" in " ".join(serve.split())  # --enable-prefix-caching


def _subcommand_parser(*path: str) -> argparse.ArgumentParser:
    parser = make_parser()
    for name in path:
        parser = next(a for a in parser._actions
                      if isinstance(a, argparse._SubParsersAction)).choices[name]
    return parser


@pytest.mark.parametrize("path", [("serve",), ("bench", "latency"), ("bench", "throughput"),
                                  ("bench", "serve")])
def test_every_subcommand_help_shows_each_default_once(path):
    """vLLM's help shows every flag's default. A help that words its own default (the
    engine and server flags) is kept as written; the others get argparse's "(default: X)"."""
    parser = _subcommand_parser(*path)
    formatter = parser._get_formatter()
    for action in parser._actions:
        if action.help == argparse.SUPPRESS or isinstance(action, argparse._HelpAction):
            continue
        shown = formatter._get_help_string(action)
        if "default" in (action.help or "").lower():
            assert shown == action.help, action.option_strings  # never a second default
        else:
            assert shown == f"{action.help or ''} (default: %(default)s)", action.option_strings


def test_bench_help_shows_the_defaults():
    text = " ".join(_subcommand_parser("bench", "latency").format_help().split())
    assert "--num-iters NUM_ITERS Timed iterations. (default: 30)" in text
    assert "--num-iters-warmup NUM_ITERS_WARMUP Untimed iterations first. (default: 10)" in text
    assert "--disable-tqdm No progress bar. (default: False)" in text
    assert "(default: on)." in text and "(default: on). (default" not in text  # engine flags
    text = " ".join(_subcommand_parser("bench", "throughput").format_help().split())
    assert "--num-prompts NUM_PROMPTS Prompts. (default: 1000)" in text


def test_top_level_help_fills_in_the_defaults():
    top = _run_cli("--help").stdout
    assert "%(default)s" not in top
    assert "Random seed of the engine (default: 0)." in top


def test_underscore_spellings_of_flags_are_accepted():
    """vLLM's FlexibleArgumentParser: `--max_model_len` is `--max-model-len` in every
    subcommand, with or without "="; values keep their underscores."""
    parser = make_parser()
    args = parser.parse_args(["serve", "--max_model_len", "64", "--served_model_name", "a_b",
                              "c_d", "--enable_prefix_caching"])
    assert (args.max_model_len, args.served_model_name) == (64, ["a_b", "c_d"])
    assert args.enable_prefix_caching is True
    args = parser.parse_args(["bench", "latency", "--num_iters_warmup=0", "--batch_size", "3",
                              "--max_num_seqs", "5"])
    assert (args.num_iters_warmup, args.batch_size, args.max_num_seqs) == (0, 3, 5)
    assert parser.parse_args(["bench", "serve", "--num_prompts", "2"]).num_prompts == 2
    assert parser.parse_args(["bench", "throughput", "--num_prompts=7"]).num_prompts == 7


def test_an_unknown_underscore_flag_names_its_subcommand(capsys):
    from vllm.entrypoints.cli.main import main

    with pytest.raises(SystemExit) as info:
        main(["bench", "latency", "--bogus_flag", "x_y"])
    assert info.value.code == 2
    assert capsys.readouterr().err == ("vllm bench latency: error: unrecognized arguments: "
                                       "--bogus-flag x_y (see vllm bench latency --help)\n")


def test_help_and_version_do_not_import_torch():
    code = ("import sys\nfrom vllm.entrypoints.cli.main import main\n"
            "for argv in (['--help'], ['serve', '--help'], ['--version']):\n"
            "    try:\n        main(argv)\n    except SystemExit:\n        pass\n"
            "print('TORCH', 'torch' in sys.modules)\n")
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert "TORCH False" in result.stdout


def test_no_subcommand_prints_the_help_and_exits_0():
    """vLLM's `vllm` without a subcommand prints its help and succeeds (it exited 1 here)."""
    result = _run_cli()
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("usage: vllm") and "serve" in result.stdout
    assert result.stderr == ""


def test_version():
    result = _run_cli("--version")
    assert result.returncode == 0
    assert result.stdout.strip() == __version__


def test_positional_model_and_flag():
    parser = make_parser()
    args = parser.parse_args(["serve", "/models/a", "--port", "9000"])
    validate_parsed_serve_args(args)
    assert args.model == "/models/a" and args.port == 9000
    args = parser.parse_args(["serve", "--model", "/models/b"])
    validate_parsed_serve_args(args)
    assert args.model == "/models/b"
    args = parser.parse_args(["serve", "/models/a", "--model", "/models/b"])
    with pytest.raises(ValueError, match="/models/a"):
        validate_parsed_serve_args(args)
    args = parser.parse_args(["serve"])
    validate_parsed_serve_args(args)
    assert args.model is None and args.port == 8000


def test_api_key_from_environment(monkeypatch):
    monkeypatch.setenv("VLLM_API_KEY", "from-env")
    args = make_parser().parse_args(["serve"])
    validate_parsed_serve_args(args)
    assert args.api_key == "from-env"
    args = make_parser().parse_args(["serve", "--api-key", "from-flag"])
    validate_parsed_serve_args(args)
    assert args.api_key == "from-flag"


def test_a_malformed_variable_fails_the_serve_check(monkeypatch):
    """Every VLLM_* variable is parsed before the server starts (exit 2, one line), even
    one read only on CUDA launches."""
    monkeypatch.setenv("VLLM_GEMV_PDL", "maybe")
    args = make_parser().parse_args(["serve"])
    with pytest.raises(ValueError, match="^VLLM_GEMV_PDL must be 1/true/on or 0/false/off, "
                                         "got 'maybe'$"):
        validate_parsed_serve_args(args)


def test_bad_flag_value_exits_2():
    result = _run_cli("serve", "--port", "many")
    assert result.returncode == 2
    assert "--port" in result.stderr


def test_unknown_flag_is_one_line_naming_serve():
    """As every start-up error: one line, exit 2 (argparse printed its usage first)."""
    result = _run_cli("serve", "--bogus-flag")
    assert result.returncode == 2
    assert result.stderr == ("vllm serve: error: unrecognized arguments: --bogus-flag "
                             "(see vllm serve --help)\n")


def test_help_states_the_scheduler_defaults_in_use():
    cpu = SchedulerConfig()
    cpu.resolve(max_model_len=512, device_type="cpu")
    cuda = SchedulerConfig()
    cuda.resolve(max_model_len=512, device_type="cuda")
    helps = {opt: action.help for action in _serve_actions() for opt in action.option_strings}
    assert (f"{cuda.max_num_seqs} on CUDA, {cpu.max_num_seqs} on CPU"
            in helps["--max-num-seqs"])
    assert (f"{cuda.max_num_batched_tokens} on CUDA, {cpu.max_num_batched_tokens} on CPU"
            in helps["--max-num-batched-tokens"])


# Errors in the flags alone: found before torch or transformers is imported.
EARLY_CONFIG_ERRORS = [
    (["--gpu-memory-utilization", "2"], "gpu_memory_utilization must be in (0, 1], got 2.0"),
    (["--block-size", "7"], "block_size must be a power of two"),
    (["/nonexistent/model-dir"], "model '/nonexistent/model-dir' not found"),
    (["--generation-config", "/nonexistent/gen"],
     "generation_config '/nonexistent/gen' must be 'auto', 'vllm', or a directory"),
]
# Errors against the model's own config (read with transformers): still one line, exit 2.
CONFIG_ERRORS = [
    *EARLY_CONFIG_ERRORS,
    (["--tensor-parallel-size", "4"],
     "tensor_parallel_size (4) is larger than num_key_value_heads (3) but not a multiple"),
]


def _processes_marked(marker: str) -> list[int]:
    """Pids of the live processes whose environment carries VLLM_TEST_MARKER=marker."""
    left = []
    for process in psutil.process_iter(["pid"]):
        with contextlib.suppress(psutil.Error):
            if process.environ().get("VLLM_TEST_MARKER") == marker:
                left.append(process.pid)
    return left


def test_config_errors_are_one_line_and_exit_2():
    """No traceback: `vllm serve: error: <message>` on stderr, exit 2 (run in parallel),
    and the engine core process started before the config was built is gone too."""
    marker = f"vllm-config-error-{os.getpid()}"
    env = {**os.environ, "VLLM_TEST_MARKER": marker}
    procs = [subprocess.Popen([sys.executable, "-m", "vllm.entrypoints.cli.main", "serve",
                               *args, "--port", "0"], cwd=REPO_ROOT, text=True, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE)
             for args, _ in CONFIG_ERRORS]
    for proc, (args, message) in zip(procs, CONFIG_ERRORS, strict=True):
        _, stderr = proc.communicate(timeout=120)
        assert proc.returncode == 2, (args, stderr)
        assert "Traceback" not in stderr, stderr
        errors = [line for line in stderr.splitlines() if line.startswith("vllm serve: error:")]
        assert len(errors) == 1 and errors[0].startswith(f"vllm serve: error: {message}"), stderr
        assert stderr.rstrip("\n").endswith(errors[0]), stderr
    assert not _processes_marked(marker), "processes left behind"


# Refused by the engine while it starts (in its own process, after the model loaded).
ENGINE_REFUSALS = [
    (["--kv-cache-memory-bytes", "64MiB", "--kv-transfer-config", json.dumps({
        "kv_connector": "OffloadingConnector", "kv_role": "kv_both",
        "kv_connector_extra_config": {"cpu_bytes_to_use": 1}})],
     2, "cpu_bytes_to_use=1 holds no KV block"),
    # Below two KV blocks (737280 bytes each), on every path: the flag and the minimum
    # named, exit 2. The elastic and classic paths said "the device is too small for even
    # one KV cache block" (exit 1); the default path served with two blocks.
    *[(flags + ["--kv-cache-memory-bytes", str(nbytes)], 2,
       f"kv_cache_memory_bytes (--kv-cache-memory-bytes) {nbytes} is below the minimum of "
       f"1474560 bytes: 2 KV cache blocks of 737280 bytes")
      for flags, nbytes in [([], 1), (["--enable-elastic-kv-cache"], 1),
                            (["--no-enable-extensible-kv-cache"], 1474559)]],
    # TP=2: the 3 KV heads split 2 + 1, so rank 0's blocks (480 KiB) are twice rank 1's and
    # only rank 0 fell short: exit 1 with its worker's traceback. Every rank now checks the
    # largest block, and the line names it once.
    (["--tensor-parallel-size", "2", "--kv-cache-memory-bytes", "737280"], 2,
     "kv_cache_memory_bytes (--kv-cache-memory-bytes) 737280 is below the minimum of 983040 "
     "bytes: 2 KV cache blocks of 491520 bytes (the null block and one for requests) on "
     "rank 0, whose blocks are the largest (the ranks' blocks: 491520, 245760 bytes)"),
    # A cache too small for one request of --max-model-len 512 (33 blocks): vLLM refuses to
    # start; this engine served max_model_len 336 with a warning.
    (["--kv-cache-memory-bytes", "16MiB"], 2,
     "max_model_len 512 (--max-model-len) does not fit the KV cache: one request of 512 tokens "
     "needs 32 blocks of 16 tokens, "),
    # The classic cache is allocated whole: an explicit size above the free memory died in
    # torch.zeros with "can't allocate memory" (two tracebacks, exit 1). It is now checked
    # against the memory free, as the extensible path checks it after warmup.
    (["--no-enable-extensible-kv-cache", "--kv-cache-memory-bytes", "1024TiB"], 1,
     "kv_cache_memory_bytes=1125899906842624 exceeds the "),
]


def test_engine_start_up_refusals_are_one_line_and_leave_no_process():
    """What the engine core refuses while it starts (a connector's option) ends `vllm
    serve` with one line, exit 2, no traceback, and no engine process left behind (it
    hung before, blocked on a message to the exiting engine process)."""
    marker = f"vllm-refusal-{os.getpid()}"
    env = {**os.environ, "VLLM_TEST_MARKER": marker}
    procs = [subprocess.Popen([sys.executable, "-m", "vllm.entrypoints.cli.main", "serve",
                               *DEFAULT_SERVER_ARGS[:6], *args, "--port", "0"], cwd=REPO_ROOT,
                              env=env, text=True, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE)
             for args, _, _ in ENGINE_REFUSALS]
    for proc, (args, code, message) in zip(procs, ENGINE_REFUSALS, strict=True):
        stdout, stderr = proc.communicate(timeout=300)
        assert proc.returncode == code, (args, stderr)
        assert "Traceback" not in stdout + stderr, stdout + stderr
        last = stderr.rstrip("\n").splitlines()[-1]
        assert last.startswith(f"vllm serve: error: {message}"), stderr
    left = _processes_marked(marker)
    assert not left, f"processes left behind: {left}"


_MAIN_THEN_REPORT_TORCH = (
    "import sys\nfrom vllm.entrypoints.cli.main import main\n"
    "rc = main(sys.argv[1:])\n"
    "print('TORCH', 'torch' in sys.modules, 'TRANSFORMERS', 'transformers' in sys.modules)\n"
    "sys.exit(rc)\n"
)


def test_flag_errors_and_a_taken_port_fail_before_torch_is_imported():
    """Flag values, the model path, the chat template and the port are checked before the
    heavy imports: one line, exit 2, and neither torch nor transformers was loaded."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        cases = [
            (["--host", "127.0.0.1", "--port", str(port)],
             f"cannot listen on 127.0.0.1:{port}: Address already in use"),
            (["--chat-template", "no-such-file"], "--chat-template 'no-such-file' is neither"),
            (["--chat-template", "{% for %}"],
             "--chat-template is not a valid Jinja template: Expected an expression"),
            (["--default-chat-template-kwargs", "{enable_thinking}"],
             "--default-chat-template-kwargs is not valid JSON"),
            (["--default-chat-template-kwargs", "[1]"],
             "--default-chat-template-kwargs must be an object, got list"),
            (["--default-chat-template-kwargs", '{"tokenize": true}'],
             "--default-chat-template-kwargs must not set 'tokenize'"),
            (["--reasoning-parser", "nope"],
             "--reasoning-parser 'nope' is not one of deepseek_r1, qwen3"),
            (["--tool-call-parser", "nope"],
             "--tool-call-parser 'nope' is not one of hermes, llama3_json"),
            (["--enable-auto-tool-choice"],
             "--enable-auto-tool-choice requires --tool-call-parser"),
            *EARLY_CONFIG_ERRORS,
        ]
        procs = [subprocess.Popen([sys.executable, "-c", _MAIN_THEN_REPORT_TORCH, "serve",
                                   *args], cwd=REPO_ROOT, text=True,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE)
                 for args, _ in cases]
        for proc, (args, message) in zip(procs, cases, strict=True):
            stdout, stderr = proc.communicate(timeout=120)
            assert proc.returncode == 2, (args, stderr)
            assert stderr == f"vllm serve: error: {message}" + stderr.split(message, 1)[1], stderr
            assert len(stderr.splitlines()) == 1, stderr
            assert "TORCH False TRANSFORMERS False" in stdout, (args, stdout)


def test_a_kv_cache_the_device_cannot_hold_is_one_line_and_exit_1(monkeypatch, capsys):
    from vllm.entrypoints.cli.main import main
    from vllm.entrypoints.openai import api_server
    from vllm.v1.worker.kv_cache_sizing import KVCacheSizingError

    def too_small(*args, **kwargs):
        raise KVCacheSizingError("the device is too small for even one KV cache block")

    monkeypatch.setattr(api_server.AsyncLLM, "from_vllm_config", too_small)
    assert main(["serve", "--port", "0", *DEFAULT_SERVER_ARGS[:6]]) == 1
    assert capsys.readouterr().err == (
        "vllm serve: error: the device is too small for even one KV cache block\n")


def test_other_start_up_errors_are_not_swallowed(monkeypatch):
    from vllm.entrypoints.cli.main import main
    from vllm.entrypoints.openai import api_server

    def broken(args):
        raise RuntimeError("not a configuration problem")

    monkeypatch.setattr(api_server, "build_engine_config", broken)
    with pytest.raises(RuntimeError, match="not a configuration problem"):
        main(["serve", "--port", "0"])


# ------------------------------------------------------------------ a served instance
# The key server's --generation-config: greedy unless a request says otherwise.
GENERATION_DEFAULTS = {"temperature": 0.0, "top_k": 5}


@pytest.fixture(scope="module")
def key_server(tmp_path_factory):
    config_dir = tmp_path_factory.mktemp("generation-config")
    (config_dir / "generation_config.json").write_text(json.dumps(GENERATION_DEFAULTS))
    remote = RemoteServer([*DEFAULT_SERVER_ARGS, "--api-key", API_KEY,
                           "--served-model-name", *NAMES, "--enable-sleep-mode",
                           "--uvicorn-log-level", "info",
                           "--shutdown-timeout", str(SHUTDOWN_TIMEOUT_S),
                           "--generation-config", str(config_dir), "--max-logprobs", "-1"])
    try:
        yield remote
    finally:
        remote.close()


def test_startup_log_ends_with_url(key_server):
    lines = [line for line in key_server.startup_log.splitlines() if line.strip()]
    assert "listening on " + key_server.url in lines[-1]


def test_startup_log_has_one_engine_config_line(key_server):
    """vLLM's start-up line with the settings in use, async scheduling among them: once,
    from the engine core process (not again from the frontend)."""
    lines = [ln for ln in key_server.startup_log.splitlines()
             if "Initializing a V1 LLM engine" in ln]
    assert len(lines) == 1, lines
    assert re.search(r"with config: model='.*', .*async_scheduling=(True|False), ", lines[0])
    assert f"(v{__version__})" in lines[0] and "max_model_len=" in lines[0]


def test_generation_config_defaults_are_logged_and_used(key_server):
    """vLLM: the generation config's sampling values are logged at start-up and used for
    the fields a request leaves unset (here temperature 0: greedy)."""
    (line,) = [ln for ln in key_server.startup_log.splitlines()
               if "default sampling params" in ln]
    assert str(GENERATION_DEFAULTS) in line
    client = key_server.get_client(api_key=API_KEY)
    texts = [client.completions.create(model=NAMES[0], prompt="Once upon a time",
                                       max_tokens=12, **extra).choices[0].text
             for extra in ({}, {}, {"temperature": 0})]
    assert texts[0] == texts[1] == texts[2]
    sampled = {client.completions.create(model=NAMES[0], prompt="Once upon a time",
                                         max_tokens=12, temperature=1.5, seed=s).choices[0].text
               for s in range(3)}
    assert len(sampled) > 1  # the request's own temperature wins


def test_prompt_logprobs_minus_one_is_the_whole_vocabulary(key_server):
    """vLLM: prompt_logprobs -1 returns every token's logprob (allowed by --max-logprobs -1;
    the shared server's default cap of 20 refuses it, see test_errors)."""
    body = {"model": NAMES[0], "prompt": "Hi there", "max_tokens": 1, "prompt_logprobs": -1}
    response = httpx.post(key_server.url_for("v1/completions"), json=body, timeout=120,
                          headers={"Authorization": f"Bearer {API_KEY}"})
    assert response.status_code == 200, response.text
    (first, *rest) = response.json()["choices"][0]["prompt_logprobs"]
    vocab = 49152  # SmolLM2's
    assert first is None and rest
    for step in rest:
        assert len(step) == vocab
        assert sorted(e["rank"] for e in step.values())[-1] <= vocab
        assert sum(math.exp(e["logprob"]) for e in step.values()) == pytest.approx(1, abs=1e-3)


def test_api_key_required_on_v1(key_server):
    missing = httpx.get(key_server.url_for("v1/models"))
    assert missing.status_code == 401
    assert error_of(missing)["type"] == "AuthenticationError"
    wrong = httpx.get(key_server.url_for("v1/models"),
                      headers={"Authorization": "Bearer nope"})
    assert wrong.status_code == 401
    with pytest.raises(openai.AuthenticationError):
        key_server.get_client(api_key="nope").models.list()
    # Outside /v1 no key is needed (health probes, Prometheus).
    assert httpx.get(key_server.url_for("health")).status_code == 200
    assert httpx.get(key_server.url_for("metrics")).status_code == 200


def test_served_model_names(key_server):
    client = key_server.get_client(api_key=API_KEY)
    assert [m.id for m in client.models.list().data] == NAMES
    for name in NAMES:
        completion = client.completions.create(model=name, prompt="Hello", max_tokens=2)
        assert completion.model == name
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model=MODEL_NAME, prompt="Hello", max_tokens=2)
    metrics = httpx.get(key_server.url_for("metrics")).text
    assert f'model_name="{NAMES[0]}"' in metrics


def test_sleep_endpoints(key_server):
    """With --enable-sleep-mode the endpoints exist; until the engine implements sleep,
    /sleep answers 501 with the OpenAI body and the engine keeps serving."""
    client = key_server.get_client(api_key=API_KEY)
    assert httpx.get(key_server.url_for("is_sleeping")).json() == {"is_sleeping": False}
    # A body or another query parameter is a 400 naming it, never ignored: `{"level": 2}`
    # or a misspelt `?levle=2` slept at level 1, `?tag=weights` woke everything.
    for route, kwargs, param in (("sleep", {"json": {"level": 2}}, "level"),
                                 ("sleep", {"params": {"levle": 2}}, "levle"),
                                 ("wake_up", {"params": {"tag": "weights"}}, "tag")):
        refused = httpx.post(key_server.url_for(route), **kwargs)
        assert refused.status_code == 400 and error_of(refused)["param"] == param, refused.text
    assert httpx.get(key_server.url_for("is_sleeping")).json() == {"is_sleeping": False}
    assert httpx.post(key_server.url_for("sleep"), params={"level": 3}).status_code == 400
    response = httpx.post(key_server.url_for("sleep"), params={"level": 1})
    if response.status_code == 501:
        assert "sleep mode is not available" in error_of(response)["message"]
        assert httpx.get(key_server.url_for("is_sleeping")).json() == {"is_sleeping": False}
    else:
        assert response.status_code == 200, response.text
        assert httpx.get(key_server.url_for("is_sleeping")).json() == {"is_sleeping": True}
        with pytest.raises(openai.APIStatusError) as info:
            client.completions.create(model=NAMES[0], prompt="Hello", max_tokens=2)
        assert info.value.status_code == 503
        # Asleep already: another sleep releases nothing and says so; a repeated tag
        # wakes its part once.
        log_before = len(key_server.log())
        assert httpx.post(key_server.url_for("sleep"), params={"level": 2}).status_code == 200
        woke = httpx.post(key_server.url_for("wake_up"),
                          params=[("tags", "weights"), ("tags", "weights")])
        assert woke.status_code == 200, woke.text
        log = key_server.log()[log_before:]
        assert "the engine is already asleep; nothing to release" in log
        assert "Sleep level 2:" not in log
        assert re.search(r"Woke weights: mapped \d+\.\d+ GiB in", log), log
        assert httpx.get(key_server.url_for("is_sleeping")).json() == {"is_sleeping": True}
        assert httpx.post(key_server.url_for("wake_up")).status_code == 200
        assert httpx.get(key_server.url_for("is_sleeping")).json() == {"is_sleeping": False}
    completion = client.completions.create(model=NAMES[0], prompt="Hello", max_tokens=2)
    assert completion.usage.completion_tokens >= 1


def test_startup_log_mentions_graph_pool_exactly_when_graphs_are_captured(key_server):
    """The sizing line names the CUDA graph pool on a GPU (the server is not eager, so it
    captures graphs there) and never on the CPU, which captures none."""
    import torch

    (line,) = [ln for ln in key_server.startup_log.splitlines()
               if "KV cache sized after warmup" in ln]
    assert "(weights " in line and "activation peak" in line
    graphs_captured = torch.cuda.is_available()
    assert ("CUDA graph pool" in line) == graphs_captured, line


def test_startup_sizing_line_names_its_limit_and_adds_up(key_server):
    """The line says which limit set the budget (this server gives --kv-cache-memory-bytes;
    the CPU default's name is tested in tests/platforms) and its "held besides KV" parts
    add up to the whole as printed."""

    (line,) = [ln for ln in key_server.startup_log.splitlines()
               if "KV cache sized after warmup" in ln]
    assert "budget 0.25 GiB, limited by kv_cache_memory_bytes;" in line, line
    held = re.search(r"held besides KV (-?\d+\.\d+) GiB \(([^)]*)\)", line)
    parts = [float(x) for x in re.findall(r"-?\d+\.\d+", held.group(2))]
    assert "other " in held.group(2) and len(parts) >= 3
    assert round(sum(parts), 2) == float(held.group(1)), line


def test_startup_announces_each_phase_before_it_runs(key_server):
    """A line as each slow phase begins (the engine core process with its imports, model
    load, memory profile, warmup), each before
    the line that reports its end: no minute of silence at start-up."""
    lines = key_server.startup_log.splitlines()

    def index(text: str) -> int:
        return next(i for i, ln in enumerate(lines) if text in ln)

    for begins, ends in [("Loading the model from", "Model loaded:"),
                         ("Profiling memory:", "Memory profile:"),
                         ("Warming up:", "KV cache sized after warmup")]:
        assert index(begins) < index(ends), (begins, ends)
    assert (index("Started the engine core process") < index("Loading the model from")
            < index("Model loaded:") < index("Profiling memory:") < index("Warming up:"))


def test_startup_log_names_the_cpu_threads(key_server):
    import torch

    lines = [ln for ln in key_server.startup_log.splitlines() if "CPU threads: " in ln]
    if torch.cuda.is_available():
        assert lines == []  # a GPU engine leaves host threads alone
        return
    (line,) = lines
    assert "VLLM_CPU_OMP_THREADS_BIND=auto" in line and "physical core(s) allowed" in line


def test_level2_sleep_then_wake_reloads_the_weights(key_server):
    """Level 2 discards the weights; waking them reloads the checkpoint, so greedy output
    is the same as before the sleep (waking only the KV cache keeps the server asleep)."""
    client = key_server.get_client(api_key=API_KEY)

    def greedy() -> str:
        completion = client.completions.create(model=NAMES[0], prompt="The capital of France is",
                                               max_tokens=8, temperature=0)
        return completion.choices[0].text

    before = greedy()
    # Reloading the checkpoint takes seconds on 2 shared CPU cores.
    assert httpx.post(key_server.url_for("sleep"), params={"level": 2},
                      timeout=120).status_code == 200
    assert httpx.post(key_server.url_for("wake_up"), params={"tags": "kv_cache"},
                      timeout=120).status_code == 200
    assert httpx.get(key_server.url_for("is_sleeping")).json() == {"is_sleeping": True}
    assert httpx.post(key_server.url_for("wake_up"), params={"tags": "weights"},
                      timeout=120).status_code == 200
    assert httpx.get(key_server.url_for("is_sleeping")).json() == {"is_sleeping": False}
    assert greedy() == before
    log = key_server.log()
    assert "reloading the weights" in log
    # One line for the sleep and one per wake, with their sizes.
    assert re.search(r"Sleep level 2: released \d+\.\d+ GiB of weights \(discarded\) and "
                     r"\d+\.\d+ GiB of KV cache", log)
    assert re.search(r"Woke kv_cache: mapped \d+\.\d+ GiB in", log)
    assert re.search(r"Woke weights: mapped \d+\.\d+ GiB in [\d.]+ s; the weights must be "
                     r"reloaded", log)


def test_bounded_mixed_load_gets_only_well_formed_answers(key_server):
    """20 s of the mixed load (streams, disconnects, hostile bodies, long prompts, sleep and
    wake cycles; benchmarks/benchmark_mixed_load.py runs it for 10 minutes): no 5xx but the
    503s of a sleeping engine, every error has the OpenAI body, every stream ends with
    [DONE], the log has no traceback, and the server still answers correctly."""
    from tests.entrypoints.openai.mixed_load import MixedLoad

    load = MixedLoad(key_server, NAMES[0], headers={"Authorization": f"Bearer {API_KEY}"},
                     max_model_len=MAX_MODEL_LEN, sleep_period_s=6.0, seed=17)
    report = asyncio.run(load.run(20.0, streamers=4, leavers=2, hostile=2, long=1))
    assert report.violations == []
    assert load.collect_tracebacks() == []
    assert report.sleep_cycles >= 2  # the third, level-2, cycle may be cut by the deadline
    counts = report.statuses
    assert counts.get("stream 200", 0) >= 5, counts
    assert counts.get("long 200", 0) + counts.get("long 503", 0) >= 1, counts
    assert sum(n for k, n in counts.items() if k.startswith("hostile") and " 400" in k) >= 20
    assert not any(k.endswith(" 500") for k in counts), counts
    # The memory samples cover the engine core's process too (model and KV cache live there).
    assert report.samples and min(s["processes"] for s in report.samples) >= 2, report.samples
    client = key_server.get_client(api_key=API_KEY)
    completion = client.completions.create(model=NAMES[0], prompt="The capital of France is",
                                           max_tokens=3, temperature=0)
    assert completion.choices[0].text.startswith(" Paris")


def _requests_running(server) -> float:
    from tests.entrypoints.openai.utils import scrape_metrics

    return scrape_metrics(server).get("vllm:num_requests_running", 0.0)


def test_sigterm_fails_in_flight_requests_cleanly(key_server):
    """SIGTERM with a non-streaming and a streaming request that cannot finish within
    --shutdown-timeout: the first gets 503 with the OpenAI body, the second an SSE error
    event and then [DONE]; one log line says so, nothing is cancelled (no traceback), the
    process exits 0 and the port is free."""
    headers = {"Authorization": f"Bearer {API_KEY}"}
    body = {"model": NAMES[0], "prompt": "Once upon a time", "max_tokens": 480,
            "ignore_eos": True}
    url = key_server.url_for("v1/completions")
    results: dict = {}
    first_event = threading.Event()

    def plain() -> None:
        results["plain"] = httpx.post(url, json=body, headers=headers, timeout=120)

    def stream() -> None:
        events = []
        with httpx.stream("POST", url, json={**body, "stream": True}, headers=headers,
                          timeout=120) as response:
            for line in response.iter_lines():
                if line:
                    events.append(line)
                    first_event.set()
        results["stream"] = events

    threads = [threading.Thread(target=plain), threading.Thread(target=stream)]
    for thread in threads:
        thread.start()
    assert first_event.wait(120)
    deadline = time.monotonic() + 60
    while _requests_running(key_server) < 2 and time.monotonic() < deadline:
        time.sleep(0.1)
    log_before = len(key_server.log())
    assert key_server.terminate() == 0
    for thread in threads:
        thread.join(60)
    plain_response = results["plain"]
    assert plain_response.status_code == 503, plain_response.text
    assert "shut down" in error_of(plain_response)["message"]
    events = results["stream"]
    assert events[-1] == "data: [DONE]"
    error_event = json.loads(events[-2].removeprefix("data: "))
    assert error_event["error"]["code"] == 503, events[-2]
    assert '"text_completion"' in events[0]  # it streamed tokens before the error
    assert port_is_free(key_server.port)
    log = key_server.log()[log_before:]
    assert (f"Shutdown timeout ({SHUTDOWN_TIMEOUT_S} s) is over: failing 2 in-flight "
            "request(s) with 503") in log, log
    assert "Traceback" not in log and "CancelledError" not in log, log
    assert "timeout graceful shutdown exceeded" not in log, log  # nothing was cancelled


def test_reasoning_parser_reaches_the_engines_structured_outputs_config():
    """--reasoning-parser also tells the engine where the reasoning ends (a grammar applies
    after it), as vLLM's StructuredOutputsConfig.reasoning_parser."""
    args = make_parser().parse_args(["serve", "--reasoning-parser", "qwen3",
                                     "--structured-outputs-config", '{"backend": "guidance"}'])
    validate_parsed_serve_args(args)
    config = args.structured_outputs_config
    assert (config.reasoning_parser, config.backend) == ("qwen3", "guidance")
    args = make_parser().parse_args(["serve"])
    validate_parsed_serve_args(args)
    assert args.structured_outputs_config is None
    args = make_parser().parse_args(["serve", "--reasoning-parser", "qwen3",
                                     "--structured-outputs-config",
                                     '{"reasoning_parser": "deepseek_r1"}'])
    with pytest.raises(ValueError, match="--reasoning-parser qwen3 and --structured-outputs-"
                                         "config reasoning_parser deepseek_r1 disagree"):
        validate_parsed_serve_args(args)
