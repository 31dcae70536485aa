"""`vllm/envs.py`: the one registry of `VLLM_*` variables.

- No other module of vllm/ reads a `VLLM_*` variable or spells one as a name (an AST
  scan; the scanner is shown to catch each way of reading one in a planted file).
- docs/environment_variables.md lists exactly the declared variables.
- Each variable's default, good and malformed values (one-line errors naming it), and
  the cache: a value is parsed once, until `reset()`.
"""

from __future__ import annotations

import ast
import os
import re
import sys
from pathlib import Path

import pytest

from vllm import envs

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "vllm"
ENVS_PY = PACKAGE / "envs.py"
DOC = ROOT / "docs" / "environment_variables.md"

_NAME = re.compile(r"VLLM_[A-Z0-9_]*")
_ENVIRON_CALLS = ("getenv", "environ.get", "environ.setdefault", "environ.pop")


def _dotted(node: ast.expr) -> str:
    """"os.environ.get" for that attribute chain ("" for anything else)."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
    return ".".join(reversed(parts))


def _vllm_name(node: ast.expr | None) -> str | None:
    is_text = isinstance(node, ast.Constant) and isinstance(node.value, str)
    return node.value if is_text and node.value.startswith("VLLM_") else None


def _docstring_ids(tree: ast.Module) -> set[int]:
    """ids of the string constants that are whole statements (docstrings, bare strings)."""
    return {id(node.value) for node in ast.walk(tree)
            if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)}


def scan_env_reads(path: Path) -> list[str]:
    """"file:line: what" for each read of a `VLLM_*` variable in `path` (os.environ[...],
    os.environ.get / setdefault / pop, os.getenv, `in os.environ`) and each string
    literal that is a variable's name or the bare prefix ("VLLM_X", "VLLM_"), docstrings
    and comments excepted."""
    tree = ast.parse(path.read_text(), str(path))
    docstrings = _docstring_ids(tree)
    found: dict[int, str] = {}
    for node in ast.walk(tree):
        what = None
        if isinstance(node, ast.Call) and _dotted(node.func).endswith(_ENVIRON_CALLS):
            name = _vllm_name(node.args[0] if node.args else None)
            what = name and f"{_dotted(node.func)}({name!r})"
        elif isinstance(node, ast.Subscript) and _dotted(node.value).endswith("environ"):
            name = _vllm_name(node.slice)
            what = name and f"{_dotted(node.value)}[{name!r}]"
        elif isinstance(node, ast.Compare) and _dotted(node.comparators[0]).endswith("environ"):
            name = _vllm_name(node.left)
            what = name and f"{name!r} in {_dotted(node.comparators[0])}"
        elif (isinstance(node, ast.Constant) and isinstance(node.value, str)
              and id(node) not in docstrings and _NAME.fullmatch(node.value)):
            what = f"the name {node.value!r}"
        if what and node.lineno not in found:
            found[node.lineno] = f"{path}:{node.lineno}: {what}"
    return [found[line] for line in sorted(found)]


def test_no_module_but_envs_reads_a_vllm_variable():
    found = [hit for path in sorted(PACKAGE.rglob("*.py")) if path != ENVS_PY
             for hit in scan_env_reads(path)]
    assert not found, "read VLLM_* variables through vllm.envs:\n" + "\n".join(found)


def test_the_scanner_finds_every_way_of_reading_one(tmp_path):
    planted = tmp_path / "planted.py"
    planted.write_text('''"""A module naming VLLM_PORT in its docstring (fine)."""
import os
from os import environ, getenv

a = os.environ.get("VLLM_PORT")
b = os.environ["VLLM_PORT"]
c = os.getenv("VLLM_GEMV_PDL", "1")
d = environ.get("VLLM_NEW_SWITCH")
e = getenv("VLLM_API_KEY")
NAME = "VLLM_CACHE_ROOT"
f = {k: v for k, v in os.environ.items() if k.startswith("VLLM_")}
g = "VLLM_PORT" in os.environ
h = os.environ.setdefault("VLLM_PORT", "1")
i = f"VLLM_{NAME}"
fine = f"set VLLM_PORT={a} to pin it"  # prose in a message; VLLM_PORT in a comment
fine_too = os.environ.get("HOME")
''')
    lines = [hit.split(":")[1] for hit in scan_env_reads(planted)]
    assert lines == [str(n) for n in range(5, 15)]
    assert scan_env_reads(planted)[0].endswith("os.environ.get('VLLM_PORT')")


def test_every_attribute_read_from_envs_is_declared():
    """`envs.X` in vllm/ names a declared variable (a typo would fail only when reached)."""
    declared = {var.name for var in envs.variables()}
    public = {"reset", "variables", "validate", "vllm_environ", "EnvVar"}
    used = set()
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and _dotted(node.value) == "envs":
                used.add((node.attr, str(path.relative_to(ROOT))))
    assert {attr for attr, _ in used} - public
    assert [u for u in sorted(used) if u[0] not in declared | public] == []


def test_envs_imports_only_the_standard_library():
    tree = ast.parse(ENVS_PY.read_text())
    modules = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import)
               for alias in node.names}
    modules |= {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    roots = {module.split(".")[0] for module in modules}
    assert roots - {"__future__"} <= set(sys.stdlib_module_names), roots


# ------------------------------------------------------------------------ docs


def test_the_doc_table_lists_exactly_the_declared_variables():
    documented = re.findall(r"^\| `(VLLM_[A-Z0-9_]+)` \|", DOC.read_text(), re.MULTILINE)
    declared = [var.name for var in envs.variables()]
    assert len(documented) == len(set(documented)), "a variable is listed twice"
    assert sorted(documented) == sorted(declared)
    assert all(var.doc for var in envs.variables())


# --------------------------------------------------------------------- parsing


@pytest.fixture
def clean_env(monkeypatch, tmp_path):
    """No VLLM_* variable set, $HOME at tmp_path."""
    for name in envs.vllm_environ():
        monkeypatch.delenv(name)
    monkeypatch.setenv("HOME", str(tmp_path))
    return tmp_path


def test_defaults(clean_env):
    from vllm.v1.core.elastic import DEFAULT_SHRINK_DELAY_S

    assert {var.name: getattr(envs, var.name) for var in envs.variables()} == {
        "VLLM_API_KEY": None,
        "VLLM_LOGGING_LEVEL": "INFO",
        "VLLM_CONFIGURE_LOGGING": True,
        "VLLM_CACHE_ROOT": str(clean_env / ".cache" / "vllm"),
        "VLLM_PORT": None,
        "VLLM_WORKER_STARTUP_TIMEOUT": 300.0,
        "VLLM_WORKER_MULTIPROC_METHOD": None,
        "VLLM_RAY_PG_TIMEOUT": 120.0,
        "VLLM_CPU_KVCACHE_SPACE": 0.0,
        "VLLM_CPU_OMP_THREADS_BIND": "auto",
        "VLLM_CPU_NUM_OF_RESERVED_CPU": None,
        "VLLM_GEMV_PDL": True,
        "VLLM_FRESH_PREFILL_ATTENTION": True,
        "VLLM_ELASTIC_KV_SHRINK_DELAY_S": 10.0,
        "VLLM_ELASTIC_KV_SHARING": True,
        "VLLM_EMULATED_DEVICE_GIB": None,
        "VLLM_KV_REGISTRY_DIR": None,
        "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1",
        "VLLM_NIXL_SIDE_CHANNEL_PORT": 0,
        "VLLM_NIXL_ABORT_REQUEST_TIMEOUT": 120.0,
        "VLLM_IMAGE_FETCH_TIMEOUT": 5.0,
        "VLLM_MAX_IMAGE_BYTES": 20 * 2**20,
    }
    assert envs.VLLM_ELASTIC_KV_SHRINK_DELAY_S == DEFAULT_SHRINK_DELAY_S  # the policy's own


@pytest.mark.parametrize(("name", "text", "value"), [
    ("VLLM_GEMV_PDL", "1", True), ("VLLM_GEMV_PDL", "true", True),
    ("VLLM_GEMV_PDL", " ON ", True), ("VLLM_GEMV_PDL", "0", False),
    ("VLLM_FRESH_PREFILL_ATTENTION", "False", False),
    ("VLLM_FRESH_PREFILL_ATTENTION", "off", False),
    ("VLLM_CONFIGURE_LOGGING", "0", False),
    ("VLLM_LOGGING_LEVEL", " debug ", "DEBUG"),
    ("VLLM_API_KEY", "s3cret", "s3cret"), ("VLLM_API_KEY", "", None),
    ("VLLM_CACHE_ROOT", "/var/cache/v", "/var/cache/v"),
    ("VLLM_PORT", "29500", 29500), ("VLLM_PORT", " ", None),
    ("VLLM_NIXL_SIDE_CHANNEL_PORT", "0", 0),
    ("VLLM_NIXL_SIDE_CHANNEL_HOST", "10.0.0.5", "10.0.0.5"),
    ("VLLM_WORKER_STARTUP_TIMEOUT", "600", 600.0), ("VLLM_RAY_PG_TIMEOUT", "2.5", 2.5),
    ("VLLM_NIXL_ABORT_REQUEST_TIMEOUT", "480", 480.0),
    ("VLLM_ELASTIC_KV_SHRINK_DELAY_S", "0", 0.0),
    ("VLLM_ELASTIC_KV_SHARING", "off", False), ("VLLM_KV_REGISTRY_DIR", "/tmp/r", "/tmp/r"),
    ("VLLM_CPU_KVCACHE_SPACE", "1.5", 1.5), ("VLLM_CPU_KVCACHE_SPACE", "", 0.0),
    ("VLLM_CPU_OMP_THREADS_BIND", " 0-3|4-7 ", "0-3|4-7"),
    ("VLLM_CPU_OMP_THREADS_BIND", "", "auto"),
    ("VLLM_CPU_NUM_OF_RESERVED_CPU", "0", 0),
])
def test_good_values(monkeypatch, name, text, value):
    monkeypatch.setenv(name, text)
    assert getattr(envs, name) == value


def test_cache_root_expands_the_home_directory(clean_env, monkeypatch):
    monkeypatch.setenv("VLLM_CACHE_ROOT", "~/elsewhere")
    root = envs.VLLM_CACHE_ROOT
    assert root == str(clean_env / "elsewhere")


@pytest.mark.parametrize(("name", "text", "message"), [
    ("VLLM_GEMV_PDL", "yes", "VLLM_GEMV_PDL must be 1/true/on or 0/false/off, got 'yes'"),
    ("VLLM_FRESH_PREFILL_ATTENTION", "2", "VLLM_FRESH_PREFILL_ATTENTION must be 1/true/on or "
                                          "0/false/off, got '2'"),
    ("VLLM_FRESH_PREFILL_ATTENTION", "", "VLLM_FRESH_PREFILL_ATTENTION must be 1/true/on or "
                                         "0/false/off, got ''"),
    ("VLLM_CONFIGURE_LOGGING", "no", "VLLM_CONFIGURE_LOGGING must be 1/true/on or 0/false/off"),
    ("VLLM_LOGGING_LEVEL", "loud", "VLLM_LOGGING_LEVEL='loud' must be a logging level: DEBUG, "
                                   "INFO, WARNING, ERROR or CRITICAL"),
    ("VLLM_PORT", "tcp://10.0.0.1:5000", "VLLM_PORT='tcp://10.0.0.1:5000' must be a TCP port in "
                                         "1..65535"),
    ("VLLM_PORT", "0", "VLLM_PORT='0' must be a TCP port in 1..65535"),
    ("VLLM_NIXL_SIDE_CHANNEL_PORT", "70000", "VLLM_NIXL_SIDE_CHANNEL_PORT='70000' must be a TCP "
                                             "port in 0..65535"),
    ("VLLM_WORKER_STARTUP_TIMEOUT", "0", "VLLM_WORKER_STARTUP_TIMEOUT='0' must be a number of "
                                         "seconds > 0"),
    ("VLLM_RAY_PG_TIMEOUT", "2m", "VLLM_RAY_PG_TIMEOUT='2m' must be a number of seconds > 0"),
    ("VLLM_NIXL_ABORT_REQUEST_TIMEOUT", "inf", "VLLM_NIXL_ABORT_REQUEST_TIMEOUT='inf' must be a "
                                               "number of seconds > 0"),
    ("VLLM_ELASTIC_KV_SHRINK_DELAY_S", "-1", "VLLM_ELASTIC_KV_SHRINK_DELAY_S='-1' must be a "
                                             "number of seconds >= 0"),
    ("VLLM_CPU_KVCACHE_SPACE", "lots", "VLLM_CPU_KVCACHE_SPACE='lots' must be a non-negative "
                                       "number of GiB"),
    ("VLLM_CPU_KVCACHE_SPACE", "nan", "VLLM_CPU_KVCACHE_SPACE='nan' must be a non-negative"),
    ("VLLM_CPU_NUM_OF_RESERVED_CPU", "one", "VLLM_CPU_NUM_OF_RESERVED_CPU='one' must be a whole "
                                            "number of cores"),
    ("VLLM_CPU_NUM_OF_RESERVED_CPU", "-1", "VLLM_CPU_NUM_OF_RESERVED_CPU='-1' must be a whole"),
])
def test_a_malformed_value_is_a_one_line_error_naming_it(monkeypatch, name, text, message):
    monkeypatch.setenv(name, text)
    with pytest.raises(ValueError, match=re.escape(message)) as error:
        getattr(envs, name)
    assert "\n" not in str(error.value)
    with pytest.raises(ValueError, match=re.escape(message)):
        envs.validate()  # the start-up check of `vllm serve` names it too


def test_a_value_is_parsed_once_until_reset(monkeypatch):
    monkeypatch.setenv("VLLM_PORT", "1234")
    assert envs.VLLM_PORT == 1234
    assert vars(envs)["VLLM_PORT"] == 1234  # a plain module attribute from now on
    monkeypatch.setenv("VLLM_PORT", "4321")
    monkeypatch.setenv("VLLM_GEMV_PDL", "not a flag")  # not read: nothing asks for it
    assert envs.VLLM_PORT == 1234  # os.environ is not read again
    envs.reset()
    assert "VLLM_PORT" not in vars(envs)
    assert envs.VLLM_PORT == 4321


def test_validate_parses_every_variable(clean_env, monkeypatch):
    monkeypatch.setenv("VLLM_RAY_PG_TIMEOUT", "30")
    envs.validate()
    assert {var.name for var in envs.variables()} <= set(vars(envs))
    assert vars(envs)["VLLM_RAY_PG_TIMEOUT"] == 30.0


def test_unknown_names_are_attribute_errors():
    with pytest.raises(AttributeError, match="has no attribute 'VLLM_NO_SUCH_SWITCH'"):
        envs.VLLM_NO_SUCH_SWITCH  # noqa: B018
    assert "VLLM_GEMV_PDL" in dir(envs)


def test_vllm_environ_is_what_ray_actors_get(monkeypatch):
    from vllm.v1.executor.ray_utils import worker_env

    monkeypatch.setenv("VLLM_TEST_ONLY_SWITCH", "x")  # undeclared ones travel too
    monkeypatch.setenv("NOT_VLLM", "y")
    forwarded = envs.vllm_environ()
    assert forwarded["VLLM_TEST_ONLY_SWITCH"] == "x" and "NOT_VLLM" not in forwarded
    assert all(key.startswith("VLLM_") for key in forwarded)
    assert {k: v for k, v in worker_env().items() if k != "PYTHONPATH"} == forwarded
    assert forwarded == {k: v for k, v in os.environ.items() if k.startswith("VLLM_")}
