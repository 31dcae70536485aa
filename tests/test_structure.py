"""The shape of vllm/ (docs/design.md, "Size and shape rules the tests keep"), enforced.

Reads files with `ast` and regular expressions (nothing is imported). Four rules:

1. Every package directory under vllm/ that holds .py files has a README.md.
2. A README says what is built, and only that:
   - every `name.py` or `dir/name.py` it mentions (in backticks, a table row or
     a fenced block) exists: relative to the README's directory, or else to one
     of the directories above it up to the repository root (so
     `v1/core/sched/stats.py` and `vllm/v1/...` and `tests/...` read naturally);
   - every module of its package (each .py file in the README's directory but
     `__init__.py`) is mentioned in it;
   - every module is used: imported (or named in a string, as lazy imports and
     registries do) by another module under vllm/, tests/, benchmarks/ or
     examples/, or an entry point (a `[project.scripts]` target or a module
     with an `if __name__ == "__main__":` block);
   - a section headed "Not built" (any heading containing those words, e.g.
     "## Not built here") lists what is not built: the first backticked name of
     each of its bullets (a bullet without one fails) must NOT exist, as a `.py`
     file, a `vllm.` module or a top-level class/function name anywhere in
     vllm/ (`Name.method()` is checked as `Name`). When it gets built, the test
     fails until the README moves it to the list of what is.
3. No .py file under vllm/ is over 600 lines, unless one of its first 30 lines,
   stripped of `#` and quotes, starts with "Longer than 600 lines because"
   (a kernel module saying why, e.g.
   `# Longer than 600 lines because the three kernel variants share helpers.`).
4. No function or method is over 60 lines, counted from its `def` line to its
   last line (decorators excluded), unless it is a Triton kernel: decorated with
   `triton.jit`, `triton.jit(...)` or a `jit` imported from triton.

Each failure names the file, the thing and its line count or the claim, so the
fix is clear: split the file or function by concept, list the module in its
README (or delete it), or correct the README. The tests at the end plant a
small tree to show each check can fail.
"""

from __future__ import annotations

import ast
import pathlib
import re
import textwrap
import tomllib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
MAX_FILE_LINES = 600
MAX_FUNCTION_LINES = 60
LONG_FILE_MARK = "Longer than 600 lines because"
USERS = ("vllm", "tests", "benchmarks", "examples")  # where a module counts as used

_PY_PATH = re.compile(r"(?<![\w/.<>*-])((?:[\w.-]+/)*\w+\.py)\b")
_BACKTICKS = re.compile(r"`([^`\n]+)`")
_HEADING = re.compile(r"^(#+)\s+(.*)$")
_BULLET = re.compile(r"^\s*[-*]\s+(.*)$")
_DOTTED = re.compile(r"^vllm(\.\w+)+(:\w+)?$")


# ------------------------------------------------------------------ packages


def packages(root: pathlib.Path) -> list[pathlib.Path]:
    """Every directory under root/vllm (itself included) that holds a .py file."""
    return sorted({path.parent for path in (root / "vllm").rglob("*.py")})


def missing_readmes(root: pathlib.Path) -> list[str]:
    return [f"{pkg.relative_to(root)}/ holds .py files but no README.md"
            for pkg in packages(root) if not (pkg / "README.md").is_file()]


# ------------------------------------------------------------ README claims


def _mentions(text: str) -> list[str]:
    """Every x.py path in backticks, table rows and fenced blocks of a markdown text."""
    found, fenced = [], False
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        if fenced or line.lstrip().startswith("|"):
            found += _PY_PATH.findall(line)
        else:
            for span in _BACKTICKS.findall(line):
                found += _PY_PATH.findall(span)
    return found


def _resolve(token: str, readme: pathlib.Path, root: pathlib.Path) -> pathlib.Path | None:
    """The file a README's path means: from its directory, else from one above it."""
    directory = readme.parent
    while True:
        candidate = directory / token
        if candidate.is_file():
            return candidate.resolve()
        if directory == root:
            return None
        directory = directory.parent


def _not_built_claims(text: str) -> list[tuple[str | None, str]]:
    """(first backticked name or None, the bullet) of each bullet under a "Not built" heading."""
    claims, level = [], None
    for line in text.splitlines():
        heading = _HEADING.match(line)
        if heading:
            depth = len(heading.group(1))
            if "not built" in heading.group(2).lower():
                level = depth
            elif level is not None and depth <= level:
                level = None
            continue
        bullet = _BULLET.match(line) if level is not None else None
        if bullet:
            spans = _BACKTICKS.findall(bullet.group(1))
            claims.append((spans[0] if spans else None, line.strip()))
    return claims


def _module(path: pathlib.Path, root: pathlib.Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def top_level_names(root: pathlib.Path) -> set[str]:
    """Every class and function defined at the top of a module under root/vllm."""
    names = set()
    for path in (root / "vllm").rglob("*.py"):
        for node in ast.parse(path.read_text(), str(path)).body:
            if isinstance(node, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
                names.add(node.name)
    return names


def _exists(name: str, readme: pathlib.Path, root: pathlib.Path, modules: set[str],
            names: set[str]) -> bool:
    if name.endswith(".py"):
        return _resolve(name, readme, root) is not None
    if name.startswith("vllm."):
        return name in modules
    return name.split(".")[0].removesuffix("()") in names


def readme_problems(readme: pathlib.Path, root: pathlib.Path, used: set[str],
                    names: set[str]) -> list[str]:
    """Each false or missing claim of one README, as an actionable line."""
    rel = readme.relative_to(root)
    text = readme.read_text()
    problems, mentioned = [], set()
    for token in sorted(set(_mentions(text))):
        target = _resolve(token, readme, root)
        if target is None:
            problems.append(f"{rel} mentions `{token}`, which is no file (looked in "
                            f"{rel.parent}/ and the directories above it)")
        else:
            mentioned.add(target)
    modules = {_module(path, root) for path in (root / "vllm").rglob("*.py")}
    for path in sorted(readme.parent.glob("*.py")):
        if path.name == "__init__.py":
            continue
        if path.resolve() not in mentioned:
            problems.append(f"{rel} does not list its module {path.name} "
                            f"(`{path.name}` in backticks, a table or a fenced block)")
        if _module(path, root) not in used:
            problems.append(f"{path.relative_to(root)} is imported by nothing under "
                            f"{', '.join(USERS)} and is no entry point: delete it or use it")
    for claim, bullet in _not_built_claims(text):
        if claim is None:
            problems.append(f"{rel}: the 'Not built' bullet '{bullet}' names nothing in backticks")
        elif _exists(claim, readme, root, modules, names):
            problems.append(f"{rel} says `{claim}` is not built, but it exists in vllm/")
    return problems


def _imported_names(node: ast.AST, importer: str, is_package: bool) -> list[str]:
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    base = node.module or ""
    if node.level:
        anchor = importer.split(".")
        anchor = anchor if is_package else anchor[:-1]
        anchor = anchor[: len(anchor) - node.level + 1]
        base = ".".join(anchor + ([base] if base else []))
    return [base] + [f"{base}.{alias.name}" for alias in node.names]


def used_modules(root: pathlib.Path) -> set[str]:
    """vllm modules imported or named by another module (any of USERS), or entry points."""
    modules = {_module(path, root) for path in (root / "vllm").rglob("*.py")}
    used = set()

    def use(name: str, user: str) -> None:
        name = name.split(":")[0]
        while name not in modules and "." in name:
            name = name.rsplit(".", 1)[0]
        if name in modules and name != user:
            used.add(name)
            while "." in name:  # importing a module runs its packages' __init__
                name = name.rsplit(".", 1)[0]
                used.add(name)

    for top in USERS:
        for path in sorted((root / top).rglob("*.py")) if (root / top).is_dir() else []:
            user = _module(path, root)
            tree = ast.parse(path.read_text(), str(path))
            for node in ast.walk(tree):
                if isinstance(node, ast.Import | ast.ImportFrom):
                    for name in _imported_names(node, user, path.name == "__init__.py"):
                        use(name, user)
                elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                    if _DOTTED.match(node.value):
                        use(node.value, user)
                elif isinstance(node, ast.If) and "__main__" in ast.unparse(node.test):
                    used.add(user)
    pyproject = root / "pyproject.toml"
    if pyproject.is_file():
        scripts = tomllib.loads(pyproject.read_text()).get("project", {}).get("scripts", {})
        for target in scripts.values():
            use(target, "")
    return used


# ---------------------------------------------------------------------- size


def long_files(root: pathlib.Path) -> list[str]:
    problems = []
    for path in sorted((root / "vllm").rglob("*.py")):
        lines = path.read_text().splitlines()
        if len(lines) <= MAX_FILE_LINES:
            continue
        head = (line.strip().lstrip("#").strip().strip("\"'").strip() for line in lines[:30])
        if not any(line.startswith(LONG_FILE_MARK) for line in head):
            problems.append(f"{path.relative_to(root)}: {len(lines)} lines "
                            f"(> {MAX_FILE_LINES}; split it by concept, or, for a kernel "
                            f"module, say '{LONG_FILE_MARK} ...' in its first 30 lines)")
    return problems


def _triton_jits(tree: ast.Module) -> set[str]:
    """Decorator spellings that mean a Triton kernel in this module."""
    jits = {"triton.jit"}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            jits |= {f"{a.asname}.jit" for a in node.names if a.name == "triton" and a.asname}
        elif isinstance(node, ast.ImportFrom) and node.module == "triton":
            jits |= {a.asname or a.name for a in node.names if a.name == "jit"}
    return jits


def _is_kernel(function: ast.FunctionDef | ast.AsyncFunctionDef, jits: set[str]) -> bool:
    for decorator in function.decorator_list:
        target = decorator.func if isinstance(decorator, ast.Call) else decorator
        if ast.unparse(target) in jits:
            return True
    return False


def long_functions(root: pathlib.Path) -> list[str]:
    problems = []
    for path in sorted((root / "vllm").rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        jits = _triton_jits(tree)
        for function, qualname in _functions(tree):
            length = function.end_lineno - function.lineno + 1
            if length > MAX_FUNCTION_LINES and not _is_kernel(function, jits):
                problems.append(f"{path.relative_to(root)}:{function.lineno}: {qualname} is "
                                f"{length} lines (> {MAX_FUNCTION_LINES}; push steps into "
                                f"named helpers)")
    return problems


def _functions(node: ast.AST, prefix: str = ""):
    """(function node, qualified name) for every function and method below `node`."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
            yield child, prefix + child.name
            yield from _functions(child, f"{prefix}{child.name}.<locals>.")
        elif isinstance(child, ast.ClassDef):
            yield from _functions(child, f"{prefix}{child.name}.")
        else:
            yield from _functions(child, prefix)


# ---------------------------------------------------------------- the checks

READMES = sorted((ROOT / "vllm").rglob("README.md"))


@pytest.fixture(scope="module")
def used() -> set[str]:
    return used_modules(ROOT)


@pytest.fixture(scope="module")
def names() -> set[str]:
    return top_level_names(ROOT)


def test_every_package_has_a_readme():
    problems = missing_readmes(ROOT)
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("readme", READMES, ids=lambda p: str(p.parent.relative_to(ROOT)))
def test_readme_lists_what_is_built(readme, used, names):
    problems = readme_problems(readme, ROOT, used, names)
    assert not problems, "\n".join(problems)


def test_no_file_over_600_lines():
    problems = long_files(ROOT)
    assert not problems, "files over the limit:\n" + "\n".join(problems)


def test_no_function_over_60_lines():
    problems = long_functions(ROOT)
    assert not problems, "functions over the limit:\n" + "\n".join(problems)


# ------------------------------------------------- the checker itself can fail


def _tree(tmp_path: pathlib.Path, files: dict[str, str]) -> pathlib.Path:
    for name, text in files.items():
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return tmp_path


def _all_readme_problems(root: pathlib.Path) -> list[str]:
    used, names = used_modules(root), top_level_names(root)
    return [problem for readme in sorted((root / "vllm").rglob("README.md"))
            for problem in readme_problems(readme, root, used, names)]


def test_checker_reports_a_package_without_readme(tmp_path):
    root = _tree(tmp_path, {"vllm/README.md": "`a/x.py`\n", "vllm/a/x.py": ""})
    assert missing_readmes(root) == ["vllm/a/ holds .py files but no README.md"]


def test_checker_reports_false_and_missing_claims(tmp_path):
    root = _tree(tmp_path, {
        "vllm/README.md": "# vllm\n",
        "vllm/pkg/README.md": (
            "| file | what |\n|---|---|\n| `used.py` | fine |\n| `gone.py` | moved away |\n"
            "```\nsub/also_gone.py   in a diagram\n```\n"
            "See `vllm/pkg/used.py` and `tests/test_pkg.py` (both exist).\n"
            "## Not built here\n- `Pipeline`: pipeline parallelism\n- `used.py`: built after all\n"
            "- `vllm.pkg.future`: later\n- `Built.run()`: it is\n- nothing named\n"
            "## Next\n- `Built`: not a claim\n"
            "`dead.py` is listed.\n"
        ),
        "vllm/pkg/used.py": "class Built: ...\n",
        "vllm/pkg/unlisted.py": "",
        "vllm/pkg/dead.py": "",
        "vllm/main.py": "from vllm.pkg import used, unlisted\n",
        "tests/test_pkg.py": "from vllm import main\n",
    })
    assert _all_readme_problems(root) == [
        "vllm/README.md does not list its module main.py "
        "(`main.py` in backticks, a table or a fenced block)",
        "vllm/pkg/README.md mentions `gone.py`, which is no file "
        "(looked in vllm/pkg/ and the directories above it)",
        "vllm/pkg/README.md mentions `sub/also_gone.py`, which is no file "
        "(looked in vllm/pkg/ and the directories above it)",
        "vllm/pkg/dead.py is imported by nothing under vllm, tests, benchmarks, examples "
        "and is no entry point: delete it or use it",
        "vllm/pkg/README.md does not list its module unlisted.py "
        "(`unlisted.py` in backticks, a table or a fenced block)",
        "vllm/pkg/README.md says `used.py` is not built, but it exists in vllm/",
        "vllm/pkg/README.md says `Built.run()` is not built, but it exists in vllm/",
        "vllm/pkg/README.md: the 'Not built' bullet '- nothing named' names nothing in backticks",
    ]


def test_a_module_is_used_through_strings_and_entry_points(tmp_path):
    root = _tree(tmp_path, {
        "pyproject.toml": '[project.scripts]\ntool = "vllm.cli:main"\n',
        "vllm/cli.py": "def main(): ...\n",
        "vllm/registry.py": '_R = {"x": ("vllm.models.llama", "Llama")}\n',
        "vllm/models/__init__.py": "",
        "vllm/models/llama.py": "",
        "vllm/proxy.py": 'if __name__ == "__main__":\n    pass\n',
        "vllm/orphan.py": "import vllm.orphan\n",  # itself: does not count
    })
    assert used_modules(root) == {"vllm.cli", "vllm", "vllm.models.llama", "vllm.models",
                                  "vllm.proxy"}


def test_checker_reports_long_files_unless_they_say_why(tmp_path):
    body = "x = 1\n" * MAX_FILE_LINES
    root = _tree(tmp_path, {
        "vllm/fits.py": body,
        "vllm/long.py": body + "y = 2\n",
        "vllm/kernel.py": f'"""Kernels.\n\n{LONG_FILE_MARK} the variants share helpers."""\n'
                          + body,
    })
    assert long_files(root) == [
        f"vllm/long.py: 601 lines (> 600; split it by concept, or, for a kernel module, "
        f"say '{LONG_FILE_MARK} ...' in its first 30 lines)"
    ]


def test_checker_reports_long_functions_but_not_kernels(tmp_path):
    def function(name: str, lines: int, decorator: str = "", indent: str = "") -> str:
        body = "".join(f"    x{i} = {i}\n" for i in range(lines - 1))
        text = f"{decorator}\ndef {name}():\n{body}" if decorator else f"def {name}():\n{body}"
        return textwrap.indent(text, indent)

    source = "\n".join([
        "import triton\nfrom triton import jit as tjit\n",
        function("fits", MAX_FUNCTION_LINES, "@functools.cache"),
        "class C:\n" + function("long", MAX_FUNCTION_LINES + 1, indent="    "),
        "def outer():\n" + function("inner", MAX_FUNCTION_LINES + 1, indent="    "),
        function("_k1", 100, "@triton.jit"),
        function("_k2", 100, "@triton.jit(do_not_specialize=['n'])"),
        function("_k3", 100, "@tjit"),
    ])
    root = _tree(tmp_path, {"vllm/a.py": source})
    lines = source.splitlines()
    line_of = {name: lines.index(f"{pad}def {name}():") + 1
               for name, pad in (("long", "    "), ("outer", ""), ("inner", "    "))}
    assert long_functions(root) == [
        f"vllm/a.py:{line_of[name]}: {qualname} is {length} lines "
        f"(> 60; push steps into named helpers)"
        for name, qualname, length in (("long", "C.long", 61), ("outer", "outer", 62),
                                       ("inner", "outer.<locals>.inner", 61))
    ]
